"""The certified imbalance-displacement frontier of a whole stream (issue 16): a MILP, solved
by HiGHS, that no outlier-delay heuristic can beat.

Given a stream of global batches, the model places every piece of every batch in a training
step and a micro-batch, and minimises the sum over steps of the largest micro-batch's forward
cost, subject to a budget on displacement per token (|training step - arrival step|,
token-weighted, the measure of `WLBPacker.stats()["displacement_per_token"]`):

- outliers (pieces >= `outlier_min` tokens) are whole: binary x[o, t, j] places outlier o in
  step t, micro-batch j, for t in its window [arrival - early, arrival + late];
- every shorter piece is divisible filler: continuous flows move its tokens to any step of
  the same window, where they spread over the micro-batches. Filler is priced per token at
  the lowest cost per token (forward seconds / tokens) of the pieces of its length class
  (`FILLER_CLASSES`), so every real plan maps to a model solution that costs no more than
  the plan: the optimum, and HiGHS's dual bound, are LOWER BOUNDS on the sum of maxima of
  every plan whose displacement is within the budget and the window, including plans that
  move short documents (e.g. release="group");
- token cap: outlier tokens + filler tokens <= max_tokens in every micro-batch;
- valid strengthening: M_t >= cost(o) whenever o is in step t; symmetry breaking: in step t,
  the r-th outlier (by index) that may use step t may use micro-batches 0..r only (relabel
  the micro-batches by their lowest outlier).

The steps run from 0 to n_steps - 1 + late (the drain of a stream fits in `late` steps).
Costs exclude the per-micro-batch constant (the same in every micro-batch of a step). The
bound is compared with a plan through the aggregate imbalance sum_t max_j cost_tj /
(sum_t mean_j cost_tj) = sum of maxima x N / total cost, which does not depend on how the
plan orders the stream (`aggregate_imbalance`).

`brute_force_frontier` solves tiny instances by enumerating every outlier placement and
solving the filler's LP for each: the independent reference of the tests.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .._optional import require

FILLER_CLASSES = (1, 256, 1024, 4096, 16384)
"""Lower edges (tokens) of the filler length classes; each class is priced at the lowest
forward cost per token of its pieces."""
_TOKEN_UNIT = 1024.0  # tokens enter the model in units of 1024 (conditioning only; exact)


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
    """(id, offset) of each outlier piece (to map a heuristic's plans onto the model)."""
    filler_tokens: np.ndarray
    """int64 [n_steps, n_classes]: filler tokens of each class arriving at each step."""
    class_density: np.ndarray
    """float64 [n_classes]: forward seconds per token charged to the filler of each class."""
    total_cost: float
    """Forward seconds of every piece of the stream (exact, not the filler's lower price)."""
    total_tokens: int
    n_micro: int
    max_tokens: int
    early: int
    late: int

    @property
    def n_steps(self) -> int:
        return int(self.filler_tokens.shape[0])

    @property
    def n_slots(self) -> int:
        """Training steps the model may use: n_steps + late."""
        return self.n_steps + self.late

    def window(self, arrival: int) -> range:
        return range(max(0, arrival - self.early), min(self.n_slots, arrival + self.late + 1))


def frontier_problem(batches, doc_cost: Callable[[np.ndarray], np.ndarray], n_micro: int, max_tokens: int, *,
                     outlier_min: int, early: int, late: int) -> FrontierProblem:
    """The frontier model's data for `batches` (a list of (pieces, ids, offsets), one per
    step), priced by `doc_cost` (lengths -> forward seconds of each piece, e.g.
    `lambda d: cost.doc_cost(d, "fwd")`; solvers take what they need as callables)."""
    lengths_all, arrivals_all, keys = [], [], []
    for s, batch in enumerate(batches):
        lengths_all.append(np.asarray(batch[0], dtype=np.int64))
        arrivals_all.append(np.full(len(batch[0]), s, dtype=np.int64))
        keys += list(zip(np.asarray(batch[1]).tolist(), np.asarray(batch[2]).tolist()))
    lengths = np.concatenate(lengths_all) if lengths_all else np.zeros(0, np.int64)
    arrivals = np.concatenate(arrivals_all) if arrivals_all else np.zeros(0, np.int64)
    if len(lengths) and lengths.max() > max_tokens:
        raise ValueError(f"a piece of {int(lengths.max())} tokens exceeds max_tokens={max_tokens}")
    doc_cost = np.asarray(doc_cost(lengths), dtype=np.float64) if len(lengths) else np.zeros(0)
    big = lengths >= outlier_min
    edges = np.asarray(FILLER_CLASSES, dtype=np.int64)
    cls = np.searchsorted(edges, lengths, side="right") - 1
    filler = np.zeros((len(batches), len(edges)), dtype=np.int64)
    density = np.zeros(len(edges))
    for c in range(len(edges)):
        mask = ~big & (cls == c)
        np.add.at(filler[:, c], arrivals[mask], lengths[mask])
        density[c] = float(np.min(doc_cost[mask] / lengths[mask])) if mask.any() else 0.0
    return FrontierProblem(outlier_length=lengths[big], outlier_arrival=arrivals[big], outlier_cost=doc_cost[big],
                           outlier_key=tuple(k for k, b in zip(keys, big.tolist()) if b),
                           filler_tokens=filler, class_density=density, total_cost=float(doc_cost.sum()),
                           total_tokens=int(lengths.sum()), n_micro=int(n_micro), max_tokens=int(max_tokens),
                           early=int(early), late=int(late))


@dataclass(frozen=True)
class FrontierResult:
    """One budget's solve: the best plan found and the proven bound (sums of maxima, in
    forward seconds), as aggregate imbalances too."""

    budget: float
    objective: float | None
    bound: float
    status: str
    seconds: float
    placement: np.ndarray | None
    """int64 [n_outliers, 2]: (step, micro-batch) of each outlier in the best plan, or None."""
    displacement_per_token: float | None
    """Of the best plan (outliers and filler flows)."""
    n_binaries: int


def aggregate_imbalance(sum_of_max: float, problem: FrontierProblem) -> float:
    """sum_t max_j cost_tj x N / total cost: the stream's imbalance as one ratio."""
    return sum_of_max * problem.n_micro / problem.total_cost if problem.total_cost > 0 else 1.0


class _Rows:
    """Sparse rows lower <= a.x <= upper, built row by row."""

    def __init__(self) -> None:
        self.start, self.index, self.value, self.lower, self.upper = [0], [], [], [], []

    def add(self, cols, vals, lower, upper) -> None:
        self.index.extend(int(c) for c in cols)
        self.value.extend(float(v) for v in vals)
        self.start.append(len(self.index))
        self.lower.append(float(lower))
        self.upper.append(float(upper))


def _build(problem: FrontierProblem, budget: float, fixed: dict[int, tuple[int, int]] | None = None,
           integral: bool = True):
    """The HighsLp of the model; `fixed` pins outliers to (step, micro-batch) (brute force)."""
    highspy = require("highspy", "exact")
    P, N, T = problem, problem.n_micro, problem.n_slots
    unit = _TOKEN_UNIT
    cost_scale = 1.0 / max(P.total_cost / max(P.n_steps, 1) / N, 1e-30)  # a fair share ~ 1
    col_cost, col_lo, col_hi, integ = [], [], [], []

    def new(obj=0.0, lo=0.0, hi=np.inf, kind=0):
        col_cost.append(obj)
        col_lo.append(lo)
        col_hi.append(hi)
        integ.append(kind)
        return len(col_cost) - 1

    M = [new(1.0) for _ in range(T)]  # scaled largest micro-batch cost of each step
    x: dict[tuple[int, int, int], int] = {}
    eligible_rank: dict[int, int] = {}
    for o in range(len(P.outlier_length)):
        for t in P.window(int(P.outlier_arrival[o])):
            r = eligible_rank.get(t, 0)
            eligible_rank[t] = r + 1
            if fixed is not None:  # brute force: any micro-batch (no symmetry breaking)
                if fixed[o][0] == t:
                    x[o, t, fixed[o][1]] = new(0.0, 0.0, 1.0, 0)
                continue
            for j in range(min(N, r + 1)):
                x[o, t, j] = new(0.0, 0.0, 1.0, 1 if integral else 0)
    n_classes = P.filler_tokens.shape[1]
    y = {(t, j, c): new() for t in range(T) for j in range(N) for c in range(n_classes)}
    f = {}
    for s in range(P.n_steps):
        for c in range(n_classes):
            if P.filler_tokens[s, c] > 0:
                for t in P.window(s):
                    f[s, c, t] = new()
    rows = _Rows()
    for o in range(len(P.outlier_length)):
        cols = [v for (oo, _, _), v in x.items() if oo == o]
        rows.add(cols, [1.0] * len(cols), 1.0, 1.0)
    for s in range(P.n_steps):
        for c in range(n_classes):
            if P.filler_tokens[s, c] > 0:
                cols = [f[s, c, t] for t in P.window(s)]
                tok = P.filler_tokens[s, c] / unit
                rows.add(cols, [1.0] * len(cols), tok, tok)
    inflow: dict[tuple[int, int], list[int]] = {}
    for (s, c, t), v in f.items():
        inflow.setdefault((t, c), []).append(v)
    for t in range(T):
        for c in range(n_classes):
            cols = [y[t, j, c] for j in range(N)] + inflow.get((t, c), [])
            rows.add(cols, [1.0] * N + [-1.0] * (len(cols) - N), 0.0, 0.0)
    by_slot: dict[tuple[int, int], list[tuple[int, int]]] = {}
    by_step: dict[tuple[int, int], list[int]] = {}
    for (o, t, j), v in x.items():
        by_slot.setdefault((t, j), []).append((o, v))
        by_step.setdefault((o, t), []).append(v)
    for t in range(T):
        for j in range(N):
            outs = by_slot.get((t, j), [])
            ys = [y[t, j, c] for c in range(n_classes)]
            rows.add([v for _, v in outs] + ys, [P.outlier_length[o] / unit for o, _ in outs] + [1.0] * n_classes,
                     -np.inf, P.max_tokens / unit)
            rows.add([v for _, v in outs] + ys + [M[t]],
                     [P.outlier_cost[o] * cost_scale for o, _ in outs]
                     + [P.class_density[c] * unit * cost_scale for c in range(n_classes)] + [-1.0], -np.inf, 0.0)
    for (o, t), cols in by_step.items():  # M_t >= cost(o) if o trains in step t
        rows.add(cols + [M[t]], [P.outlier_cost[o] * cost_scale] * len(cols) + [-1.0], -np.inf, 0.0)
    disp_cols, disp_vals = [], []
    for (o, t, j), v in x.items():
        d = abs(t - int(P.outlier_arrival[o]))
        if d:
            disp_cols.append(v)
            disp_vals.append(d * P.outlier_length[o] / unit)
    for (s, c, t), v in f.items():
        if t != s:
            disp_cols.append(v)
            disp_vals.append(abs(t - s))
    rows.add(disp_cols, disp_vals, -np.inf, budget * P.total_tokens / unit)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(col_cost), len(rows.lower)
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = col_cost, col_lo, col_hi
    lp.row_lower_, lp.row_upper_ = rows.lower, rows.upper
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = rows.start, rows.index, rows.value
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = lp.num_col_, lp.num_row_
    if integral and x:
        lp.integrality_ = [highspy.HighsVarType.kInteger if k else highspy.HighsVarType.kContinuous for k in integ]
    return lp, dict(M=M, x=x, y=y, f=f, scale=cost_scale, disp=(disp_cols, disp_vals))


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
        if values:
            sol = highspy.HighsSolution()
            sol.col_value = list(values)
            sol.value_valid = True
            h.setSolution(sol)
    h.run()
    return h


def placement_of(problem: FrontierProblem, plans) -> np.ndarray | None:
    """(step, micro-batch) of each outlier in a heuristic's `plans` (every plan of a stream,
    `plan.step` set), micro-batches of a step relabelled by their lowest outlier index (the
    model's symmetry breaking); None if an outlier is missing or outside its window."""
    where = {}
    for plan in plans:
        for j, mb in enumerate(plan.micro_batches):
            for i in mb.tolist():
                where[int(plan.doc_ids[i]), int(plan.offsets[i])] = (int(plan.step), j)
    out = np.zeros((len(problem.outlier_key), 2), dtype=np.int64)
    for o, key in enumerate(problem.outlier_key):
        if key not in where or where[key][0] not in problem.window(int(problem.outlier_arrival[o])):
            return None
        out[o] = where[key]
    for t in np.unique(out[:, 0]):
        rows = np.flatnonzero(out[:, 0] == t)
        lowest = {}
        for o in rows:  # rows ascend, so the first seen is the lowest index of its micro-batch
            lowest.setdefault(int(out[o, 1]), int(o))
        relabel = {j: r for r, j in enumerate(sorted(lowest, key=lowest.get))}
        out[rows, 1] = [relabel[int(j)] for j in out[rows, 1]]
    return out


def _start_values(lp, idx, problem: FrontierProblem, placement: np.ndarray, budget: float) -> list[float]:
    """A MIP start: the outliers where `placement` puts them, the filler solved as an LP
    within `budget` ([] if that is infeasible)."""
    fixed_lp, fixed_idx = _build(problem, budget, fixed={o: (int(t), int(j)) for o, (t, j) in enumerate(placement)},
                                 integral=False)
    h = _run(fixed_lp, None, 1)
    values = np.zeros(lp.num_col_)
    if h.modelStatusToString(h.getModelStatus()) != "Optimal":
        return []
    got = np.asarray(h.getSolution().col_value)
    for key in ("M",):
        values[idx[key]] = got[fixed_idx[key]]
    for k, v in idx["x"].items():
        values[v] = 1.0 if k in fixed_idx["x"] else 0.0
    for name in ("y", "f"):
        for k, v in idx[name].items():
            values[v] = got[fixed_idx[name][k]]
    return values.tolist()


def solve_frontier(problem: FrontierProblem, budget: float, time_limit: float = 60.0, threads: int = 1,
                   starts=()) -> FrontierResult:
    """Minimise the sum of maxima within `budget` displacement per token; the best plan found
    and HiGHS's proven bound (sums of forward seconds). `starts`: outlier placements (from
    `placement_of`) tried as MIP starts (the filler's best response is solved for each; one
    over the budget is rejected by HiGHS)."""
    if not (budget >= 0 and np.isfinite(budget)):
        raise ValueError(f"budget must be a finite displacement per token >= 0, got {budget!r}")
    t0 = time.perf_counter()
    lp, idx = _build(problem, budget)
    h = _run(lp, time_limit, threads, starts=[_start_values(lp, idx, problem, p, budget) for p in starts if p is not None])
    info, status = h.getInfo(), h.modelStatusToString(h.getModelStatus())
    scale = idx["scale"]
    has_x = bool(idx["x"])
    bound = (info.mip_dual_bound if has_x else info.objective_function_value) / scale
    placement = displacement = objective = None
    if info.primal_solution_status == 2:  # feasible
        values = np.asarray(h.getSolution().col_value)
        objective = float(sum(values[m] for m in idx["M"])) / scale
        placement = np.zeros((len(problem.outlier_length), 2), dtype=np.int64)
        for (o, t, j), v in idx["x"].items():
            if values[v] > 0.5:
                placement[o] = (t, j)
        cols, vals = idx["disp"]
        displacement = float(np.dot(values[cols], vals)) * _TOKEN_UNIT / problem.total_tokens if cols else 0.0
    if status == "Infeasible":
        bound = np.inf
    return FrontierResult(budget=float(budget), objective=objective, bound=float(min(bound, objective or np.inf)),
                          status=status, seconds=time.perf_counter() - t0, placement=placement,
                          displacement_per_token=displacement, n_binaries=len(idx["x"]))


def brute_force_frontier(problem: FrontierProblem, budget: float) -> float:
    """The model's optimum on a tiny instance, by enumeration: every (step, micro-batch) of
    every outlier, the filler's LP solved for each; inf if no placement fits the budget."""
    P = problem
    choices = [[(t, j) for t in P.window(int(a)) for j in range(P.n_micro)] for a in P.outlier_arrival]
    best = np.inf
    for combo in itertools.product(*choices):
        lp, idx = _build(P, budget, fixed=dict(enumerate(combo)), integral=False)
        h = _run(lp, None, 1)
        if h.modelStatusToString(h.getModelStatus()) == "Optimal":
            best = min(best, h.getInfo().objective_function_value / idx["scale"])
    return float(best)
