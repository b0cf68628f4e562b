"""Lower bounds on the largest micro-batch cost: never above the optimum (found by enumerating
every assignment), hand-checked values, the deferral bound, and the capacity check."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wlb_opt.solvers import bounds


def optimum_by_assignment(weights, n_bins, lengths=None, max_tokens=None, placed_at_least=None):
    """Smallest largest load over every assignment (item -> bin, or -1 = deferred when
    placed_at_least is given). The slow twin of the bounds."""
    n = len(weights)
    choices = range(-1, n_bins) if placed_at_least is not None else range(n_bins)
    best = None
    for assign in itertools.product(choices, repeat=n):
        assign = np.array(assign)
        if placed_at_least is not None and lengths[assign >= 0].sum() < placed_at_least:
            continue
        if max_tokens is not None and any(lengths[assign == b].sum() > max_tokens for b in range(n_bins)):
            continue
        load = max(weights[assign == b].sum() for b in range(n_bins))
        best = load if best is None else min(best, load)
    return best


@settings(max_examples=40)
@given(w=st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=7), m=st.integers(1, 3),
       const=st.sampled_from([0.0, 2.5]))
def test_bounds_never_exceed_the_optimum(w, m, const):
    w = np.array(w)
    opt = optimum_by_assignment(w, m) + const
    lb = bounds.makespan_lower_bound(w, m, const)
    assert lb <= opt * (1 + 1e-12) + 1e-12
    for part in (bounds.mean_bound(w, m), bounds.largest_item_bound(w), bounds.pigeonhole_bound(w, m)):
        assert part + const <= lb + 1e-12


@settings(max_examples=40)
@given(w=st.lists(st.integers(0, 1000), min_size=1, max_size=7), m=st.integers(1, 3))
def test_integer_bound_never_exceeds_the_integer_optimum(w, m):
    w = np.array(w, dtype=np.int64)
    assert bounds.integer_makespan_lower_bound(w, m) <= optimum_by_assignment(w, m)


@settings(max_examples=25)
@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=6), m=st.integers(1, 2), frac=st.floats(0, 1))
def test_deferral_bound_never_exceeds_the_optimum(lengths, m, frac):
    lengths = np.array(lengths, dtype=np.int64)
    w = 0.01 * lengths ** 2 + 0.1 * lengths + 0.05  # cost per token not monotone in length
    target = int(frac * lengths.sum())
    opt = optimum_by_assignment(w, m, lengths, placed_at_least=target)
    assert bounds.placed_load_bound(lengths, w, m, target, 1.0) <= opt + 1.0 + 1e-12


def test_hand_checked_values():
    w = np.array([10.0, 9.0, 8.0, 1.0, 1.0, 1.0])
    assert bounds.mean_bound(w, 2) == 15.0
    assert bounds.largest_item_bound(w) == 10.0
    # k = 1: 2nd + 3rd largest = 17 (three items, two bins); k = 2: 3 smallest of top 5 = 10
    assert bounds.pigeonhole_bound(w, 2) == 17.0
    assert bounds.makespan_lower_bound(w, 2, bin_const=0.5) == 17.5
    assert optimum_by_assignment(w, 2) == 17.0  # the bound is tight here
    assert bounds.pigeonhole_bound([5.0, 4.0], 2) == 0.0  # fewer items than m + 1
    assert bounds.integer_makespan_lower_bound(np.array([3, 3, 1]), 2) == 4  # ceil(7 / 2)


def test_min_placed_weight_is_fractional_by_cost_per_token():
    lengths = np.array([10, 10, 10])
    w = np.array([5.0, 1.0, 3.0])  # per token 0.5, 0.1, 0.3
    assert bounds.min_placed_weight(lengths, w, 0) == 0.0
    assert bounds.min_placed_weight(lengths, w, 10) == pytest.approx(1.0)
    assert bounds.min_placed_weight(lengths, w, 15) == pytest.approx(2.5)
    assert bounds.min_placed_weight(lengths, w, 30) == pytest.approx(9.0)
    assert bounds.min_placed_weight(lengths, w, 99) == pytest.approx(9.0)
    assert bounds.placed_load_bound(lengths, w, 2, 15, bin_const=1.0) == pytest.approx(2.25)
    assert bounds.max_placeable_tokens([5, 30, 7], 2, 10) == 12
    assert bounds.max_placeable_tokens([5, 9, 7], 2, 10) == 20


def test_check_capacity_names_the_document_or_the_excess():
    bounds.check_capacity([10, 10], 2, 10)  # exactly full is fine (max_tokens is inclusive)
    bounds.check_capacity([], 2, 10)
    with pytest.raises(ValueError, match=r"document 42 \(position 1\) has 11 tokens > max_tokens=10"):
        bounds.check_capacity([3, 11], 2, 10, ids=[7, 42])
    with pytest.raises(ValueError, match=r"21 tokens do not fit in 2 micro-batches x 10 = 20 tokens \(1 tokens over\)"):
        bounds.check_capacity([10, 6, 5], 2, 10)


def test_bad_arguments():
    with pytest.raises(ValueError, match="n_bins"):
        bounds.mean_bound([1.0], 0)
    with pytest.raises(ValueError, match="weights"):
        bounds.makespan_lower_bound([1.0, -2.0], 2)
    with pytest.raises(ValueError, match="weights"):
        bounds.largest_item_bound([[1.0]])
