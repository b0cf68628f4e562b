"""The certified imbalance-displacement frontier of a whole stream: a MILP, solved
by HiGHS, whose optimum (and HiGHS's dual bound) no plan within the displacement budget beats.

A plan places every piece of every global batch in a training step t and a micro-batch j,
at most `max_tokens` tokens per micro-batch; its objective is the sum over steps of the
largest micro-batch's forward cost, M_t = max_j cost_tj (the per-micro-batch constant left
out: it is the same in every micro-batch). Its displacement per token is the token-weighted
mean of |t - arrival step| over all pieces (`WLBPacker.stats()["displacement_per_token"]`).

The model is a relaxation of that problem, so its optimum is a LOWER BOUND on the objective
of every plan whose outliers train within their window [arrival - early, arrival + late] (in
steps 0 .. n_slots - 1) and whose displacement per token is within the budget -- including
plans that move short documents, and short documents placed late for lack of room:

- outliers (pieces >= `outlier_min` tokens) are whole: a binary z[o, t] per step of the
  window, sum_t z[o, t] = 1;
- the shorter pieces are filler in length classes (consecutive lengths whose cost per token
  differ by at most a factor `density_tolerance`; `filler_classes`). Filler is divisible and
  carries TWO conserved quantities, tokens and forward seconds: for each class, a chain of
  flows between neighbouring steps (forward t -> t+1, backward t+1 -> t) moves both; the
  filler of the class present at step t is the step's arrivals plus inflows minus outflows.
  Every flow and every present amount keeps cost / tokens within [lowest, highest] cost per
  token of the class's pieces. A real plan gives such a solution: the class-c pieces that
  cross the edge between t and t+1 forward (arrived at or before t, trained after t) are a
  set of class-c pieces, so their cost per token lies in the class's range, and likewise
  for the pieces present at step t; the total cost of the stream is conserved exactly;
- per step: tokens of the outliers in t + filler tokens present <= N x max_tokens; cost of
  the outliers in t + filler cost present <= N x M_t (the largest micro-batch is at least
  the mean); M_t >= cost(o) z[o, t] (a micro-batch holds its outlier whole); at most k x N
  outliers longer than max_tokens / (k + 1) (a micro-batch holds at most k of them);
- displacement: sum_o |t - a_o| len(o) z[o, t] + sum of the filler tokens on every edge
  (a piece moved by d steps crosses d edges) <= budget x total tokens;
- grouping cuts (`_grouping_cuts`, derived there): a big outlier either shares its step with
  others like it, which pushes filler out of the step (charged on the chain), or leaves
  micro-batches that filler cannot fill up to its cost. The LP alone spreads a big outlier
  over several steps, each seemingly balanced; these rows charge that, and branching does
  the rest.

The micro-batch of each outlier is relaxed away (only the step counts), the filler's window
too; both only weaken the bound, never invalidate it. `plan_solution` maps a heuristic's
plans onto the model's variables exactly (z, present filler, edge flows, M_t = the plan's
largest micro-batch) and `solution_violation` checks that mapped point against every row,
so "bound <= heuristic" is checked, not assumed; the mapped points are also HiGHS's MIP
starts. The bound is compared with a plan through the aggregate imbalance sum_t M_t x N /
total cost (`aggregate_imbalance`), which the model's cost conservation keeps >= 1.

`brute_force_frontier` solves tiny instances of the model by enumerating every outlier step
and solving the filler's LP for each; the tests also enumerate whole-piece plans directly
(an independent reference: the bound never exceeds their optimum).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .._optional import require

DENSITY_TOLERANCE = 1.2
"""Largest ratio of cost per token between two filler lengths of one class. Any value >= 1
gives a valid bound; finer classes give a tighter LP but a slower one, and within the
bench's time limits (40 s a budget, 200 steps) 1.2 (5 classes on the default stream) proved
more than 1.05 (19 classes): 1.16 against 1.04-1.10 at a budget of 0.1."""
_TOKEN_UNIT = 1024.0  # tokens enter the model in units of 1024 (conditioning only; exact)
_RATIO_SLACK = 1e-9  # the ratio rows are widened by this (relative) so exact plans stay feasible


def filler_classes(lengths: np.ndarray, density: np.ndarray, tolerance: float = DENSITY_TOLERANCE) -> np.ndarray:
    """Lower edges of the filler classes: consecutive distinct lengths, a new class whenever
    the class's highest and lowest cost per token would differ by more than `tolerance`."""
    if not tolerance >= 1.0:
        raise ValueError(f"density_tolerance must be >= 1, got {tolerance!r}")
    order = np.argsort(lengths, kind="stable")
    uniq, first = np.unique(np.asarray(lengths)[order], return_index=True)
    dens = np.asarray(density)[order][first]
    edges, lo, hi = [], np.inf, -np.inf
    for length, d in zip(uniq.tolist(), dens.tolist()):
        if not edges or max(hi, d) > tolerance * min(lo, d):
            edges.append(length)
            lo = hi = d
        else:
            lo, hi = min(lo, d), max(hi, d)
    return np.asarray(edges, dtype=np.int64)


@dataclass(frozen=True)
class FrontierProblem:
    """A stream reduced to what the frontier model needs (see the module docstring)."""

    outlier_length: np.ndarray
    """int64 tokens of each outlier piece."""
    outlier_arrival: np.ndarray
    """int64 arrival step of each outlier."""
    outlier_cost: np.ndarray
    """float64 forward seconds of each outlier (per-micro-batch constant excluded)."""
    outlier_key: tuple
    """(id, offset) of each outlier piece."""
    class_edges: np.ndarray
    """int64 lower edge (tokens) of each filler class."""
    filler_tokens: np.ndarray
    """int64 [n_steps, n_classes]: filler tokens of each class arriving at each step."""
    filler_cost: np.ndarray
    """float64 [n_steps, n_classes]: their forward seconds (exact)."""
    density_low: np.ndarray
    """float64 [n_classes]: lowest forward seconds per token of a piece of the class."""
    density_high: np.ndarray
    """float64 [n_classes]: highest."""
    pieces: dict
    """(id, offset) -> (length, arrival step, forward seconds) of every piece (to map plans
    onto the model)."""
    total_cost: float
    """Forward seconds of every piece of the stream."""
    total_tokens: int
    n_micro: int
    max_tokens: int
    early: int
    late: int
    n_slots: int
    """Training steps the model may use (0 .. n_slots - 1)."""

    @property
    def n_steps(self) -> int:
        return int(self.filler_tokens.shape[0])

    @property
    def n_classes(self) -> int:
        return int(len(self.class_edges))

    def window(self, arrival: int) -> range:
        return range(max(0, arrival - self.early), min(self.n_slots, arrival + self.late + 1))

    def filler_class(self, lengths) -> np.ndarray:
        return np.searchsorted(self.class_edges, np.asarray(lengths), side="right") - 1


def frontier_problem(batches, doc_cost: Callable[[np.ndarray], np.ndarray], n_micro: int, max_tokens: int, *,
                     outlier_min: int, early: int, late: int, n_slots: int | None = None,
                     density_tolerance: float = DENSITY_TOLERANCE) -> FrontierProblem:
    """The frontier model's data for `batches` (a list of (pieces, ids, offsets), one per
    step), priced by `doc_cost` (lengths -> forward seconds of each piece, e.g.
    `lambda d: cost.doc_cost(d, "fwd")`). `n_slots` defaults to len(batches) + late."""
    for name, value in (("n_micro", n_micro), ("max_tokens", max_tokens), ("outlier_min", outlier_min)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if int(early) != early or int(late) != late or early < 0 or late < 0:
        raise ValueError(f"early and late must be integers >= 0, got {early!r}, {late!r}")
    lengths_all, arrivals_all, keys = [], [], []
    for s, batch in enumerate(batches):
        lengths_all.append(np.asarray(batch[0], dtype=np.int64))
        arrivals_all.append(np.full(len(batch[0]), s, dtype=np.int64))
        keys += list(zip(np.asarray(batch[1]).tolist(), np.asarray(batch[2]).tolist()))
    lengths = np.concatenate(lengths_all) if lengths_all else np.zeros(0, np.int64)
    arrivals = np.concatenate(arrivals_all) if arrivals_all else np.zeros(0, np.int64)
    if len(lengths) and (lengths.max() > max_tokens or lengths.min() < 1):
        raise ValueError(f"pieces must have 1 .. max_tokens={max_tokens} tokens, got {int(lengths.min())} .. "
                         f"{int(lengths.max())}")
    if len(set(keys)) != len(keys):
        raise ValueError("every piece needs a distinct (id, offset)")
    costs = np.asarray(doc_cost(lengths), dtype=np.float64) if len(lengths) else np.zeros(0)
    big = lengths >= outlier_min
    edges = filler_classes(lengths[~big], costs[~big] / lengths[~big], density_tolerance) if (~big).any() else \
        np.zeros(0, np.int64)
    cls = np.searchsorted(edges, lengths, side="right") - 1
    n_steps, n_classes = len(batches), len(edges)
    tokens = np.zeros((n_steps, n_classes), dtype=np.int64)
    fcost = np.zeros((n_steps, n_classes))
    small = np.flatnonzero(~big)
    np.add.at(tokens, (arrivals[small], cls[small]), lengths[small])
    np.add.at(fcost, (arrivals[small], cls[small]), costs[small])
    dens = costs[small] / lengths[small]
    low = np.array([dens[cls[small] == c].min() for c in range(n_classes)])
    high = np.array([dens[cls[small] == c].max() for c in range(n_classes)])
    slots = n_steps + int(late) if n_slots is None else int(n_slots)
    if slots < n_steps:
        raise ValueError(f"n_slots must be >= the number of batches ({n_steps}), got {n_slots!r}")
    return FrontierProblem(outlier_length=lengths[big], outlier_arrival=arrivals[big], outlier_cost=costs[big],
                           outlier_key=tuple(k for k, b in zip(keys, big.tolist()) if b), class_edges=edges,
                           filler_tokens=tokens, filler_cost=fcost, density_low=low, density_high=high,
                           pieces={k: (int(n), int(a), float(c)) for k, n, a, c in
                                   zip(keys, lengths.tolist(), arrivals.tolist(), costs.tolist())},
                           total_cost=float(costs.sum()), total_tokens=int(lengths.sum()), n_micro=int(n_micro),
                           max_tokens=int(max_tokens), early=int(early), late=int(late), n_slots=slots)


@dataclass(frozen=True)
class FrontierResult:
    """One budget's solve: the best model solution found and the proven bound (sums of
    maxima, forward seconds)."""

    budget: float
    objective: float | None
    bound: float
    status: str
    seconds: float
    placement: np.ndarray | None
    """int64 [n_outliers]: training step of each outlier in the best solution, or None."""
    displacement_per_token: float | None
    """Of the best solution (outliers and filler flows)."""
    n_binaries: int
    values: np.ndarray | None = field(default=None, repr=False)
    """The best solution's column values: a MIP start for a larger budget (`starts`)."""


def aggregate_imbalance(sum_of_max: float, problem: FrontierProblem) -> float:
    """sum_t max_j cost_tj x N / total cost: the stream's imbalance as one ratio."""
    return sum_of_max * problem.n_micro / problem.total_cost if problem.total_cost > 0 else 1.0


class _Model:
    """Columns and sparse rows lower <= a.x <= upper of the frontier model."""

    def __init__(self) -> None:
        self.cost, self.lo, self.hi, self.integer = [], [], [], []
        self.start, self.index, self.value, self.row_lo, self.row_hi = [0], [], [], [], []

    def col(self, obj=0.0, lo=0.0, hi=np.inf, integer=False) -> int:
        self.cost.append(obj)
        self.lo.append(lo)
        self.hi.append(hi)
        self.integer.append(integer)
        return len(self.cost) - 1

    def row(self, cols, vals, lower, upper) -> None:
        self.index.extend(int(c) for c in cols)
        self.value.extend(float(v) for v in vals)
        self.start.append(len(self.index))
        self.row_lo.append(float(lower))
        self.row_hi.append(float(upper))


def _densities(problem: FrontierProblem) -> np.ndarray:
    """[n_classes, 2]: cost per token of the low and high part of each class, widened by
    `_RATIO_SLACK` so that the two differ and an exact plan stays feasible."""
    return np.stack([problem.density_low * (1 - _RATIO_SLACK), problem.density_high * (1 + _RATIO_SLACK)], axis=1)


GROUPING_LENGTHS = (0.75, 0.9, 1.0)
"""Shares of max_tokens / 1.25 (the window, in the usual setting) from which outliers are "big"
in the grouping cuts (see `_grouping_cuts`)."""
GROUPING_RATES = (0.5, 1.0, 2.0)
"""Multiples of the natural exchange rate between waste and filler displacement in those cuts."""


def _grouping_cuts(m: "_Model", P: FrontierProblem, z, in_step, present, fwd, bwd, M, density, scale) -> None:
    """Valid inequalities that price a big outlier wherever it trains: alone it wastes the
    micro-batches that filler cannot fill, grouped it pushes filler out of its step.

    For a step t and a set B of big outliers (length >= L_B, cost >= c_B, at most one per
    micro-batch: L_B > max_tokens / 2), let k = the number of B in t. The micro-batches
    without one (at least N - k) cost at most max_tokens x d_f (d_f = the highest filler cost
    per token) plus the excess e_o = cost(o) - d_f len(o) of the other outliers in them, and
    each is at most M_t, so the waste N M_t - cost_t >= (N - k)(c_B - d_f max_tokens) - sum
    e_o z[o, t]. The filler present at t is at most N max_tokens - k L_B, so the filler that
    leaves t (its outflow on the chain, charged to the displacement) is at least
    k L_B - (N max_tokens - A_t), A_t the filler arriving at t. Hence for any rate mu >= 0:
        N M_t - cost_t + sum_{o not in B} e_o z[o, t] + mu outflow_t >= alpha sum_{o in B} z[o, t],
    alpha = min over k = 1..N of [(N - k) delta + mu max(0, k L_B - r_t)] / k, which holds for
    k = 0 too. The model's LP alone would spread a big outlier over several steps, each
    seemingly balanced, with no filler moved; these rows charge it.
    """
    N, T, cap, unit = P.n_micro, P.n_slots, P.max_tokens, _TOKEN_UNIT
    if not len(P.outlier_length) or not P.n_classes:
        return
    d_f = float(P.density_high.max())
    excess = np.maximum(P.outlier_cost - d_f * P.outlier_length, 0.0) * scale
    window = cap / 1.25
    C = P.n_classes
    for share in GROUPING_LENGTHS:
        big = P.outlier_length >= max(share * window, cap // 2 + 1)
        if not big.any():
            continue
        L_B, c_B = float(P.outlier_length[big].min()), float(P.outlier_cost[big].min())
        delta = (c_B - d_f * cap) * scale
        if delta <= 0:
            continue
        rate0 = delta / (L_B / unit)  # waste of one empty micro-batch per token unit of a big outlier
        for t in range(T):
            outs = in_step.get(t, [])
            if not any(big[o] for o in outs):
                continue
            arrived = float(P.filler_tokens[t].sum()) if t < P.n_steps else 0.0
            room = (N * cap - arrived) / unit
            outflow = [fwd[c, t, q] for c in range(C) for q in range(2) if (c, t, q) in fwd] + \
                [bwd[c, t - 1, q] for c in range(C) for q in range(2) if (c, t - 1, q) in bwd]
            for mult in GROUPING_RATES:
                mu = mult * rate0
                alpha = min(((N - k) * delta + mu * max(0.0, k * L_B / unit - room)) / k for k in range(1, N + 1))
                if alpha <= 1e-12:
                    continue
                coef = [-P.outlier_cost[o] * scale + (-alpha if big[o] else excess[o]) for o in outs]
                m.row([M[t]] + [z[o, t] for o in outs] + [present[c, t, q] for c in range(C) for q in range(2)]
                      + outflow, [float(N)] + coef + (-density).ravel().tolist() + [mu] * len(outflow), 0.0, np.inf)


def _build(problem: FrontierProblem, budget: float, fixed: dict[int, int] | None = None, integral: bool = True):
    """The model as a HighsLp and its column index; `fixed` pins outliers to steps."""
    P, N, T, unit = problem, problem.n_micro, problem.n_slots, _TOKEN_UNIT
    scale = 1.0 / max(P.total_cost / max(P.n_steps, 1) / N, 1e-30)  # a fair share of a step ~ 1
    m = _Model()
    M = [m.col(1.0) for _ in range(T)]
    z: dict[tuple[int, int], int] = {}
    for o in range(len(P.outlier_length)):
        steps = P.window(int(P.outlier_arrival[o])) if fixed is None else [fixed[o]]
        for t in steps:
            z[o, t] = m.col(0.0, 0.0, 1.0, integral and fixed is None)
    C = P.n_classes
    # Filler of class c as two parts, u at the class's lowest cost per token and v at its
    # highest: any (tokens, cost) with cost / tokens in that range is one such pair, so the
    # ratio needs no rows. Keys (c, t, part), part 0 = u, 1 = v.
    present = {(c, t, q): m.col() for c in range(C) for t in range(T) for q in range(2)}
    fwd = {(c, t, q): m.col() for c in range(C) for t in range(T - 1) for q in range(2)}  # t -> t+1
    # filler may train early whatever the outliers' window (`early` bounds the outliers only)
    bwd = {(c, t, q): m.col() for c in range(C) for t in range(T - 1) for q in range(2)}
    for o in range(len(P.outlier_length)):
        cols = [z[o, t] for t in range(T) if (o, t) in z]
        m.row(cols, [1.0] * len(cols), 1.0, 1.0)
    density = _densities(P) * unit * scale  # [C, 2] scaled cost of one token unit of u, v
    for c in range(C):
        for t in range(T):
            cols = [(present, t, 1.0)]
            if t + 1 < T:
                cols += [(fwd, t, 1.0), (bwd, t, -1.0)]
            if t > 0:
                cols += [(fwd, t - 1, -1.0), (bwd, t - 1, 1.0)]
            for quantity in range(2):  # tokens, cost: both conserved
                idx, vals = [], []
                for group, e, sgn in cols:
                    for q in range(2):
                        idx.append(group[c, e, q])
                        vals.append(sgn * (1.0 if quantity == 0 else density[c, q]))
                a = (P.filler_tokens[t, c] / unit if quantity == 0 else P.filler_cost[t, c] * scale) \
                    if t < P.n_steps else 0.0
                m.row(idx, vals, float(a), float(a))
    in_step: dict[int, list[int]] = {}
    for (o, t) in z:
        in_step.setdefault(t, []).append(o)
    cap = P.max_tokens
    for t in range(T):
        outs = in_step.get(t, [])
        parts = [present[c, t, q] for c in range(C) for q in range(2)]
        m.row([z[o, t] for o in outs] + parts, [P.outlier_length[o] / unit for o in outs] + [1.0] * len(parts),
              -np.inf, N * cap / unit)
        m.row([z[o, t] for o in outs] + parts + [M[t]],
              [P.outlier_cost[o] * scale for o in outs] + density.ravel().tolist() + [-float(N)], -np.inf, 0.0)
        for o in outs:
            m.row([M[t], z[o, t]], [1.0, -P.outlier_cost[o] * scale], 0.0, np.inf)
        k = 1
        while k * N < len(outs):  # a micro-batch holds at most k pieces longer than cap / (k + 1)
            long = [o for o in outs if P.outlier_length[o] * (k + 1) > cap]
            if len(long) > k * N:
                m.row([z[o, t] for o in long], [1.0] * len(long), -np.inf, float(k * N))
            k += 1
    _grouping_cuts(m, P, z, in_step, present, fwd, bwd, M, density, scale)
    disp_cols, disp_vals = [], []
    for (o, t), v in z.items():
        d = abs(t - int(P.outlier_arrival[o]))
        if d:
            disp_cols.append(v)
            disp_vals.append(d * P.outlier_length[o] / unit)
    for group in (fwd, bwd):
        for v in group.values():
            disp_cols.append(v)
            disp_vals.append(1.0)
    m.row(disp_cols, disp_vals, -np.inf, budget * P.total_tokens / unit)
    highspy = require("highspy", "exact")
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(m.cost), len(m.row_lo)
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = m.cost, m.lo, m.hi
    lp.row_lower_, lp.row_upper_ = m.row_lo, m.row_hi
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = m.start, m.index, m.value
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = lp.num_col_, lp.num_row_
    if any(m.integer):
        lp.integrality_ = [highspy.HighsVarType.kInteger if k else highspy.HighsVarType.kContinuous for k in m.integer]
    index = dict(M=M, z=z, present=present, fwd=fwd, bwd=bwd, scale=scale, densities=_densities(P), disp=(disp_cols, disp_vals), model=m)
    return lp, index


def _run(lp, time_limit: float | None, threads: int, starts=()):
    from .milp import _quiet_stdout

    highspy = require("highspy", "exact")
    with _quiet_stdout():
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", int(threads))
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("mip_rel_gap", 1e-4)
    if time_limit is not None:
        h.setOptionValue("time_limit", float(time_limit))
    h.passModel(lp)
    for values in starts:
        sol = highspy.HighsSolution()
        sol.col_value = list(values)
        sol.value_valid = True
        h.setSolution(sol)
    h.run()
    return h


@dataclass(frozen=True)
class PlanSolution:
    """A stream's plans as a point of the model (see `plan_solution`)."""

    placement: np.ndarray
    """int64 [n_outliers]: training step of each outlier."""
    step_max: np.ndarray
    """float64 [n_slots]: forward seconds of each step's largest micro-batch (constant excluded)."""
    present: np.ndarray
    """float64 [n_classes, n_slots, 2]: filler tokens and seconds trained in each step."""
    forward: np.ndarray
    """float64 [n_classes, n_slots - 1, 2]: filler tokens and seconds crossing t -> t+1 late."""
    backward: np.ndarray
    """float64 [n_classes, n_slots - 1, 2]: ... crossing t+1 -> t early."""
    displacement_per_token: float

    @property
    def sum_of_max(self) -> float:
        return float(self.step_max.sum())


def plan_solution(problem: FrontierProblem, plans) -> tuple[PlanSolution | None, str]:
    """Map a stream's `plans` (every plan, `plan.step` set, at most `max_tokens` tokens and
    `n_micro` micro-batches each) onto the model: (solution, "") or (None, why it does not
    fit: a piece missing, twice, unknown, an outlier outside its window, a step outside
    0 .. n_slots - 1, a micro-batch over the token cap)."""
    P, T = problem, problem.n_slots
    seen: set = set()
    placement = np.full(len(P.outlier_length), -1, dtype=np.int64)
    outlier_index = {k: o for o, k in enumerate(P.outlier_key)}
    step_max = np.zeros(T)
    present = np.zeros((P.n_classes, T, 2))
    late = np.zeros((P.n_classes, T + 1, 2))  # difference arrays of the edge flows
    early = np.zeros((P.n_classes, T + 1, 2))
    disp = 0
    for plan in plans:
        t = plan.step
        if t is None or not 0 <= int(t) < T:
            return None, f"a plan's step {t} is outside 0 .. {T - 1}"
        t = int(t)
        if len(plan.micro_batches) > P.n_micro:
            return None, f"step {t} has {len(plan.micro_batches)} micro-batches > n_micro={P.n_micro}"
        for mb in plan.micro_batches:
            mb_cost = 0.0
            mb_tokens = 0
            for i in mb.tolist():
                key = (int(plan.doc_ids[i]), int(plan.offsets[i]))
                if key not in P.pieces or key in seen or int(plan.lengths[i]) != P.pieces[key][0]:
                    return None, f"piece {key} is unknown, placed twice or of another length"
                seen.add(key)
                length, arrival, cost = P.pieces[key]
                mb_cost += cost
                mb_tokens += length
                disp += abs(t - arrival) * length
                if key in outlier_index:
                    o = outlier_index[key]
                    if t not in P.window(arrival):
                        return None, f"outlier {key} (arrival {arrival}) trains at step {t}, outside its window"
                    placement[o] = t
                    continue
                c = int(P.filler_class(length))
                present[c, t] += (length, cost)
                if t > arrival:
                    late[c, arrival] += (length, cost)
                    late[c, t] -= (length, cost)
                elif t < arrival:
                    early[c, t] += (length, cost)
                    early[c, arrival] -= (length, cost)
            if mb_tokens > P.max_tokens:
                return None, f"a micro-batch of step {t} holds {mb_tokens} > max_tokens={P.max_tokens} tokens"
            step_max[t] = max(step_max[t], mb_cost)
    if len(seen) != len(P.pieces):
        return None, f"{len(P.pieces) - len(seen)} pieces of the stream are not in the plans"
    return PlanSolution(placement=placement, step_max=step_max, present=present,
                        forward=np.cumsum(late, axis=1)[:, :T - 1], backward=np.cumsum(early, axis=1)[:, :T - 1],
                        displacement_per_token=disp / max(P.total_tokens, 1)), ""


def _values(index: dict, solution: PlanSolution, n_cols: int) -> np.ndarray:
    """The model's column values of `solution` (the layout of `_build`)."""
    values = np.zeros(n_cols)
    scale, unit = index["scale"], (1.0 / _TOKEN_UNIT)
    values[index["M"]] = solution.step_max * scale
    for (o, t), v in index["z"].items():
        values[v] = float(solution.placement[o] == t)
    low, high = index["densities"][:, 0], index["densities"][:, 1]
    for name, array in (("present", solution.present), ("fwd", solution.forward), ("bwd", solution.backward)):
        tokens, cost = array[..., 0], array[..., 1]
        u = np.clip((high[:, None] * tokens - cost) / (high - low)[:, None], 0.0, tokens)  # tokens at the low density
        for (c, t, q), v in index[name].items():
            values[v] = (u[c, t] if q == 0 else tokens[c, t] - u[c, t]) * unit
    return values


def solution_violation(problem: FrontierProblem, solution: PlanSolution, budget: float) -> float:
    """Largest violation of a row or column bound of the model at `solution` (in the model's
    units, a fair share of a step ~ 1; <= 1e-6 means feasible)."""
    lp, index = _build(problem, budget, integral=False)
    return _violation(index["model"], _values(index, solution, lp.num_col_))


def _violation(m: _Model, values: np.ndarray) -> float:
    start = np.asarray(m.start)
    rows = np.repeat(np.arange(len(m.row_lo)), np.diff(start))
    activity = np.bincount(rows, weights=np.asarray(m.value) * values[np.asarray(m.index, dtype=np.int64)],
                           minlength=len(m.row_lo))
    worst = max(0.0, float(np.max(np.asarray(m.row_lo) - activity, initial=0.0)),
                float(np.max(activity - np.asarray(m.row_hi), initial=0.0)))
    return max(worst, float(np.max(np.asarray(m.lo) - values, initial=0.0)),
               float(np.max(values - np.asarray(m.hi), initial=0.0)))


def solve_frontier(problem: FrontierProblem, budget: float, time_limit: float = 60.0, threads: int = 1,
                   starts=()) -> FrontierResult:
    """Minimise the sum of maxima within `budget` displacement per token: the best model
    solution and HiGHS's proven bound (sums of forward seconds). `starts`: MIP starts, each
    a `PlanSolution` (a heuristic's plans, from `plan_solution`) or the `values` of an earlier
    result on the same problem (a smaller budget's); those infeasible here are left out."""
    if not (budget >= 0 and np.isfinite(budget)):
        raise ValueError(f"budget must be a finite displacement per token >= 0, got {budget!r}")
    t0 = time.perf_counter()
    lp, idx = _build(problem, budget)
    points = [s if isinstance(s, np.ndarray) else _values(idx, s, lp.num_col_) for s in starts if s is not None]
    feasible = [v for v in points if len(v) == lp.num_col_ and _violation(idx["model"], v) <= 1e-6]
    objective_of = np.asarray(idx["model"].cost)
    best_start = [min(feasible, key=lambda v: float(objective_of @ v))] if feasible else []  # HiGHS keeps one start
    h = _run(lp, max(time_limit - (time.perf_counter() - t0), 1.0), threads, starts=best_start)
    info, status = h.getInfo(), h.modelStatusToString(h.getModelStatus())
    scale = idx["scale"]
    if idx["z"]:
        bound = info.mip_dual_bound / scale
    elif status == "Optimal":  # no outliers: the LP's optimum
        bound = info.objective_function_value / scale
    else:  # an LP stopped early proves nothing beyond the cost's conservation (aggregate 1)
        bound = problem.total_cost / problem.n_micro
    placement = displacement = objective = values = None
    if info.primal_solution_status == 2:  # feasible
        values = np.asarray(h.getSolution().col_value)
        objective = float(sum(values[m] for m in idx["M"])) / scale
        placement = np.full(len(problem.outlier_length), -1, dtype=np.int64)
        for (o, t), v in idx["z"].items():
            if values[v] > 0.5:
                placement[o] = t
        cols, vals = idx["disp"]
        displacement = float(np.dot(values[cols], vals)) * _TOKEN_UNIT / problem.total_tokens if cols else 0.0
    if status == "Infeasible":
        bound = np.inf
    if status != "Infeasible":  # the trivial bound (a maximum is at least the mean) holds without a dual bound
        bound = max(bound, problem.total_cost / problem.n_micro) if np.isfinite(bound) else \
            problem.total_cost / problem.n_micro
    return FrontierResult(budget=float(budget), objective=objective,
                          bound=float(max(min(bound, objective or np.inf), 0.0)), status=status,
                          seconds=time.perf_counter() - t0, placement=placement,
                          displacement_per_token=displacement, n_binaries=len(idx["z"]), values=values)


def brute_force_frontier(problem: FrontierProblem, budget: float) -> float:
    """The model's optimum on a tiny instance, by enumeration: every step of every outlier's
    window, the filler's LP solved for each; inf if no placement fits the budget."""
    P = problem
    best = np.inf
    for combo in itertools.product(*[P.window(int(a)) for a in P.outlier_arrival]):
        lp, idx = _build(P, budget, fixed=dict(enumerate(combo)), integral=False)
        h = _run(lp, None, 1)
        if h.modelStatusToString(h.getModelStatus()) == "Optimal":
            best = min(best, h.getInfo().objective_function_value / idx["scale"])
    return float(best)
