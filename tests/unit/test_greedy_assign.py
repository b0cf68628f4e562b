"""Algorithm 1 (`wlb_greedy`) against a plain twin: the same plans on random batches,
overloaded ones included (items that fit nowhere are deferred, most of the short ones fall
back to the bin of fewest tokens)."""
from __future__ import annotations

import heapq

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from wlb_opt.solvers.greedy import placement_order, wlb_greedy
from wlb_opt.solvers.problem import PackProblem


def reference_wlb_greedy(problem: PackProblem) -> tuple[list[np.ndarray], np.ndarray]:
    """Algorithm 1 as written in the paper: least load first (ties: lowest bin), else the
    bin of fewest tokens (a scan), else defer. Returns (bins, deferred) in placement order."""
    n, cap = problem.n_bins, int(problem.max_tokens)
    lengths, weights = problem.lengths.tolist(), problem.weights.tolist()
    order = placement_order(problem, problem.lengths).tolist()
    toks, loads = [0] * n, [0.0] * n
    bins, deferred = [[] for _ in range(n)], []
    for i in order:
        d = lengths[i]
        b = min(range(n), key=lambda j: (loads[j], j))
        if toks[b] + d > cap:
            b = min(range(n), key=lambda j: (toks[j], j))
            if toks[b] + d > cap:
                deferred.append(i)
                continue
        toks[b] += d
        loads[b] += weights[i]
        bins[b].append(i)
    return [np.asarray(b, dtype=np.int64) for b in bins], np.asarray(deferred, dtype=np.int64)


@st.composite
def problems(draw):
    n_bins = draw(st.integers(1, 9))
    cap = draw(st.integers(4, 60))
    # up to ~3x the capacity: overloaded batches defer and fall back often
    n = draw(st.integers(0, 3 * n_bins * cap // 8 + 2))
    lengths = np.asarray(draw(st.lists(st.integers(1, cap), min_size=n, max_size=n)), dtype=np.int64)
    quadratic = draw(st.sampled_from([0.0, 0.5, 1.0]))
    # coarse weights make equal loads (ties) common
    weights = np.round(quadratic * lengths.astype(float) ** 2 / 7.0 + lengths) if draw(st.booleans()) else (
        quadratic * lengths.astype(float) ** 2 + 0.37 * lengths)
    return PackProblem(lengths=lengths, weights=weights.astype(np.float64), n_bins=n_bins, max_tokens=cap,
                       carried=draw(st.integers(0, n)))


@settings(max_examples=300, deadline=None)
@given(problems())
def test_algorithm_1_places_like_its_plain_twin(problem):
    result = wlb_greedy(problem)
    bins, deferred = reference_wlb_greedy(problem)
    assert len(result.bins) == len(bins)
    for got, want in zip(result.bins, bins):
        assert np.array_equal(got, want)
    assert np.array_equal(result.deferred, deferred)


def test_an_overloaded_batch_falls_back_to_the_bin_of_fewest_tokens():
    # 9 -> bin 0, 8 -> bin 1; 3 is due to bin 0 (least load, lowest index) but fits neither
    # bin 0 nor bin 1 (fewest tokens): deferred; 2 does not fit bin 0 and falls back to bin 1
    problem = PackProblem(lengths=np.array([9, 8, 3, 2], dtype=np.int64), weights=np.array([0.1, 0.1, 0.1, 5.0]),
                          n_bins=2, max_tokens=10)
    result = wlb_greedy(problem)
    assert [b.tolist() for b in result.bins] == [[0], [1, 3]] and result.deferred.tolist() == [2]
    bins, deferred = reference_wlb_greedy(problem)
    assert [b.tolist() for b in bins] == [[0], [1, 3]] and deferred.tolist() == [2]
