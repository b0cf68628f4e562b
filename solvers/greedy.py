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

import contextlib
import heapq
import os
from bisect import bisect_left
from itertools import chain, islice
from operator import itemgetter, neg
from typing import NamedTuple

import numpy as np

from .problem import PackProblem, PackResult


def placement_order(problem: PackProblem, key: np.ndarray) -> np.ndarray:
    """Carried items in their given order, then the rest by `key` descending (stable)."""
    k = problem.carried
    rest = k + argsort_descending(key[k:])
    return np.concatenate([np.arange(k, dtype=np.int64), rest.astype(np.int64)])


RADIX_FROM = 2048
"""`argsort_descending` sorts this many integer keys or more by radix passes."""


def argsort_descending(key: np.ndarray) -> np.ndarray:
    """Indices of `key` largest first, ties in index order: `np.argsort(-key, kind="stable")`.

    Non-negative integer keys below 2**32 (token counts) are sorted as two 16-bit digits,
    low digit first, each by numpy's stable radix sort of uint16: the same permutation (a
    stable sort is unique) in a fraction of the time of the comparison sort numpy uses for
    int64, from about `RADIX_FROM` keys up (below, the two passes cost more than they save)."""
    if len(key) < 2:  # nothing to sort (a group of one piece, most often)
        return np.arange(len(key), dtype=np.int64)
    if key.dtype.kind == "u":  # -key would wrap around
        key = key.astype(np.int64)
    if key.dtype.kind not in "iu" or len(key) < RADIX_FROM:
        return (-key).argsort(kind="stable")
    top = int(key.max())
    if int(key.min()) < 0 or top >= 2**32:
        return (-key).argsort(kind="stable")
    flipped = top - key.astype(np.int64)  # ascending in `flipped` = descending in `key`
    order = (flipped & 0xFFFF).astype(np.uint16).argsort(kind="stable")
    if top >= 2**16:
        order = order[(flipped[order] >> 16).astype(np.uint16).argsort(kind="stable")]
    return order.astype(np.int64)


def wlb_greedy(problem: PackProblem) -> PackResult:
    """Algorithm 1: minimum workload first, minimum tokens as fallback, else defer."""
    order = placement_order(problem, problem.lengths)
    placed_bin = wlb_assign(order, problem.lengths, problem.weights, problem.n_bins, int(problem.max_tokens))
    return _group(order, placed_bin, problem.n_bins)


class AssignStop(NamedTuple):
    """When Algorithm 1's Python loop may give up on a packing (`wlb_assign(..., stop=)`): a
    caller that only needs to know whether the packing passes some limits learns that it does
    not as soon as it is certain, without packing the rest. Every quantity it watches only
    grows as items are placed or deferred, so a limit passed part-way is passed at the end."""

    load: float = float("inf")
    """Give up when a bin's load exceeds this stop..."""
    slope: float = 0.0
    """...which falls by `slope` x the cost of each deferred item (a stop proportional to the
    packing's mean load, which deferred items lower); a bin already above the fallen stop
    ends the packing there too."""
    load_cap: float = float("inf")
    """...and never exceeds this, whatever is deferred (from a bound on the mean load that
    holds however little is placed: `TrialPack.rejects` derives one from the token capacity)."""
    deferred_tokens: float = float("inf")
    """Give up when the deferred items' tokens reach this."""
    keep: frozenset = frozenset()
    """Give up when the item at one of these positions (in the placement order) is deferred."""


def wlb_assign(order: np.ndarray, lengths: np.ndarray, weights: np.ndarray, n_bins: int, cap: int,
               stop: AssignStop | None = None) -> np.ndarray | None:
    """Algorithm 1's bin of each item of `order` (placement order), -1 = deferred: the
    compiled loop (greedy_compiled.py) when numba imports and `use_compiled` allows it, else
    `wlb_assign_python`. Both give the same placements.

    `stop`: the Python loop returns None as soon as the packing passes one of its limits
    (`AssignStop`); the compiled loop, fast enough without, packs everything."""
    compiled = compiled_loop()
    if compiled is None:
        return wlb_assign_python(order, lengths, weights, n_bins, cap, stop=stop)
    return compiled(np.ascontiguousarray(order, dtype=np.int64), np.ascontiguousarray(lengths, dtype=np.int64),
                    np.ascontiguousarray(weights, dtype=np.float64), int(n_bins), int(cap))


_COMPILED: dict = {"enabled": os.environ.get("WLB_OPT_COMPILED", "1") != "0", "module": None, "tried": False}


def compiled_loop(name: str = "wlb_assign_compiled"):
    """The compiled loop `name` of greedy_compiled.py (Algorithm 1's "wlb_assign_compiled",
    the balanced placement's "phases_assign_compiled", the lumped candidates' packing
    "lumped_assign_compiled" of `StepSolver.assign_split`), or None: numba missing, or
    switched off."""
    if not _COMPILED["enabled"]:
        return None
    if not _COMPILED["tried"]:
        _COMPILED["tried"] = True
        try:
            from . import greedy_compiled
        except ImportError:  # the `fast` extra is not installed: the Python loops
            greedy_compiled = None
        _COMPILED["module"] = greedy_compiled
    return None if _COMPILED["module"] is None else getattr(_COMPILED["module"], name)


def compiled_available() -> bool:
    """Whether the compiled loops can run here (numba, the `fast` extra)."""
    enabled = _COMPILED["enabled"]
    _COMPILED["enabled"] = True
    try:
        return compiled_loop() is not None
    finally:
        _COMPILED["enabled"] = enabled


def warm_up_compiled() -> bool:
    """Compile the compiled loops (or load them from numba's cache) now, on tiny inputs, so
    that no later call pays for it; False where they cannot run (numba missing, or switched
    off by `use_compiled` / WLB_OPT_COMPILED=0)."""
    module = compiled_loop() and _COMPILED["module"]
    if not module:
        return False
    one, ones = np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.int64)
    module.wlb_assign_compiled(one, ones, np.ones(1), 1, 1)
    module.phases_assign_compiled(ones, np.ones(1), np.ones(1), 0.0, 0.0, 1, 1)
    module.lumped_assign_compiled(one, one, one, ones, np.ones(1), ones, np.ones(1), 1, 1)
    return True


@contextlib.contextmanager
def use_compiled(enabled: bool):
    """Within the block, `wlb_assign`, `phases.phases_assign` and the lumped candidates'
    packing (`StepSolver.assign_split`) run the compiled loops (if numba imports) or, with enabled=False, the Python loops; the environment variable
    WLB_OPT_COMPILED=0 sets the default to the Python loops."""
    before = _COMPILED["enabled"]
    _COMPILED["enabled"] = bool(enabled)
    try:
        yield
    finally:
        _COMPILED["enabled"] = before


def wlb_assign_python(order: np.ndarray, lengths: np.ndarray, weights: np.ndarray, n_bins: int,
                      cap: int, loads: np.ndarray | None = None, toks: np.ndarray | None = None,
                      stop: AssignStop | None = None) -> np.ndarray | None:
    """Algorithm 1's bin of each item of `order` (placement order), -1 = deferred.

    `loads` and `toks` (float64 and int64 per bin), when given, are the bins' starting state
    and are updated in place (`fill.fill_assign` continues a plan this way); default: empty
    bins. `stop`, when given: None is returned (and `loads`, `toks` are left unchanged) as
    soon as the packing passes one of its limits (`AssignStop`).

    Each item goes to the bin of least load (ties: lowest index) if it fits under `cap`
    tokens, else to the bin of fewest tokens (ties: lowest index) if it fits there, else it
    is deferred. Loads accumulate in placement order (the same float sums as a plain loop).

    Both heaps hold one entry per bin whose key may lag behind the bin's value (a bin filled
    by the fallback is not re-keyed in the load heap, nor any bin in the token heap): values
    only grow, so a lagging key is never above its value, and the top is re-keyed until it
    is current, which makes it the true minimum. The fallback is then O(log N) per item
    instead of a scan of every bin plus a rebuilt heap, which matters on overloaded steps
    where most short items fall back. Until the first fallback no key lags, and a leaner loop
    places the items (most of a step's, or all of them).
    """
    order = np.asarray(order, dtype=np.int64)
    sized = lengths[order]
    return wlb_assign_lists(sized.tolist(), weights[order].tolist(), n_bins, cap, loads=loads, toks=toks, stop=stop,
                            sizes_array=lambda: sized)


def wlb_assign_lists(sizes: list[int], costs: list[float], n_bins: int, cap: int, *, loads: np.ndarray | None = None,
                     toks: np.ndarray | None = None, stop: AssignStop | None = None,
                     sizes_array=None, as_list: bool = False) -> np.ndarray | list[int] | None:
    """`wlb_assign_python` on items given as Python lists in placement order: `sizes`
    (tokens) and `costs`, the loop's own input (a caller that holds them as lists, such as
    the lumps a step's candidates share, skips the conversion). `sizes_array()`, if given,
    returns `sizes` as an int64 array (read at the first run of deferred items, if any).
    `loads` and `toks` may be lists; `as_list`: the bins are returned as a list."""
    start_loads, start_toks = loads, toks
    toks = [0] * n_bins if start_toks is None else list(start_toks) if isinstance(start_toks, list) else start_toks.tolist()
    loads = ([0.0] * n_bins if start_loads is None else list(start_loads) if isinstance(start_loads, list)
             else start_loads.tolist())
    placed_bin: list[int] = []
    put = placed_bin.append
    heap = [(loads[b], b) for b in range(n_bins)]  # (load, bin): a heap orders ties by the lowest bin index
    tok_heap = [(toks[b], b) for b in range(n_bins)]  # (tokens, bin), keys may lag
    if start_loads is not None or start_toks is not None:
        heapq.heapify(heap)
        heapq.heapify(tok_heap)
    replace = heapq.heapreplace
    stop = AssignStop() if stop is None else stop
    stop_slope, keep = float(stop.slope), sorted(stop.keep)
    stop_falling, stop_cap = float(stop.load), float(stop.load_cap)
    stop_load = min(stop_falling, stop_cap)
    deferred_tokens, stop_deferred = 0, stop.deferred_tokens
    sorted_from = None  # where the lengths stop rising (found at the first item deferred)
    items = zip(sizes, costs)
    # Until the first item that does not fit the least-loaded bin, no key lags: this loop
    # needs neither `loads` nor the check. At that item the general loop below takes over.
    for d, w in items:
        load, b = heap[0]
        t = toks[b] + d
        if t <= cap:
            toks[b] = t
            load += w
            if load > stop_load:
                return None
            replace(heap, (load, b))
            put(b)
            continue
        items = chain([(d, w)], items)
        break
    for load, b in heap:
        loads[b] = load
    # `stuck`, when >= 0: the room of the least-loaded bin, current at the heap's top. An item
    # longer than that falls back without the heap being read: only the bin at the top could
    # change the top, and a fallback places elsewhere (that bin, had it the fewest tokens
    # and no room, would have deferred the item).
    stuck = -1
    for d, w in items:
        if d <= stuck or stuck < 0:
            load, b = heap[0]
            while load != loads[b]:  # a key left behind by the fallback
                replace(heap, (loads[b], b))
                load, b = heap[0]
            t = toks[b] + d
            if t <= cap:
                toks[b] = t
                load += w
                if load > stop_load:
                    return None
                loads[b] = load
                replace(heap, (load, b))
                put(b)
                stuck = -1
                continue
            stuck = cap - toks[b]
        tok, b = tok_heap[0]
        while tok != toks[b]:
            replace(tok_heap, (toks[b], b))
            tok, b = tok_heap[0]
        t = tok + d
        if t <= cap:  # fallback: fewest tokens (rare but for overloaded steps)
            toks[b] = t
            loads[b] += w
            if loads[b] > stop_load:
                return None
            replace(tok_heap, (t, b))  # the bin at the top, re-keyed now
            put(b)
        else:  # fits nowhere, nor does any next item longer than the most room left: all deferred at once
            # (the bins do not change while items are deferred; where the lengths no longer rise
            # the first item that fits is found by bisection, elsewhere by a scan)
            k = len(placed_bin)
            if sorted_from is None:
                sized = np.asarray(sizes, dtype=np.int64) if sizes_array is None else sizes_array()
                rises = (sized[1:] > sized[:-1]).nonzero()[0]
                sorted_from = int(rises[-1]) + 1 if len(rises) else 0
            if k >= sorted_from:
                j = bisect_left(sizes, tok - cap, k + 1, len(sizes), key=neg)
            else:
                j, room, n_items = k + 1, cap - tok, len(sizes)
                while j < n_items and sizes[j] > room:
                    j += 1
            if keep:
                at = bisect_left(keep, k)
                if at < len(keep) and keep[at] < j:
                    return None
            placed_bin.extend([-1] * (j - k))
            stop_falling -= stop_slope * sum(costs[k:j])
            if stop_falling < stop_load:  # a bin already above the lowered stop stays above it
                stop_load = stop_falling
                if max(loads) > stop_load:
                    return None
            deferred_tokens += sum(sizes[k:j])
            if deferred_tokens >= stop_deferred:
                return None
            if j - k > 1:
                next(islice(items, j - k - 2, j - k - 1), None)  # skip the items deferred with this one
    if start_loads is not None:
        start_loads[:] = loads
    if start_toks is not None:
        start_toks[:] = toks
    return placed_bin if as_list else np.array(placed_bin, dtype=np.int64)


class Unshared(Exception):
    """`SharedPlacements.assign` cannot reuse the shared placements for this candidate."""


class SharedPlacements:
    """Algorithm 1 (`wlb_assign_lists`) on many item lists of the form first + group + rest,
    where `first` and `rest` are the same for all and only the few items of `group` differ:
    a step's candidates, whose group of outliers, the longest pieces, is placed right after
    the pieces placed first, the other pieces in the same order after it.

    Until an item of `rest` goes to a bin the group went to (or to a bin where it does not
    fit), it goes where Algorithm 1 puts it on the other bins alone: the least-loaded bin
    overall is the least-loaded of those as long as their least load (ties: bin index) is
    below that of the group's bins, and that least load only grows. Candidates whose groups
    fill the same bins therefore share the placements of `rest` on the others up to that
    point. Those are computed once, as far as the candidates have needed them (a `_Run`), and
    each candidate packs `rest` only from where it leaves them. The placements, loads and
    `stop` are exactly those of `wlb_assign_lists` on the whole list (the loads are the same
    sums, in the same order).

    `assign` raises `Unshared` where the shared placements do not apply: an item of `first`
    or `group` that does not fit the least-loaded bin."""

    def __init__(self, first_sizes: list[int], first_costs: list[float], sizes: list[int], costs: list[float],
                 n_bins: int, cap: int):
        self.sizes, self.costs, self.n_bins, self.cap = sizes, costs, n_bins, cap
        self.n_first = len(first_sizes)
        loads, toks = [0.0] * n_bins, [0] * n_bins
        heap = [(0.0, b) for b in range(n_bins)]
        placed = _lean_placements(first_sizes, first_costs, loads, toks, heap, cap)
        self._first = None if placed is None else (loads, toks, heap, *placed)
        self._runs: dict[frozenset, _Run] = {}

    def assign(self, group_sizes: list[int], group_costs: list[float],
               stop: AssignStop | None = None) -> list[int] | None:
        """`wlb_assign_lists(first + group + rest, n_bins, cap, stop=stop)`, as a list (None:
        stopped)."""
        if self._first is None:
            raise Unshared("an item placed first does not fit the least-loaded bin")
        loads, toks, heap, placed_first, peak = self._first
        loads, toks, heap = loads[:], toks[:], heap[:]
        placed = _lean_placements(group_sizes, group_costs, loads, toks, heap, self.cap)
        if placed is None:
            raise Unshared("an item of the group does not fit the least-loaded bin")
        placed_group, peak_group = placed
        touched = frozenset(placed_group)
        run = self._runs.get(touched)
        if run is None:
            run = self._runs[touched] = _Run(self, touched)
        stop = AssignStop() if stop is None else stop
        stop_load = min(float(stop.load), float(stop.load_cap))
        if max(peak, peak_group) > stop_load:
            return None  # a bin above the stop after the items placed first or the group
        # the least (load, bin) of the group's bins: none, and every item of `rest` is shared
        level = min((loads[b], b) for b in touched) if touched else (float("inf"), self.n_bins)
        k = run.reach(level, stop_load)
        shared_bins, peak = run.state(k, loads, toks)
        if peak > stop_load:
            return None  # ... or after the shared placements
        offset = self.n_first + len(group_sizes) + k
        if stop.keep:
            stop = stop._replace(keep=frozenset(i - offset for i in stop.keep if i >= offset))
        rest = wlb_assign_lists(self.sizes[k:], self.costs[k:], self.n_bins, self.cap, loads=loads, toks=toks,
                                stop=stop, as_list=True)
        if rest is None:
            return None
        return placed_first + placed_group + shared_bins + rest


_BIN = itemgetter(1)


class _Run:
    """Algorithm 1's placements of the items after the group (`SharedPlacements.sizes`,
    `.costs`) on the bins a group left alone, from their state after the items placed first,
    as far as callers have asked (`reach`)."""

    __slots__ = ("sizes", "costs", "cap", "heap", "chosen")

    def __init__(self, shared: SharedPlacements, touched: frozenset):
        loads, toks = shared._first[:2]
        self.sizes, self.costs, self.cap = shared.sizes, shared.costs, shared.cap
        # (load, bin, tokens) of each bin: a heap ordered by (load, bin), bins being distinct
        self.heap = [(loads[b], b, toks[b]) for b in range(shared.n_bins) if b not in touched]
        heapq.heapify(self.heap)
        self.chosen: list[tuple[float, int, int]] = []  # the bin each item goes to, as it is then: non-decreasing

    def reach(self, level: tuple[float, int], stop_load: float = float("inf")) -> int:
        """How many items go where they go here in a packing whose group's bins have their least
        (load, bin) at `level`: those placed while this run's least (load, bin) is below it,
        placing more as needed, but none after one that brings a bin above `stop_load` (the
        caller's packing stops there)."""
        chosen = self.chosen
        if chosen and chosen[-1] >= level:
            return bisect_left(chosen, level)
        heap, sizes, costs, cap = self.heap, self.sizes, self.costs, self.cap
        choose, replace = chosen.append, heapq.heapreplace
        level_load, level_bin = level
        for i in range(len(chosen), len(sizes) if heap else 0):
            top = heap[0]
            load, b, t = top
            if load >= level_load and (load > level_load or b > level_bin):
                break
            t += sizes[i]
            if t > cap:  # the shared placements end here: the packing falls back, or defers
                break
            load += costs[i]
            replace(heap, (load, b, t))
            choose(top)
            if load > stop_load:
                break
        return len(chosen)

    def state(self, k: int, loads: list[float], toks: list[int]) -> tuple[list[int], float]:
        """Set `loads` and `toks` of the bins the first `k` items go to as they are after them
        (each bin's last item: its load and tokens then plus the item's, the same sums); returns
        those items' bins and the highest of those loads (-inf: none)."""
        chosen, sizes, costs = self.chosen, self.sizes, self.costs
        bins = list(map(_BIN, chosen[:k]))
        peak = float("-inf")
        for b, i in dict(zip(bins, range(k))).items():
            load, _, t = chosen[i]
            load = loads[b] = load + costs[i]
            toks[b] = t + sizes[i]
            if load > peak:
                peak = load
        return bins, peak


def _lean_placements(sizes: list[int], costs: list[float], loads: list[float], toks: list[int],
                     heap: list[tuple[float, int]], cap: int) -> tuple[list[int], float] | None:
    """Algorithm 1's bin of each item while each fits the least-loaded bin (None at the first
    that does not), from the bins' `loads`, `toks` and their (load, bin) `heap`, all updated;
    with the highest load an item brings a bin to (-inf: no item)."""
    placed, peak = [], float("-inf")
    for d, w in zip(sizes, costs):
        load, b = heap[0]
        t = toks[b] + d
        if t > cap:
            return None
        toks[b] = t
        load += w
        loads[b] = load
        heapq.heapreplace(heap, (load, b))
        placed.append(b)
        if load > peak:
            peak = load
    return placed, peak


def _group(order: np.ndarray, placed_bin: np.ndarray, n_bins: int) -> PackResult:
    """Bins from (item, bin) pairs in placement order; each bin keeps placement order."""
    keep = placed_bin >= 0
    items, bins_of = order[keep], placed_bin[keep]
    return PackResult(bins=split_by_bin(items.astype(np.int64, copy=False), bins_of, n_bins), deferred=order[~keep])


def split_by_bin(items: np.ndarray, bins_of: np.ndarray, n_bins: int) -> list[np.ndarray]:
    """Per bin, the `items` whose `bins_of` is that bin, in their given order (`np.split` of a
    stable sort by bin, without its per-piece overhead): views of one array."""
    order, ends = group_by_bin(bins_of, n_bins)
    return cut_at(items[order], ends)


def group_by_bin(bins_of: np.ndarray, n_bins: int) -> tuple[np.ndarray, list[int]]:
    """(the stable sort of `bins_of` by bin, where each bin's run ends in it)."""
    return bin_order(bins_of, n_bins), np.bincount(bins_of, minlength=n_bins).cumsum().tolist()


def cut_at(values: np.ndarray, ends: list[int]) -> list[np.ndarray]:
    """`values` cut into consecutive slices (views) that end at `ends`."""
    return [values[start:end] for start, end in zip([0] + ends[:-1], ends)]


def insert_sorted(values: np.ndarray, at: np.ndarray, items: np.ndarray) -> np.ndarray:
    """`np.insert(values, at, items)` for non-decreasing positions `at` (items at equal
    positions keep their order), without np.insert's general-case overhead."""
    n, k = len(values), len(items)
    out = np.empty(n + k, dtype=values.dtype)
    where = at + np.arange(k)
    rest = np.ones(n + k, dtype=bool)
    rest[where] = False
    out[where] = items
    out[rest] = values
    return out


def bin_order(bins_of: np.ndarray, n_bins: int) -> np.ndarray:
    """`np.argsort(bins_of, kind="stable")` for bin indices in [0, n_bins): as uint16 (numpy's
    radix sort) when the bins fit in 16 bits."""
    if n_bins <= 2**16:
        return bins_of.astype(np.uint16).argsort(kind="stable")
    return bins_of.argsort(kind="stable")


def bin_tokens(lengths: np.ndarray, bins: list[np.ndarray]) -> np.ndarray:
    """int64 tokens of each bin (`lengths` summed over each bin's positions), from one
    cumulative sum: integer sums are exact in any order."""
    if not bins:
        return np.zeros(0, dtype=np.int64)
    counts = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
    members = np.concatenate(bins).astype(np.int64) if counts.sum() else np.zeros(0, dtype=np.int64)
    return run_sums(np.asarray(lengths, dtype=np.int64)[members], np.cumsum(counts))


def run_sums(values: np.ndarray, ends) -> np.ndarray:
    """int64 sums of the consecutive runs of integer `values` that end at `ends`, from one
    cumulative sum (exact in any order)."""
    ends = np.asarray(ends, dtype=np.int64)
    running = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
    return running[ends] - running[np.concatenate([[0], ends[:-1]])]


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
