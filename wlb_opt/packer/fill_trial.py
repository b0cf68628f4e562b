"""One step's candidate packings for method "wlb_fill", scored without packing the short pieces.

`wlb_fill` (solvers/fill.py) places the large pieces of a step first and lets the short
ones fill the gaps they leave. A release candidate (a group of held outliers joining the
step) changes the large pieces, not the thousands of short ones, so `FillStepSolver` scores
a candidate from its large pieces alone:

- the placed-first pieces and every piece costing at least `PREDICT_SHARE` x the step's mean
  micro-batch cost are placed by Algorithm 1's rule in rounds (`predict_rounds`: each round
  gives the next items, heaviest first, to the lightest micro-batches, as many as Algorithm
  1 would place before a filled one becomes the lightest again), as `wlb_fill`'s first two
  phases place them (its descent and polish aside);
- the cheaper pieces are taken as a fluid: they raise the lightest micro-batches to the
  water level W that their total cost fills, each by at most what its token room holds at
  their mean cost per token (`water_levels`), so micro-batch b is predicted at
  min(max(large_b, W), large_b + room_b); the short tokens beyond the token room the large
  pieces leave are predicted deferred.

The short pieces of a step are its fresh documents in every candidate: they are sorted and
summed once per step. A release policy's candidates of one round differ only in the group
they add (`FillTrial.with_groups`), so they are scored together: their placement orders are
merged from one sorted list, and `predict_rounds` and `water_levels` work on every
candidate's micro-batches at once, a few array operations per round rather than a heap pass
per candidate. On a 32-micro-batch step of the `real` stream the round prediction is as
close to `wlb_fill`'s packed imbalance as placing the large pieces one by one (median
|error| 0.002). `FillTrial` answers what the release policies read (imbalance, deferred
tokens, whether a piece is deferred, whether the step is idle) from that prediction, and
packs the candidate the step keeps with `wlb_fill` itself (`FillTrial.plan`, also
`micro_batches` and `loads`, which `MarginalRelease._trimmed` reads). The predicted imbalance
is what `wlb_fill` would reach if the short pieces filled the gaps exactly; its descent and
polish only lower the largest load.
"""
from __future__ import annotations

from itertools import chain
from operator import is_
from typing import NamedTuple

import numpy as np

from ..plan import PackPlan, SolveInfo
from ..solvers.fill import wlb_fill
from ..solvers.greedy import argsort_descending, bin_tokens
from ..solvers.problem import PackProblem
from ._cached import cached_property
from .state import HeldPiece
from .trial import StepSolver


def water_levels(large_loads: np.ndarray, short_cost: np.ndarray, room_cost: np.ndarray | None = None) -> np.ndarray:
    """`water_level` for each row of `large_loads` (C x bins) at once: row c's fluid of
    `short_cost[c]` fills its lightest bins first, bin b rising to max(large_loads[c, b], W_c)
    and by at most room_cost[c, b] (None: no limit). Exact: the filled volume is piecewise
    linear in the level, with a kink at each bin's floor and ceiling; W_c is found on the
    segment where the volume reaches short_cost[c]."""
    loads = np.asarray(large_loads, dtype=np.float64)
    short = np.asarray(short_cost, dtype=np.float64)
    n_rows, n_bins = loads.shape
    if n_bins == 0:
        return loads.copy()
    if room_cost is None:  # no bin rises by more than the whole fluid
        room = np.broadcast_to(np.maximum(short, 0.0)[:, None] + 1.0, loads.shape)
    else:
        room = np.asarray(room_cost, dtype=np.float64)
    top = loads + room
    points = np.concatenate([loads, top], axis=1)
    slope = np.concatenate([np.ones_like(loads), -np.ones_like(loads)], axis=1)
    order = np.argsort(points, axis=1, kind="stable")
    points = np.take_along_axis(points, order, axis=1)
    rate = np.cumsum(np.take_along_axis(slope, order, axis=1), axis=1)  # bins rising after each point
    steps = np.maximum(rate[:, :-1], 0) * np.diff(points, axis=1)
    filled = np.concatenate([np.zeros((n_rows, 1)), np.cumsum(steps, axis=1)], axis=1)  # volume at each point
    j = np.minimum((filled < short[:, None]).sum(axis=1), 2 * n_bins - 1)  # first point with enough volume
    below = np.maximum(j - 1, 0)
    rows = np.arange(n_rows)
    at_rate = rate[rows, below]
    level = np.where(at_rate > 0, points[rows, below] + (short - filled[rows, below]) / np.maximum(at_rate, 1),
                     points[rows, j])
    level = np.where(short > 0, level, -np.inf)
    return np.minimum(np.maximum(loads, level[:, None]), top)


def water_level(large_loads: np.ndarray, short_cost: float, room_cost: np.ndarray | None = None) -> np.ndarray:
    """The loads after a fluid of `short_cost` fills the lightest bins first: bin b rises to
    max(large_loads[b], W), at most by room_cost[b] (the cost its token room holds; None: no
    limit), with W chosen so that the rises add up to short_cost (or every bin full)."""
    loads = np.asarray(large_loads, dtype=np.float64)
    room = None if room_cost is None else np.asarray(room_cost, dtype=np.float64)[None, :]
    return water_levels(loads[None, :], np.array([short_cost], dtype=np.float64), room)[0]


def predict_rounds(weights: np.ndarray, tokens: np.ndarray, n_items: np.ndarray, n_bins: int,
                   cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Algorithm 1's rule in rounds, for C candidate placement orders at once.

    weights, tokens: C x T, each row a candidate's items in placement order (zero past
    n_items[c]). Each round, a row takes its next k items, k the number of its bins lighter
    than (lightest load + the next item's cost), and gives the j-th of them to its j-th
    lightest bin: what Algorithm 1 does item by item while no bin it filled in the round
    becomes the lightest again. The items of a round that do not fit under `cap` tokens go,
    in order, to the row's bins of fewest tokens, one each (Algorithm 1's fallback), else
    they are deferred. A round is a few array operations on every candidate,
    not a heap operation per item and per candidate.

    Returns (loads C x bins, tokens C x bins, deferred C x T bool)."""
    n_rows, width = weights.shape
    loads = np.zeros((n_rows, n_bins), dtype=np.float64)
    toks = np.zeros((n_rows, n_bins), dtype=np.int64)
    deferred = np.zeros((n_rows, width), dtype=bool)
    if n_rows == 0 or n_bins == 0:
        return loads, toks, deferred
    stride = width + n_bins  # padded rows: a round reads n_bins items ahead
    w = np.concatenate([weights, np.zeros((n_rows, n_bins))], axis=1).ravel()
    t = np.concatenate([tokens, np.zeros((n_rows, n_bins), dtype=np.int64)], axis=1).ravel()
    flat_loads, flat_toks = loads.ravel(), toks.ravel()
    n_items = np.asarray(n_items, dtype=np.int64)
    ptr = np.zeros(n_rows, dtype=np.int64)
    cols = np.arange(n_bins)
    rows = np.flatnonzero(ptr < n_items)
    while len(rows):
        order = np.argsort(loads[rows], axis=1, kind="stable")  # lightest first, ties: lowest bin
        flat = (rows * n_bins)[:, None] + order  # flat index of each row's j-th lightest bin
        lo = flat_loads[flat]
        p = ptr[rows]
        pos = (rows * stride + p)[:, None] + cols  # flat index of each row's next n_bins items
        wi = w[pos]
        k = np.minimum(np.maximum((lo < lo[:, :1] + wi[:, :1]).sum(axis=1), 1), n_items[rows] - p)
        take = cols < k[:, None]
        ti = t[pos]
        fits = take & (flat_toks[flat] + ti <= cap)
        flat_loads[flat[fits]] += wi[fits]
        flat_toks[flat[fits]] += ti[fits]
        bad = take & ~fits
        if bad.any():  # the fallback: the round's misfits, in order, to the bins of fewest tokens
            at, j = np.nonzero(bad)
            rank = np.cumsum(bad, axis=1)[at, j] - 1  # j-th misfit of its row
            c = rows[at]
            b = np.argsort(toks[c], axis=1, kind="stable")[np.arange(len(at)), rank]
            ok = toks[c, b] + ti[at, j] <= cap
            loads[c[ok], b[ok]] += wi[at, j][ok]  # distinct (row, bin) pairs: one misfit per bin
            toks[c[ok], b[ok]] += ti[at, j][ok]
            deferred[c[~ok], p[at][~ok] + j[~ok]] = True
        ptr[rows] = p + k
        rows = rows[ptr[rows] < n_items[rows]]
    return loads, toks, deferred


PREDICT_SHARE = 0.02
"""Pieces costing at least this share of the step's mean micro-batch cost are placed one by
one in a prediction; the cheaper ones are taken as a fluid."""


class Prediction(NamedTuple):
    """A candidate step as the release policies read it (module docstring)."""

    loads: np.ndarray
    """Predicted seconds of each micro-batch (with the per-micro-batch constant)."""
    deferred_tokens: int
    deferred_large: np.ndarray
    """Global indices (in the step solver) of the large pieces predicted deferred."""
    n_placed: int
    imbalance: float
    """max / mean of `loads` (`plan.imbalance`)."""


class FillStepSolver(StepSolver):
    """`StepSolver` for method "wlb_fill": candidates scored from their large pieces
    (module docstring); same arguments."""

    def __init__(self, pieces: list[HeldPiece] | None, weights: np.ndarray, fresh: list[HeldPiece], *, n_micro: int,
                 dp: int, max_tokens: int, bin_const: float, method: str = "wlb_fill", table: np.ndarray | None = None,
                 fresh_at: int | None = None):
        super().__init__(pieces, weights, fresh, n_micro=n_micro, dp=dp, max_tokens=max_tokens,
                         bin_const=bin_const, method=method, table=table, fresh_at=fresh_at)
        idx, by_length = self._sorted_tail(fresh)  # longest first; cost grows with length: also by cost
        self._fresh_idx = idx
        self._fresh_sorted = by_length
        self._fresh_neg_w = -self.weights[by_length]  # ascending, for searchsorted
        self._fresh_cum_w = np.concatenate([[0.0], np.cumsum(self.weights[by_length])])
        self._fresh_cum_tok = np.concatenate([[0], np.cumsum(self.lengths[by_length])])

    def solve(self, first: list[HeldPiece], rest: list[HeldPiece]):
        """Score `first` (placed first, in this order) + `rest`, as `wlb_fill` with
        carried=len(first) packs them. Returns (pending = first + rest, FillTrial, arrival
        step of each pending piece)."""
        m = len(self.fresh)
        # the release policies append the step's fresh list whole: recognised by identity
        with_fresh = bool(m) and len(rest) >= m and all(map(is_, rest[len(rest) - m:], self.fresh))
        extra = rest[:len(rest) - m] if with_fresh else rest
        trial = FillTrial(self, first, extra, [], with_fresh)
        return trial.pending, trial, trial.arrival

    def _predict(self, first_idx: np.ndarray, base_idx: np.ndarray, groups: list[np.ndarray],
                 with_fresh: bool) -> list[Prediction]:
        """The prediction of each candidate: first_idx, then base_idx + groups[c] and the fresh
        pieces if with_fresh. The candidates' placement orders are built together (the base
        and fresh pieces sorted once, each group merged in by length) and placed together by
        `predict_rounds`."""
        w, lengths = self.weights, self.lengths
        n_bins, cap = self.dp * self.n_micro, self.max_tokens
        n_rows = len(groups)
        # base and fresh longest first, base first among equal lengths (a stable sort of base + fresh)
        base_sorted = base_idx[argsort_descending(lengths[base_idx])]
        fresh_sorted = self._fresh_sorted if with_fresh else np.zeros(0, dtype=np.int64)
        at = np.searchsorted(-lengths[fresh_sorted], -lengths[base_sorted], side="left")
        common = np.insert(fresh_sorted, at, base_sorted)
        common_w = (float(w[first_idx].sum()) + float(w[base_idx].sum())
                    + (float(self._fresh_cum_w[-1]) if with_fresh else 0.0))
        common_tok = (int(lengths[first_idx].sum()) + int(lengths[base_idx].sum())
                      + (int(self._fresh_cum_tok[-1]) if with_fresh else 0))
        n_common = len(first_idx) + len(base_idx) + len(fresh_sorted)
        sizes = np.array([len(g) for g in groups], dtype=np.int64)
        width = int(sizes.max(initial=0))
        flat = np.concatenate(groups) if n_rows else np.zeros(0, dtype=np.int64)
        row = np.repeat(np.arange(n_rows), sizes)
        col = np.arange(len(flat)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        group_idx = np.zeros((n_rows, width), dtype=np.int64)
        group_idx[row, col] = flat
        in_group = np.arange(width)[None, :] < sizes[:, None]
        # each group longest first, stable: padding sorts last
        by_length = np.argsort(np.where(in_group, -lengths[group_idx], 1), axis=1, kind="stable")
        group_idx = np.take_along_axis(group_idx, by_length, axis=1)
        total_w = common_w + np.where(in_group, w[group_idx], 0.0).sum(axis=1)
        total_tok = common_tok + np.where(in_group, lengths[group_idx], 0).sum(axis=1)
        threshold = PREDICT_SHARE * total_w / n_bins
        # the common pieces any candidate places one by one (cost >= its threshold)
        common = common[w[common] >= threshold.min(initial=np.inf)]
        common_large = w[common][None, :] >= threshold[:, None]
        group_large = in_group & (w[group_idx] >= threshold[:, None])
        # merge key: common piece i -> 2i + 1; a group piece before the first common piece
        # shorter than it, after the base pieces of its length (before fresh ones of its length)
        ahead = np.searchsorted(-lengths[common], -lengths[group_idx], side="left")
        base_lengths = np.sort(lengths[base_idx])
        ahead += (np.searchsorted(base_lengths, lengths[group_idx], side="right")
                  - np.searchsorted(base_lengths, lengths[group_idx], side="left"))
        keys = np.concatenate([np.where(common_large, 2.0 * np.arange(len(common))[None, :] + 1.0, np.inf),
                               np.where(group_large, 2.0 * ahead + np.arange(width)[None, :] / (width + 1.0), np.inf)],
                              axis=1)
        pieces = np.concatenate([np.broadcast_to(common, (n_rows, len(common))), group_idx], axis=1)
        order = np.take_along_axis(pieces, np.argsort(keys, axis=1, kind="stable"), axis=1)
        n_rest = common_large.sum(axis=1) + group_large.sum(axis=1)
        index = np.concatenate([np.broadcast_to(first_idx, (n_rows, len(first_idx))), order], axis=1)
        n_items = len(first_idx) + n_rest
        real = np.arange(index.shape[1])[None, :] < n_items[:, None]
        large_w = np.where(real, w[index], 0.0)
        large_tok = np.where(real, lengths[index], 0)
        loads, toks, deferred = predict_rounds(large_w, large_tok, n_items, n_bins, cap)
        short_w = np.maximum(0.0, total_w - large_w.sum(axis=1))
        short_tok = total_tok - large_tok.sum(axis=1)
        short_deferred = np.maximum(0, short_tok - (cap - toks).sum(axis=1))
        per_token = np.divide(short_w, short_tok, out=np.zeros_like(short_w), where=short_tok > 0)
        predicted = water_levels(loads, short_w, (cap - toks) * per_token[:, None]) + self.bin_const
        deferred &= real
        deferred_tok = np.where(deferred, large_tok, 0).sum(axis=1) + short_deferred
        n_short = n_common + in_group.sum(axis=1) - n_items
        n_placed = n_items - deferred.sum(axis=1) + np.where(short_tok > short_deferred, n_short, 0)
        mean = predicted.mean(axis=1) if n_bins else np.zeros(n_rows)
        ratio = np.divide(predicted.max(axis=1, initial=0.0), mean, out=np.ones(n_rows), where=mean > 0)
        return [Prediction(predicted[c], int(deferred_tok[c]), index[c][deferred[c]], int(n_placed[c]), float(ratio[c]))
                for c in range(n_rows)]


class FillTrial:
    """A candidate step for "wlb_fill": the prediction the release policies read, and the
    packed plan (`plan()`, `micro_batches`, `loads`) of the candidate kept.

    Its pieces are `first` (placed first), `extra` and `group` (the held pieces the candidate
    takes, in this order) and, if with_fresh, the step's fresh documents; `with_groups`
    scores variants with another group in one `predict_rounds`."""

    def __init__(self, solver: FillStepSolver, first: list[HeldPiece], extra: list[HeldPiece],
                 group: list[HeldPiece], with_fresh: bool, prediction: Prediction | None = None,
                 indices: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None):
        self._solver = solver
        self._first, self._extra, self._group = first, extra, group
        self._with_fresh = with_fresh
        if prediction is not None:
            self._prediction = prediction
        if indices is not None:
            self._parts = indices

    @cached_property
    def _parts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The solver's indices of first, extra and group."""
        s = self._solver
        return s._indices(self._first), s._indices(self._extra), s._indices(self._group)

    @cached_property
    def pending(self) -> list[HeldPiece]:
        """Every piece of the candidate: first, extra, group, then the fresh ones."""
        return list(self._first) + list(self._extra) + list(self._group) + (list(self._solver.fresh)
                                                                             if self._with_fresh else [])

    @cached_property
    def _pending_idx(self) -> np.ndarray:
        return np.concatenate(list(self._parts) + ([self._solver._fresh_idx] if self._with_fresh else []))

    @property
    def arrival(self) -> np.ndarray:
        """Arrival step of each pending piece."""
        return self._solver.arrival[self._pending_idx]

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each pending piece (a PackPlan's `lengths`)."""
        return self._solver.lengths[self._pending_idx]

    @cached_property
    def _prediction(self) -> Prediction:
        first_idx, extra_idx, group_idx = self._parts
        return self._solver._predict(first_idx, extra_idx, [group_idx], self._with_fresh)[0]

    def with_groups(self, groups: list[list[HeldPiece]], account=None) -> list["FillTrial"]:
        """This candidate with each of `groups` added after its extra pieces (before the fresh
        ones), all scored in one `predict_rounds`; `account(n_candidates, n_pieces)`, if
        given, is told of them (the calibration meter counts them as packings)."""
        s = self._solver
        if account is not None and groups:
            account(len(groups), len(self.pending) + sum(map(len, groups)) // len(groups))
        first_idx, extra_idx, group_idx = self._parts
        base = self._extra + self._group
        base_idx = np.concatenate([extra_idx, group_idx])
        flat = s._indices(list(chain.from_iterable(groups)))
        ends = np.cumsum([len(group) for group in groups]).tolist()
        groups_idx = [flat[end - len(group):end] for group, end in zip(groups, ends)]
        predictions = s._predict(first_idx, base_idx, groups_idx, self._with_fresh)
        return [FillTrial(s, self._first, base, group, self._with_fresh, prediction, (first_idx, base_idx, idx))
                for group, prediction, idx in zip(groups, predictions, groups_idx)]

    @property
    def predicted_loads(self) -> np.ndarray:
        """Predicted seconds of each micro-batch (module docstring)."""
        return self._prediction.loads

    @property
    def imbalance(self) -> float:
        """Predicted max / mean load."""
        return self._prediction.imbalance

    @property
    def deferred_tokens(self) -> int:
        """Predicted tokens deferred."""
        return self._prediction.deferred_tokens

    @property
    def n_placed(self) -> int:
        """Predicted pieces placed (0: the step would train nothing)."""
        return self._prediction.n_placed

    def defers_any(self, pieces: list[HeldPiece]) -> bool:
        """Whether any of `pieces` is a large piece the prediction defers."""
        deferred = self._prediction.deferred_large
        if not len(pieces) or not len(deferred):
            return False
        return bool(np.isin(self._solver._indices(pieces), deferred).any())

    @cached_property
    def _plan(self) -> PackPlan:
        s, idx = self._solver, self._pending_idx
        n_bins = s.dp * s.n_micro
        problem = PackProblem(lengths=s.lengths[idx], weights=s.weights[idx], n_bins=n_bins,
                              max_tokens=s.max_tokens, carried=len(self._first), bin_const=s.bin_const)
        result = wlb_fill(problem)
        bins = [np.asarray(b, dtype=np.int64) for b in result.bins]
        loads = np.array([problem.weights[b].sum() + s.bin_const for b in bins], dtype=np.float64)
        info = SolveInfo(method=s.method, status="heuristic", objective=float(loads.max()) if len(loads) else 0.0,
                         extra=dict(result.extra, predicted_imbalance=self.imbalance))
        return PackPlan(doc_ids=s.ids[idx], lengths=s.lengths[idx], offsets=s.offsets[idx], micro_batches=tuple(bins),
                        replica_of=np.arange(n_bins, dtype=np.int64) // s.n_micro,
                        deferred=np.asarray(result.deferred, dtype=np.int64), loads=loads,
                        tokens=bin_tokens(problem.lengths, bins), n_micro=s.n_micro, dp=s.dp,
                        max_tokens=s.max_tokens, info=info)

    @property
    def micro_batches(self) -> tuple[np.ndarray, ...]:
        """Positions (in the pending list) of each micro-batch's pieces, as packed."""
        return self._plan.micro_batches

    @property
    def loads(self) -> np.ndarray:
        """Seconds of each micro-batch, as packed."""
        return self._plan.loads

    def plan(self) -> PackPlan:
        """The step packed by `wlb_fill` (`replica_of` is the plain split; the packer deals)."""
        return self._plan
