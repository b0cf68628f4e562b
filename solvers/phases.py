"""`wlb_phases`: Algorithm 1 with each micro-batch's forward and backward time balanced apart.

A pipeline runs a micro-batch's forward and its backward as separate operations, and its
bubbles follow the heaviest forward and the heaviest backward, not the heaviest sum
(paper Table 2 measures the forward time). The two phases weigh a document differently:
attention's share of the cost is larger in the backward pass, the tensor-parallel
communication's share smaller. Algorithm 1 balances the sum, so a micro-batch holding a
long document (much attention) and one of many short documents (much linear work) can cost
the same in total and still differ by a few percent in each phase, in opposite directions.

`phases_assign` keeps Algorithm 1's rule and its order (placed-first items as given, then
the rest longest first) and changes only what "least loaded" means: a micro-batch's load is
the larger of its forward time over the step's mean forward time and its backward time over
the step's mean backward time. Each item goes to the micro-batch of least load (ties: lowest
index) if it fits under the token cap, else to the one of fewest tokens if it fits there,
else it is deferred. When the backward costs are a fixed multiple of the forward ones the
rule is Algorithm 1's.

`wlb_phases` never defers an item that Algorithm 1 places (from `LUMP_MIN_BINS` bins:
Algorithm 1 over the same lumps, below): if the balanced placement defers anything
Algorithm 1 does not, Algorithm 1's placement is kept (`PackResult.extra["fallback"]`).
The streaming packer relies on this: its release policies decide on Algorithm 1's packings,
and the plan it keeps must not defer a piece they counted as placed.

From `LUMP_MIN_BINS` (32) bins the short items that end the order go in lumps (`tail_lumps`):
consecutive items, each lump one item of their tokens and costs, about 1 / (LUMP_SPLIT x bins)
of the tail's tokens still to place where it starts. A step of 32 micro-batches holds
thousands of short pieces, placed when the bins still differ by many of them; the last ones,
which even the bins out, stay single. A heavy-tailed step then places several times fewer
items, at the balance of the item-by-item placement (docs/tuning.md, "The plan's short tail
in lumps"). Both placements and the fallback see the same lumps; the items before the tail,
every long piece among them, come first in either, so the fallback defers none of them that
Algorithm 1 places piece by piece.
"""
from __future__ import annotations

import functools
import heapq
from collections.abc import Callable
from itertools import chain, islice

import numpy as np

from .greedy import _group, compiled_loop, placement_order, wlb_assign
from .problem import PackProblem, PackResult


def phases_assign(order: np.ndarray, lengths: np.ndarray, fwd: np.ndarray, bwd: np.ndarray, n_bins: int, cap: int,
                  fwd_const: float = 0.0, bwd_const: float = 0.0,
                  stop_if_placed_by: Callable[[], np.ndarray] | None = None) -> np.ndarray | None:
    """The bin of each item of `order` (placement order) under the module's rule, -1 = deferred.

    `stop_if_placed_by`, if given, is called at the first item that fits nowhere and returns
    another placement of `order` (-1 = deferred); the Python loop then returns None as soon
    as it defers an item that placement places (the compiled loop places every item).

    `fwd`, `bwd`: seconds of each item in each phase; `fwd_const`, `bwd_const`: seconds every
    bin adds. A bin's key, max(forward / mean forward, backward / mean backward) over the
    bins (every item of `order` counted in the means), only grows, so the heaps' keys may lag
    behind as in `greedy.wlb_assign_python` and are re-keyed at the top; as there, a leaner
    loop places the items until the first fallback, and an item that fits nowhere is deferred
    with every next item longer than the most room left, at once (an overloaded step of 32
    micro-batches defers a thousand of its tail's items). With numba (the `fast` extra) the same
    loop runs compiled (`greedy_compiled.phases_assign_compiled`, the same placements) unless
    `greedy.use_compiled(False)`."""
    order = np.asarray(order, dtype=np.int64)
    if not len(order):
        return np.zeros(0, dtype=np.int64)
    f_mean = (float(np.add.reduce(fwd[order])) + n_bins * fwd_const) / n_bins
    b_mean = (float(np.add.reduce(bwd[order])) + n_bins * bwd_const) / n_bins
    if not (f_mean > 0 and b_mean > 0):  # nothing to balance in a phase: Algorithm 1 on the sum
        return wlb_assign(order, lengths, fwd + bwd, n_bins, cap)
    f_share, b_share = fwd[order] / f_mean, bwd[order] / b_mean
    compiled = compiled_loop("phases_assign_compiled")
    if compiled is not None:
        return compiled(np.ascontiguousarray(lengths[order], dtype=np.int64), np.ascontiguousarray(f_share,
                        dtype=np.float64), np.ascontiguousarray(b_share, dtype=np.float64), fwd_const / f_mean,
                        bwd_const / b_mean, int(n_bins), int(cap))
    sizes = lengths[order].tolist()
    n_items = len(sizes)
    f_share, b_share = f_share.tolist(), b_share.tolist()
    f_load = [fwd_const / f_mean] * n_bins
    b_load = [bwd_const / b_mean] * n_bins
    keys = [max(f, b) for f, b in zip(f_load, b_load)]
    toks = [0] * n_bins
    heap = [(keys[b], b) for b in range(n_bins)]  # equal keys: already a heap, ties to the lowest index
    tok_heap = [(0, b) for b in range(n_bins)]
    replace = heapq.heapreplace
    placed: list[int] = []
    put = placed.append
    items = zip(sizes, f_share, b_share)
    # Until the first item that does not fit the least-loaded bin, no key lags: this loop
    # needs neither `keys` nor the check. At that item the general loop below takes over.
    for d, fs, bs in items:
        key, b = heap[0]
        t = toks[b] + d
        if t <= cap:
            toks[b] = t
            f = f_load[b] + fs
            g = b_load[b] + bs
            f_load[b] = f
            b_load[b] = g
            replace(heap, (f if f > g else g, b))
            put(b)
            continue
        items = chain([(d, fs, bs)], items)
        break
    for key, b in heap:
        keys[b] = key
    stuck = -1  # >= 0: the room of the least-loaded bin, current at the top (as in wlb_assign_python)
    other = None  # the placement of `stop_if_placed_by`, once called
    for d, fs, bs in items:
        least = False
        if d <= stuck or stuck < 0:
            key, b = heap[0]
            while key != keys[b]:  # a key left behind by the fallback
                replace(heap, (keys[b], b))
                key, b = heap[0]
            least = toks[b] + d <= cap
            if not least:
                stuck = cap - toks[b]
        if not least:  # the fewest-token bin (not the least-loaded one, which had no room)
            tok, b = tok_heap[0]
            while tok != toks[b]:
                replace(tok_heap, (toks[b], b))
                tok, b = tok_heap[0]
            if tok + d > cap:  # fits nowhere, nor does any next item longer than the most room left:
                # all deferred at once (the bins do not change while items are deferred)
                k, room = len(placed), cap - tok
                j = k + 1
                while j < n_items and sizes[j] > room:
                    j += 1
                if stop_if_placed_by is not None:
                    if other is None:
                        other = stop_if_placed_by().tolist()
                    if max(other[k:j]) >= 0:
                        return None
                placed.extend([-1] * (j - k))
                if j - k > 1:
                    next(islice(items, j - k - 2, j - k - 1), None)  # skip the items deferred with this one
                continue
        toks[b] += d
        f = f_load[b] + fs
        g = b_load[b] + bs
        f_load[b] = f
        b_load[b] = g
        keys[b] = f if f > g else g
        if least:  # the top bin changed: re-keyed, and no longer known to be full
            replace(heap, (keys[b], b))
            stuck = -1
        else:  # the top of the load heap stays; the fewest-token bin is re-keyed now
            replace(tok_heap, (toks[b], b))
        put(b)
    return np.array(placed, dtype=np.int64)


LUMP_MIN_BINS = 32
"""From this many bins, `wlb_phases` places the short tail of its order in lumps (`tail_lumps`)."""
LUMP_SHARE = 1 / 40
"""The tail that may be lumped: the items after the last one of at least this share of the
token cap (4,096 tokens at 163,840), where the streaming packer's candidates start their lumps
too (`packer.trial.COARSE_SHARE`)."""
LUMP_SPLIT = 4
"""A lump holds between 1 / (2 x LUMP_SPLIT x bins) and 1 / (LUMP_SPLIT x bins) of the tail's
tokens still to place where it starts (rounded to powers of two)."""
LUMP_MIN_TAIL = 64
"""A tail of fewer items is placed item by item."""


def tail_lumps(order: np.ndarray, lengths: np.ndarray, n_bins: int, cap: int, n_first: int = 0):
    """(cut, lump of each item of `order[cut:]`, numbered from 0 in order), or None where the
    whole order is placed item by item (fewer than `LUMP_MIN_BINS` bins, or a short tail).

    The tail is every item after the last one of at least `LUMP_SHARE` x `cap` tokens and after
    the `n_first` placed-first ones: short items, longest first. Where r tokens of the tail are
    left to place (the item's own included), r in [2^e, 2^(e+1)), the tail is cut every
    2^(e - b) tokens, 2^b >= LUMP_SPLIT x n_bins: a lump holds 1 / (2 x 2^b) to 1 / 2^b of what
    is left, so the items that even the bins out at the end (r below 2^b tokens) stay single,
    while the first short items, placed when the bins still differ by many of them, go by the
    dozen. Integers only (the plans do not depend on a platform's rounding)."""
    if n_bins < LUMP_MIN_BINS:
        return None
    sizes = lengths[order]
    long_at = (sizes >= max(1, int(cap * LUMP_SHARE))).nonzero()[0]
    cut = max(n_first, int(long_at[-1]) + 1 if len(long_at) else 0)
    if len(order) - cut < LUMP_MIN_TAIL:
        return None
    return cut, geometric_lumps(sizes[cut:], LUMP_SPLIT * n_bins)


def geometric_lumps(sizes: np.ndarray, split: int, finest: int = 1) -> np.ndarray:
    """The lump of each of `sizes` (items in placement order, tokens > 0), numbered from 0:
    consecutive items, cut by the tokens left to place. Where r tokens are left (the item's
    own included), r in [2^e, 2^(e+1)), the items are cut every 2^(e - b) tokens, 2^b >= `split`,
    so that a lump holds 1 / (2 x 2^b) to 1 / 2^b of what is left; below `finest` x 2^b tokens
    left, every `finest` tokens (1: each item alone there). Integers only (the lumps do not
    depend on a platform's rounding)."""
    left = sizes[::-1].cumsum(dtype=np.int64)[::-1]  # tokens from each item to the end
    bits = int(split - 1).bit_length()
    octave = np.frexp(np.maximum(left, 1).astype(np.float64))[1].astype(np.int64) - 1  # floor(log2), exact
    key = (octave << 32) | (left >> np.maximum(octave - bits, 0))
    if finest > 1:  # the fine end: every `finest` tokens (keys below 2^32, apart from the coarse ones)
        fine = left < (finest << bits)
        key[fine] = left[fine] // finest
    new = np.ones(len(key), dtype=bool)
    new[1:] = key[1:] != key[:-1]
    return new.cumsum() - 1


def phases_or_algorithm1(order: np.ndarray, lengths: np.ndarray, weights: np.ndarray, fwd: np.ndarray,
                         bwd: np.ndarray, n_bins: int, cap: int, fwd_const: float, bwd_const: float,
                         algorithm1: np.ndarray | None = None, n_first: int = 0) -> tuple[np.ndarray, bool]:
    """(bin of each item of `order`, whether Algorithm 1's placement was kept): the balanced
    placement unless it defers an item that Algorithm 1 (on `weights`; `algorithm1`, its
    placement of `order` if already known) places. From `LUMP_MIN_BINS` bins the order's short
    tail (after its `n_first` placed-first items) goes in lumps (`tail_lumps`): each lump is
    one item of its items' tokens and costs, in both placements, and its items go where it
    goes (`algorithm1` is then not used: Algorithm 1 places the same lumps)."""
    lumps = tail_lumps(order, lengths, n_bins, cap, n_first)
    if lumps is None:
        return _balanced_or_algorithm1(
            order, lengths, fwd, bwd, n_bins, cap, fwd_const, bwd_const,
            lambda: wlb_assign(order, lengths, weights, n_bins, cap) if algorithm1 is None else algorithm1)
    cut, lump_of = lumps
    head, tail = order[:cut], order[cut:]
    items = np.arange(cut + int(lump_of[-1]) + 1, dtype=np.int64)

    def with_lumps(values):
        return np.concatenate([values[head], np.bincount(lump_of, weights=values[tail])])

    item_lengths = with_lumps(lengths).astype(np.int64)  # token sums: exact in float64
    placed, fallback = _balanced_or_algorithm1(
        items, item_lengths, with_lumps(fwd), with_lumps(bwd), n_bins, cap, fwd_const, bwd_const,
        lambda: wlb_assign(items, item_lengths, with_lumps(weights), n_bins, cap))
    return np.concatenate([placed[:cut], placed[cut:][lump_of]]), fallback


def _balanced_or_algorithm1(order, lengths, fwd, bwd, n_bins, cap, fwd_const, bwd_const, algorithm1):
    """`phases_or_algorithm1` item by item; `algorithm1()` gives Algorithm 1's placement,
    made only where the balanced one defers an item (at the first it defers: the balanced
    placement stops at the first item it defers that Algorithm 1 places)."""
    algorithm1 = functools.cache(algorithm1)  # made once, where first asked for
    placed = phases_assign(order, lengths, fwd, bwd, n_bins, cap, fwd_const, bwd_const,
                           stop_if_placed_by=algorithm1)
    if placed is None:
        return algorithm1(), True
    if placed.min(initial=0) >= 0:
        return placed, False
    if np.any((placed < 0) & (algorithm1() >= 0)):
        return algorithm1(), True
    return placed, False


def wlb_phases(problem: PackProblem) -> PackResult:
    """The module's rule on a PackProblem: carried items first, then the rest longest first;
    the phases' costs from `problem.phase_weights` (None: the weights, i.e. Algorithm 1)."""
    order = placement_order(problem, problem.lengths)
    if problem.phase_weights is None:
        fwd = bwd = problem.weights
        fwd_const = bwd_const = problem.bin_const
    else:
        fwd, bwd = problem.phase_weights
        fwd_const, bwd_const = problem.phase_consts
    placed, fallback = phases_or_algorithm1(order, problem.lengths, problem.weights, fwd, bwd, problem.n_bins,
                                            int(problem.max_tokens), fwd_const, bwd_const, n_first=problem.carried)
    result = _group(order, placed, problem.n_bins)
    result.extra["fallback"] = fallback
    return result
