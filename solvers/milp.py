"""`method="milp"`: the packing ILPs in PuLP, with CBC (`backend="cbc"`, default) or HiGHS
(`backend="highs"`, in-process through highspy).

Same model as `cpsat.py` (see exact_common for symmetry breaking, the start and the options):
binary x[i, b] for b <= rank(i), continuous makespan T in [lower bound, start makespan],
exactly one bin per item (at most one with allow_defer, except carried items), tokens per bin
<= max_tokens, T >= load_b. Costs are divided by the start makespan (`scale` = 1 / that, in
units per second) so T is about 1 and solver tolerances mean the same on every instance; no
rounding, so the MILP optimum is the float optimum.

Bounds: HiGHS reports its MIP dual bound (`mip_dual_bound`), widened by a relative 1e-5: its
feasibility tolerance lets it prove a makespan a hair above the best plan's on near-tied
weights (and call that plan "optimal"). CBC through PuLP
exposes none: when CBC proves optimality the bound is objective x (1 - gap_limit) x (1 -
_CBC_REL_TOLERANCE); otherwise the bound is the one from `bounds.py`, and `status` says so.
CBC's "optimal" is optimal only up to its tolerances (the cutoff increment that prunes a
node unless it improves the incumbent by that much, the integrality tolerance): it was seen
reporting "optimal" 2e-5 above the optimum CP-SAT proved. So CBC runs with a tiny cutoff
increment, and the bound it implies is widened by a relative 1e-4 so that it stays a bound.
CBC's `status` is "Not Solved" when it stops on time with an incumbent; its `sol_status`
(integer feasible) is read as well.
The start is passed as a warm start to both (CBC: `warmStart`; HiGHS: `setSolution`), except
to CBC's phase 1: warm-started there, CBC was seen proving a plan that places fewer tokens
than the most.

The phases (time split, skipping phase 2 when the start meets the bound, the fallback to the
start) are exact_common.solve_lex; `_Phases` supplies the PuLP models, one per phase.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import warnings

import numpy as np

from .._optional import require
from .exact_common import (ExactData, LexPlan, PhaseSolve, PlanSource, prepare, read_assignment, solve_lex,
                           variable_rows)
from .problem import PackProblem, PackResult

BACKENDS = ("cbc", "highs")
_CBC_REL_TOLERANCE = 1e-4
"""Relative slack between CBC's "optimal" objective and the bound it is taken to prove."""
_HIGHS_REL_TOLERANCE = 1e-5
"""Relative slack taken off HiGHS's MIP dual bound: its feasibility tolerance (1e-6 on the
scaled T >= load rows) lets it prove a makespan a hair above the best plan's, near-ties of
weights included, so the bound is widened to stay below every plan."""
_CBC_INCREMENT = 1e-9
"""CBC's cutoff increment on the scaled objective (T ~ 1); its default, 1e-4, prunes better
solutions closer than that to the incumbent."""


@contextlib.contextmanager
def _quiet_stdout():
    """HiGHS prints a banner from C on construction; keep benchmark tables clean."""
    try:
        fd = os.dup(1)
    except OSError:  # pragma: no cover - no real stdout
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(fd, 1)
        os.close(fd)


def _solver(pulp, backend: str, time_limit: float, data: ExactData, warm: bool):
    opts = data.options
    threads = opts.workers()
    if backend == "cbc":
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=float(time_limit), gapRel=opts.gap_limit, threads=threads,
                                 warmStart=warm, options=[f"randomSeed {int(data.problem.seed) + 1}", "preprocess off",
                                                          f"increment {_CBC_INCREMENT}"])

    class _HiGHSWarm(pulp.HiGHS):
        """pulp.HiGHS plus a warm start from the variables' initial values."""

        def callSolver(self, lp):
            if warm:
                values = [v.varValue if v.varValue is not None else 0.0 for v in lp.variables()]
                index = [v.index for v in lp.variables()]
                col = np.zeros(len(values))
                col[index] = values
                sol = highspy.HighsSolution()
                sol.col_value = col.tolist()
                sol.value_valid = True
                lp.solverModel.setSolution(sol)
            lp.solverModel.run()

    highspy = require("highspy", "method='milp' with backend='highs'")
    params = dict(random_seed=int(data.problem.seed))
    return _HiGHSWarm(msg=False, timeLimit=float(time_limit), gapRel=opts.gap_limit, threads=threads, **params)


class _Model:
    """One phase's PuLP model: the 0/1 variables, one bin per item, the token caps; the phase
    adds its objective."""

    def __init__(self, pulp, data: ExactData, wn: np.ndarray, sense):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # LpVariable(...) in PuLP 3.3
            self._build(pulp, data, wn, sense)

    def _build(self, pulp, data: ExactData, wn: np.ndarray, sense):
        p = data.problem
        m, cap = p.n_bins, int(p.max_tokens)
        self.prob = pulp.LpProblem("pack", sense)
        lengths = p.lengths.tolist()
        w = wn.tolist()
        self.x = variable_rows(data, lambda i, b: pulp.LpVariable(f"x{i}_{b}", cat="Binary"))
        per_bin_l: list[list] = [[] for _ in range(m)]
        per_bin_w: list[list] = [[] for _ in range(m)]
        placed = []
        for i, row in enumerate(self.x):
            if not row:
                continue
            one = pulp.LpAffineExpression([(v, 1) for v in row])
            self.prob += (one == 1) if data.mandatory[i] else (one <= 1), f"one_{i}"
            for b, v in enumerate(row):
                per_bin_l[b].append((v, lengths[i]))
                per_bin_w[b].append((v, w[i]))
                placed.append((v, lengths[i]))
        for b in range(m):
            self.prob += pulp.LpAffineExpression(per_bin_l[b]) <= cap, f"cap_{b}"
        self.loads = [pulp.LpAffineExpression(per_bin_w[b]) for b in range(m)]
        self.placed = pulp.LpAffineExpression(placed)

    def warm(self, assign: np.ndarray | None) -> None:
        if assign is None:
            return
        for i, row in enumerate(self.x):
            for b, v in enumerate(row):
                v.setInitialValue(1 if assign[i] == b else 0)

    def read(self) -> np.ndarray:
        return read_assignment(self.x, lambda v: v.varValue is not None and v.varValue > 0.5)


def _cbc_available(pulp) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(pulp.PULP_CBC_CMD().available())


class _Phases:
    """The LexModel of `solve_lex` for PuLP: a fresh `_Model` per phase, normalised costs
    wn = weights * scale."""

    def __init__(self, pulp, data: ExactData, backend: str, scale: float):
        self.pulp, self.data, self.backend, self.scale = pulp, data, backend, scale
        self.name = f"milp ({backend})"
        self.wn = data.problem.weights * scale
        self.model: _Model | None = None

    def maximize_placed(self, start: np.ndarray | None, time_limit: float) -> PhaseSolve:
        pulp = self.pulp
        model = _Model(pulp, self.data, self.wn, pulp.LpMaximize)
        model.prob += model.placed
        model.warm(start)
        # (HiGHS's MIP dual bound is read in phase 2 only: PuLP hands it this maximisation negated)
        # CBC, warm-started here with preprocessing off, was seen calling a plan "optimal" that
        # places fewer tokens than another; cold it found the most. The start stays the
        # fallback (solve_lex keeps whichever places more).
        run = self._solve(model, time_limit, start is not None and self.backend != "cbc")
        if run.proven and self.data.options.gap_limit == 0 and run.assign is not None:
            # no bound comes back through PuLP here, but a proven optimum of this integer
            # objective (tokens placed) is its own bound
            run = dataclasses.replace(run, bound=float(self.data.problem.lengths[run.assign >= 0].sum()))
        return run

    def add_makespan(self, placed_tokens: int, start: np.ndarray | None) -> tuple[float, float]:
        pulp, data, wn = self.pulp, self.data, self.wn
        p = data.problem
        model = self.model = _Model(pulp, data, wn, pulp.LpMinimize)
        lb = max(0.0, (data.lower_bound(placed_tokens) - p.bin_const) * self.scale)
        ub = max((float(wn[start == b].sum()) for b in range(p.n_bins)), default=0.0) if start is not None \
            else float(wn.sum())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            T = pulp.LpVariable("T", lowBound=min(lb, ub) * (1 - 1e-9), upBound=ub * (1 + 1e-6) + 1e-12)
        model.prob += T
        for b, load in enumerate(model.loads):
            model.prob += load - T <= 0, f"T_{b}"
        if data.options.allow_defer:
            model.prob += model.placed >= placed_tokens, "placed"
        model.warm(start)
        if start is not None:
            T.setInitialValue(ub)
        return lb, ub

    def minimize_makespan(self, start: np.ndarray | None, time_limit: float) -> PhaseSolve:
        return self._solve(self.model, time_limit, start is not None, dual_bound=self.backend == "highs")

    def bound(self, plan: LexPlan) -> tuple[float, str]:
        p = self.data.problem
        bound = self.data.lower_bound(plan.placed_tokens)
        if plan.source is PlanSource.START_MEETS_BOUND:
            return bound, " (bound from bounds.py)"
        if self.backend == "highs":
            dual = plan.phase2.bound
            if dual is not None and np.isfinite(dual):
                return (max(bound, dual * (1 - _HIGHS_REL_TOLERANCE) / self.scale + p.bin_const),
                        " (bound: HiGHS mip_dual_bound, less its tolerance)")
            return bound, ""
        if plan.source is PlanSource.SOLVER and plan.phase2.proven:
            obj = float(p.loads(plan.bins).max() - p.bin_const)
            return max(bound, obj * (1.0 - self.data.options.gap_limit) * (1 - _CBC_REL_TOLERANCE) + p.bin_const), \
                " (bound: CBC optimality within gap_limit and CBC's tolerance)"
        return bound, " (bound from bounds.py: CBC through PuLP exposes none)"

    def _solve(self, model: _Model, time_limit: float, warm: bool, dual_bound: bool = False) -> PhaseSolve:
        """Run the backend on `model`; `dual_bound`: read HiGHS's MIP dual bound (CBC through
        PuLP reports none)."""
        pulp, prob = self.pulp, model.prob
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # PuLP 3.3 announces its 4.0 API
            solver = _solver(pulp, self.backend, time_limit, self.data, warm)
            t0 = time.perf_counter()
            with _quiet_stdout():
                prob.solve(solver)
            dt = time.perf_counter() - t0
        found = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
        dual = prob.solverModel.getInfo().mip_dual_bound if dual_bound else None
        return PhaseSolve(status=f"{pulp.LpStatus[prob.status]}/{pulp.LpSolution[prob.sol_status]}",
                          assign=model.read() if found else None, proven=prob.sol_status == pulp.LpSolutionOptimal,
                          infeasible=prob.status == pulp.LpStatusInfeasible, bound=dual, solve_s=dt)


def solve(problem: PackProblem) -> PackResult:
    """Solve Eq. 2 (Eq. 1 with max_tokens = window) with CBC or HiGHS through PuLP."""
    if problem.backend is not None and not isinstance(problem.backend, str):
        raise ValueError(f"milp backend must be one of {list(BACKENDS)}, got {problem.backend!r}")
    backend = (problem.backend or "cbc").lower()
    if backend not in BACKENDS:
        raise ValueError(f"unknown milp backend {problem.backend!r}; valid: {list(BACKENDS)}")
    pulp = require("pulp", "method='milp'")
    if backend == "highs":
        require("highspy", "method='milp' with backend='highs'")
    elif not _cbc_available(pulp):
        raise ImportError("method='milp' with backend='cbc' needs the CBC binary bundled with pulp<4; "
                          "install it with `pip install 'wlb-opt[exact]'` (or use backend='highs')")
    t_build = time.perf_counter()
    data = prepare(problem)
    ref = data.reference_cost()
    scale = 1.0 / ref if ref > 0 else 1.0
    return solve_lex(data, _Phases(pulp, data, backend, scale), scale=scale, build_s=time.perf_counter() - t_build,
                     extra={"backend": backend})
