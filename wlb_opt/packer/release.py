"""When held outliers leave their queues: the release policies of `WLBPacker`.

Outlier documents (length >= L1) wait in multi-level FIFO queues (queue i holds
L_i <= d < L_{i+1}; the last queue is open above). Each step a policy decides which held
outliers join the step's fresh documents and the carried ones, and packs them through the
packer's `solve` callback (Algorithm 1 by default: carried first, the rest longest first).

The default is "marginal", with or without lookahead (`PackerConfig.resolved_release`;
defaults.py says why).

- "paper" (paper §3.2 / Algorithm 1; `PackerConfig.paper`): a queue that holds dp x n_micro outliers
  releases exactly that many, FIFO, once per step, so that every micro-batch gets one
  outlier of similar length.
- `max_delay=K` (every policy): a queue whose head has waited K steps is released even if
  it holds fewer than dp x n_micro outliers (topped up with the heads of the nearest other
  queues, so each micro-batch still gets one outlier), and pieces at their deadline
  (released or carried) are placed before anything else, longest first. No piece waits in
  a queue more than K steps; one is placed more than K steps late only if the due pieces of
  a step exceed its capacity (`stats()["late_pieces"]`). With `max_delay=None` the packer
  is paper-faithful.
- "balance" (beyond the paper, opt-in): after the paper's releases, a step also takes held
  outliers early (FIFO heads of a queue, a whole queue, or a queue topped up to one outlier
  per micro-batch from the nearest levels) whenever the packed step's predicted imbalance
  stays within max(`balance_tolerance`, its imbalance without them) and no more tokens are
  deferred. An outlier that the step's short documents can balance then waits for nothing.
- "group" (beyond the paper): all held outliers form one pool (the queues only
  store them). Each step the pool's pieces at max_delay leave; then, greedily, the step
  takes groups of 1 to dp x n_micro held outliers adjacent in (length, arrival) order
  (similar cost; FIFO among equal lengths) while its predicted imbalance stays within
  max(`balance_tolerance`, its imbalance without them) and the short documents this pushes
  to the next step are fewer tokens than the group brings. Long outliers then leave in
  groups of similar ones from any level, a cheap one alone, at the cost of carrying some
  short documents one step; a group leaves only if the step places all of it (an outlier
  deferred by the packing would be carried and placed first, often alone, next step).
  Candidates whose imbalance is surely above the limit (the group's heaviest piece, or the
  pieces some micro-batch must share, against the largest mean load the step's pieces and
  token capacity allow) or that defer over the carry limit whatever the packing are not
  packed at all: the same plans, a fraction of the planning time. Tolerance ~1.3 (fwd + bwd
  loads) suits the default stream. On steps of `SPARSE_MIN_BINS` micro-batches or more the
  default step packer tries a sparse set of these groups (`sparse_window`: a few sizes, starts
  a quarter group apart, a whole group apart for those holding an early piece), chosen among
  exactly as the full set, and packs at most `MAX_PACKED` of them per search and
  `MAX_STEP_PACKED` per step.
- "marginal" (beyond the paper): the pool and the candidates of "group", chosen at the
  margin: a group leaves while the imbalance it adds is worth the tokens it stops holding.
  `MarginalRelease` states the rule (score, price, pairs, carried pieces, trim).
- `drain()` (end of data) releases every queue whatever the policy (`DrainRelease`).
- lookahead (`WLBPacker(..., lookahead=K)`, lookahead.py): the queues also hold outliers that
  arrive up to K steps later ("group" and "marginal" take those up to `max_lead` steps ahead
  into a step's pool). A group (a full queue's dp x n_micro, a "balance" or "group"
  candidate) leaves early only if at most half of it is early (arrival after the step): a
  group then trains at or after the median of its arrival steps, which minimises its total
  displacement |step - arrival|; leaving as soon as the last member is visible would train
  most of it early. The candidate groups of "group" and "marginal" are formed among the
  arrived pieces alone (adjacent in their own (length, arrival) order, as without lookahead),
  plus the groups of all held pieces that hold exactly one early piece: pieces seen ahead
  would otherwise split runs of similar arrived pieces, and a step would lose the groups it
  has without lookahead. (Groups with more early pieces balanced no better on the
  calibration streams, at more displacement and planning time; docs/tuning.md.) Only the
  repair of "marginal" (`MarginalRelease._repaired`, steps still above `repair_from`
  imbalance) takes groups of held pieces whatever their arrival, within max_lead.

Every policy is a `ReleasePolicy`: `plan_step(fresh, queues, carry, step, solve)` pops what
it releases from `queues` (the packer's copies) and returns a `StepRelease`.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from itertools import chain, takewhile
from typing import Callable, Literal, NamedTuple

import numpy as np

from ..plan import PackPlan
from ..solvers.bounds import densest_first, densest_order, pigeonhole_sorted
from ..solvers.greedy import argsort_descending
from ._cached import cached_property
from .pieces import FreshPieces, PieceChain, lengths_of, owned, take
from .state import _ARRIVAL, _ID_OFFSET, _LENGTH, _LENGTH_ARRIVAL, HeldPiece
from .trial import BELOW_ANY, ROOM_MIN_PIECES, TrialPack, as_pack_plan

ReleaseName = Literal["paper", "balance", "group", "marginal"]

SolveStep = Callable[[list[HeldPiece], list[HeldPiece]], tuple[list[HeldPiece], "PackPlan | TrialPack", np.ndarray]]
"""The packer's `solve(first, rest)`: packs `first` (placed first) then `rest`; returns
(pending = first + rest, plan, arrival step of each pending piece). The plan is a PackPlan
or a `TrialPack` (trial.py), which answers the same questions and builds its PackPlan with
`as_pack_plan`. A callback may also have `account(n_candidates, n_pieces)`, told of candidates
scored together without it (`FillTrial.with_groups`; calibration's meter counts them)."""

# Slack on the imbalance limit, so that a candidate equal to it in exact arithmetic is kept.
_TOLERANCE_SLACK = 1e-12

SMALL_WINDOWS = 64
"""`GroupRelease._windows` judges a pool of n pieces in plain Python when n x min(need, n) is
at most this (fewer windows than numpy's per-call cost pays for), with numpy above."""


SPARSE_MIN_BINS = 32
"""The default step packer tries the sparse set of groups (`sparse_window`) on steps of at least
this many micro-batches (dp x n_micro); at 16 it lost balance on the calibration streams
(docs/tuning.md)."""
MAX_PACKED = 32
"""On the steps that try the sparse set of groups, a search (a round's groups, or a pair's
second groups) packs at most this many candidates, in its visiting order (the lowest bounds
first): the slowest steps at 32 micro-batches packed several times as many, and the balance
of the calibration streams held with 32 (docs/tuning.md)."""
MAX_STEP_PACKED = 64
"""On the same steps, all the searches of a step (its rounds and their pairs) pack at most this
many candidates together; once they have, the step keeps what it has taken and its last round
chooses among the candidates packed. A median step packs far fewer; the slowest steps at 32
micro-batches (`real` with lookahead 4) packed about twice as many, and the balance of the
calibration streams held with 64 (docs/tuning.md)."""

REPAIR_ROUNDS = 6
"""A repair (`MarginalRelease._repaired`) takes at most this many groups."""

SPARSE_STRIDE = 4
"""With `sparse_windows`, a group of `size` pieces starts every max(1, size // SPARSE_STRIDE)
pieces of the pool (a quarter of the group moves from one to the next)."""
EARLY_SPARSE_STRIDE = 1
"""With `sparse_windows` and lookahead, a group that holds an early piece (the second list of
`GroupRelease._candidates`) starts every max(1, size // EARLY_SPARSE_STRIDE) pieces: the groups
of one size follow each other without overlap. They are as many again as the groups of the
arrived pieces, and on the calibration streams at 32 micro-batches the balance held with a
quarter as many of them (docs/tuning.md)."""


def sparse_window(size: int, start: int, n: int, top: int, early: bool = False) -> bool:
    """Whether the run of `size` pieces at `start`, in a pool of `n` sorted pieces whose groups
    hold at most `top`, is a group of the sparse set: sizes 1 to 4, then 2**k and 3 x 2**k
    (6, 8, 12, 16, 24, 32, ...) and `top`; for each size, the starts every
    max(1, size // SPARSE_STRIDE) pieces (with `early`, a group holding an early piece: every
    max(1, size // EARLY_SPARSE_STRIDE)) and the run that ends at the last piece. At 32
    micro-batches a pool of 34 outliers then makes 193 groups instead of 592, one of 88
    makes 536 instead of 2,320, and a group seldom differs much from the nearest one kept."""
    stride = EARLY_SPARSE_STRIDE if early else SPARSE_STRIDE
    return bool(_sparse_mask(np.array([size]), np.array([start]), n, top, stride)[0])


def _sparse_mask(sizes: np.ndarray, starts: np.ndarray, n: int, top: int, stride: int = SPARSE_STRIDE) -> np.ndarray:
    """`sparse_window` of each (size, start), as a boolean array; `stride`: `SPARSE_STRIDE` or
    `EARLY_SPARSE_STRIDE`."""
    power_of_two = (sizes & (sizes - 1)) == 0
    thirds = sizes // 3
    three_times = (sizes % 3 == 0) & ((thirds & (thirds - 1)) == 0)
    size_kept = (sizes <= 4) | (sizes == top) | power_of_two | three_times
    every = np.maximum(1, sizes // stride)
    return size_kept & ((starts % every == 0) | (starts == n - sizes))


SPARSE_SUMS_FROM = 64
"""When a step's groups may hold this many pieces or more (top = min(dp x n_micro, the pool's
size)), `GroupRelease._windows` sums the costs of the windows it keeps size by size
(`_window_costs`) instead of over the (top x n) layout: for small groups the layout or a row
per window takes fewer numpy calls, for large ones the layout sums mostly windows left out
(docs/tuning.md)."""


@functools.lru_cache(maxsize=256)
def _sparse_windows(n: int, top: int, stride: int = SPARSE_STRIDE) -> tuple[np.ndarray, np.ndarray]:
    """(size, start) of each of the sparse set's windows of a pool of n pieces, groups of 1 to
    top, by size then start (`sparse_window`; `stride` as `_sparse_mask`), made once per
    (n, top, stride)."""
    sizes = np.arange(1, top + 1)
    kept = sizes[_sparse_mask(sizes, np.zeros(top, dtype=np.int64), n, top)].tolist()  # start 0 passes any stride
    out = []
    for size in kept:
        if size > n:
            break
        starts = np.arange(0, n - size + 1, max(1, size // stride))
        if starts[-1] != n - size:  # the run that ends at the last piece
            starts = np.append(starts, n - size)
        out.append((size, starts))
    sizes = np.concatenate([np.full(len(starts), size) for size, starts in out])
    starts = np.concatenate([starts for _, starts in out])
    sizes.flags.writeable = starts.flags.writeable = False
    return sizes, starts


def _window_costs(costs: np.ndarray, sizes: np.ndarray, starts: np.ndarray, top: int,
                  how: Literal["by_size", "rows", "layout"] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(summed cost, largest cost) of each window (`sizes`, `starts`, by size then start) of a
    pool whose pieces cost `costs`, groups of at most `top`. Each sum is added left to right
    from the window's first piece, as the Python sum over the group: the same floats, the same
    decisions, however the windows are gathered (`how`; None: the cheapest for their number):

    - "by_size": a (windows, size) gather per size, for large groups (from `SPARSE_SUMS_FROM`),
      where the windows kept are few of the (top x n) layout's;
    - "rows": a row per window, its pieces from column 0 (the pool's next pieces past its
      end, zeros past the pool's; only column size - 1 of the running sum is read);
    - "layout": column i of the (top x n) layout holds pieces i to i + top - 1 (zeros past the
      end), and accumulating down it gives, at row size - 1, the window of `size` at i."""
    n = len(costs)
    if not len(sizes):
        return np.zeros(0), np.zeros(0)
    widest = int(sizes[-1])  # by size
    if how is None:
        how = "by_size" if top >= SPARSE_SUMS_FROM else "rows" if len(sizes) * widest < top * n else "layout"
    padded = np.concatenate([costs, np.zeros(top - 1)])
    if how == "layout":
        rows = padded[_window_layout(n, top).rows]
        at = (sizes - 1, starts)
        return np.add.accumulate(rows, axis=0)[at], np.maximum.accumulate(rows, axis=0)[at]
    if how == "rows":
        rows = padded[starts[:, None] + np.arange(widest)]
        at = (np.arange(len(sizes)), sizes - 1)
        return np.add.accumulate(rows, axis=1)[at], np.maximum.accumulate(rows, axis=1)[at]
    bounds = (sizes[1:] != sizes[:-1]).nonzero()[0] + 1
    total, heaviest = [], []
    for lo, hi in zip([0, *bounds.tolist()], [*bounds.tolist(), len(sizes)]):
        rows = padded[starts[lo:hi, None] + np.arange(int(sizes[lo]))]
        total.append(np.add.accumulate(rows, axis=1)[:, -1])
        heaviest.append(np.maximum.accumulate(rows, axis=1)[:, -1])
    return np.concatenate(total), np.concatenate(heaviest)


def _window_sums(values: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The sum of `values[start:end]` for each window, from their prefix sums: integers, or
    floats that are multiples of `EARLY_CREDIT_UNIT` (the reliefs), exact in any
    order either way (unlike a sum of arbitrary floats)."""
    prefix = np.zeros(len(values) + 1, dtype=np.float64 if values.dtype.kind == "f" else np.int64)
    values.cumsum(out=prefix[1:])
    return prefix[ends] - prefix[starts]


class _WindowLayout(NamedTuple):
    """Where `GroupRelease._windows` reads the windows of a pool of n pieces, groups of 1 to top."""

    rows: np.ndarray
    """(top, n) indices into the pool padded with top - 1 zeros: entry (k, i) is piece i + k."""
    sizes: np.ndarray
    """Size of each window that ends within the pool, by size then start."""
    starts: np.ndarray
    """Start of each of those windows, in the same order."""
    sparse: np.ndarray
    """`sparse_window` of each of those windows."""
    sparse_early: np.ndarray
    """`sparse_window` of each of those windows with early=True."""


@functools.lru_cache(maxsize=256)
def _window_layout(n: int, top: int) -> _WindowLayout:
    """The layout of a pool of n pieces, made once per (n, top): pools come back in these sizes."""
    rows = np.arange(top)[:, None] + np.arange(n)[None, :]
    valid = np.arange(n)[None, :] <= n - np.arange(1, top + 1)[:, None]
    sizes = np.repeat(np.arange(1, top + 1), n - np.arange(top))
    starts = np.nonzero(valid)[1]
    layout = _WindowLayout(rows, sizes, starts, _sparse_mask(sizes, starts, n, top),
                           _sparse_mask(sizes, starts, n, top, EARLY_SPARSE_STRIDE))
    for array in layout:
        array.flags.writeable = False
    return layout


class StepRelease(NamedTuple):
    """What a policy decided for one step."""

    pending: list[HeldPiece]
    """Every piece the plan holds, by the plan's piece indices (placed or deferred)."""
    plan: PackPlan | TrialPack
    """The step's packing (`as_pack_plan` gives its PackPlan)."""
    arrival: np.ndarray
    """int64 arrival step of each pending piece."""
    released: list[HeldPiece]
    """Outliers taken out of the queues this step."""
    n_early: int
    """How many of `released` left before the paper's rule (full queue or max_delay) sent them."""


def is_idle(plan) -> bool:
    """Whether a step's packing places nothing (a predicted packing says so without packing)."""
    n_placed = getattr(plan, "n_placed", None)
    return n_placed == 0 if n_placed is not None else not any(len(mb) for mb in plan.micro_batches)


def split_due(carry: list[HeldPiece], released: list[HeldPiece], fresh: list[HeldPiece], step: int,
              max_delay: int | None) -> tuple[list[HeldPiece], list[HeldPiece]]:
    """(first, rest) of a step: the pieces at their deadline (carried or released) first,
    longest first, then the other carried pieces; the other released outliers and the
    fresh documents after. Without max_delay: the carried pieces first."""
    if max_delay is None:
        return owned(carry), released + fresh
    if isinstance(carry, FreshPieces) and not (len(carry) and carry.table[3].min() <= step - max_delay):
        due = [piece for piece in released if step - piece.arrival >= max_delay]  # none carried: the table unread
    else:
        due = [piece for piece in carry + released if step - piece.arrival >= max_delay]
    if not due:
        return owned(carry), released + fresh
    due.sort(key=lambda piece: -piece.length)  # stable: longest first among the due ones
    due_keys = {piece.key for piece in due}
    first = due + [piece for piece in carry if piece.key not in due_keys]
    return first, [piece for piece in released if piece.key not in due_keys] + fresh


def displacement_relief(group, step: int, early_credit: float = 0.0) -> int | float:
    """Token-steps of displacement that training `group` at `step` saves: a piece that has
    arrived saves at least one step of waiting (its tokens); an early one (lookahead) adds
    its lead less `early_credit` steps, (arrival - step - early_credit) x tokens. Without
    lookahead this is the group's tokens. With lookahead, ranking groups by tokens took early
    pieces as readily as waiting ones, and the displacement feedback (which raises the
    tolerance when the stream is over its target) then released still more early ones, past
    the budget (docs/tuning.md).

    `early_credit` (`ReleasePolicy.early_credit`; "marginal" has `defaults.EARLY_CREDIT`):
    steps of waiting an early piece would still have had after its arrival had it not left
    early; a multiple of 1/64, so that every relief, and every sum of them, is exact in
    float64 (the groups' reliefs summed in any order compare the same)."""
    return sum(piece.length if piece.arrival <= step else piece.length * (early_credit - (piece.arrival - step))
               for piece in group)


EARLY_CREDIT_UNIT = 1 / 64
"""`ReleasePolicy.early_credit` is a multiple of this: the reliefs stay exact in float64."""


def nearest_levels(queues: list[deque], level: int) -> list[int]:
    """The other queue levels, nearest to `level` first (ties: the lower level)."""
    return [k for k in sorted(range(len(queues)), key=lambda k: (abs(k - level), k)) if k != level]


@dataclass(frozen=True, kw_only=True)
class ReleasePolicy(ABC):
    """Decides which held outliers a step takes (see the module docstring)."""

    need: int
    """dp x n_micro: outliers a full release sends, one per micro-batch."""
    max_delay: int | None
    """Most steps a piece may wait in a queue, or None (no deadline)."""
    balance_tolerance: float
    """Predicted max / mean load a step may reach by taking outliers early."""
    max_backlog_tokens: int
    """Carry limit: "group" defers at most half of it (the packer's max_backlog_tokens, or two
    steps' capacity when that is the default)."""
    lookahead: int = 0
    """Batches the queues see ahead (lookahead.py); 0: no held piece is early."""
    max_lead: int | None = None
    """With lookahead, "group" and "marginal" leave the pieces that arrive more than this many
    steps after the step out of its pool (they wait in their queues until they are that close),
    so that no piece trains more than `max_lead` steps early; None: up to `lookahead`. The
    packer sets `defaults.MAX_LEAD` for "marginal"."""
    piece_cost: Callable[[np.ndarray], np.ndarray] | None = None
    """Cost of pieces by length, as the packing weighs them (the packer's `cost.doc_cost`);
    with `bin_const`, lets "group" skip candidates that cannot pass the tolerance
    (`cost_bounds`), and lets "marginal" weigh the pieces it sheds (`MarginalRelease.shed`).
    None: neither."""
    cost_bounds: bool = True
    """Whether "group" and "marginal" skip the candidates that surely fail (the lower bounds
    from `piece_cost`, and from the token cap with `max_tokens`). False: try every candidate;
    the plans are the same."""
    bin_const: float = 0.0
    """Cost every micro-batch adds (`cost.mb_const()`)."""
    max_tokens: int | None = None
    """Token cap of a micro-batch: with `piece_cost`, "group" and "marginal" also skip the
    candidates that the step's token capacity surely rejects (`_Room`; None: not used; the
    plans are the same)."""
    room_bounds: bool = True
    """Whether "group" and "marginal" bound candidates by the step's token capacity (`_Room`,
    on steps of `ROOM_MIN_PIECES` pieces or more). The packer turns it off where the step
    packer lumps its candidates' short pieces (`trial.COARSE_MIN_BINS`): such a candidate costs
    about what the bounds do. The plans are the same either way."""
    sparse_windows: bool = False
    """Whether "group" and "marginal" try a sparse set of groups (`sparse_window`) rather than
    every run of 1 to need adjacent held pieces. The packer sets it with the default step
    packer on steps of `SPARSE_MIN_BINS` micro-batches or more."""
    max_packed: int | None = None
    """At most this many candidates packed per search of `_candidates` (a round's groups, or a
    pair's second groups), in its visiting order; None: every one the bounds leave. The packer
    sets `MAX_PACKED` with `sparse_windows`."""
    max_step_packed: int | None = None
    """At most this many candidates packed by all of a step's searches together (`_StepContext.budget`);
    None: no limit but `max_packed`. The packer sets `MAX_STEP_PACKED` with `sparse_windows`."""
    early_credit: float = 0.0
    """With lookahead, "group" and "marginal" value an early piece at its lead less this many
    steps (`displacement_relief`); a multiple of `EARLY_CREDIT_UNIT` in [0, 64]. The packer sets
    `defaults.EARLY_CREDIT` for "marginal"; 0: the whole lead."""

    def __post_init__(self):
        credit = self.early_credit
        if (isinstance(credit, bool) or not isinstance(credit, (int, float)) or not 0 <= credit <= 64
                or (credit / EARLY_CREDIT_UNIT) % 1):
            raise ValueError(f"early_credit must be a multiple of {EARLY_CREDIT_UNIT} in [0, 64] (steps), "
                             f"got {credit!r}")

    @abstractmethod
    def plan_step(self, fresh: list[HeldPiece], queues: list[deque], carry: list[HeldPiece], step: int,
                  solve: SolveStep) -> StepRelease:
        """Release from `queues` (mutated), then pack carry + released + fresh."""

    def _is_due(self, piece: HeldPiece, step: int) -> bool:
        return self.max_delay is not None and step - piece.arrival >= self.max_delay

    def _not_too_early(self, group, step: int) -> bool:
        """With lookahead: at most half of `group` arrives after `step` (see the module
        docstring); always true without lookahead."""
        return not self.lookahead or 2 * sum(piece.arrival > step for piece in group) <= len(group)


class PaperRelease(ReleasePolicy):
    """release="paper": full queues leave (dp x n_micro, FIFO); max_delay forces the rest."""

    def plan_step(self, fresh, queues, carry, step, solve) -> StepRelease:
        return self._scheduled_step(fresh, queues, carry, step, solve)[2]

    def _scheduled_step(self, fresh, queues, carry, step, solve):
        """(first, rest, StepRelease) of the paper's releases alone."""
        released = self._scheduled_releases(queues, step)
        first, rest = split_due(carry, released, fresh, step, self.max_delay)
        pending, plan, arrival = solve(first, rest)
        return first, rest, StepRelease(pending, plan, arrival, released, n_early=0)

    def _scheduled_releases(self, queues: list[deque], step: int) -> list[HeldPiece]:
        released: list[HeldPiece] = []
        for level, q in enumerate(queues):
            if len(q) >= self.need and self._not_too_early([q[j] for j in range(self.need)], step):
                # paper §3.2: exactly dp x n_micro, FIFO, once per step
                released.extend(q.popleft() for _ in range(self.need))
            elif q and self._is_due(q[0], step):
                # Forced release of a queue that did not fill: top it up to one outlier per
                # micro-batch with the FIFO heads of the nearest other levels, so that no
                # micro-batch is left without one (they are the most alike documents held).
                group = [q.popleft() for _ in range(len(q))]
                for k in nearest_levels(queues, level):
                    while queues[k] and len(group) < self.need:
                        group.append(queues[k].popleft())
                released.extend(group)
            while q and self._is_due(q[0], step):  # anything still at its deadline goes too
                released.append(q.popleft())
        return released


class DrainRelease(PaperRelease):
    """End of data (`drain`): every queue leaves, whatever the policy."""

    def _scheduled_releases(self, queues: list[deque], step: int) -> list[HeldPiece]:
        released = [piece for q in queues for piece in q]
        for q in queues:
            q.clear()
        return released


class BalanceRelease(PaperRelease):
    """release="balance": the paper's releases, then held outliers (queue heads, FIFO)
    while the step stays balanced. Among admissible groups the one with the lowest
    imbalance wins (ties: more tokens, lower queue); repeats until none is admissible."""

    def plan_step(self, fresh, queues, carry, step, solve) -> StepRelease:
        first, rest, result = self._scheduled_step(fresh, queues, carry, step, solve)
        if not any(queues):
            return result
        pending, plan, arrival = result.pending, result.plan, result.arrival
        early: list[HeldPiece] = []
        base_deferred = plan.deferred_tokens
        for _ in range(self.need + len(queues)):
            limit = max(self.balance_tolerance, plan.imbalance) + _TOLERANCE_SLACK
            # a step that would train nothing takes its most balanced group whatever the tolerance
            idle = is_idle(plan)
            best = None
            for group in self._early_candidates(queues):
                entries = [queues[level][j] for level, count in group for j in range(count)]
                if not self._not_too_early(entries, step):
                    continue
                t_pending, t_plan, t_arrival = solve(first, rest + early + entries)
                tokens = sum(piece.length for piece in entries)
                if (t_plan.imbalance > limit and not idle) or t_plan.deferred_tokens > base_deferred:
                    continue
                key = (t_plan.imbalance, -tokens, sorted(group))
                if best is None or key < best[0]:
                    best = (key, group, entries, t_pending, t_plan, t_arrival)
            if best is None:
                break
            _, group, entries, pending, plan, arrival = best
            base_deferred = plan.deferred_tokens
            for level, count in group:
                for _ in range(count):
                    queues[level].popleft()
            early.extend(entries)
        return StepRelease(pending, plan, arrival, result.released + early, n_early=len(early))

    def _early_candidates(self, queues: list[deque]) -> list[list[tuple[int, int]]]:
        """FIFO-respecting groups of held outliers a step may take early, as [(queue, count)]:
        the head of each queue, each whole queue, and each queue topped up to one outlier per
        micro-batch with the heads of the nearest levels (the most alike documents held)."""
        out: list[list[tuple[int, int]]] = []
        for level, q in enumerate(queues):
            if not q:
                continue
            out.append([(level, 1)])
            if 1 < len(q) <= self.need:
                out.append([(level, len(q))])
            if len(q) < self.need:
                group, room = [(level, len(q))], self.need - len(q)
                for k in nearest_levels(queues, level):
                    if queues[k] and room:
                        take = min(room, len(queues[k]))
                        group.append((k, take))
                        room -= take
                if len(group) > 1:
                    out.append(group)
        seen, unique = set(), []
        for group in out:
            key = tuple(sorted(group))
            if key not in seen:
                seen.add(key)
                unique.append(group)
        return unique


class GroupRelease(ReleasePolicy):
    """release="group": one pool of held outliers. The pool's pieces at max_delay leave;
    then, greedily, the step takes a group of held outliers adjacent in (length, arrival)
    order (1 to dp x n_micro of them) whenever the packed step's predicted imbalance stays
    within max(balance_tolerance, the imbalance without them) and the group brings more
    tokens than it pushes to the next step. Among admissible groups the one that relieves the
    most displacement wins (`displacement_relief`: its tokens, less the early ones' lead;
    ties: lower imbalance, then the earliest arrival); repeats until none is admissible.

    A group leaves only if the step places all of it. A released outlier that the packing
    defers would be carried, and a carried piece is placed first in the next step whatever
    joins it: often alone, one window among short documents (imbalance ~2). It stays in the
    pool instead, to leave with similar ones (less imbalance at the same displacement;
    docs/tuning.md). With method "wlb_fill" the step's packing is predicted
    (`FillTrial`) and the plan kept is `wlb_fill`'s, which may still defer a piece of a
    group the prediction placed: that piece is carried, as any deferred piece."""

    def _costs(self, pieces: list[HeldPiece]) -> dict:
        """Cost of each piece by key (empty without `piece_cost`)."""
        if self.piece_cost is None or not self.cost_bounds or not pieces:
            return {}
        weights = self.piece_cost(lengths_of(pieces)).tolist()
        return dict(zip(map(_ID_OFFSET, pieces), weights))

    def _cannot_pass(self, group, costs: dict, base_cost: float, limit: float, heaviest: float = 0.0) -> bool:
        """True when the step with `group` is surely above `limit`: a group is kept only if all
        of it is placed, so the heaviest micro-batch costs at least the group's heaviest piece
        (or `heaviest`, a piece the step surely places) plus `bin_const`, and the mean is at
        most (every pending piece + need x bin_const) / need; their ratio bounds the imbalance
        from below (margin for rounding). `_windows` applies the same bound to every window at
        once; `_repaired` to each of its groups."""
        top = max(heaviest, max(costs[piece.key] for piece in group)) + self.bin_const
        mean_at_most = (base_cost + sum(costs[piece.key] for piece in group)) / self.need + self.bin_const
        return top > (limit + 1e-9) * mean_at_most

    def _bound_with(self, ctx: "_StepContext", group) -> float:
        """A lower bound on the step's imbalance with `group` placed and ctx.kept: the heaviest
        micro-batch holds at least the largest of those pieces' costs, or the pigeonhole bound
        (some micro-batch holds two of the need + 1 largest, ...), plus `bin_const`, over the
        largest mean (`_cannot_pass`)."""
        costs = ctx.costs
        merged = sorted(ctx.kept + tuple(costs[piece.key] for piece in group), reverse=True)
        group_cost = sum(costs[piece.key] for piece in group)
        placed = ctx.base_cost + group_cost
        group_tokens = sum(piece.length for piece in group)
        if ctx.room is not None and ctx.room.overflows(group_tokens):
            placed = min(placed, float(ctx.room.placed_at_most(group_tokens, group_cost)))
        heaviest = max(merged[0], pigeonhole_sorted(merged, self.need))
        return (heaviest + self.bin_const) / (placed / self.need + self.bin_const)

    @staticmethod
    def _defers_any(group, pending, plan) -> bool:
        """Whether the packed step defers a piece of `group` (see the class docstring)."""
        if hasattr(plan, "defers_any"):  # TrialPack, FillTrial
            return plan.defers_any(group)
        keys = {piece.key for piece in group}
        return any(pending[i].key in keys for i in plan.deferred.tolist())

    def _rejects(self, plan, pending, threshold: float | None, deferred_tokens: int, keep: list[HeldPiece]) -> bool:
        """Whether the packed step `plan` is above `threshold` (None: no limit), defers
        `deferred_tokens` or more, or defers a piece of `keep`. A `TrialPack` is packed only as
        far as that takes (`TrialPack.rejects`)."""
        rejects = getattr(plan, "rejects", None)
        if rejects is not None:
            return rejects(threshold, deferred_tokens, keep)
        return ((threshold is not None and plan.imbalance > threshold) or plan.deferred_tokens >= deferred_tokens
                or self._defers_any(keep, pending, plan))

    def _split(self, carry, released, fresh, step):
        """(first, rest) that `solve` packs: `split_due` (Algorithm 1: carried pieces first)."""
        return split_due(carry, released, fresh, step, self.max_delay)

    def _windows(self, remaining: list[HeldPiece], ctx: "_StepContext", early_only: bool = False,
                 arrived: bool = False):
        """The groups of `remaining` that `_candidates` packs before `hopeless`, by size then
        start: (sizes, starts, tokens, imbalance_at_least, relief) lists over them
        (imbalance_at_least None without costs; relief: `displacement_relief`, the tokens
        without lookahead). A group is left out when too early (`_not_too_early`), with
        `early_only` unless it holds exactly one early piece, when it defers over half the
        carry limit whatever the packing (ctx.room), or, with costs and a step that is not
        idle, when it is surely above ctx.limit (`_cannot_pass`, with ctx.kept and ctx.room).
        The windows of every size are judged at once. The sums of integers (tokens, early
        pieces, relief) come from prefix sums; the cost sums grow one piece at a time, left to
        right, so each equals the Python sum over the group (the same floats, the same
        decisions).

        `arrived`: the caller knows that every piece of `remaining` has arrived (no early
        piece), so the windows are judged as without lookahead: the same windows, and each
        relief is its tokens (the same numbers)."""
        n = len(remaining)
        top = min(self.need, n)
        if top == 0:
            return [], [], [], (None if not ctx.costs else []), []
        lookahead = self.lookahead and not arrived
        if n * top <= SMALL_WINDOWS:
            return self._few_windows(remaining, ctx, early_only, lookahead)
        lengths = lengths_of(remaining)
        # The windows judged, by size then start: the sparse set's (`sparse_window`) or every one.
        if self.sparse_windows:
            sizes, starts = _sparse_windows(n, top, EARLY_SPARSE_STRIDE if early_only else SPARSE_STRIDE)
        else:
            layout = _window_layout(n, top)
            sizes, starts = layout.sizes, layout.starts
        ends = starts + sizes
        if lookahead:  # the early rules first: the windows they leave out are not summed
            lead = np.fromiter(map(_ARRIVAL, remaining), dtype=np.int64, count=n) - ctx.step
            early = _window_sums((lead > 0).astype(np.int64), starts, ends)
            keep = 2 * early <= sizes
            if early_only:
                keep &= early == 1
            if not keep.all():
                kept = keep.nonzero()[0]
                sizes, starts, ends, keep = sizes[kept], starts[kept], ends[kept], keep[kept]
        else:
            keep = np.ones(len(sizes), dtype=bool)
        # integer sums are exact in any order: each window's is a difference of prefix sums
        tokens = _window_sums(lengths, starts, ends)
        # the token capacity only bounds a step that a group can take past it (`remaining` is
        # sorted by length: no window holds more than its `need` last pieces)
        room = ctx.room if ctx.room is not None and ctx.room.overflows(int(lengths[-self.need:].sum())) else None
        if room is not None:  # it defers over half the carry limit whatever the packing
            keep &= room.deferred_at_least(tokens) < self.max_backlog_tokens // 2 + 1
        at_least = None
        if ctx.costs:
            # a window's cost is summed left to right from its first piece (`_window_costs`)
            costs = np.fromiter(map(ctx.costs.__getitem__, map(_ID_OFFSET, remaining)), dtype=np.float64, count=n)
            if not keep.all():  # only the windows still kept are summed
                kept = keep.nonzero()[0]
                sizes, starts, ends, tokens, keep = sizes[kept], starts[kept], ends[kept], tokens[kept], keep[kept]
            total, heaviest_cost = _window_costs(costs, sizes, starts, top)
            heaviest = (heaviest_cost if not ctx.kept else np.maximum(heaviest_cost, ctx.kept[0])) + self.bin_const
            placed = ctx.base_cost + total
            if room is not None:
                placed = np.minimum(placed, room.placed_at_most(tokens, total))
            mean_at_most = placed / self.need + self.bin_const
            at_least = heaviest / mean_at_most
            if not ctx.idle:
                keep &= ~(heaviest > (ctx.limit + 1e-9) * mean_at_most)
        kept = keep.nonzero()[0]
        tokens_of = tokens[kept].tolist()
        return (sizes[kept].tolist(), starts[kept].tolist(), tokens_of,
                None if at_least is None else at_least[kept].tolist(),
                _window_sums(np.where(lead > 0, lengths * (self.early_credit - lead), lengths), starts[kept],
                             ends[kept]).tolist()
                if lookahead else tokens_of)

    def _few_windows(self, remaining: list[HeldPiece], ctx: "_StepContext", early_only: bool, lookahead: bool):
        """`_windows` in plain Python: a pool of a few pieces makes a few windows, fewer than
        numpy's per-call cost. The same sums in the same order, the same floats, the same
        windows (ctx.room's bound on the cost placed is computed for them all in one call)."""
        n, top, step = len(remaining), min(self.need, len(remaining)), ctx.step
        lengths = list(map(_LENGTH, remaining))
        credit = self.early_credit  # as `displacement_relief` of each piece alone
        relief = [piece.length if piece.arrival <= step else piece.length * (credit - (piece.arrival - step))
                  for piece in remaining] if lookahead else None
        early = [int(piece.arrival > step) for piece in remaining] if lookahead else None
        costs = list(map(ctx.costs.__getitem__, map(_ID_OFFSET, remaining))) if ctx.costs else None
        need, bin_const, base_cost = self.need, self.bin_const, ctx.base_cost
        limit = None if ctx.idle else ctx.limit + 1e-9
        # as in `_windows`: the token capacity only bounds a step that a group can take past it
        room = ctx.room if ctx.room is not None and ctx.room.overflows(sum(lengths[-need:])) else None
        kept_top = ctx.kept[0] if ctx.kept else None
        if room is not None:  # a window deferring this many tokens or more whatever the packing is left out
            excess = room.base_tokens + room.joined_tokens - room.capacity
            defer_limit = self.max_backlog_tokens // 2 + 1
        windows = []  # (size, start, tokens, relief, total cost, heaviest cost) past the early and deferral rules
        sparse = None
        if self.sparse_windows:  # by size, start
            layout = _window_layout(n, top)
            sparse = iter((layout.sparse_early if early_only else layout.sparse).tolist())
        tokens, reliefs, earlies, totals, heaviest = lengths, relief, early, costs, costs  # windows of 1
        for size in range(1, top + 1):
            if size > 1:  # windows of `size` from those of size - 1 and the piece after them
                last = size - 1
                tokens = [t + lengths[j + last] for j, t in enumerate(tokens[:-1])]
                if lookahead:
                    reliefs = [r + relief[j + last] for j, r in enumerate(reliefs[:-1])]
                    earlies = [e + early[j + last] for j, e in enumerate(earlies[:-1])]
                if costs is not None:
                    totals = [t + costs[j + last] for j, t in enumerate(totals[:-1])]
                    heaviest = [h if h >= costs[j + last] else costs[j + last] for j, h in enumerate(heaviest[:-1])]
            for start in range(n - size + 1):
                if sparse is not None and not next(sparse):
                    continue
                if lookahead and (2 * earlies[start] > size or (early_only and earlies[start] != 1)):
                    continue
                if room is not None and tokens[start] + excess >= defer_limit:
                    continue
                windows.append((size, start, tokens[start], reliefs[start] if lookahead else tokens[start],
                                None if costs is None else totals[start], None if costs is None else heaviest[start]))
        if costs is None:
            return ([w[0] for w in windows], [w[1] for w in windows], [w[2] for w in windows], None,
                    [w[3] for w in windows])
        bounds = None
        if room is not None and windows:
            bounds = room.placed_at_most(np.array([w[2] for w in windows], dtype=np.int64),
                                         np.array([w[4] for w in windows], dtype=np.float64)).tolist()
        sizes, starts, tokens_of, at_least_of, relief_of = [], [], [], [], []
        for k, (size, start, tok, rel, total, heavy) in enumerate(windows):
            if kept_top is not None and kept_top > heavy:
                heavy = kept_top
            top_cost = heavy + bin_const
            placed = base_cost + total
            if bounds is not None and bounds[k] < placed:
                placed = bounds[k]
            mean_at_most = placed / need + bin_const
            if limit is not None and top_cost > limit * mean_at_most:
                continue
            at_least_of.append(top_cost / mean_at_most)
            sizes.append(size)
            starts.append(start)
            tokens_of.append(tok)
            relief_of.append(rel)
        return sizes, starts, tokens_of, at_least_of, relief_of

    def _candidates(self, remaining: list[HeldPiece], ctx: "_StepContext", extra_tokens: int = 0, hopeless=None,
                    joining: list[HeldPiece] = (), lowest_bound_first: bool = False, cutoff=None,
                    most_tokens_first: bool = False, price: float = 0.0):
        """Each admissible group of `remaining` (1 to need pieces adjacent in (length, arrival)
        order), packed with ctx's released pieces: yields (i, group, tokens, pending, plan,
        arrival). Admissible: within ctx.limit (unless the step is idle), deferring fewer short
        tokens than the group (+ `extra_tokens`, pieces joining with it) brings, at most half the
        carry limit, and no early-released outlier deferred (see the class docstring).
        `hopeless(tokens, imbalance_at_least, relief)`, if given, skips a group before it is
        packed (imbalance_at_least: the bound of `_cannot_pass` as a ratio, None without costs;
        relief: its `displacement_relief`, the tokens without lookahead).
        With `lowest_bound_first` the groups come in increasing imbalance_at_least - `price` x
        relief (`displacement_relief`, summed over each window; with "marginal"'s price, a lower
        bound on its score, early pieces' lead included), with
        `most_tokens_first` in decreasing tokens (ties: the order above), so that a `hopeless`
        that learns from the groups seen skips more of them; a caller that ranks the groups by
        their own keys chooses the same group in any order (but for `max_packed`: with it, the
        search stops once that many candidates are packed, so it keeps the first ones visited).
        `cutoff(relief)`, if given, is the imbalance above which the group is of no use to the
        caller (None: no limit but ctx.limit): a candidate above it, or above ctx.limit, is
        skipped, and a `TrialPack` is packed only until it surely fails one of these limits
        (`TrialPack.rejects`), which costs a fraction of a packing for most of the groups a
        caller rejects.

        When ctx.plan makes variants of itself (`TrialPack.with_group`, one group at a time and
        only past `hopeless`; `FillTrial.with_groups`, all at once: `joining` + a group added to
        its pieces; ctx.released is ctx.plan's released pieces + `joining`), the candidates come
        from it (packed when read, or scored together), and pending and arrival are yielded as
        None (`_resolved` reads them from the plan kept).

        With lookahead the groups are those of the arrived pieces of `remaining` alone, then
        those of all of `remaining` that hold exactly one early piece (the module docstring
        says why); the i yielded numbers the groups of the second list after those of the
        first."""
        with_groups = getattr(ctx.plan, "with_groups", None)
        with_group = getattr(ctx.plan, "with_group", None)  # one at a time (TrialPack): made past `hopeless`
        account = getattr(ctx.solve, "account", None)  # calibration's meter counts them as solves
        sources = [remaining]
        if self.lookahead:  # groups of arrived pieces adjacent among themselves, then those with an early one
            arrived = [piece for piece in remaining if piece.arrival <= ctx.step]
            if len(arrived) < len(remaining):
                sources = [arrived, remaining]
        windows, offset = [], 0  # (index of the group, size, tokens, imbalance_at_least, source, start, relief)
        for n, source in enumerate(sources):
            # the first source's pieces have all arrived (with lookahead: `arrived` or all of `remaining`)
            sizes, starts, tokens_of, at_least_of, relief_of = self._windows(source, ctx, early_only=n > 0,
                                                                             arrived=n == 0)
            if at_least_of is None:
                at_least_of = [None] * len(sizes)
            windows += [(offset + i, size, tokens, at_least, source, i, relief)
                        for size, i, tokens, at_least, relief in zip(sizes, starts, tokens_of, at_least_of, relief_of)]
            offset += len(source)
        windows = _visiting_order(windows, lowest_bound_first, most_tokens_first, price)
        trials = [None] * len(windows)
        if with_group is None and with_groups is not None and windows:
            groups = [list(joining) + source[i:i + size] for _, size, _, _, source, i, _ in windows]
            trials = with_groups(groups, account=account)
        packed = 0
        for (i, size, tokens, at_least, source, start, relief), t_plan in zip(windows, trials):
            if hopeless is not None and hopeless(tokens, at_least, relief):
                continue
            if self.max_packed is not None and packed >= self.max_packed:
                break  # the search's most promising groups are packed
            if ctx.budget is not None and ctx.budget.left <= 0:
                break  # the step has packed its share of candidates
            group = source[start:start + size]
            threshold = None if ctx.idle else ctx.limit
            useful = None if cutoff is None else cutoff(relief)
            if useful is not None:
                threshold = useful if threshold is None else min(threshold, useful)
            if at_least is not None and ctx.kept and len(ctx.kept) + size > self.need:
                # more pieces to place than micro-batches: a sharper bound than the heaviest piece
                at_least = max(at_least, self._bound_with(ctx, group))
                if ((threshold is not None and at_least > threshold + 1e-9)
                        or (hopeless is not None and hopeless(tokens, at_least, relief))):
                    continue
            packed += 1
            if ctx.budget is not None:
                ctx.budget.left -= 1
            if with_group is not None:
                t_plan = with_group(list(joining) + group, account=account)
            if t_plan is None:
                t_pending, t_plan, t_arrival = ctx.solve(*self._split(ctx.carry, ctx.released + group, ctx.fresh,
                                                                      ctx.step))
            else:
                t_pending = t_arrival = None
            # it defers at least as many short tokens as the group brings, or over half the carry limit
            deferred_limit = min(ctx.base_deferred + tokens + extra_tokens, self.max_backlog_tokens // 2 + 1)
            if self._rejects(t_plan, t_pending, threshold, deferred_limit, ctx.released[ctx.n_forced:] + group):
                continue
            yield i, group, tokens, t_pending, t_plan, t_arrival

    def _choose(self, remaining: list[HeldPiece], ctx: "_StepContext"):
        """The group the step takes next, as (group, pending, plan, arrival), or None: the most
        displacement relieved (`displacement_relief`; ties: lower imbalance, then the earliest
        arrival); an idle step, the most balanced group."""
        best = None

        def hopeless(tokens, imbalance_at_least, relief):  # relieves less than the best group so far
            return not ctx.idle and best is not None and relief < -best[0][0]

        def cutoff(relief):  # above the best group's imbalance, a group ranks after it
            if best is None:
                return None
            if ctx.idle:
                return best[0][0] + _TOLERANCE_SLACK
            return best[0][1] + _TOLERANCE_SLACK if relief == -best[0][0] else None

        # an idle step ranks by imbalance, the others by relief first: the likely best groups first
        for i, group, tokens, t_pending, t_plan, t_arrival in self._candidates(
                remaining, ctx, hopeless=hopeless, cutoff=cutoff, lowest_bound_first=ctx.idle,
                most_tokens_first=not ctx.idle):
            first = min(piece.arrival for piece in group)
            relief = displacement_relief(group, ctx.step, self.early_credit)
            key = (t_plan.imbalance, -relief, first, i) if ctx.idle else (-relief, t_plan.imbalance, first, i)
            if best is None or key < best[0]:
                best = (key, group, t_pending, t_plan, t_arrival)
        return None if best is None else _resolved(*best[1:])

    def plan_step(self, fresh, queues, carry, step, solve) -> StepRelease:
        return self._plan_groups(fresh, queues, carry, step, solve)[0]

    def _plan_groups(self, fresh, queues, carry, step, solve) -> tuple[StepRelease, StepRelease]:
        """(the step with the groups its rounds take, the step without any: its carried, due
        and fresh pieces, as the first round weighed the groups against)."""
        held = chain.from_iterable(queues)
        if self.max_lead is not None and self.lookahead > self.max_lead:  # pieces seen further ahead wait
            held = (piece for piece in held if piece.arrival - step <= self.max_lead)
        pool = sorted(held, key=_ARRIVAL)  # FIFO among equals
        released = [piece for piece in pool if self._is_due(piece, step)]
        taken = {piece.key for piece in released}
        n_forced = len(released)
        pending, plan, arrival = solve(*self._split(carry, released, fresh, step))
        without_groups = StepRelease(pending, plan, arrival, released, 0)
        costs = {}  # the held pieces', by key; the step's own ones only count in base_cost
        base_cost = 0.0
        if self.piece_cost is not None and self.cost_bounds and (carry or fresh or pool):
            own_lengths = np.concatenate([lengths_of(carry), lengths_of(fresh)])
            # the step's own pieces and the held ones weighed in one call (each cost is its own)
            weighed = self.piece_cost(np.concatenate([own_lengths, lengths_of(pool)]) if pool else own_lengths)
            own = weighed[:len(own_lengths)]
            if pool:
                costs = dict(zip(map(_ID_OFFSET, pool), weighed[len(own_lengths):].tolist()))
            # summed in the order carry, fresh, released: the same floats as piece by piece
            base_cost = sum(own.tolist() + [costs[piece.key] for piece in released])
        own_pieces = None
        if self.room_bounds and self.max_tokens is not None and costs and len(carry) + len(fresh) >= ROOM_MIN_PIECES:
            own_pieces = _DensestPieces(own_lengths, np.asarray(own, dtype=np.float64))
        by_size = sorted(pool, key=_LENGTH_ARRIVAL)  # a stable sort: each round's remaining pieces in order
        budget = None if self.max_step_packed is None else _Budget(self.max_step_packed)
        while True:
            remaining = [piece for piece in by_size if _ID_OFFSET(piece) not in taken]
            if not remaining:
                break
            ctx = _StepContext(
                carry=carry, fresh=fresh, step=step, solve=solve, released=released, n_forced=n_forced, plan=plan,
                base_deferred=plan.deferred_tokens, costs=costs, base_cost=base_cost,
                limit=max(self.balance_tolerance, plan.imbalance) + _TOLERANCE_SLACK,
                # a step that would train nothing takes its most balanced group whatever the tolerance
                idle=is_idle(plan),
                kept=() if own_pieces is None else _kept_costs((), released[n_forced:], costs),
                room=None if own_pieces is None else _Room.of(own_pieces, released, costs, self.need * self.max_tokens),
                budget=budget)
            chosen = self._choose(remaining, ctx)
            if chosen is None:
                break
            group, pending, plan, arrival = chosen
            released = released + group
            base_cost += sum(costs[piece.key] for piece in group) if costs else 0.0
            taken |= {piece.key for piece in group}
        _leave_queues(queues, taken)
        return StepRelease(pending, plan, arrival, released, n_early=len(released) - n_forced), without_groups


_MUST_PLACE_TOP = 4
"""`_repaired` bounds a group's step by the step's own pieces among the `_MUST_PLACE_TOP` x
need longest it must place (`_surely_defers`; any of them give a valid bound)."""


def _surely_defers(pieces: list[HeldPiece], longest: list[int], n_bins: int, cap: int) -> bool:
    """Whether `pieces` and the pieces of lengths `longest` cannot all be placed in n_bins
    micro-batches of `cap` tokens: whatever the placement, some micro-batch holds k + 1 of the
    k x n_bins + 1 longest of them (pigeonhole), and for some k even the k + 1 shortest of
    those exceed `cap` (`pigeonhole_sorted`)."""
    lengths = sorted([piece.length for piece in pieces] + longest, reverse=True)
    return pigeonhole_sorted(lengths, n_bins) > cap


def _visiting_order(windows: list[tuple], lowest_bound_first: bool, most_tokens_first: bool, price: float) -> list:
    """The order in which `_candidates` visits its windows, (index, size, tokens,
    imbalance_at_least, source, start, relief) each: with `lowest_bound_first`, increasing
    imbalance_at_least - `price` x relief; with `most_tokens_first`, decreasing tokens; else
    as given (stable sorts: ties keep the order given). A policy's choice does not depend on
    it, only how much of its candidates' packing the bounds skip."""
    if lowest_bound_first and windows and windows[0][3] is not None:
        windows.sort(key=lambda window: window[3] - price * window[6])
    elif most_tokens_first:
        windows.sort(key=lambda window: -window[2])
    return windows


def _kept_costs(kept: tuple[float, ...], group, costs: dict) -> tuple[float, ...]:
    """`kept` (costs, largest first) with `group`'s pieces' costs; () without costs."""
    if not costs:
        return ()
    return tuple(sorted(kept + tuple(costs[piece.key] for piece in group), reverse=True))


def _longest(positions: list[int], result: StepRelease) -> int:
    """The first of `positions` (in result.pending) of the longest piece, then the latest
    arrived, as max() over them takes it; a chain's pieces (`PieceChain`) are read from the
    plan's arrays, not made."""
    pending = result.pending
    if not isinstance(pending, PieceChain):
        return max(positions, key=lambda i: (pending[i].length, pending[i].arrival))
    at = np.asarray(positions, dtype=np.int64)
    lengths, arrival = result.plan.lengths[at], np.asarray(result.arrival)[at]
    longest = lengths == lengths.max()
    return positions[int(np.flatnonzero(longest & (arrival == arrival[longest].max()))[0])]


def _without(pieces: list[HeldPiece], piece: HeldPiece) -> list[HeldPiece]:
    """`pieces` less `piece` (keys are unique: at most one is equal), a new list."""
    pieces = pieces if isinstance(pieces, list) else list(pieces)
    try:
        j = pieces.index(piece)
    except ValueError:
        return list(pieces)
    return pieces[:j] + pieces[j + 1:]


def _leave_queues(queues: list[deque], keys: set) -> None:
    """Takes the pieces of `keys` ((id, offset)) out of `queues`, each queue keeping its FIFO
    order for what stays."""
    for q in queues:
        kept = [piece for piece in q if _ID_OFFSET(piece) not in keys]
        q.clear()
        q.extend(kept)


def _deferring(pending: list[HeldPiece], plan, arrival: np.ndarray, pieces: list[HeldPiece]):
    """(pending, plan, arrival) of a packed step with `pieces`, which it does not hold, added
    as deferred (they join the carry): the plan is made a PackPlan (`as_pack_plan`)."""
    plan = as_pack_plan(plan)
    plan = plan.replace(doc_ids=np.append(plan.doc_ids, [piece.id for piece in pieces]),
                        lengths=np.append(plan.lengths, [piece.length for piece in pieces]),
                        offsets=np.append(plan.offsets, [piece.offset for piece in pieces]),
                        deferred=np.append(plan.deferred, np.arange(len(pending), len(pending) + len(pieces))))
    return pending + list(pieces), plan, np.append(arrival, [piece.arrival for piece in pieces])


def _resolved(group, pending, plan, arrival):
    """(group, pending, plan, arrival) of a kept candidate; pending and arrival read from the
    plan when `_candidates` scored it with others (yielded as None)."""
    return (group, plan.pending, plan, plan.arrival) if pending is None else (group, pending, plan, arrival)


class _DensestPieces:
    """A step's carried and fresh pieces (lengths, costs), sorted by cost per token, largest
    first, when a round first needs it (`_Room`)."""

    def __init__(self, lengths: np.ndarray, costs: np.ndarray):
        self.lengths, self.costs = lengths, costs
        self.tokens = int(np.add.reduce(lengths))

    @cached_property
    def sorted(self) -> tuple[np.ndarray, np.ndarray]:
        order = densest_order(self.lengths, self.costs)
        return self.lengths[order], self.costs[order]


@dataclass(frozen=True)
class _Room:
    """Bounds from the step's token capacity (dp x n_micro x max_tokens) on a candidate that
    adds a group (`tokens`, `cost`, arrays over groups or numbers) to the round's pieces (its
    carried and fresh ones, `own`, and the held ones it released) and must place all of it (a
    group partly deferred is rejected).

    The micro-batches place at most `capacity` tokens, so the candidate defers at least its
    tokens less the capacity, and the cost it places is at most the group's plus the most
    cost the round's pieces fit into the tokens left (`solvers.bounds.densest_first`). A
    step that holds more than its capacity places less than all of it, and its mean load is
    lower than the mean of everything it holds. Only a group that `overflows` can take the
    step past its capacity; the running sums are made when first needed."""

    capacity: int
    own: _DensestPieces
    released: tuple[tuple[int, float], ...]
    """(length, cost) of each held piece released so far."""
    joined_tokens: int = 0
    """A pair's first group, placed with every second group (`joined`)."""
    joined_cost: float = 0.0

    @classmethod
    def of(cls, own: _DensestPieces, released: list[HeldPiece], costs: dict, capacity: int) -> _Room:
        return cls(capacity=int(capacity), own=own,
                   released=tuple((piece.length, costs[piece.key]) for piece in released))

    @cached_property
    def base_tokens(self) -> int:
        return self.own.tokens + sum(length for length, _ in self.released)

    @cached_property
    def _cum(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, cost) running sums of the round's pieces, densest first, from 0."""
        lengths, weights = self.own.sorted
        if self.released:
            extra_len = np.array([length for length, _ in self.released], dtype=np.int64)
            extra_cost = np.array([cost for _, cost in self.released], dtype=np.float64)
            at = np.searchsorted(-weights / np.maximum(lengths, 1), -extra_cost / np.maximum(extra_len, 1))
            lengths, weights = np.insert(lengths, at, extra_len), np.insert(weights, at, extra_cost)
        return densest_first(lengths, weights, np.arange(len(lengths)))

    def joined(self, tokens: int, cost: float) -> _Room:
        """The bounds with another group placed with every candidate (a pair's first one)."""
        return dataclasses.replace(self, joined_tokens=self.joined_tokens + tokens,
                                   joined_cost=self.joined_cost + cost)

    def overflows(self, tokens: int) -> bool:
        """Whether a group of `tokens` takes the step past its capacity."""
        return self.base_tokens + self.joined_tokens + tokens > self.capacity

    def deferred_at_least(self, tokens):
        """Tokens a candidate with a group of `tokens` defers at least."""
        return np.asarray(tokens) + (self.base_tokens + self.joined_tokens - self.capacity)

    def placed_at_most(self, tokens, cost):
        """The most cost a candidate placing all of a group (`tokens`, `cost`) can place
        (the round's pieces already counted in `cost` are not counted again: callers pass
        the group's own). Where the groups alone exceed the capacity, the candidate is
        rejected whatever it places; the bound is then the groups' cost."""
        cum_tokens, cum_cost = self._cum
        left = self.capacity - self.joined_tokens - np.asarray(tokens)
        return self.joined_cost + np.asarray(cost) + np.interp(np.maximum(left, 0), cum_tokens, cum_cost)


@dataclass(frozen=True)
class _StepContext:
    """One round of GroupRelease's greedy: what the step holds so far."""

    carry: list[HeldPiece]
    fresh: list[HeldPiece]
    step: int
    solve: SolveStep
    released: list[HeldPiece]
    """Released so far this step: the due pieces (the first n_forced), then the groups taken."""
    n_forced: int
    plan: PackPlan | TrialPack
    """The step packed with `released`."""
    base_deferred: int
    costs: dict
    base_cost: float
    limit: float
    idle: bool
    room: _Room | None = None
    """What the micro-batches' token caps let the candidates place (None without costs or caps)."""
    kept: tuple[float, ...] = ()
    """Costs of the held pieces every candidate must place (the groups taken, a pair's first
    group), largest first: `_bound_with` (empty without costs, and on steps of fewer than
    ROOM_MIN_PIECES pieces, where the bound costs about what it saves)."""
    budget: "_Budget | None" = None
    """The candidates the step may still pack, shared by its rounds (`max_step_packed`; None: no limit)."""


class _Budget:
    """Candidates a step may still pack (`ReleasePolicy.max_step_packed`), counted down by
    `_candidates` across the step's rounds and pair searches."""

    __slots__ = ("left",)

    def __init__(self, left: int):
        self.left = left


@dataclass(frozen=True, kw_only=True)
class MarginalRelease(GroupRelease):
    """release="marginal": "group"'s pool and candidates, chosen at the margin.

    A group is worth the tokens it stops holding (one more step held adds its tokens to the
    stream's displacement) and costs the imbalance it adds. With the price
    lambda = `price` x (balance_tolerance - 1), a group's score is

        (imbalance of the step with it) - (imbalance without it) - lambda x relief / capacity_tokens

    (relief: `displacement_relief`, the group's tokens less the lead of its early pieces, each
    lead less `early_credit` steps; the tokens without lookahead)
    and the step takes the lowest-scoring group while its score is <= 0 (and the step stays
    within the tolerance, the deferral rules of "group" unchanged). Unlike "most tokens first
    within the tolerance", a starved step takes what lowers its imbalance, and a pair of
    windows waits unless the tokens it frees are worth the imbalance it adds. With
    balance_tolerance="auto" the feedback of `wlb_opt.packer.defaults` sets the tolerance,
    hence the price (`MARGINAL_PRICE` x (tolerance - 1); docs/tuning.md gives what was tried).

    Pairs: a group that balances only with a second one (three windows and the two mediums
    that fill the fourth micro-batch) scores > 0 alone. The best-scoring rejected group is
    tried with each admissible second group; the pair is taken if its joint score is <= 0
    and lower than any single group's.

    Trim: after the groups, the longest fresh or carried (not due) piece of the heaviest
    micro-batch is deferred to the next step if the imbalance that removes is worth its
    tokens at the same price (`_trimmed`): a starved step keeps a few short documents, one of
    which can outweigh the rest together. A carried piece may be trimmed again while that
    pays, until its deadline.

    Without groups: a step that took groups is weighed again against the step without them,
    each trimmed (`_without_groups_instead`): a group is taken when it beats the step without
    it as that step is, and a starved step whose short pieces include a long one is less
    balanced without its outliers than with them, though without that piece it is balanced.

    Repair: a step still above `repair_from` imbalance then takes more groups of held pieces,
    one at a time, while the best lowers its score (`_repaired`); these groups may hold
    several early pieces: a starved step of a few medium outliers needs several similar ones,
    often seen ahead, which a group with one early piece does not bring.

    Shed: then the shortest such pieces of the heaviest micro-batch are deferred one by one
    while each is worth its tokens at the same price, the other pieces left in place
    (`_shed`): a step that took a few outliers is often full to its token cap.

    Carried pieces: "group" packs the carried pieces first (Algorithm 1), spread over the
    micro-batches, which leaves less than a window's room in each; here only pieces at their
    deadline are packed first, the other carried ones with the rest, longest first (a short
    piece carried again still leaves by max_delay)."""

    price: float
    """lambda per unit of tolerance above 1 (see the class docstring)."""
    capacity_tokens: int
    """Tokens one step can place (dp x n_micro x max_tokens): the unit of a group's tokens."""
    trim: bool = True
    """Whether a step may defer the longest piece of its heaviest micro-batch (`_trimmed`)."""
    shed: bool = True
    """Whether a step may then defer short pieces of its heaviest micro-batch (`_shed`)."""
    trim_without_groups: bool = True
    """Whether a step that took groups is weighed, trimmed, against the step without them,
    trimmed too (`_without_groups_instead`; needs `trim`)."""
    held_group_steps: float = 1.0
    """Steps of the groups' relief that the step without them must outweigh
    (`_without_groups_instead`): a group held back once meets the same choice next step."""
    repair_from: float | None = None
    """Imbalance above which a step is repaired (`_repaired`); None: never."""

    def _token_price(self) -> float:
        """lambda per token: the imbalance one token held one more step is worth."""
        return self.price * (self.balance_tolerance - 1.0) / self.capacity_tokens

    def plan_step(self, fresh, queues, carry, step, solve) -> StepRelease:
        weigh = self.trim and self.trim_without_groups
        before = [list(q) for q in queues] if weigh else None
        result, without_groups = self._plan_groups(fresh, queues, carry, step, solve)
        found = self._trimmed(result, fresh, carry, step, solve) if self.trim else None
        chosen = result if found is None else found[0]
        if weigh and result.n_early:
            lam = self._token_price()
            groups = result.released[len(result.released) - result.n_early:]
            score = (result.plan.imbalance if found is None else found[1] + lam * chosen.pending[-1].length) \
                - self.held_group_steps * lam * displacement_relief(groups, step, self.early_credit)
            chosen = self._without_groups_instead(chosen, score, without_groups, fresh, queues, before, carry, step,
                                                  solve)
        if self.repair_from is not None and chosen.plan.imbalance > self.repair_from and not is_idle(chosen.plan):
            chosen = self._repaired(chosen, fresh, queues, carry, step, solve)
        return self._shed(chosen, fresh, step) if self.shed else chosen

    def _repaired(self, chosen: StepRelease, fresh, queues, carry, step: int, solve) -> StepRelease:
        """`chosen`, or the step with more groups of held pieces, found by a local search. Each
        round packs the step with each group of 1 to need held pieces adjacent in (length,
        arrival) order, early ones up to max_lead steps ahead included, and takes the group of
        lowest score

            its imbalance - lambda x the group's relief (`displacement_relief`)

        (lambda per token, `_token_price`) if that is below the step's imbalance, for at most
        `REPAIR_ROUNDS` rounds. Unlike the groups of the search, a group may hold several early
        pieces: a starved step of a few medium outliers needs several similar ones, often seen
        ahead. A group whose packing (without the pieces the step deferred) defers more tokens
        than the step deferred, or than half the carry limit leaves beside those pieces (which
        stay deferred), or a released piece, is not taken. A group surely above the
        score it must beat (its heaviest piece against the largest mean the step can have, as
        `_cannot_pass`), or whose step surely defers a piece it must place (`_surely_defers`:
        the released pieces, the group's, and those longer than the tokens the step may
        defer), is not packed, and the others are packed only until they surely fail
        (`TrialPack.rejects`). The pieces the step deferred (its trim) stay deferred; the
        groups taken leave their queues."""
        released = list(chosen.released)
        taken_keys = {piece.key for piece in released}
        pool = sorted((piece for q in queues for piece in q if piece.key not in taken_keys
                       and (self.max_lead is None or piece.arrival - step <= self.max_lead)), key=_LENGTH_ARRIVAL)
        if not pool:
            return chosen
        lam = self._token_price()
        kept_back = take(chosen.pending, chosen.plan.deferred.tolist())
        back_keys = {piece.key for piece in kept_back}
        carry_in = [piece for piece in carry if piece.key not in back_keys]
        fresh_in = [piece for piece in fresh if piece.key not in back_keys]
        # no more than the step deferred, nor (with its deferred pieces) more than half the carry limit
        limit = min(chosen.plan.deferred_tokens, self.max_backlog_tokens // 2 - sum(p.length for p in kept_back))
        longest = None  # the longest pieces of the step's own that a packing kept must place
        if self.max_tokens is not None:
            own = np.concatenate([lengths_of(carry_in), lengths_of(fresh_in)])
            longest = (-np.sort(-own[own > limit]))[:_MUST_PLACE_TOP * self.need].tolist()
        cost_of = self._costs(pool + released)
        if cost_of:  # the step places every piece but kept_back: what it places costs its loads
            placed_cost = float(np.add.reduce(chosen.plan.loads)) - self.need * self.bin_const
            heaviest = max((cost_of[piece.key] for piece in released), default=0.0)
        added: list[HeldPiece] = []
        current, score = None, chosen.plan.imbalance
        for _ in range(REPAIR_ROUNDS):
            best = None
            left = [piece for piece in pool if piece.key not in taken_keys]
            for size in range(1, min(self.need, len(left)) + 1):
                for start in range(len(left) - size + 1):
                    group = left[start:start + size]
                    gain = lam * displacement_relief(group, step, self.early_credit)
                    below = (score if best is None else best[0]) + gain
                    if cost_of and self._cannot_pass(group, cost_of, placed_cost, below, heaviest):
                        continue
                    keep = released + added + group
                    if longest is not None and _surely_defers(keep, longest, self.need, self.max_tokens):
                        continue
                    pending, plan, arrival = solve(*self._split(carry_in, keep, fresh_in, step))
                    if self._rejects(plan, pending, below, limit + 1, keep):
                        continue
                    value = plan.imbalance - gain
                    if value < score and (best is None or value < best[0]):
                        best = (value, group, (pending, plan, arrival))
            if best is None:
                break
            _, group, current = best
            added = added + group
            taken_keys |= {piece.key for piece in group}
            score = current[1].imbalance
            if cost_of:
                placed_cost += sum(cost_of[piece.key] for piece in group)
                heaviest = max(heaviest, max(cost_of[piece.key] for piece in group))
        if current is None:
            return chosen
        pending, plan, arrival = _deferring(*current, kept_back) if kept_back else current
        _leave_queues(queues, {piece.key for piece in added})
        return StepRelease(pending, plan, arrival, released + added, chosen.n_early + len(added))

    def _without_groups_instead(self, chosen: StepRelease, score: float, without_groups: StepRelease, fresh,
                                queues, before, carry, step, solve) -> StepRelease:
        """`chosen` (the step with its groups, then trimmed), or the step without any group,
        trimmed, if that scores lower. A group is taken when it beats the step without it,
        untrimmed; a starved step whose short pieces include a long one (a batch of a few
        short documents after one of outliers) can be less balanced without the outliers than
        with them, while without that one piece it would be balanced. So the two are weighed
        again, each trimmed (`score`, chosen's):

            chosen:  its imbalance - s x lambda x the groups' relief + lambda x its trimmed piece's tokens
            without: its imbalance + lambda x its trimmed piece's tokens

        (lambda per token, `_token_price`; imbalances as the rule weighs them, `_trimmed`;
        s = `held_group_steps`: groups held back once tend to be held again, and at s = 1 the
        held groups' wait outran the displacement feedback on a stream of mostly outliers). No
        step's imbalance is below 1, so a chosen step that scores 1 or less is kept without
        trimming the other. Taking the step without groups puts the groups' pieces back in
        their queues, in their order (`before`: the queues before the groups were taken)."""
        if score <= 1.0 or is_idle(without_groups.plan):
            return chosen
        found = self._trimmed(without_groups, fresh, carry, step, solve, below=score)
        if found is None:
            return chosen
        forced = {piece.key for piece in without_groups.released}
        for q, was in zip(queues, before):
            q.clear()
            q.extend(piece for piece in was if piece.key not in forced)
        return found[0]

    def _shed(self, result: StepRelease, fresh, step: int) -> StepRelease:
        """The step's plan (a PackPlan) with short pieces of its heaviest micro-batch deferred,
        one at a time, while each lowers the imbalance by more than holding its tokens one
        more step costs, at the price of the groups:

            (imbalance with it) - (imbalance without it) > lambda x its tokens / capacity.

        Each time the piece is the shortest movable one (`_movable_test`: fresh, or carried and not
        due) of the micro-batch that is then the heaviest, never a micro-batch's only piece,
        and the step defers at most half the carry limit in all. The other pieces stay where
        they are: the loads of the micro-batches that lose a piece are summed again as the
        plan sums them. A step that took a few outliers is often full to its token cap, every
        micro-batch at the cap and the one with the longest outlier the heaviest; its short
        pieces then wait a step, where one without outliers has room for them."""
        plan = as_pack_plan(result.plan)
        kept = result._replace(plan=plan)
        room = self.max_backlog_tokens // 2 - plan.deferred_tokens
        n = len(plan.loads)
        if n < 2 or room <= 0 or self.piece_cost is None:
            return kept
        lam, movable = self._token_price(), self._movable_test(result, fresh, step)
        loads = plan.loads.tolist()
        total = sum(loads)
        heaviest = [(-load, h) for h, load in enumerate(loads)]  # the heaviest first (ties: the lowest index)
        heapq.heapify(heaviest)
        queues = {}  # micro-batch: [pieces it holds, its pieces shortest first (ties: the first placed),
        shed = []    #               their tokens, their costs, how many of them were passed, those shed]
        piece_costs = None  # every piece's, weighed in one call when a micro-batch is first read
        while True:
            h = heaviest[0][1]
            queue = queues.get(h)
            if queue is None:
                if piece_costs is None:
                    piece_costs = self.piece_cost(plan.lengths)
                mb = plan.micro_batches[h]
                lengths = plan.lengths[mb]
                by = np.lexsort((mb, lengths))
                queue = queues[h] = [len(mb), mb[by].tolist(), lengths[by].tolist(), piece_costs[mb[by]].tolist(), 0,
                                     []]
            held, order, lengths, costs, at, gone = queue
            while at < len(order) and not movable(order[at]):
                at += 1
            queue[4] = at
            if held <= 1 or at == len(order) or lengths[at] > room:
                break
            lighter = loads[h] - costs[at]
            second = -min(heaviest[1][0], heaviest[2][0]) if n > 2 else -heaviest[1][0]
            after = max(second, lighter) / ((total - costs[at]) / n)
            if loads[h] / (total / n) - after <= lam * lengths[at]:
                break
            loads[h], total, room = lighter, total - costs[at], room - lengths[at]
            heapq.heapreplace(heaviest, (-lighter, h))
            queue[0], queue[4] = held - 1, at + 1
            gone.append(order[at])
            shed.append(order[at])
        if not shed:
            return kept
        micro_batches, exact, tokens = list(plan.micro_batches), plan.loads.copy(), plan.tokens.copy()
        for h, queue in queues.items():
            if queue[5]:  # summed as `TrialPack._plan_loads` sums a micro-batch, in placement order
                gone = set(queue[5])
                mb = micro_batches[h] = np.array([i for i in micro_batches[h].tolist() if i not in gone],
                                                 dtype=np.int64)
                exact[h] = np.add.reduce(piece_costs[mb]) + self.bin_const
                tokens[h] = np.add.reduce(plan.lengths[mb])
        # the plan's own largest cost; a bound or optimality proven for the pieces before the shed is not its own
        proven = {} if plan.info.bound is None and plan.info.status != "optimal" else dict(
            bound=None, gap=None, status="feasible" if plan.info.status == "optimal" else plan.info.status)
        info = dataclasses.replace(plan.info, objective=float(exact.max()) if len(exact) else plan.info.objective,
                                   extra={**plan.info.extra, "shed": len(shed)}, **proven)
        plan = plan.replace(micro_batches=tuple(micro_batches), deferred=np.append(plan.deferred, shed), loads=exact,
                            tokens=tokens, info=info)
        return result._replace(plan=plan)

    def _trimmed(self, result: StepRelease, fresh, carry, step, solve,
                 below: float | None = None) -> tuple[StepRelease, float] | None:
        """The step with the longest fresh or carried (not due; only with a max_delay) piece of
        its heaviest micro-batch deferred, if the imbalance that removes is worth more than
        holding the piece one more step costs, at the price of the groups:

            (imbalance without it) - (imbalance with it) + lambda x its tokens / capacity < 0.

        With the trimmed step's imbalance as the rule weighs it (the packing's `solve` or
        `TrialPack` made, before it is kept); otherwise None. A step whose batch brought almost
        only outliers, its pool held, is left with a few short documents, one of which can
        outweigh the others together (prose calibration seed 100: steps whose micro-batches
        cost a twentieth of a window's, at 1.4-1.6 imbalance). The piece joins the carry
        (packed with the next step's pieces, and first once at max_delay). `below`: the
        trimmed step must also score below it (its imbalance plus the piece's tokens at the
        price), which lets its packing stop sooner."""
        plan = result.plan
        n_placed = getattr(plan, "n_placed", None)  # a TrialPack counts them without its micro-batches
        if (n_placed if n_placed is not None else sum(len(mb) for mb in plan.micro_batches)) <= 1:
            return None
        heaviest = int(np.argmax(plan.loads))
        one = getattr(plan, "micro_batch", None)  # a TrialPack finds one micro-batch without the others
        positions = one(heaviest) if one else plan.micro_batches[heaviest]
        movable = self._movable_test(result, fresh, step)
        lengths = plan.lengths[positions]
        ranked = argsort_descending(lengths)  # the longest movable piece's length first, from the longest down
        length = next((d for i, d in zip(positions[ranked].tolist(), lengths[ranked].tolist()) if movable(i)), None)
        if length is None:
            return None
        lam = self._token_price()
        limit = plan.imbalance if below is None else min(plan.imbalance, below)
        threshold = limit - lam * length
        if threshold < BELOW_ANY:  # no packing is below 1: nothing to pack to know it fails
            return None
        # the piece: among the movable ones of that length (`_longest`'s tie rule, in the same order)
        position = _longest([i for i, d in zip(positions.tolist(), lengths.tolist()) if d == length and movable(i)],
                            result)
        piece = result.pending[position]
        without = getattr(plan, "without", None)
        if without is not None:  # a TrialPack: the same candidate as `solve` makes, less one piece
            pending, t_plan, arrival = without(position)
        else:
            pending, t_plan, arrival = solve(*self._split(_without(carry, piece), result.released,
                                                          _without(fresh, piece), step))
        # the re-packing defers nothing more, nor more than "group"'s carry limit, nor a released
        # piece; a TrialPack is packed only until it surely fails (`_rejects`), then compared exactly
        deferred_limit = min(plan.deferred_tokens + 1, self.max_backlog_tokens // 2 - piece.length + 1)
        if (self._rejects(t_plan, pending, threshold, deferred_limit, result.released)
                or t_plan.imbalance - limit + lam * piece.length >= 0):
            return None
        weighed = t_plan.imbalance
        pending, t_plan, arrival = _deferring(pending, t_plan, arrival, [piece])
        return StepRelease(pending, t_plan, arrival, result.released, result.n_early), weighed

    def _movable_test(self, result: StepRelease, fresh, step: int) -> Callable[[int], bool]:
        """Whether the piece at a position of result.pending is one the trim and the shed may
        defer: a fresh one, or a carried one while it has a deadline to come (max_delay=None:
        fresh pieces only, so that no piece is deferred twice without a bound)."""
        pending = result.pending
        if self.max_delay is None:
            movable = set(fresh)  # pieces, hashed whole: their keys are unique
            return lambda i: pending[i] in movable
        # the step's pieces are its carried, released and fresh ones, and the fresh ones arrived
        # at this step: all may move but the released ones and those at their deadline, which
        # are carried (found without a pass over the carry, nor one over the fresh pieces)
        fixed, due_by = set(result.released), step - self.max_delay
        tables = pending.fresh_ranges() if isinstance(pending, PieceChain) else []
        arrival = result.arrival
        if 0 < len(tables) <= 2:  # a chain's fresh pieces and its carry held as a table: never released, not read
            (lo, hi), (lo2, hi2) = (tables + [(0, 0)])[:2]
            return lambda i: arrival[i] > due_by and (lo <= i < hi or lo2 <= i < hi2 or pending[i] not in fixed)
        if tables:
            return lambda i: arrival[i] > due_by and (any(lo <= i < hi for lo, hi in tables) or pending[i] not in fixed)
        return lambda i: pending[i].arrival > due_by and pending[i] not in fixed

    def _split(self, carry, released, fresh, step):
        first, rest = split_due(carry, released, fresh, step, self.max_delay)
        if self.max_delay is None:
            return first, rest
        due_by = step - self.max_delay  # the due pieces lead `first` (`split_due`): count them, not the rest
        if isinstance(first, FreshPieces):  # the carry's table, none of it due (`split_due`)
            return first[:0], first + rest
        n_due = sum(1 for _ in takewhile(lambda piece: piece.arrival <= due_by, first))
        return first[:n_due], first[n_due:] + rest

    def _choose(self, remaining, ctx):
        if ctx.idle:
            return super()._choose(remaining, ctx)
        lam = self._token_price()
        best, rejected = None, None

        def hopeless(tokens, imbalance_at_least, relief):
            # its score is surely > 0 and above the best rejected one, or surely above the best
            # one where no score can be > 0 (see `cutoff`): neither taken nor paired
            if imbalance_at_least is None:
                return False
            # (the relief is the group's tokens without lookahead, less with early pieces)
            low = imbalance_at_least - ctx.plan.imbalance - lam * relief
            if (best is not None and low > best[0][0] + _TOLERANCE_SLACK
                    and ctx.plan.imbalance + lam * relief >= ctx.limit + 1e-9):
                return True
            return low > _TOLERANCE_SLACK and (rejected is not None and low > rejected[0][0] + _TOLERANCE_SLACK)

        def cutoff(relief):
            # useful: a score below the best one (taken) or in (0, best rejected) (paired). A
            # group whose score is surely < 0 within ctx.limit cannot be rejected: then only
            # the best bounds it (a step above the tolerance, whose limit is its own imbalance)
            zero = ctx.plan.imbalance + lam * relief  # the imbalance of score 0
            if best is not None and zero >= ctx.limit + 1e-9:
                return zero + best[0][0] + _TOLERANCE_SLACK
            if rejected is None:
                return None
            return zero + rejected[0][0] + _TOLERANCE_SLACK

        # lowest score bound first: the best groups, found early, let `hopeless` skip more
        for i, group, tokens, t_pending, t_plan, t_arrival in self._candidates(remaining, ctx, hopeless=hopeless,
                                                                                lowest_bound_first=True, price=lam,
                                                                                cutoff=cutoff):
            score = t_plan.imbalance - ctx.plan.imbalance - lam * displacement_relief(group, ctx.step,
                                                                                      self.early_credit)
            entry = ((score, -tokens, min(piece.arrival for piece in group), i), group, t_pending, t_plan, t_arrival)
            if score > 0:
                if rejected is None or entry[0] < rejected[0]:
                    rejected = entry
            elif best is None or entry[0] < best[0]:
                best = entry
        if rejected is not None:  # the most promising rejected group, with a second one
            best = self._best_pair(rejected[1], remaining, ctx, lam, best)
        return None if best is None else _resolved(*best[1:])

    def _best_pair(self, first_group, remaining, ctx, lam, best):
        """`best`, or `first_group` + a second group whose joint score is <= 0 and lower."""
        keys = {piece.key for piece in first_group}
        rest = [piece for piece in remaining if piece.key not in keys]
        first_tokens = sum(piece.length for piece in first_group)
        first_relief = displacement_relief(first_group, ctx.step, self.early_credit)
        costs = ctx.costs
        with_first = dataclasses.replace(
            ctx, released=ctx.released + first_group,
            base_cost=ctx.base_cost + (sum(costs[piece.key] for piece in first_group) if costs else 0.0),
            kept=() if ctx.room is None else _kept_costs(ctx.kept, first_group, costs),
            room=None if ctx.room is None else ctx.room.joined(first_tokens,
                                                               sum(costs[piece.key] for piece in first_group)))

        def top():  # the highest score a pair may have and still be taken
            return 0.0 if best is None else min(0.0, best[0][0])

        def hopeless(tokens, imbalance_at_least, relief):  # the pair's score is surely above top()
            if imbalance_at_least is None:
                return False
            return imbalance_at_least - ctx.plan.imbalance - lam * (first_relief + relief) > top() + _TOLERANCE_SLACK

        def cutoff(relief):  # the imbalance at which the pair's score is top()
            return ctx.plan.imbalance + lam * (first_relief + relief) + top() + _TOLERANCE_SLACK

        for i, group, tokens, t_pending, t_plan, t_arrival in self._candidates(rest, with_first, first_tokens,
                                                                                hopeless, joining=first_group,
                                                                                cutoff=cutoff, lowest_bound_first=True,
                                                                                price=lam):
            score = t_plan.imbalance - ctx.plan.imbalance - lam * (
                first_relief + displacement_relief(group, ctx.step, self.early_credit))
            key = (score, -(first_tokens + tokens), min(piece.arrival for piece in first_group + group), i)
            if score <= 0 and (best is None or key < best[0]):
                best = (key, first_group + group, t_pending, t_plan, t_arrival)
        return best


_POLICIES: dict[str, type[ReleasePolicy]] = {"paper": PaperRelease, "balance": BalanceRelease,
                                             "group": GroupRelease, "marginal": MarginalRelease}
RELEASE_POLICIES: tuple[str, ...] = tuple(_POLICIES)


def make_release_policy(name: ReleaseName, **rules) -> ReleasePolicy:
    """The policy object for `release=name`; `rules` are ReleasePolicy's fields."""
    return _POLICIES[name](**rules)
