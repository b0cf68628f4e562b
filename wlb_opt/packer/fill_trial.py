"""One step's candidate packings for method "wlb_fill", scored without packing the short pieces.

`wlb_fill` (solvers/fill.py) places the large pieces of a step first and lets the short
ones fill the gaps they leave. A release candidate (a group of held outliers joining the
step) changes the large pieces, not the thousands of short ones, so `FillStepSolver` scores
a candidate from its large pieces alone:

- the placed-first pieces and every piece costing at least `PREDICT_SHARE` x the step's mean
  micro-batch cost are placed by Algorithm 1's rule, as `wlb_fill`'s first two phases place
  them (its descent and polish aside);
- the cheaper pieces are taken as a fluid: they raise the lightest micro-batches to the
  water level W that their total cost fills, each by at most what its token room holds at
  their mean cost per token (`water_level`), so micro-batch b is predicted at
  min(max(large_b, W), large_b + room_b); the short tokens beyond the token room the large
  pieces leave are predicted deferred.

The short pieces of a step are its fresh documents in every candidate: their costs are
sorted and summed once per step, and a candidate costs a heap pass over its large
pieces and a sort of dp x n_micro loads. `FillTrial` answers what the release policies read
(imbalance, deferred tokens, whether a piece is deferred, whether the step is idle) from
that prediction, and packs the candidate the step keeps with `wlb_fill` itself
(`FillTrial.plan`, also `micro_batches` and `loads`, which `MarginalRelease._trim` reads).
The predicted imbalance is what `wlb_fill` would reach if the short pieces filled the gaps
exactly; its descent and polish only lower the largest load.
"""
from __future__ import annotations

from functools import cached_property
from operator import is_

import numpy as np

from ..plan import PackPlan, SolveInfo, imbalance
from ..solvers.fill import fill_assign, wlb_fill
from ..solvers.greedy import argsort_descending, bin_tokens
from ..solvers.problem import PackProblem
from .state import HeldPiece
from .trial import StepSolver


def water_level(large_loads: np.ndarray, short_cost: float, room_cost: np.ndarray | None = None) -> np.ndarray:
    """The loads after a fluid of `short_cost` fills the lightest bins first: bin b rises to
    max(large_loads[b], W), at most by room_cost[b] (the cost its token room holds; None: no
    limit), with W chosen so that the rises add up to short_cost (or every bin full)."""
    loads = np.asarray(large_loads, dtype=np.float64)
    if not len(loads) or short_cost <= 0:
        return loads.copy()
    if room_cost is None:
        low = np.sort(loads)
        k = np.arange(1, len(low) + 1)
        level = (short_cost + np.cumsum(low)) / k
        ok = np.flatnonzero(level[:-1] <= low[1:])
        return np.maximum(loads, level[ok[0]] if len(ok) else level[-1])
    top = loads + room_cost
    if room_cost.sum() <= short_cost:
        return top
    points = np.sort(np.concatenate([loads, top]))
    filled = np.clip(points[:, None] - loads[None, :], 0.0, room_cost[None, :]).sum(axis=1)
    j = int(np.searchsorted(filled, short_cost, side="left"))  # filled[j - 1] < short_cost <= filled[j]
    lo, hi = points[j - 1], points[j]
    active = ((loads < hi) & (top > lo)).sum()  # bins rising between the two breakpoints
    level = lo + (short_cost - filled[j - 1]) / active if active else hi
    return np.minimum(np.maximum(loads, level), top)


PREDICT_SHARE = 0.02
"""Pieces costing at least this share of the step's mean micro-batch cost are placed one by
one in a prediction; the cheaper ones are taken as a fluid."""


class FillStepSolver(StepSolver):
    """`StepSolver` for method "wlb_fill": candidates scored from their large pieces
    (module docstring); same arguments."""

    def __init__(self, pieces: list[HeldPiece], weights: np.ndarray, fresh: list[HeldPiece], *, n_micro: int,
                 dp: int, max_tokens: int, bin_const: float, method: str = "wlb_fill"):
        super().__init__(pieces, weights, fresh, n_micro=n_micro, dp=dp, max_tokens=max_tokens,
                         bin_const=bin_const, method=method)
        idx = self._indices(fresh)
        by_length = idx[argsort_descending(self.lengths[idx])]  # cost grows with length: also by cost
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
        first_idx = self._indices(first)
        extra_idx = self._indices(extra)
        parts = [first_idx, extra_idx] + ([self._fresh_idx] if with_fresh else [])
        pending_idx = np.concatenate(parts) if len(parts) > 1 else first_idx
        pending = list(first) + list(rest)
        return pending, FillTrial(self, pending_idx, len(first), len(extra_idx), with_fresh), self.arrival[pending_idx]


class FillTrial:
    """A candidate step for "wlb_fill": the prediction the release policies read, and the
    packed plan (`plan()`, `micro_batches`, `loads`) of the candidate kept."""

    def __init__(self, solver: FillStepSolver, pending_idx: np.ndarray, n_first: int, n_extra: int,
                 with_fresh: bool):
        self._solver = solver
        self._pending_idx = pending_idx
        self._n_first = n_first
        self._n_extra = n_extra
        self._with_fresh = with_fresh

    @cached_property
    def _prediction(self):
        """(predicted loads, predicted deferred tokens, global indices of deferred large pieces,
        pieces placed)."""
        s = self._solver
        w, lengths = s.weights, s.lengths
        n_bins, cap = s.dp * s.n_micro, s.max_tokens
        first = self._pending_idx[:self._n_first]
        extra = self._pending_idx[self._n_first:self._n_first + self._n_extra]
        total_w = float(w[first].sum() + w[extra].sum()) + (s._fresh_cum_w[-1] if self._with_fresh else 0.0)
        total_tok = int(lengths[first].sum() + lengths[extra].sum()) + (int(s._fresh_cum_tok[-1])
                                                                          if self._with_fresh else 0)
        threshold = PREDICT_SHARE * total_w / n_bins
        extra_large = extra[w[extra] >= threshold]
        extra_large = extra_large[argsort_descending(lengths[extra_large])]
        if self._with_fresh:
            n_fresh_large = int(np.searchsorted(s._fresh_neg_w, -threshold, side="right"))
            fresh_large = s._fresh_sorted[:n_fresh_large]
            # extra before fresh among equal lengths (a stable sort of extra + fresh)
            at = np.searchsorted(-lengths[fresh_large], -lengths[extra_large], side="left")
            rest_large = np.insert(fresh_large, at, extra_large)
        else:
            rest_large = extra_large
        order = np.concatenate([first, rest_large])
        loads = np.zeros(n_bins, dtype=np.float64)
        toks = np.zeros(n_bins, dtype=np.int64)
        placed = fill_assign(np.arange(len(order)), lengths[order], w[order], loads, toks, cap)
        deferred_large = order[placed < 0]
        large_w = float(w[order].sum())
        large_tok = int(lengths[order].sum())
        short_w = max(0.0, total_w - large_w)
        short_tok = total_tok - large_tok
        room = cap - toks
        short_deferred = max(0, short_tok - int(room.sum()))
        per_token = short_w / short_tok if short_tok else 0.0
        predicted = water_level(loads, short_w, room * per_token) + s.bin_const
        n_placed = int((placed >= 0).sum()) + (len(self._pending_idx) - len(order) if short_tok > short_deferred else 0)
        return predicted, int(lengths[deferred_large].sum()) + short_deferred, deferred_large, n_placed

    @property
    def predicted_loads(self) -> np.ndarray:
        """Predicted seconds of each micro-batch (module docstring)."""
        return self._prediction[0]

    @cached_property
    def imbalance(self) -> float:
        """Predicted max / mean load."""
        return imbalance(self._prediction[0])

    @property
    def deferred_tokens(self) -> int:
        """Predicted tokens deferred."""
        return self._prediction[1]

    @property
    def n_placed(self) -> int:
        """Predicted pieces placed (0: the step would train nothing)."""
        return self._prediction[3]

    def defers_any(self, pieces: list[HeldPiece]) -> bool:
        """Whether any of `pieces` is a large piece the prediction defers."""
        deferred = self._prediction[2]
        if not len(pieces) or not len(deferred):
            return False
        return bool(np.isin(self._solver._indices(pieces), deferred).any())

    @cached_property
    def _plan(self) -> PackPlan:
        s, idx = self._solver, self._pending_idx
        n_bins = s.dp * s.n_micro
        problem = PackProblem(lengths=s.lengths[idx], weights=s.weights[idx], n_bins=n_bins,
                              max_tokens=s.max_tokens, carried=self._n_first, bin_const=s.bin_const)
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
