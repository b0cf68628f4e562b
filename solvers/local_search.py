"""`wlb_ls`: Algorithm 1 followed by a deterministic local search on the largest load.

WLB-LLM's Algorithm 1 (`greedy.wlb_greedy`) is a one-pass list scheduler; it stays a few
percent above the lower bound when the last, small documents cannot even out the bins, or
when its fewest-tokens fallback puts a document on a heavy bin. This method keeps the same
input and output and the same millisecond budget, and adds:

1. a second start, cost-LPT with the token cap (`greedy.fixed_greedy`, the Fixed-4D rule),
   and keeps the better of the two, lexicographically (placed tokens, then largest load);
2. placement of deferred items into bins with room (the least-loaded such bin), heaviest first,
   then a fill pass for tight caps (fixed-length packing): swap a placed item for a longer
   deferred one that still fits, largest token gain first, so fewer tokens are deferred;
3. a descent on the heaviest bin h: the best single move of an item of h to any bin with
   room, else the best swap of an item of h with an item of a lighter bin (lightest bins
   first; partners found by binary search on the weight that would halve the difference),
   accepted only when it lowers max(load_h, load_b) strictly. The sorted vector of loads then
   decreases lexicographically, so the descent ends; `max_iter` caps it. Where a move or swap
   left room for a deferred item, step 2 runs again and the descent goes on: no deferred item
   fits a bin at the end.

Deterministic: no randomness, no clock; ties go to the lowest index. Carried items stay
placed (moves keep every item in some bin; the fill pass never swaps a carried item out).
"""
from __future__ import annotations

import numpy as np

from .bounds import makespan_lower_bound
from .greedy import fixed_greedy, wlb_greedy
from .problem import PackProblem, PackResult

_NEIGHBOURS = 3  # swap partners tried on each side of the ideal weight in a sorted bin


class _State:
    """Bins as item lists with cached loads and tokens (weights without bin_const)."""

    def __init__(self, problem: PackProblem, bins, deferred):
        self.w = problem.weights
        self.L = problem.lengths
        self.cap = int(problem.max_tokens)
        self.carried = int(problem.carried)
        self.where = np.full(problem.n_items, -1, dtype=np.int64)
        for b, items in enumerate(bins):
            self.where[np.asarray(items, dtype=np.int64)] = b
        self.members = [list(map(int, items)) for items in bins]
        self.loads = np.array([self.w[m].sum() if m else 0.0 for m in self.members], dtype=np.float64)
        self.toks = np.array([int(self.L[m].sum()) if m else 0 for m in self.members], dtype=np.int64)
        self.deferred = [int(i) for i in deferred]

    def _add(self, i: int, b: int) -> None:
        self.members[b].append(i)
        self.loads[b] += self.w[i]
        self.toks[b] += self.L[i]
        self.where[i] = b

    def _remove(self, i: int, b: int) -> None:
        self.members[b].remove(i)
        self.loads[b] -= self.w[i]
        self.toks[b] -= self.L[i]
        self.where[i] = -1

    def move(self, i: int, src: int, dst: int) -> None:
        self._remove(i, src)
        self._add(i, dst)

    def place_deferred(self) -> None:
        keep = []
        for i in sorted(self.deferred, key=lambda j: (-self.w[j], j)):
            room = self.toks + self.L[i] <= self.cap
            if not room.any():
                keep.append(i)
                continue
            self._add(i, int(np.argmin(np.where(room, self.loads, np.inf))))
        self.deferred = sorted(keep)

    def deferred_fits(self) -> bool:
        """Whether some deferred item fits the bin of most room."""
        return bool(self.deferred) and int(self.L[self.deferred].min()) <= self.cap - int(self.toks.min())

    def fill(self, max_steps: int) -> int:
        """Raise placed tokens: swap a placed item i for a longer deferred j that still fits
        (or insert j into the slack), the largest gain first. Returns the number of swaps."""
        steps = 0
        while self.deferred and steps < max_steps:
            dl = np.asarray(self.deferred, dtype=np.int64)
            order = np.argsort(self.L[dl], kind="stable")
            dl, dlen = dl[order], self.L[dl[order]]
            best = (0, -1, -1, -1)  # gain, bin, item out (-1: insert), item in
            for b in range(len(self.members)):
                slack = self.cap - int(self.toks[b])
                if slack <= 0 and not self.members[b]:
                    continue
                out = np.asarray([-1] + [i for i in self.members[b] if i >= self.carried], dtype=np.int64)
                out_len = np.where(out >= 0, self.L[np.maximum(out, 0)], 0)
                pos = np.searchsorted(dlen, out_len + slack, side="right") - 1  # longest that fits
                ok = pos >= 0
                gain = np.where(ok, dlen[np.maximum(pos, 0)] - out_len, 0)
                k = int(np.argmax(gain))
                if gain[k] > best[0]:
                    best = (int(gain[k]), b, int(out[k]), int(dl[pos[k]]))
            if best[0] <= 0:
                break
            _, b, i, j = best
            if i >= 0:
                self._remove(i, b)
                self.deferred.append(i)
            self.deferred.remove(j)
            self._add(j, b)
            steps += 1
        self.deferred.sort()
        return steps

    def best_move(self, h: int):
        """Best move of one item of h to another bin: (new pair max, item, dst) or None."""
        items = np.asarray(self.members[h], dtype=np.int64)
        if items.size == 0:
            return None
        wi = self.w[items][:, None]
        fits = self.toks[None, :] + self.L[items][:, None] <= self.cap
        fits[:, h] = False
        pair = np.maximum(self.loads[h] - wi, self.loads[None, :] + wi)
        pair = np.where(fits, pair, np.inf)
        k = int(np.argmin(pair))
        r, b = divmod(k, pair.shape[1])
        if not np.isfinite(pair[r, b]):
            return None
        return float(pair[r, b]), int(items[r]), int(b)

    def best_swap(self, h: int, b: int):
        """Best swap of i in h with j in b (w_i > w_j): (new pair max, i, j) or None."""
        hi = np.asarray(self.members[h], dtype=np.int64)
        bj = np.asarray(self.members[b], dtype=np.int64)
        if hi.size == 0 or bj.size == 0:
            return None
        diff = self.loads[h] - self.loads[b]
        order = np.argsort(self.w[bj], kind="stable")
        bj = bj[order]
        wb = self.w[bj]
        # The pair max is smallest when w_i - w_j = diff / 2; look at the neighbours of that.
        pos = np.searchsorted(wb, self.w[hi] - diff / 2.0)
        offs = np.arange(-_NEIGHBOURS, _NEIGHBOURS)
        cand = np.clip(pos[:, None] + offs[None, :], 0, len(bj) - 1)
        i_idx = np.repeat(hi, cand.shape[1])
        j_idx = bj[cand.ravel()]
        delta = self.w[i_idx] - self.w[j_idx]
        ok = (delta > 0) & (self.toks[h] - self.L[i_idx] + self.L[j_idx] <= self.cap) \
            & (self.toks[b] - self.L[j_idx] + self.L[i_idx] <= self.cap)
        pair = np.where(ok, np.maximum(self.loads[h] - delta, self.loads[b] + delta), np.inf)
        k = int(np.argmin(pair))
        if not np.isfinite(pair[k]):
            return None
        return float(pair[k]), int(i_idx[k]), int(j_idx[k])


def improve(problem: PackProblem, bins, deferred, max_iter: int | None = None,
            swap_bins: int | None = None) -> PackResult:
    """Local search from a given solution; returns a solution at least as good. `swap_bins`:
    swaps of the heaviest bin are tried with at most this many of the lightest bins (None:
    every lighter bin)."""
    st = _State(problem, bins, deferred)
    m = problem.n_bins
    max_iter = max_iter if max_iter is not None else 20 * m + 200
    fills = 0

    def place() -> None:  # step 2: deferred items into bins with room, then the fill pass
        nonlocal fills
        st.place_deferred()
        fills += st.fill(max_iter)

    if st.deferred:
        place()
    iters = moves = swaps = 0
    while iters < max_iter and m > 1:
        iters += 1
        h = int(np.argmax(st.loads))
        top = st.loads[h]
        tol = 1e-12 * max(top, 1e-300)
        mv = st.best_move(h)
        if mv is not None and mv[0] < top - tol:
            st.move(mv[1], h, mv[2])
            moves += 1
            continue
        done = False
        for b in np.argsort(st.loads, kind="stable")[:swap_bins].tolist():
            if b == h or st.loads[b] >= top - tol:
                continue
            sw = st.best_swap(h, b)
            if sw is not None and sw[0] < top - tol:
                st.move(sw[1], h, b)
                st.move(sw[2], b, h)
                swaps += 1
                done = True
                break
        if not done:
            if st.deferred_fits():  # the descent freed room for a deferred item: place it, go on
                place()
                continue
            break
    if st.deferred_fits():  # the descent stopped at max_iter with room for a deferred item
        place()
    out_bins = [np.asarray(sorted(mb), dtype=np.int64) for mb in st.members]
    return PackResult(bins=out_bins, deferred=np.asarray(st.deferred, dtype=np.int64),
                      extra=dict(ls_iterations=iters, ls_moves=moves, ls_swaps=swaps, ls_fills=fills))


def wlb_local_search(problem: PackProblem) -> PackResult:
    """`wlb_ls`: the better of Algorithm 1 and capped LPT, then `improve` (skipped when
    Algorithm 1 places everything within 0.01% of the makespan lower bound).

    Options (PackProblem.options): `max_iter` (descent steps, default 20 * bins + 200).
    """
    max_iter = problem.options.get("max_iter")
    if max_iter is not None and (isinstance(max_iter, bool) or not isinstance(max_iter, (int, np.integer))
                                 or max_iter < 0):
        raise ValueError(f"max_iter must be an integer >= 0, got {max_iter!r}")
    first = wlb_greedy(problem)
    if len(first.deferred) == 0 and problem.n_items:
        # Already within 0.01% of a lower bound (e.g. one document heavier than a fair share
        # fills its own micro-batch): nothing left to gain, keep Algorithm 1's plan.
        bound = makespan_lower_bound(problem.weights, problem.n_bins, problem.bin_const)
        if problem.loads(first.bins).max() <= bound * (1.0 + 1e-4):
            first.extra = dict(start="wlb", stopped="within 1e-4 of the lower bound")
            return first
    starts = [("wlb", first), ("lpt", fixed_greedy(problem))]
    name, best = min(starts, key=lambda s: problem.lex_key(s[1].bins, s[1].deferred))
    result = improve(problem, best.bins, best.deferred, max_iter)
    result.extra["start"] = name
    return result
