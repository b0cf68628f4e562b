"""Greedy packers: the paper's three methods on plain arrays.

- `original_sequential`: Plain-4D. Items in data order are concatenated into fixed sequences
  of `max_tokens` tokens; an item crossing a boundary continues in the next sequence.
- `fixed_greedy`: Fixed-4D. Whole items, heaviest first, each to the least-loaded bin that
  still has room (longest-processing-time with a token cap).
- `wlb_greedy`: Algorithm 1 of WLB-LLM (§3.3): carried items first, then the rest
  longest-first; each to the least-loaded bin if it fits, else to the bin with the fewest
  tokens if it fits there, else deferred. `<=` max_tokens (docs/architecture.md, "Units").

All are deterministic: ties go to the lowest bin index, sorts are stable.
"""
from __future__ import annotations

import heapq

import numpy as np

from .problem import PackProblem, PackResult


def placement_order(problem: PackProblem, key: np.ndarray) -> np.ndarray:
    """Carried items in their given order, then the rest by `key` descending (stable)."""
    k = problem.carried
    rest = k + np.argsort(-key[k:], kind="stable")
    return np.concatenate([np.arange(k, dtype=np.int64), rest.astype(np.int64)])


def wlb_greedy(problem: PackProblem) -> PackResult:
    """Algorithm 1: minimum workload first, minimum tokens as fallback, else defer."""
    n = problem.n_bins
    cap = int(problem.max_tokens)
    lengths = problem.lengths.tolist()
    weights = problem.weights.tolist()
    order = placement_order(problem, problem.lengths).tolist()
    toks = [0] * n
    placed_bin = [-1] * len(order)  # bin of the k-th item in placement order, -1 = deferred
    heap = [(0.0, b) for b in range(n)]  # (load, bin): a heap orders ties by the lowest bin index
    replace = heapq.heapreplace
    for k, i in enumerate(order):
        d = lengths[i]
        load, b = heap[0]
        if toks[b] + d <= cap:
            toks[b] += d
            replace(heap, (load + weights[i], b))
            placed_bin[k] = b
            continue
        b = min(range(n), key=toks.__getitem__)  # fallback: fewest tokens (rare)
        if toks[b] + d <= cap:
            toks[b] += d
            heap = [(load + weights[i], j) if j == b else (load, j) for load, j in heap]
            heapq.heapify(heap)
            placed_bin[k] = b
    return _group(np.asarray(order, dtype=np.int64), np.asarray(placed_bin, dtype=np.int64), n)


def _group(order: np.ndarray, placed_bin: np.ndarray, n_bins: int) -> PackResult:
    """Bins from (item, bin) pairs in placement order; each bin keeps placement order."""
    keep = placed_bin >= 0
    items, bins_of = order[keep], placed_bin[keep]
    by_bin = np.argsort(bins_of, kind="stable")
    counts = np.bincount(bins_of, minlength=n_bins)
    bins = np.split(items[by_bin], np.cumsum(counts)[:-1])
    return PackResult(bins=[b.astype(np.int64) for b in bins], deferred=order[~keep])


def fixed_greedy(problem: PackProblem) -> PackResult:
    """Longest-processing-time on cost, with a token cap: carried items first, then heaviest
    first, each to the least-loaded bin that has room; items that fit nowhere are deferred.

    A heap of (load, bin) gives O(n log m): bins without room for the current item are popped,
    then pushed back. Ties go to the lowest bin index.
    """
    n_bins, cap = problem.n_bins, int(problem.max_tokens)
    lengths = problem.lengths.tolist()
    weights = problem.weights.tolist()
    order = placement_order(problem, problem.weights).tolist()
    toks = [0] * n_bins
    placed_bin = [-1] * len(order)
    heap = [(0.0, b) for b in range(n_bins)]
    for k, i in enumerate(order):
        d = lengths[i]
        skipped = []
        while heap and toks[heap[0][1]] + d > cap:
            skipped.append(heapq.heappop(heap))
        if heap:
            load, b = heap[0]
            toks[b] += d
            placed_bin[k] = b
            heapq.heapreplace(heap, (load + weights[i], b))
        for item in skipped:
            heapq.heappush(heap, item)
    return _group(np.asarray(order, dtype=np.int64), np.asarray(placed_bin, dtype=np.int64), n_bins)


def original_sequential(problem: PackProblem) -> PackResult:
    """Plain-4D: fill `n_bins` sequences of `max_tokens` tokens in data order, cutting items
    at sequence boundaries; everything after the last sequence is deferred (as pieces)."""
    cap = int(problem.max_tokens)
    starts = np.concatenate([[0], np.cumsum(problem.lengths)[:-1]]).astype(np.int64)
    ends = starts + problem.lengths
    # Cut points: every multiple of cap inside an item splits it.
    src, plen, poff, pbin = [], [], [], []
    for i, (s, e) in enumerate(zip(starts.tolist(), ends.tolist())):
        pos = s
        while pos < e:
            stop = min(e, (pos // cap + 1) * cap)
            src.append(i)
            plen.append(stop - pos)
            poff.append(pos - s)
            pbin.append(pos // cap)
            pos = stop
    src = np.asarray(src, dtype=np.int64)
    plen = np.asarray(plen, dtype=np.int64)
    poff = np.asarray(poff, dtype=np.int64)
    pbin = np.asarray(pbin, dtype=np.int64)
    bins = [np.flatnonzero(pbin == b) for b in range(problem.n_bins)]
    deferred = np.flatnonzero(pbin >= problem.n_bins)
    return PackResult(bins=bins, deferred=deferred, pieces=(src, plen, poff))
