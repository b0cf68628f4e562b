"""`wlb_fill`: large pieces balanced first, short pieces into the gaps, then a polish.

Algorithm 1 (`greedy.wlb_greedy`) places every item longest first on the least-loaded bin.
When two large documents land in one micro-batch, or one micro-batch gets a large document
late, the short documents that follow cannot even it out, and a descent on the finished plan
(`wlb_ls`) is then hemmed in by the token cap of bins that are already full. This method
builds the plan in the order that keeps the large documents movable:

1. **Large items** (the carried ones, and every item whose cost is at least
   `LARGE_SHARE` x the step's mean micro-batch cost) are placed by Algorithm 1's rule,
   carried first, then by length descending (Algorithm 1's order), and a descent on their loads alone (moves of one
   item off the heaviest bin, swaps with a lighter bin's item, `local_search.improve` on the
   large items) lowers the heaviest large load while the bins still have token room.
2. **Short items** follow longest first, each to the least-loaded bin with room, the
   fewest-tokens bin as fallback, else deferred: Algorithm 1's rule continued from the
   large loads (`fill_assign`), so they fill the gaps the large items left.
3. **Polish**: the same descent on the whole plan (`local_search.improve`, at most
   `POLISH_ITERATIONS` x bins steps, swaps with the `POLISH_SWAP_BINS` lightest bins), which
   also places deferred items where they fit.

Deterministic (stable sorts, ties to the lowest bin); carried items are placed first and
never deferred by the polish. The plan is never worse than phase 2's (the descent accepts
strict improvements of the largest load only).
"""
from __future__ import annotations

import numpy as np

from .greedy import placement_order, wlb_assign, wlb_assign_python
from .local_search import improve
from .problem import PackProblem, PackResult

LARGE_SHARE = 0.1
"""An item is large when its cost is at least this share of the step's mean micro-batch cost
(total item cost / bins)."""
POLISH_ITERATIONS = 4
"""The polish makes at most this many descent steps per bin."""
POLISH_SWAP_BINS = 4
"""The descents try swaps of the heaviest bin with this many of the lightest bins: a swap
with a bin near the top rarely lowers the maximum, and trying every bin made the polish the
larger part of a 32-micro-batch step's planning time."""


def fill_assign(order: np.ndarray, lengths: np.ndarray, weights: np.ndarray, loads: np.ndarray,
                toks: np.ndarray, cap: int) -> np.ndarray:
    """Algorithm 1's rule from given bin loads and tokens (both updated in place): each item
    of `order` to the least-loaded bin (ties: lowest index) if it fits under `cap`, else to
    the bin of fewest tokens if it fits there, else deferred (-1). Returns each item's bin."""
    return wlb_assign_python(order, lengths, weights, len(loads), cap, loads=loads, toks=toks)


def large_mask(weights: np.ndarray, n_bins: int, carried: int = 0) -> np.ndarray:
    """Which items `wlb_fill` places first: the carried ones and those costing at least
    LARGE_SHARE x total cost / n_bins."""
    threshold = LARGE_SHARE * float(weights.sum()) / n_bins
    mask = weights >= threshold
    mask[:carried] = True
    return mask


def place_large(problem: PackProblem, order: np.ndarray, large: np.ndarray) -> tuple[list[list[int]], list[int]]:
    """Phase 1: the large items of `order` (Algorithm 1's rule, then the descent on their
    loads). Returns (items of each bin, deferred items), as item indices."""
    items = order[large[order]]
    n_bins, cap = problem.n_bins, int(problem.max_tokens)
    placed = wlb_assign(np.arange(len(items), dtype=np.int64), problem.lengths[items], problem.weights[items],
                        n_bins, cap)
    bins = [[] for _ in range(n_bins)]
    deferred = []
    for k, b in enumerate(placed.tolist()):
        (bins[b] if b >= 0 else deferred).append(k)
    if n_bins > 1 and len(items) > n_bins:
        sub = PackProblem(lengths=problem.lengths[items], weights=problem.weights[items], n_bins=n_bins,
                          max_tokens=cap, carried=int(min(problem.carried, len(items))))
        result = improve(sub, [np.asarray(b, dtype=np.int64) for b in bins], np.asarray(deferred, dtype=np.int64),
                         max_iter=4 * n_bins, swap_bins=POLISH_SWAP_BINS)
        bins = [b.tolist() for b in result.bins]
        deferred = result.deferred.tolist()
    return [items[b].tolist() for b in bins], items[deferred].tolist() if deferred else []


def wlb_fill(problem: PackProblem) -> PackResult:
    """`wlb_fill` (module docstring): large items balanced, short items into the gaps, polish."""
    n_bins, cap = problem.n_bins, int(problem.max_tokens)
    order = placement_order(problem, problem.lengths)
    if problem.n_items == 0:
        return PackResult(bins=[np.zeros(0, dtype=np.int64) for _ in range(n_bins)],
                          deferred=np.zeros(0, dtype=np.int64))
    large = large_mask(problem.weights, n_bins, problem.carried)
    bins, deferred = place_large(problem, order, large)
    loads = np.array([problem.weights[b].sum() if b else 0.0 for b in bins], dtype=np.float64)
    toks = np.array([problem.lengths[b].sum() if b else 0 for b in bins], dtype=np.int64)
    short = order[~large[order]]
    placed = fill_assign(short, problem.lengths, problem.weights, loads, toks, cap)
    for i, b in zip(short.tolist(), placed.tolist()):
        (bins[b] if b >= 0 else deferred).append(i)
    result = improve(problem, [np.asarray(b, dtype=np.int64) for b in bins], np.asarray(deferred, dtype=np.int64),
                     max_iter=POLISH_ITERATIONS * n_bins, swap_bins=POLISH_SWAP_BINS)
    result.extra = dict(large=int(large.sum()), **result.extra)
    return result
