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
    # the mirror: the densest tokens first (0.5, 0.3, 0.1 per token)
    assert bounds.max_placed_weight(lengths, w, 0) == 0.0
    assert bounds.max_placed_weight(lengths, w, 15) == pytest.approx(6.5)
    assert bounds.max_placed_weight(lengths, w, 25) == pytest.approx(8.5)
    assert bounds.max_placed_weight(lengths, w, 99) == pytest.approx(9.0)
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


def least_delay_by_enumeration(batches, n_micro, max_tokens, horizon=None):
    """Smallest token-weighted displacement of any delay-only plan, by enumerating every
    (step >= arrival, micro-batch) of every piece before `horizon` (default: steps + number
    of pieces, which always suffices; a shorter one gives an upper bound): the slow twin of
    `bounds.delay_floor`."""
    pieces = [(int(x), t) for t, b in enumerate(batches) for x in b]
    horizon = horizon or len(batches) + len(pieces)
    best = None
    slots = [[(s, j) for s in range(t, horizon) for j in range(n_micro)] for _, t in pieces]
    for combo in itertools.product(*slots):
        load: dict = {}
        for (x, _), slot in zip(pieces, combo):
            load[slot] = load.get(slot, 0) + x
        if max(load.values()) > max_tokens:
            continue
        wait = sum(x * (s - t) for (x, t), (s, _) in zip(pieces, combo))
        best = wait if best is None else min(best, wait)
    return best / sum(x for x, _ in pieces)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(1, 10), max_size=3), min_size=1, max_size=3).filter(
    lambda bs: 1 <= sum(map(len, bs)) <= 3), st.integers(1, 2))
def test_delay_floor_never_exceeds_the_least_delay_of_any_plan(batches, n_micro):
    floor = bounds.delay_floor([np.array(b, dtype=np.int64) for b in batches], n_micro, 10)
    assert floor <= least_delay_by_enumeration(batches, n_micro, 10) + 1e-12


def test_delay_floor_is_exact_when_only_the_micro_batches_bind():
    # pieces longer than max_tokens / 2 each need a micro-batch: 5 arrive at once, 2 per step
    batches = [np.array([9, 8, 7, 6, 6]), np.array([], dtype=np.int64), np.array([2])]
    exact = least_delay_by_enumeration(batches, 2, 10, horizon=4)  # an upper bound, met by the floor
    assert exact > 0 and bounds.delay_floor(batches, 2, 10) == pytest.approx(exact)
    # (9, 8) wait 0, (7, 6) wait 1, 6 waits 2: the longest first
    assert bounds.delay_floor(batches, 2, 10) == pytest.approx((7 + 6 + 2 * 6) / 38)


def test_delay_floor_serves_the_longest_waiting_piece_first_and_carries_the_token_backlog():
    # one micro-batch per step: 6 and 6 arrive, then 9; FIFO would make the 9 wait 1 step
    # (6 + 9 = 15 token-steps), longest first makes a 6 wait twice instead (6 + 6 = 12)
    assert bounds.delay_floor([[6, 6], [9]], 1, 10) == pytest.approx(12 / 21)
    assert bounds.delay_floor([[6, 6], [9]], 1, 10) == pytest.approx(least_delay_by_enumeration([[6, 6], [9]], 1, 10))
    # two steps of 120 tokens into 20 per step: the backlog carries over (100, 200, 180, ..., 20)
    assert bounds.delay_floor([np.full(30, 4)] * 2, 2, 10) == pytest.approx((100 + 200 + sum(range(20, 181, 20))) / 240)
    # a tuple of lengths is lengths, not a (pieces, ids, offsets) triple
    assert bounds.delay_floor([(6, 6, 6)], 1, 10) == bounds.delay_floor([[6, 6, 6]], 1, 10) == pytest.approx(1.0)
    assert bounds.delay_floor([()], 1, 10) == 0.0


def test_delay_floor_counts_tokens_over_a_steps_capacity_and_takes_global_batches():
    from wlb_opt.workloads import global_batches
    # 30 short pieces of 4 tokens into one step of 2 x 10 tokens: 100 tokens wait 1 step, 80 wait 2, ...
    batches = [np.full(30, 4)]
    assert bounds.delay_floor(batches, 2, 10) == pytest.approx((100 + 80 + 60 + 40 + 20) / 120)
    stream = global_batches("default", 4096, 4 * 4096, 3, seed=1)
    assert bounds.delay_floor(stream, 4, 5120) == bounds.delay_floor([b[0] for b in stream], 4, 5120)


@pytest.mark.parametrize("args, match", [
    (([np.array([11])], 2, 10), "piece of 11 tokens > max_tokens=10"),
    (([np.array([0])], 2, 10), "positive token counts"),
    (([np.array([1])], 0, 10), "n_micro must be an integer >= 1"),
    (([np.array([1])], 2, 0), "max_tokens must be an integer >= 1"),
    (([np.array([1])], 2, 10.5), "max_tokens must be an integer >= 1"),
])
def test_delay_floor_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        bounds.delay_floor(*args)
