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
    order = placement_order(problem, problem.lengths)
    placed_bin = wlb_assign(order, problem.lengths, problem.weights, problem.n_bins, int(problem.max_tokens))
    return _group(order, placed_bin, problem.n_bins)


def wlb_assign(order: np.ndarray, lengths: np.ndarray, weights: np.ndarray, n_bins: int, cap: int) -> np.ndarray:
    """Algorithm 1's bin of each item of `order` (placement order), -1 = deferred.

    Each item goes to the bin of least load (ties: lowest index) if it fits under `cap`
    tokens, else to the bin of fewest tokens (ties: lowest index) if it fits there, else it
    is deferred. Loads accumulate in placement order (the same float sums as a plain loop).

    Both heaps hold one entry per bin whose key may lag behind the bin's value (a bin filled
    by the fallback is not re-keyed in the load heap, nor any bin in the token heap): values
    only grow, so a lagging key is never above its value, and the top is re-keyed until it
    is current, which makes it the true minimum. The fallback is then O(log N) per item
    instead of a scan of every bin plus a rebuilt heap, which matters on overloaded steps
    where most short items fall back.
    """
    lengths_of = lengths.tolist()
    weights_of = weights.tolist()
    toks = [0] * n_bins
    loads = [0.0] * n_bins
    placed_bin = [-1] * len(order)
    heap = [(0.0, b) for b in range(n_bins)]  # (load, bin): a heap orders ties by the lowest bin index
    tok_heap = [(0, b) for b in range(n_bins)]  # (tokens, bin), keys may lag
    replace = heapq.heapreplace
    for k, i in enumerate(order.tolist()):
        d = lengths_of[i]
        load, b = heap[0]
        while load != loads[b]:  # a key left behind by the fallback
            replace(heap, (loads[b], b))
            load, b = heap[0]
        if toks[b] + d <= cap:
            toks[b] += d
            loads[b] = load = load + weights_of[i]
            replace(heap, (load, b))
            placed_bin[k] = b
            continue
        tok, b = tok_heap[0]
        while tok != toks[b]:
            replace(tok_heap, (toks[b], b))
            tok, b = tok_heap[0]
        if tok + d <= cap:  # fallback: fewest tokens (rare but for overloaded steps)
            toks[b] = tok + d
            loads[b] += weights_of[i]
            placed_bin[k] = b
    return np.asarray(placed_bin, dtype=np.int64)


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
