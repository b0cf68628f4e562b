"""One step's candidate packings, evaluated without building a plan for each.

A release policy (release.py) packs the step once per candidate group of outliers and keeps
one of them. Through `solve_pack` every candidate would validate the step's pieces again,
weigh them with the cost model, sort all of them and build a frozen PackPlan, though most
candidates are only read for their imbalance and deferred tokens. `StepSolver` does that
work once per step: it holds the step's pieces (carried, fresh and queued) as arrays with
their costs, sorts the fresh documents once (a trimmed step, the fresh documents but one,
reuses that order), and packs a candidate by merging its few other pieces into that order
and running Algorithm 1's assignment (`wlb_assign`). A `TrialPack`
answers what the policies read (imbalance, deferred tokens, micro-batches) and builds the
PackPlan only when asked, for the candidate the step keeps.

The candidates of one round differ only in the group of held pieces they add to the step's
current packing (release.py). `TrialPack.with_group` builds them from that packing: a
group's pieces are merged into its placement order (after the held pieces of equal length,
before the fresh ones, as the stable sort puts them), and a candidate is packed only when a
policy first reads it, so that the groups a policy skips unread cost nothing.

The plans are those of `solve_pack(method="wlb")` on the same pieces in the same order: the
same placement order (placed-first pieces as given, then the others longest first, stable),
the same assignment, and loads summed the same way (each micro-batch's piece costs in
placement order, plus the per-micro-batch constant). With method "wlb_phases" the plan kept
is `solve_pack(method="wlb_phases")`'s; from `COARSE_MIN_BINS` micro-batches its candidates
are Algorithm 1's packings with the step's short pieces in lumps (`StepSolver.assign_and_sum`).
"""
from __future__ import annotations

import numpy as np

from ..plan import PackPlan, SolveInfo, _imbalance as imbalance
from ..solvers.bounds import densest_first, densest_order
from ..solvers.greedy import (AssignStop, SharedPlacements, Unshared, argsort_descending, compiled_loop, cut_at,
                               group_by_bin, insert_sorted, run_sums, wlb_assign, wlb_assign_lists)
from ..solvers.phases import geometric_lumps, phases_or_algorithm1
from ._cached import cached_property
from .pieces import FreshPieces, PieceChain, common_prefix, piece_table
from .state import HeldPiece

ROOM_MIN_PIECES = 512
"""Steps of fewer pieces go without the token-capacity bounds (`TrialPack.rejects`'s stop,
release.py's `_Room`) and the pigeonhole bound on candidates (`_bound_with`): packing so few
costs about what the bounds cost, and no plan changes. So do candidates packed with their
short pieces in lumps (`StepSolver.lump_tokens`), which are as cheap."""

COARSE_MIN_BINS = 16
"""Method "wlb_phases" packs the candidates of a step of at least this many micro-batches
(dp x n_micro) with their short pieces in lumps (`StepSolver.assign_and_sum`): such a step holds
thousands of pieces and tries up to dp x n_micro outliers per group. Smaller steps are packed
piece by piece."""
COARSE_SHARE = 1 / 40
"""The pieces after the last one of at least this share of max_tokens (4,096 tokens at
max_tokens = 163,840) go in lumps, and no lump is cut finer than that many tokens."""
COARSE_CUTS = 32
"""A lump holds between 1 / (2 x 2^b) and 1 / 2^b of the short tail's tokens still to place where
it starts, 2^b >= max(COARSE_CUTS, dp x n_micro) (`solvers.phases.geometric_lumps`), down to
COARSE_SHARE x max_tokens: a few per micro-batch while the tail is long, the finest where the
micro-batches are evened out."""
COARSE_MIN_TAIL = 64
"""A candidate with fewer short pieces than this is packed piece by piece."""

SHARED_MIN_BINS = 16
"""From this many micro-batches (dp x n_micro) the candidates whose group goes first share their
packing's placements of its other pieces (`TrialPack._assign_shared`). With fewer, the group's
micro-batches soon become the least loaded, so little is shared: a step of 4 micro-batches took
0.5-1.6% more instructions with the sharing than without (`real` and `heavy`, lookahead 4)."""
BELOW_ANY = 1 - 1e-9
"""A threshold below this rejects every packing (`TrialPack.rejects`, without packing it): the
heaviest micro-batch is at least the mean, so an imbalance is at least 1 but for the rounding of
the mean's sum (a relative 1e-12 at most, for any number of micro-batches a step has)."""

_UNSHARED = object()  # `TrialPack._assign_shared`: the shared placements do not apply


class StepSolver:
    """Packs candidate sets of one step's pieces (`solve(first, rest)`).

    Args:
        pieces: every piece a candidate of this step may hold (carried, queued, fresh).
        fresh: the step's fresh documents, the list every candidate's `rest` ends with (the
            release policies append it whole): sorted once per step.
        weights: cost of each piece (seconds), as `cost.doc_cost` gives it.
        n_micro, dp, max_tokens: the step's layout; dp x n_micro micro-batches.
        bin_const: cost every micro-batch adds (`cost.mb_const()`).
        method: the name the plans report in `info.method`.
        phases: (forward cost, backward cost of each piece, forward and backward cost of a
            micro-batch) for method "wlb_phases": candidates are still packed by Algorithm 1
            (what the release policies decide on; on a step of `COARSE_MIN_BINS` micro-batches
            or more, with its short pieces in lumps: `assign_and_sum`) and the plan kept is packed with the
            phases balanced apart (`solvers.phases`; from 32 micro-batches its own lumps of the short
            tail, `solvers.phases.tail_lumps`); None: every packing is Algorithm 1's, piece by piece.
        table: `piece_table(pieces)`, if the caller has it already.
        fresh_at: where `fresh` starts in `pieces` when the caller knows that `pieces` ends with
            it (the packer's pieces are held + fresh; `pieces` may then be None, with `table`).
        carry: a `FreshPieces` that `pieces` starts with (the step's carry, held as a table):
            its pieces are found by position, like the fresh ones, not looked up.
    """

    def __init__(self, pieces: list[HeldPiece] | None, weights: np.ndarray, fresh: list[HeldPiece], *, n_micro: int,
                 dp: int, max_tokens: int, bin_const: float, method: str = "wlb",
                 phases: tuple[np.ndarray, np.ndarray, float, float] | None = None, table: np.ndarray | None = None,
                 fresh_at: int | None = None, carry: FreshPieces | None = None):
        if table is None:
            table = piece_table(pieces)
        self._table = table
        self.ids, self.offsets, self.lengths, self.arrival = table
        # a row of a transposed table is strided: the compiled loops take the lengths
        # contiguous (one compiled signature, the one `greedy.warm_up_compiled` makes)
        self.lengths = np.ascontiguousarray(self.lengths)
        self.weights = np.asarray(weights, dtype=np.float64)
        # pieces = held + fresh (the packer's order): the fresh ones are addressed by position,
        # and only the held ones are indexed unless a fresh one is looked up
        m = len(fresh)
        if fresh_at is None:
            fresh_at = len(pieces) - m if pieces[len(pieces) - m:] == fresh else None
        elif fresh_at + m != len(self.ids):
            raise ValueError(f"fresh_at={fresh_at} + {m} fresh pieces != {len(self.ids)} pieces")
        self._fresh_at = fresh_at
        self._carry = carry
        start = 0 if carry is None else len(carry)
        stop = len(self.ids) if self._fresh_at is None else self._fresh_at
        self._unindexed = [(0, start), (stop, len(self.ids))]  # the carry and the fresh pieces: by position
        # keyed by the whole piece (id, offset, length, arrival), which a HeldPiece hashes and
        # compares as: a piece is looked up as itself, without building its (id, offset)
        self.index = dict(zip(zip(*table[:, start:stop].tolist()), range(start, stop)))
        self.n_micro, self.dp, self.max_tokens = n_micro, dp, max_tokens
        self.bin_const = float(bin_const)
        self.method = method
        self.phases = phases
        self.fresh = fresh
        self.lump_tokens = (max(1, int(max_tokens * COARSE_SHARE))
                            if phases is not None and dp * n_micro >= COARSE_MIN_BINS else 0)
        """Tokens of a lump of short pieces in the candidates' packings (`assign_and_sum`); 0: none."""
        self._lumps: tuple[np.ndarray, ...] | None = None  # (tail, lump of each, lump lengths, lump costs)
        self._lump_lists: tuple[list, list] = ([], [])  # the lumps' tokens and costs as lists (the Python loop's input)
        self._tail: tuple[list, np.ndarray, np.ndarray] | None = None  # (list, indices, indices longest first)
        self._head: tuple[list, np.ndarray, np.ndarray] = ([], np.zeros(0, np.int64), np.zeros(0, np.int64))
        self._last_rest: list[HeldPiece] = []
        self._first: tuple[list[HeldPiece], np.ndarray] = ([], np.zeros(0, np.int64))  # the last `first`, indexed

    @cached_property
    def _densest(self) -> np.ndarray:
        """Every piece's index, in decreasing cost per token (`solvers.bounds.densest_order`)."""
        return densest_order(self.lengths, self.weights)

    def placed_at_most(self, idx: np.ndarray, tokens: int) -> float:
        """The most cost the pieces `idx` can place in `tokens` tokens, taken fractionally in
        decreasing cost per token (`solvers.bounds.max_placed_weight`), from the step's order."""
        member = np.zeros(len(self.lengths), dtype=bool)
        member[idx] = True
        order = self._densest[member[self._densest]]
        cum_tokens, cum_cost = densest_first(self.lengths, self.weights, order)
        return float(np.interp(tokens, cum_tokens, cum_cost))

    def _indices(self, pieces: list[HeldPiece]) -> np.ndarray:
        """Solver index of each of `pieces`: the carry's and the fresh pieces' by position
        (a `FreshPieces` view of either, or a chain of such parts and lists), the others
        looked up."""
        if type(pieces) is PieceChain:
            return np.concatenate([self._indices(part) for part in pieces.parts] or [np.zeros(0, np.int64)])
        if type(pieces) is FreshPieces:
            for whole, at in ((self._carry, 0), (self.fresh, self._fresh_at)):
                if type(whole) is FreshPieces and at is not None and pieces._made is whole._made:
                    start = at + pieces._start - whole._start
                    return np.arange(start, start + len(pieces), dtype=np.int64)
        index = self.index
        try:
            return np.fromiter(map(index.__getitem__, pieces), dtype=np.int64, count=len(pieces))
        except KeyError:
            if not self._unindexed:
                raise
        for start, stop in self._unindexed:  # a carried or fresh piece looked up: index them all
            index.update(zip(zip(*self._table[:, start:stop].tolist()), range(start, stop)))
        self._unindexed = []
        return self._indices(pieces)

    def _first_indices(self, first: list[HeldPiece]) -> np.ndarray:
        """`_indices(first)`, reused while the step's candidates place the same pieces first
        (its carried ones: hundreds on a step after one that deferred many)."""
        last, idx = self._first
        if not (first is last or first == last):
            idx = self._indices(first)
            self._first = (first, idx)
        return idx

    def _sorted_tail(self, tail: list[HeldPiece]) -> tuple[np.ndarray, np.ndarray]:
        """(indices of `tail`, the same longest first, stable), cached for the last tail given."""
        if self._tail is None or self._tail[0] is not tail:
            if tail is self.fresh and self._fresh_at is not None:
                idx = np.arange(self._fresh_at, len(self.ids), dtype=np.int64)
            else:
                idx = self._indices(tail)
            self._tail = (tail, idx, idx[argsort_descending(self.lengths[idx])])
        return self._tail[1], self._tail[2]

    def _fresh_but_one(self, tail: list[HeldPiece]) -> int | None:
        """j such that `tail` is the step's fresh pieces without the j-th, else None (a trimmed
        step: `MarginalRelease._trimmed` packs the step again without one fresh piece). The
        longest prefix in common is found by bisection on list comparisons, in C."""
        fresh = self.fresh
        if len(tail) != len(fresh) - 1:
            return None
        low, high = 0, len(tail)  # tail[:low] == fresh[:low]; tail[:high + 1] != fresh[:high + 1]
        while low < high:
            mid = (low + high + 1) // 2
            if tail[:mid] == fresh[:mid]:
                low = mid
            else:
                high = mid - 1
        return low if tail[low:] == fresh[low + 1:] else None

    def _sorted_rest(self, rest: list[HeldPiece]) -> tuple[np.ndarray, np.ndarray]:
        """(indices of `rest`, the same longest first, stable). Candidates of one round share
        a head (carried and released pieces) and differ in the group after it: the head found
        in common with the previous call is indexed and sorted once, and each call merges its
        few other pieces into it (after the head's among equal lengths, as a stable sort)."""
        head, head_idx, head_sorted = self._head
        n = len(head)
        if not (n and len(rest) >= n and rest[:n] == head):
            n = common_prefix(rest, self._last_rest)  # the prefix this call shares with the previous one
            self._last_rest = rest
            head = rest[:n]
            head_idx = self._indices(head)
            head_sorted = head_idx[argsort_descending(self.lengths[head_idx])]
            self._head = (head, head_idx, head_sorted)
        more_idx = self._indices(rest[n:])
        if not len(more_idx):
            return head_idx, head_sorted
        more_sorted = more_idx[argsort_descending(self.lengths[more_idx])]
        at = (-self.lengths[head_sorted]).searchsorted(-self.lengths[more_sorted], side="right")
        return np.concatenate([head_idx, more_idx]), insert_sorted(head_sorted, at, more_sorted)

    def solve(self, first: list[HeldPiece], rest: list[HeldPiece]):
        """Pack `first` (in this order), then `rest` longest first (stable), as `solve_pack`
        with carried=len(first). Returns (pending = first + rest, TrialPack, arrival step of
        each pending piece); the TrialPack is packed when first read, or only as far as
        `TrialPack.rejects` needs."""
        m, n = len(self.fresh), len(rest)
        tail_idx = tail_sorted = np.zeros(0, np.int64)
        head = rest.before(self.fresh) if type(rest) is PieceChain else None
        if head is not None or (m and n >= m and rest[n - m:] == self.fresh):  # the usual case: rest ends with fresh
            rest, tail = rest[:n - m] if head is None else head, self.fresh
            rest = rest if isinstance(rest, (list, PieceChain)) else list(rest)
            tail_idx, tail_sorted = self._sorted_tail(tail)
        elif m > 1 and n >= m - 1 and (gone := self._fresh_but_one(tail := rest[n - m + 1:])) is not None:
            rest = rest[:n - m + 1]  # fresh but one: its sorted order less that piece
            fresh_idx, fresh_sorted = self._sorted_tail(self.fresh)
            tail_idx = np.concatenate([fresh_idx[:gone], fresh_idx[gone + 1:]])
            tail_sorted = fresh_sorted[fresh_sorted != fresh_idx[gone]]
        else:
            tail = ()
        first_idx = self._first_indices(first)
        rest_idx, rest_sorted = self._sorted_rest(rest)
        # rest before tail among equal lengths: insert at the left end of each run of equals
        at = (-self.lengths[tail_sorted]).searchsorted(-self.lengths[rest_sorted], side="left")
        order = np.concatenate([first_idx, insert_sorted(tail_sorted, at, rest_sorted)])
        pending_idx = np.concatenate([first_idx, rest_idx, tail_idx])
        # the fresh pieces (a `FreshPieces`) stay a table: a chain of the three, copying none
        pending = (PieceChain((first if isinstance(first, (list, FreshPieces)) else list(first), rest, tail))
                   if isinstance(tail, FreshPieces) or isinstance(first, FreshPieces) or type(rest) is PieceChain
                   else list(first) + list(rest) + list(tail))
        trial = TrialPack(self, pending_idx, order, n_first=len(first_idx), n_rest=len(rest_idx), pending=pending)
        return pending, trial, self.arrival[pending_idx]  # packed when first read (or `rejects`)

    def assign_and_sum(self, order: np.ndarray, stop: AssignStop | None = None) -> tuple:
        """(Algorithm 1's bin of each piece of `order` (`wlb_assign`; -1 = deferred), each
        micro-batch's cost summed piece by piece in placement order, the deferred pieces'
        tokens). The first is None once the packing passes a limit of `stop`; the last two are
        None unless the compiled loop packed the candidate in lumps
        (`greedy_compiled.lumped_assign_compiled`, which sums them on the way, the same floats
        as `TrialPack.loads`): a TrialPack then has them without a pass over its pieces.

        With `lump_tokens` (method "wlb_phases", steps of `COARSE_MIN_BINS` micro-batches or more),
        the pieces shorter than `lump_tokens` that end the placement order (the short fresh
        and carried ones, every candidate's same tail) are packed in lumps: consecutive
        pieces, each lump one item of their summed tokens and cost, and every piece of a lump
        goes where Algorithm 1 puts the lump. A lump holds 1 / (2 x 2^b) to 1 / 2^b of the
        tail's tokens still to place, 2^b >= max(`COARSE_CUTS`, micro-batches), down to
        `lump_tokens` (`solvers.phases.geometric_lumps`): the first short pieces, placed
        while the micro-batches still differ by several of them, go by the dozen, and the
        end that balances the micro-batches at a granularity of about 2.5% of one. The
        longer pieces come first and are placed one by one, so a candidate places or defers
        its group the same way (docs/tuning.md, "Short pieces in lumps"). The plan a step keeps is
        `solve_pack(method="wlb_phases")`'s (`TrialPack.plan`)."""
        return self.assign_split(*(self.lumped_split(order) or (order, None)), stop)

    def lumped_split(self, order: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(head, tail) of `order` where `assign_and_sum` packs lumps: the tail is every piece after the
        last one of at least `lump_tokens` tokens; None without lumps or with a tail shorter
        than `COARSE_MIN_TAIL`."""
        if not self.lump_tokens:
            return None
        long_at = (self.lengths[order] >= self.lump_tokens).nonzero()[0]
        cut = int(long_at[-1]) + 1 if len(long_at) else 0
        if len(order) - cut < COARSE_MIN_TAIL:
            return None
        return order[:cut], order[cut:]

    def assign_split(self, head: np.ndarray, tail: np.ndarray | None, stop: AssignStop | None = None) -> tuple:
        """`assign_and_sum` of the placement order head + tail (`lumped_split`): the head's
        pieces one by one, the tail in lumps; tail None: `head` is the whole order,
        packed piece by piece. A stop that watches a piece of the tail watches its lump (the
        piece goes where its lump goes), so the lumps, hence the packing, are those of the
        candidate packed whole."""
        n_bins = self.dp * self.n_micro
        if tail is None:
            return wlb_assign(head, self.lengths, self.weights, n_bins, self.max_tokens, stop), None, None
        lump_of, lump_lengths, lump_costs = self._lumps_of(tail)
        cut = len(head)
        if stop is not None and stop.keep and max(stop.keep) >= cut:
            stop = stop._replace(keep=frozenset(p if p < cut else cut + int(lump_of[p - cut]) for p in stop.keep))
        compiled = compiled_loop("lumped_assign_compiled")
        if compiled is not None:  # packs the whole candidate (no stop: fast enough without)
            placed, sums, deferred = compiled(np.ascontiguousarray(head), np.ascontiguousarray(tail), lump_of,
                                              lump_lengths, lump_costs, self.lengths, self.weights, int(n_bins),
                                              int(self.max_tokens))
            return placed, sums, int(deferred)
        sizes, costs = self._lump_lists
        head_sizes = self.lengths[head]
        placed = wlb_assign_lists(head_sizes.tolist() + sizes, self.weights[head].tolist() + costs, n_bins,
                                  self.max_tokens, stop=stop,
                                  sizes_array=lambda: np.concatenate([head_sizes, lump_lengths]))
        if placed is None:
            return None, None, None
        return np.concatenate([placed[:cut], placed[cut:][lump_of]]), None, None

    def _lumps_of(self, tail: np.ndarray) -> tuple[np.ndarray, ...]:
        """(lump of each piece of `tail`, tokens and cost of each lump), cached for the last
        tail: the candidates of a step share it."""
        cached = self._lumps
        if cached is not None and (cached[0] is tail or (len(cached[0]) == len(tail) and np.array_equal(cached[0], tail))):
            return cached[1:]
        lengths = self.lengths[tail]
        lump_of = geometric_lumps(lengths, max(COARSE_CUTS, self.dp * self.n_micro), self.lump_tokens)
        lump_lengths = np.bincount(lump_of, weights=lengths).astype(np.int64)
        lump_costs = np.bincount(lump_of, weights=self.weights[tail])
        self._lumps = (tail, lump_of, lump_lengths, lump_costs)
        self._lump_lists = (lump_lengths.tolist(), lump_costs.tolist())  # the Python loop's input, made once
        return self._lumps[1:]


class TrialPack:
    """A candidate packing of a step: what the release policies read, and `plan()`.

    Its pending pieces are `n_first` placed first, then `n_rest` others (carried and held
    pieces), then the step's fresh ones; `order` is the placement order (solver indices).
    Positions (`micro_batches`, `deferred`) index the pending pieces, as a PackPlan's do.
    The pieces are packed (Algorithm 1) when first read; `account(1, n_pieces)`, if given, is
    told then (the calibration meter counts each packing)."""

    def __init__(self, solver: StepSolver, pending_idx: np.ndarray | None, order: np.ndarray | None, *, n_first: int,
                 n_rest: int, pending: list[HeldPiece] | None = None,
                 extends: tuple["TrialPack", list[HeldPiece]] | None = None, account=None):
        self._solver = solver
        if pending_idx is not None:  # else made from `extends` when first read
            self._pending_idx, self._order = pending_idx, order
        self._n_first, self._n_rest = n_first, n_rest
        if pending is not None:
            self.pending = pending
        self._extends = extends  # (packing, group) of a candidate made by `with_group`
        self._account = account

    @cached_property
    def _group_idx(self) -> np.ndarray:
        return self._solver._indices(self._extends[1])

    @cached_property
    def _pending_idx(self) -> np.ndarray:
        """Solver index of each pending piece."""
        base = self._extends[0]
        n_held = base._n_first + base._n_rest
        return np.concatenate([base._pending_idx[:n_held], self._group_idx, base._pending_idx[n_held:]])

    @cached_property
    def _order(self) -> np.ndarray:
        """Placement order (solver indices): the group merged into its packing's order after
        the held pieces of equal length, before the fresh ones (a stable sort's order)."""
        derived = self._derived_split
        if derived is not None:
            return np.concatenate(derived)
        return self._merged(self._extends[0]._order)

    @cached_property
    def _group_merge(self) -> tuple[np.ndarray, np.ndarray]:
        """(the group's solver indices longest first, where each goes among its packing's
        pieces after those placed first: `insert_sorted` positions)."""
        s, base, idx = self._solver, self._extends[0], self._group_idx
        ranked = idx[argsort_descending(s.lengths[idx])]
        return ranked, base._merge_keys.searchsorted(2 * (s.max_tokens - s.lengths[ranked]), side="right")

    def _merged(self, base_order: np.ndarray) -> np.ndarray:
        """`base_order` (the packing's placement order, or a prefix of it that ends after the
        last place the group goes) with the group merged in."""
        cut = self._extends[0]._n_first
        ranked, at = self._group_merge
        return np.concatenate([base_order[:cut], insert_sorted(base_order[cut:], at, ranked)])

    @cached_property
    def _derived_split(self) -> tuple[np.ndarray, np.ndarray] | None:
        """This candidate's `_split` made from its packing's, without its whole placement order:
        where the packing's head ends after its placed-first pieces and every piece of the
        group is long (at least `lump_tokens`), the group goes into the head (a long piece
        sorts before every short one) and the tail is the packing's, the same array (its
        lumps are cached). None otherwise."""
        s, base, idx = self._solver, self._extends[0], self._group_idx
        if not s.lump_tokens:
            return None
        split = base._split
        if split is None or len(split[0]) < base._n_first or (len(idx) and s.lengths[idx].min() < s.lump_tokens):
            return None
        return self._merged(split[0]), split[1]

    @cached_property
    def _split(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(head, tail) of the placement order where the solver packs the tail in lumps
        (`StepSolver.lumped_split`); None where it packs piece by piece."""
        if not self._solver.lump_tokens:
            return None
        if self._extends is not None and self._derived_split is not None:
            return self._derived_split
        return self._solver.lumped_split(self._order)

    @cached_property
    def _total_cost(self) -> float:
        """The pending pieces' summed cost, for the stop of `rejects` (a candidate made by
        `with_group`: its packing's sum plus its group's; the order of the sum differs by
        rounding, far inside the stop's margin)."""
        weights = self._solver.weights
        if self._extends is None:
            return float(np.add.reduce(weights[self._pending_idx]))
        return self._extends[0]._total_cost + float(np.add.reduce(weights[self._group_idx]))

    @cached_property
    def _placed_bin(self) -> np.ndarray:
        """Micro-batch of each piece of the placement order, -1 = deferred."""
        return self._assign()

    def _assign(self, stop: AssignStop | None = None) -> np.ndarray | None:
        """Algorithm 1 on this candidate (None: stopped, see `StepSolver.assign_and_sum`); `account` is
        told of the first packing only, stopped or not."""
        if self._account is not None:
            self._account(1, len(self._pending_idx))
            self._account = None
        placed = self._assign_shared(stop)
        if placed is not _UNSHARED:
            return placed
        s = self._solver
        if self._split is None and compiled_loop() is None:  # piece by piece, in Python: from lists
            sizes, costs = self._item_lists
            return wlb_assign_lists(sizes, costs, s.dp * s.n_micro, s.max_tokens, stop=stop,
                                    sizes_array=lambda: s.lengths[self._order])
        placed, sums, deferred_tokens = s.assign_split(*(self._split or (self._order, None)), stop)
        if sums is not None:  # the values `loads` and `deferred_tokens` would compute from `placed`
            self.__dict__["loads"] = sums + s.bin_const
            self.__dict__["deferred_tokens"] = deferred_tokens
        return placed

    def _assign_shared(self, stop: AssignStop | None):
        """`_assign` of a candidate whose group goes right after the pieces placed first, with
        the placements its packing's other candidates share (`SharedPlacements`), or
        `_UNSHARED` where they do not apply: another kind of candidate, fewer than
        `SHARED_MIN_BINS` micro-batches, the compiled loops,
        a candidate that `assign_split` would cut elsewhere, or one whose first or group
        pieces do not all fit where they go first."""
        extends, s = self._extends, self._solver
        if extends is None or s.dp * s.n_micro < SHARED_MIN_BINS or compiled_loop() is not None:
            return _UNSHARED
        base, split = extends[0], self._split
        ranked, at = self._group_merge
        if len(at) and at[-1]:  # a group piece goes after a piece of the packing
            return _UNSHARED
        if split is not None and (self._derived_split is None
                                  or (stop is not None and stop.keep and max(stop.keep) >= len(split[0]))):
            return _UNSHARED  # not the packing's tail, or a stop that watches a piece of the tail
        if (split is None) != (base._split is None):
            return _UNSHARED
        try:
            placed = base._shared.assign(s.lengths[ranked].tolist(), s.weights[ranked].tolist(), stop)
        except Unshared:
            return _UNSHARED
        if placed is None:
            return None
        placed = np.array(placed, dtype=np.int64)
        if split is None:
            return placed
        cut = len(split[0])
        return np.concatenate([placed[:cut], placed[cut:][s._lumps_of(split[1])[0]]])

    @cached_property
    def _item_lists(self) -> tuple[list[int], list[float]]:
        """(tokens, cost) of each piece of the placement order, as the Python lists Algorithm 1's
        loop reads. A candidate of a packing that has its lists takes theirs with its group's
        pieces put in (slices of the lists, not a conversion of every piece again): the
        candidates of a step of 4 micro-batches are packed piece by piece, a few hundred each."""
        s, extends = self._solver, self._extends
        base_lists = None if extends is None else extends[0].__dict__.get("_item_lists")
        if base_lists is None:
            order = self._order
            return s.lengths[order].tolist(), s.weights[order].tolist()
        sizes, costs = base_lists
        ranked, at = self._group_merge
        group_sizes, group_costs = s.lengths[ranked].tolist(), s.weights[ranked].tolist()
        start = extends[0]._n_first  # the group goes after the pieces placed first
        merged_sizes, merged_costs = sizes[:start], costs[:start]
        for size, cost, where in zip(group_sizes, group_costs, (at + start).tolist()):
            merged_sizes += sizes[start:where]
            merged_costs += costs[start:where]
            merged_sizes.append(size)
            merged_costs.append(cost)
            start = where
        return merged_sizes + sizes[start:], merged_costs + costs[start:]

    @cached_property
    def _shared(self) -> SharedPlacements:
        """Algorithm 1's placements shared by the candidates made from this packing whose group
        goes right after its pieces placed first (`_assign_shared`): its own items after those,
        the head's pieces one by one and its tail in lumps (`StepSolver.assign_split`)."""
        s, cut = self._solver, self._n_first
        if self._split is None:
            order = self._order
            first, rest, sizes, costs = order[:cut], order[cut:], [], []
        else:
            head, tail = self._split
            s._lumps_of(tail)
            first, rest, (sizes, costs) = head[:cut], head[cut:], s._lump_lists
        return SharedPlacements(s.lengths[first].tolist(), s.weights[first].tolist(),
                                s.lengths[rest].tolist() + sizes, s.weights[rest].tolist() + costs,
                                s.dp * s.n_micro, s.max_tokens)

    def rejects(self, threshold: float | None = None, deferred_tokens: float = float("inf"),
                keep: list[HeldPiece] = ()) -> bool:
        """Whether this candidate's imbalance is above `threshold` (None: no limit), or its
        deferred tokens reach `deferred_tokens`, or it defers one of `keep`, packing it only as
        far as that takes. The heaviest micro-batch so far over the largest mean the step can
        have (every pending piece placed but those deferred so far, and, when the pieces hold
        more tokens than the micro-batches, no more than the densest tokens that fit) bounds
        the imbalance from below, so the packing stops once that bound passes the threshold
        (with a margin of 1e-9 for rounding), once the tokens deferred so far reach the limit,
        or once a piece of `keep` is deferred. When it does not stop, the candidate is packed
        whole and its exact values compared (the compiled loops always pack it whole). A
        threshold below `BELOW_ANY` rejects without packing: no packing is below 1, and a
        policy's `cutoff` (a score less the price of the displacement a group relieves) can
        ask for less."""
        if threshold is not None and threshold < BELOW_ANY:
            return True
        if "_placed_bin" not in self.__dict__ and compiled_loop() is not None:
            self._placed_bin = self._assign()  # the compiled loops pack whole: no stop to derive
        if "_placed_bin" not in self.__dict__:
            s = self._solver
            n_bins = s.dp * s.n_micro
            load, slope, load_cap, keep_at = float("inf"), 0.0, float("inf"), frozenset()
            if threshold is not None:
                mean_at_most = self._total_cost / n_bins + s.bin_const
                factor = threshold * (1 + 1e-9)
                load, slope = factor * mean_at_most - s.bin_const, factor / n_bins
                capacity = n_bins * s.max_tokens
                if (not s.lump_tokens and len(self._pending_idx) >= ROOM_MIN_PIECES  # it cannot place everything
                        and np.add.reduce(s.lengths[self._pending_idx]) > capacity):
                    load_cap = (factor * (s.placed_at_most(self._pending_idx, capacity) / n_bins + s.bin_const)
                                - s.bin_const)
            if len(keep):  # their positions in the placement order (in the head where they all are)
                marked = np.zeros(len(s.lengths), dtype=bool)
                keep_idx = s._indices(keep)
                marked[keep_idx] = True
                split = self._split
                at = None if split is None else marked[split[0]].nonzero()[0]
                if at is None or len(at) < len(keep_idx):
                    at = marked[self._order].nonzero()[0]
                keep_at = frozenset(at.tolist())
            placed = self._assign(AssignStop(load=load, slope=slope, load_cap=load_cap,
                                             deferred_tokens=deferred_tokens, keep=keep_at))
            if placed is None:
                return True
            self._placed_bin = placed
        return ((threshold is not None and self.imbalance > threshold) or self.deferred_tokens >= deferred_tokens
                or self.defers_any(keep))

    @cached_property
    def pending(self) -> list[HeldPiece]:
        """Every piece of the candidate, by position (the pieces `solve(first, rest)` returns)."""
        base, group = self._extends
        n_held = base._n_first + base._n_rest
        return base.pending[:n_held] + list(group) + base.pending[n_held:]

    @property
    def arrival(self) -> np.ndarray:
        """Arrival step of each pending piece."""
        return self._solver.arrival[self._pending_idx]

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each pending piece (a PackPlan's `lengths`)."""
        return self._solver.lengths[self._pending_idx]

    @cached_property
    def _merge_keys(self) -> np.ndarray:
        """Sort key of each piece of the placement order after the placed-first ones:
        2 x (max_tokens - length) + 1 for the fresh pieces, without the + 1 for the others, so
        that it is non-decreasing (longest first, the others before fresh ones of equal length)."""
        s, cut = self._solver, self._n_first
        is_fresh = np.zeros(len(s.lengths), dtype=np.int64)
        is_fresh[self._pending_idx[cut + self._n_rest:]] = 1
        tail = self._order[cut:]
        return 2 * (s.max_tokens - s.lengths[tail]) + is_fresh[tail]

    def without(self, position: int):
        """This candidate less its pending piece at `position` (a carried or fresh piece, not one
        placed first): what `solve(first, rest)` returns for the same pieces less that one, as
        (pending, TrialPack packed when first read, arrival). Its placement order is this one's
        less the piece (the order of a stable sort is kept when an item leaves it), so nothing
        is sorted again: `MarginalRelease._trimmed` packs the step without one piece this way."""
        cut, n_held = self._n_first, self._n_first + self._n_rest
        if not cut <= position < len(self._pending_idx):
            raise ValueError(f"position {position} is not a carried or fresh piece of the candidate "
                             f"(those are {cut} to {len(self._pending_idx) - 1})")
        idx = self._pending_idx
        gone = idx[position]
        pending_idx = np.concatenate([idx[:position], idx[position + 1:]])
        kept = self._order != gone
        order = self._order[kept]
        pending = self.pending[:position] + self.pending[position + 1:]
        trial = TrialPack(self._solver, pending_idx, order, n_first=cut,
                          n_rest=self._n_rest - (position < n_held), pending=pending)
        lists = self.__dict__.get("_item_lists")
        if lists is not None:  # Algorithm 1's input less the piece, sliced from this one's
            at = int(kept.argmin())
            trial._item_lists = tuple(items[:at] + items[at + 1:] for items in lists)
        return pending, trial, self._solver.arrival[pending_idx]

    def with_groups(self, groups: list[list[HeldPiece]], account=None) -> list["TrialPack"]:
        """This packing with each of `groups` added to its pieces, after its other held ones
        and before the fresh ones: the candidates `solve(first, rest + group + fresh)` gives,
        each packed when first read (`account` as in the class docstring)."""
        return [self.with_group(group, account) for group in groups]

    def with_group(self, group: list[HeldPiece], account=None) -> "TrialPack":
        """`with_groups` of one group: a candidate costs nothing until it is read, so a policy
        makes it only for a group it does not skip."""
        return TrialPack(self._solver, None, None, n_first=self._n_first, n_rest=self._n_rest + len(group),
                         extends=(self, group), account=account)

    @cached_property
    def _positions(self) -> np.ndarray:
        """Position in the pending list of each item of the placement order."""
        where = np.empty(len(self._solver.lengths), dtype=np.int64)
        where[self._pending_idx] = np.arange(len(self._pending_idx), dtype=np.int64)
        return where[self._order]

    @cached_property
    def _by_bin(self) -> tuple[np.ndarray, list[int]]:
        """(the placed pieces' places in the placement order, micro-batch by micro-batch, each in
        placement order; where each micro-batch ends in that list): the one stable sort by
        micro-batch that `micro_batches` and the plan's sums and tokens share."""
        placed = self._placed_bin
        kept = (placed >= 0).nonzero()[0]
        order, ends = group_by_bin(placed[kept], self._solver.dp * self._solver.n_micro)
        return kept[order], ends

    @cached_property
    def _members(self) -> np.ndarray:
        """Global piece indices of the placed pieces, micro-batch by micro-batch (`_by_bin`)."""
        return self._order[self._by_bin[0]]

    @cached_property
    def loads(self) -> np.ndarray:
        """Seconds of each micro-batch, what the policies compare: its piece costs added one by
        one in placement order (Algorithm 1's running sums; one `np.bincount`), plus the
        per-micro-batch constant. `plan()` sums each micro-batch as `solve_pack` does
        (`_plan_loads`); the two differ by rounding alone."""
        s = self._solver  # deferred pieces (-1) are summed into bin 0 of the shifted count, dropped
        return np.bincount(self._placed_bin + 1, weights=s.weights[self._order],
                           minlength=s.dp * s.n_micro + 1)[1:] + s.bin_const

    def _plan_loads(self) -> np.ndarray:
        """Seconds of each micro-batch summed as `solve_pack` sums them (the PackPlan's loads)."""
        weights, const = self._solver.weights[self._members], self._solver.bin_const
        add = np.add.reduce  # what ndarray.sum() runs, without its overhead (on each contiguous slice)
        return np.array([add(w) + const for w in cut_at(weights, self._by_bin[1])], dtype=np.float64)

    @cached_property
    def imbalance(self) -> float:
        return imbalance(self.loads)

    @cached_property
    def deferred(self) -> np.ndarray:
        """Positions (in the pending list) of the pieces not placed, in placement order."""
        return self._positions[self._placed_bin < 0]

    @cached_property
    def deferred_tokens(self) -> int:
        placed = self._placed_bin
        if not len(placed) or np.minimum.reduce(placed) >= 0:
            return 0
        return int(np.add.reduce(self._solver.lengths[self._order[placed < 0]]))

    @cached_property
    def micro_batches(self) -> tuple[np.ndarray, ...]:
        """Positions (in the pending list) of each micro-batch's pieces, in placement order."""
        grouped, ends = self._by_bin
        positions = self._positions[grouped]
        positions.flags.writeable = False
        return tuple(cut_at(positions, ends))

    @property
    def n_placed(self) -> int:
        """How many pieces the packing places (`release.is_idle` reads it)."""
        placed = self._placed_bin
        return len(placed) - int(np.count_nonzero(placed < 0))

    def micro_batch(self, b: int) -> np.ndarray:
        """`micro_batches[b]` alone: positions of micro-batch b's pieces, in placement order."""
        if "micro_batches" in self.__dict__:
            return self.micro_batches[b]
        return self._positions[self._placed_bin == b]

    def defers_any(self, pieces: list[HeldPiece]) -> bool:
        """Whether any of `pieces` (pending pieces of this candidate) is deferred."""
        if not len(pieces) or self._placed_bin.min(initial=0) >= 0:
            return False
        deferred = np.zeros(len(self._solver.lengths), dtype=bool)
        deferred[self._order[self._placed_bin < 0]] = True
        return bool(deferred[self._solver._indices(pieces)].any())

    def plan(self) -> PackPlan:
        """The PackPlan `solve_pack` would return for these pieces (with the solver's method).
        `replica_of` is the plain split (n_micro per replica): the packer deals the
        micro-batches itself."""
        s = self._solver
        if s.phases is None:
            return self._plan({})
        # method "wlb_phases": the same pieces packed again, with the phases balanced apart
        # (Algorithm 1's placement, the fallback, is this one unless it packed lumps)
        fwd, bwd, fwd_const, bwd_const = s.phases
        placed, fallback = phases_or_algorithm1(self._order, s.lengths, s.weights, fwd, bwd, s.dp * s.n_micro,
                                                s.max_tokens, fwd_const, bwd_const,
                                                algorithm1=None if s.lump_tokens else self._placed_bin,
                                                n_first=self._n_first)
        kept = TrialPack(s, self._pending_idx, self._order, n_first=self._n_first, n_rest=self._n_rest,
                         pending=self.pending)
        kept._placed_bin = placed
        return kept._plan({"fallback": fallback})

    def _plan(self, extra: dict) -> PackPlan:
        """This packing as a PackPlan, `extra` its `info.extra`."""
        s, idx = self._solver, self._pending_idx
        loads = self._plan_loads()
        tokens = run_sums(s.lengths[self._members], self._by_bin[1])
        n_bins = s.dp * s.n_micro
        info = SolveInfo(method=s.method, status="heuristic", objective=float(loads.max()) if len(loads) else 0.0,
                         extra=extra)
        # arrays made here for the plan alone, read-only: the PackPlan keeps them without a copy
        fields = dict(doc_ids=s.ids[idx], lengths=s.lengths[idx], offsets=s.offsets[idx],
                      replica_of=np.arange(n_bins, dtype=np.int64) // s.n_micro, deferred=self.deferred.copy(),
                      loads=loads, tokens=tokens)
        for array in fields.values():
            array.flags.writeable = False
        return PackPlan(micro_batches=self.micro_batches, n_micro=s.n_micro, dp=s.dp, max_tokens=s.max_tokens,
                        info=info, **fields)


def as_pack_plan(plan: PackPlan | TrialPack) -> PackPlan:
    """`plan` as a PackPlan (a TrialPack or FillTrial builds its own)."""
    return plan if isinstance(plan, PackPlan) else plan.plan()
