"""`method="cpsat"`: the paper's packing ILPs (Eq. 1 / Eq. 2) in OR-Tools CP-SAT.

Model (d-krupke/cpsat-primer order: data, variables, constraints, objective, solve, read):
- data: integer costs w_i = floor(weight_i * scale), scale = 1e7 / (start makespan), so the
  integer optimum is within (items per bin) / 1e7 of the float one, and bound / scale is a
  valid lower bound in seconds (floor never overstates a cost);
- variables: Booleans x[i, b] only for b <= rank(i) (symmetry breaking, see exact_common), an
  integer makespan T with domain [lower bound, start makespan];
- constraints: each item exactly once (at most once with allow_defer, except carried items),
  tokens per bin <= max_tokens, T >= load_b;
- objective: minimise T; with allow_defer first maximise placed tokens (phase 1), then fix
  placed tokens >= the phase-1 value and minimise T (phase 2);
- the start plan (`wlb_ls`, or options["hint"]) is the solution hint of both phases.

Options (PackProblem.options, see exact_common.ExactOptions): allow_defer, deterministic (one
worker, `max_deterministic_time` = time_limit), hint, num_workers, gap_limit, phase1_share.
"""
from __future__ import annotations

import time

import numpy as np

from .._optional import require
from .bounds import integer_makespan_lower_bound, placed_load_bound
from .exact_common import ExactData, bins_to_assignment, plan_from_assignment, prepare, start_is_complete
from .problem import PackProblem, PackResult

SCALE_TARGET = 1e7
"""Integer units of the start plan's largest bin (without bin_const)."""


class _Model:
    """The CP-SAT model of one instance; built once, solved in one or two phases."""

    def __init__(self, cp_model, data: ExactData, w_int: np.ndarray):
        p = data.problem
        self.cp_model = cp_model
        self.data = data
        self.m = p.n_bins
        self.model = cp_model.CpModel()
        model = self.model
        n, m, cap = p.n_items, p.n_bins, int(p.max_tokens)
        lengths = p.lengths.tolist()
        w = w_int.tolist()
        # variables
        self.x: list[list] = []
        per_bin_w: list[list] = [[] for _ in range(m)]
        per_bin_l: list[list] = [[] for _ in range(m)]
        per_bin_v: list[list] = [[] for _ in range(m)]
        placed_terms_v, placed_terms_c = [], []
        for i in range(n):
            if lengths[i] > cap:
                self.x.append([])
                continue
            row = [model.new_bool_var(f"x{i}_{b}") for b in range(int(data.max_bin[i]) + 1)]
            self.x.append(row)
            if data.mandatory[i]:
                model.add_exactly_one(row)
            else:
                model.add_at_most_one(row)
            for b, v in enumerate(row):
                per_bin_v[b].append(v)
                per_bin_w[b].append(w[i])
                per_bin_l[b].append(lengths[i])
                placed_terms_v.append(v)
                placed_terms_c.append(lengths[i])
        self.placed = cp_model.LinearExpr.weighted_sum(placed_terms_v, placed_terms_c)
        self.loads = []
        for b in range(m):
            model.add(cp_model.LinearExpr.weighted_sum(per_bin_v[b], per_bin_l[b]) <= cap)
            self.loads.append(cp_model.LinearExpr.weighted_sum(per_bin_v[b], per_bin_w[b]))
        self.total_w = int(sum(w))
        self.T = None

    def add_makespan(self, lb: int, ub: int) -> None:
        self.T = self.model.new_int_var(lb, max(lb, ub), "T")
        for load in self.loads:
            self.model.add(self.T >= load)

    def hint(self, assign: np.ndarray, w_int: np.ndarray) -> None:
        self.model.clear_hints()
        for i, row in enumerate(self.x):
            for b, v in enumerate(row):
                self.model.add_hint(v, int(assign[i] == b))
        if self.T is not None:
            loads = [int(w_int[assign == b].sum()) for b in range(self.m)]
            self.model.add_hint(self.T, max(loads) if loads else 0)

    def solve(self, time_limit: float, opts, seed: int):
        solver = self.cp_model.CpSolver()
        prm = solver.parameters
        if opts.deterministic:
            prm.num_workers = 1
            prm.max_deterministic_time = float(time_limit)
            # Safety net only: a wall-clock stop would make the result depend on machine load.
            prm.max_time_in_seconds = max(60.0, 20.0 * float(time_limit))
        else:
            prm.num_workers = opts.workers()
            prm.max_time_in_seconds = float(time_limit)
        prm.random_seed = int(seed)
        prm.relative_gap_limit = float(opts.gap_limit)
        prm.log_search_progress = False
        t0 = time.perf_counter()
        status = solver.solve(self.model)
        return solver, status, time.perf_counter() - t0

    def read(self, solver) -> np.ndarray:
        assign = np.full(len(self.x), -1, dtype=np.int64)
        for i, row in enumerate(self.x):
            for b, v in enumerate(row):
                if solver.boolean_value(v):
                    assign[i] = b
                    break
        return assign


def solve(problem: PackProblem) -> PackResult:
    """Solve Eq. 2 (Eq. 1 with max_tokens = window) exactly, or to the time limit."""
    cp_model = require("ortools.sat.python.cp_model", "method='cpsat'")
    t_build = time.perf_counter()
    data = prepare(problem)
    p, opts = problem, data.options
    n, m = p.n_items, p.n_bins
    complete = start_is_complete(data)
    start_assign = bins_to_assignment(data.start.bins, n)
    start_w = p.loads(data.start.bins).max() - p.bin_const if m else 0.0
    total_w = float(p.weights.sum())
    ref = start_w if complete and start_w > 0 else total_w
    scale = SCALE_TARGET / ref if ref > 0 else 1.0
    w_int = np.floor(p.weights * scale).astype(np.int64)
    model = _Model(cp_model, data, w_int)
    build_s = time.perf_counter() - t_build
    solve_s = 0.0
    extra: dict = {"start": data.start.status, "start_objective": data.start_key[1],
                   "start_placed": -data.start_key[0], "num_workers": opts.workers()}

    # Phase 1 (allow_defer): maximise placed tokens, unless the start already places the maximum.
    placed_target = -data.start_key[0]
    phase1_status = "not needed"
    assign = start_assign if complete else None
    budget = float(p.time_limit)
    if opts.allow_defer and placed_target < data.placeable:
        model.model.maximize(model.placed)
        if assign is not None:
            model.hint(assign, w_int)
        limit1 = budget * opts.phase1_share
        solver, status, dt = model.solve(limit1, opts, p.seed)
        solve_s += dt
        budget = max(budget - dt, 0.05 * float(p.time_limit))
        phase1_status = solver.status_name(status).lower()
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            cand = model.read(solver)
            got = int(p.lengths[cand >= 0].sum())
            if got > placed_target or assign is None:
                assign, placed_target = cand, got
        extra["phase1_bound_tokens"] = min(data.placeable, int(solver.best_objective_bound)) if status in (
            cp_model.OPTIMAL, cp_model.FEASIBLE) else data.placeable
        model.model.clear_objective()
        placed_proven = status == cp_model.OPTIMAL
    else:
        placed_proven = True
    extra["phase1"] = phase1_status

    # Phase 2: minimise the largest load among plans placing >= placed_target tokens.
    t1 = time.perf_counter()
    if opts.allow_defer:
        model.model.add(model.placed >= placed_target)
        # The bound on floored integer costs, computed on those integers (a float bound scaled
        # up would not be valid for them).
        lb_int = int(np.ceil(placed_load_bound(p.lengths, w_int.astype(np.float64), m, placed_target) - 1e-6))
    else:
        lb_int = integer_makespan_lower_bound(w_int, m)
    if assign is not None:
        ub_int = max(int(w_int[assign == b].sum()) for b in range(m))
    else:
        ub_int = int(w_int.sum())
    lb_int = max(0, min(lb_int, ub_int))
    model.add_makespan(lb_int, ub_int)
    model.model.minimize(model.T)
    if assign is not None:
        model.hint(assign, w_int)
    build_s += time.perf_counter() - t1
    if assign is not None and lb_int >= ub_int - opts.gap_limit * ub_int:
        # The start is within gap_limit of the lower bound: nothing left to prove.
        status_name, bound_int, sol = "optimal", lb_int, assign
        extra["phase2"] = "start meets the lower bound"
    else:
        solver, status, dt = model.solve(budget, opts, p.seed)
        solve_s += dt
        status_name = solver.status_name(status).lower()
        extra["phase2"] = status_name
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            sol = model.read(solver)
            bound_int = int(solver.best_objective_bound)
        elif assign is not None:
            sol, bound_int, status_name = assign, lb_int, "feasible (start; no better plan found in time)"
        else:
            raise ValueError(f"cpsat found no plan that places every document within time_limit={p.time_limit} s "
                             f"({status_name}); raise time_limit or pass allow_defer=True")
    bins, deferred = plan_from_assignment(data, sol, m, extra)

    bound = max(bound_int / scale + p.bin_const, data.lower_bound(placed_target))
    bound = min(bound, float(p.loads(bins).max()) if m else bound)  # float round-off only
    status = {"optimal": "optimal", "feasible": "feasible"}.get(status_name, status_name)
    if opts.allow_defer and not placed_proven:
        status += " (placed tokens not proven maximal)"
    return PackResult(bins=bins, deferred=deferred, status=status, bound=bound, scale=scale,
                      build_s=build_s, solve_s=solve_s, extra=extra)
