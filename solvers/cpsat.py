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

The phases themselves (time split, skipping phase 2 when the start meets the bound, the
fallback to the start, the status words) are exact_common.solve_lex; this file supplies the
CP-SAT model (`_Model`, a LexModel) and its bound: the solver's best objective bound / scale,
never below the float bound of bounds.py.

Options (PackProblem.options, see exact_common.ExactOptions): allow_defer, deterministic (one
worker, `max_deterministic_time` = time_limit), hint, num_workers, gap_limit, phase1_share.
"""
from __future__ import annotations

import time

import numpy as np

from .._optional import require
from .bounds import integer_makespan_lower_bound, placed_load_bound
from .exact_common import ExactData, LexPlan, PhaseSolve, PlanSource, prepare, read_assignment, solve_lex, variable_rows
from .problem import PackProblem, PackResult

SCALE_TARGET = 1e7
"""Integer units of the start plan's largest bin (without bin_const)."""


class _Model:
    """The CP-SAT model of one instance; built once, solved in one or two phases (LexModel)."""

    name = "cpsat"

    def __init__(self, cp_model, data: ExactData, scale: float):
        p = data.problem
        self.cp_model = cp_model
        self.data = data
        self.scale = scale
        self.w_int = np.floor(p.weights * scale).astype(np.int64)
        self.model = cp_model.CpModel()
        model = self.model
        m, cap = p.n_bins, int(p.max_tokens)
        lengths = p.lengths.tolist()
        w = self.w_int.tolist()
        # variables
        self.x = variable_rows(data, lambda i, b: model.new_bool_var(f"x{i}_{b}"))
        # constraints
        per_bin_w: list[list] = [[] for _ in range(m)]
        per_bin_l: list[list] = [[] for _ in range(m)]
        per_bin_v: list[list] = [[] for _ in range(m)]
        placed_terms_v, placed_terms_c = [], []
        for i, row in enumerate(self.x):
            if not row:
                continue
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
        self.T = None

    # ---------------------------------------------------------------- LexModel
    def maximize_placed(self, start: np.ndarray | None, time_limit: float) -> PhaseSolve:
        self.model.maximize(self.placed)
        if start is not None:
            self._hint(start)
        run = self._solve(time_limit)
        self.model.clear_objective()
        return run

    def add_makespan(self, placed_tokens: int, start: np.ndarray | None) -> tuple[float, float]:
        p, m, w_int = self.data.problem, self.data.problem.n_bins, self.w_int
        if self.data.options.allow_defer:
            self.model.add(self.placed >= placed_tokens)
            # The bound on floored integer costs, computed on those integers (a float bound scaled
            # up would not be valid for them).
            lb = int(np.ceil(placed_load_bound(p.lengths, w_int.astype(np.float64), m, placed_tokens) - 1e-6))
        else:
            lb = integer_makespan_lower_bound(w_int, m)
        ub = max(int(w_int[start == b].sum()) for b in range(m)) if start is not None else int(w_int.sum())
        lb = max(0, min(lb, ub))
        self.T = self.model.new_int_var(lb, max(lb, ub), "T")
        for load in self.loads:
            self.model.add(self.T >= load)
        self.model.minimize(self.T)
        if start is not None:
            self._hint(start)
        return lb, ub

    def minimize_makespan(self, start: np.ndarray | None, time_limit: float) -> PhaseSolve:
        return self._solve(time_limit)

    def bound(self, plan: LexPlan) -> tuple[float, str]:
        # bound / scale is valid in seconds: flooring never overstates a cost.
        bound_int = int(plan.phase2.bound) if plan.source is PlanSource.SOLVER else plan.lower
        p = self.data.problem
        return max(bound_int / self.scale + p.bin_const, self.data.lower_bound(plan.placed_tokens)), ""

    # ---------------------------------------------------------------- helpers
    def _hint(self, assign: np.ndarray) -> None:
        self.model.clear_hints()
        for i, row in enumerate(self.x):
            for b, v in enumerate(row):
                self.model.add_hint(v, int(assign[i] == b))
        if self.T is not None:
            loads = [int(self.w_int[assign == b].sum()) for b in range(self.data.problem.n_bins)]
            self.model.add_hint(self.T, max(loads) if loads else 0)

    def _solve(self, time_limit: float) -> PhaseSolve:
        """Solve the model as it stands (objective and hint set by the phase)."""
        cp_model, opts, seed = self.cp_model, self.data.options, self.data.problem.seed
        solver = cp_model.CpSolver()
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
        dt = time.perf_counter() - t0
        if status == cp_model.MODEL_INVALID:  # our model is valid by construction: its parameters are not
            raise ValueError(f"CP-SAT refused its parameters (num_workers={prm.num_workers}, random_seed="
                             f"{prm.random_seed}, max_time_in_seconds={prm.max_time_in_seconds}): "
                             f"{solver.solution_info() or 'model invalid'}")
        found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
        return PhaseSolve(status=solver.status_name(status).lower(),
                          assign=read_assignment(self.x, solver.boolean_value) if found else None,
                          proven=status == cp_model.OPTIMAL, infeasible=status == cp_model.INFEASIBLE,
                          bound=float(solver.best_objective_bound) if found else None, solve_s=dt)


def solve(problem: PackProblem) -> PackResult:
    """Solve Eq. 2 (Eq. 1 with max_tokens = window) exactly, or to the time limit."""
    cp_model = require("ortools.sat.python.cp_model", "method='cpsat'")
    t_build = time.perf_counter()
    data = prepare(problem)
    ref = data.reference_cost()
    scale = SCALE_TARGET / ref if ref > 0 else 1.0
    model = _Model(cp_model, data, scale)
    return solve_lex(data, model, scale=scale, build_s=time.perf_counter() - t_build,
                     extra={"num_workers": data.options.workers()})
