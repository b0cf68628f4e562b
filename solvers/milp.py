"""`method="milp"`: the packing ILPs in PuLP, with CBC (`backend="cbc"`, default) or HiGHS
(`backend="highs"`, in-process through highspy).

Same model as `cpsat.py` (see exact_common for symmetry breaking, the start and the options):
binary x[i, b] for b <= rank(i), continuous makespan T in [lower bound, start makespan],
exactly one bin per item (at most one with allow_defer, except carried items), tokens per bin
<= max_tokens, T >= load_b. Costs are divided by the start makespan (`scale` = 1 / that, in
units per second) so T is about 1 and solver tolerances mean the same on every instance; no
rounding, so the MILP optimum is the float optimum.

Bounds: HiGHS reports its MIP dual bound (`mip_dual_bound`), used directly. CBC through PuLP
exposes none: when CBC proves optimality the bound is objective x (1 - gap_limit); otherwise
the bound is the one from `bounds.py`, and `status` says so. CBC's `status` is "Not Solved"
when it stops on time with an incumbent; its `sol_status` (integer feasible) is read as well.
The start is passed as a warm start to both (CBC: `warmStart`; HiGHS: `setSolution`).
"""
from __future__ import annotations

import contextlib
import os
import time
import warnings

import numpy as np

from .._optional import require
from .exact_common import ExactData, bins_to_assignment, plan_from_assignment, prepare, start_is_complete
from .problem import PackProblem, PackResult

BACKENDS = ("cbc", "highs")


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
                                 warmStart=warm, options=[f"randomSeed {int(data.problem.seed) + 1}"])

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
    def __init__(self, pulp, data: ExactData, wn: np.ndarray, sense):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # LpVariable(...) in PuLP 3.3
            self._build(pulp, data, wn, sense)

    def _build(self, pulp, data: ExactData, wn: np.ndarray, sense):
        p = data.problem
        self.pulp, self.data = pulp, data
        n, m, cap = p.n_items, p.n_bins, int(p.max_tokens)
        self.prob = pulp.LpProblem("pack", sense)
        lengths = p.lengths.tolist()
        w = wn.tolist()
        self.x: list[list] = []
        per_bin_l: list[list] = [[] for _ in range(m)]
        per_bin_w: list[list] = [[] for _ in range(m)]
        placed = []
        for i in range(n):
            if lengths[i] > cap:
                self.x.append([])
                continue
            row = [pulp.LpVariable(f"x{i}_{b}", cat="Binary") for b in range(int(data.max_bin[i]) + 1)]
            self.x.append(row)
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
        assign = np.full(len(self.x), -1, dtype=np.int64)
        for i, row in enumerate(self.x):
            for b, v in enumerate(row):
                if v.varValue is not None and v.varValue > 0.5:
                    assign[i] = b
                    break
        return assign


def _cbc_available(pulp) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(pulp.PULP_CBC_CMD().available())


def _has_solution(pulp, prob) -> bool:
    return prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)


def _run(pulp, model: _Model, backend: str, time_limit: float, data: ExactData, warm: bool):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # PuLP 3.3 announces its 4.0 API
        solver = _solver(pulp, backend, time_limit, data, warm)
        t0 = time.perf_counter()
        with _quiet_stdout():
            model.prob.solve(solver)
    return time.perf_counter() - t0


def solve(problem: PackProblem) -> PackResult:
    """Solve Eq. 2 (Eq. 1 with max_tokens = window) with CBC or HiGHS through PuLP."""
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
    p, opts = problem, data.options
    n, m = p.n_items, p.n_bins
    complete = start_is_complete(data)
    assign = bins_to_assignment(data.start.bins, n) if complete else None
    start_w = float(p.loads(data.start.bins).max() - p.bin_const) if m else 0.0
    ref = start_w if complete and start_w > 0 else float(p.weights.sum())
    scale = 1.0 / ref if ref > 0 else 1.0
    wn = p.weights * scale
    build_s = time.perf_counter() - t_build
    solve_s = 0.0
    extra: dict = {"backend": backend, "start": data.start.status, "start_objective": data.start_key[1],
                   "start_placed": -data.start_key[0]}
    budget = float(p.time_limit)

    placed_target = -data.start_key[0]
    placed_proven = True
    if opts.allow_defer and placed_target < data.placeable:
        t0 = time.perf_counter()
        model = _Model(pulp, data, wn, pulp.LpMaximize)
        model.prob += model.placed
        model.warm(assign)
        build_s += time.perf_counter() - t0
        dt = _run(pulp, model, backend, budget * opts.phase1_share, data, assign is not None)
        solve_s += dt
        budget = max(budget - dt, 0.05 * float(p.time_limit))
        extra["phase1"] = f"{pulp.LpStatus[model.prob.status]}/{pulp.LpSolution[model.prob.sol_status]}"
        placed_proven = model.prob.sol_status == pulp.LpSolutionOptimal
        if _has_solution(pulp, model.prob):
            cand = model.read()
            got = int(p.lengths[cand >= 0].sum())
            if got > placed_target or assign is None:
                assign, placed_target = cand, got

    t0 = time.perf_counter()
    model = _Model(pulp, data, wn, pulp.LpMinimize)
    lb = max(0.0, (data.lower_bound(placed_target) - p.bin_const) * scale)
    ub = max((float(wn[assign == b].sum()) for b in range(m)), default=0.0) if assign is not None else float(wn.sum())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        T = pulp.LpVariable("T", lowBound=min(lb, ub) * (1 - 1e-9), upBound=ub * (1 + 1e-6) + 1e-12)
    model.prob += T
    for b, load in enumerate(model.loads):
        model.prob += load - T <= 0, f"T_{b}"
    if opts.allow_defer:
        model.prob += model.placed >= placed_target, "placed"
    model.warm(assign)
    if assign is not None:
        T.setInitialValue(ub)
    build_s += time.perf_counter() - t0
    prob = model.prob
    if assign is not None and ub - lb <= opts.gap_limit * ub:
        # The start meets the lower bound: nothing to prove (the primer: skip the solver).
        sol, status = assign, "optimal"
        extra["phase2"] = "start meets the lower bound"
    else:
        dt = _run(pulp, model, backend, budget, data, assign is not None)
        solve_s += dt
        extra["phase2"] = f"{pulp.LpStatus[prob.status]}/{pulp.LpSolution[prob.sol_status]}"
    if "phase2" in extra and extra["phase2"] == "start meets the lower bound":
        pass
    elif _has_solution(pulp, prob):
        sol = model.read()
        status = "optimal" if prob.sol_status == pulp.LpSolutionOptimal else "feasible"
    elif assign is not None:
        sol, status = assign, "feasible (start; no better plan found in time)"
    else:
        if prob.status == pulp.LpStatusInfeasible:
            raise ValueError(f"milp ({backend}) proved that no plan places every document in {m} micro-batches "
                             f"of max_tokens={p.max_tokens} (infeasible); pass allow_defer=True to defer some")
        raise ValueError(f"milp ({backend}) found no plan that places every document within "
                         f"time_limit={p.time_limit} s; raise time_limit or pass allow_defer=True")
    bins, deferred = plan_from_assignment(data, sol, m, extra)

    bound = data.lower_bound(placed_target)
    if extra["phase2"] == "start meets the lower bound":
        status += " (bound from bounds.py)"
    elif backend == "highs":
        dual = prob.solverModel.getInfo().mip_dual_bound
        if dual is not None and np.isfinite(dual):
            bound = max(bound, dual / scale + p.bin_const)
            status += " (bound: HiGHS mip_dual_bound)"
    elif status == "optimal":
        obj = float(p.loads(bins).max() - p.bin_const)
        bound = max(bound, obj * (1.0 - opts.gap_limit) * (1 - 1e-9) + p.bin_const)
        status += " (bound: CBC optimality within gap_limit)"
    else:
        status += " (bound from bounds.py: CBC through PuLP exposes none)"
    if opts.allow_defer and not placed_proven:
        status += " (placed tokens not proven maximal)"
    # Solver tolerances (1e-6 on T >= load) may put a dual bound a hair above the plan.
    bound = min(bound, float(p.loads(bins).max()) if m else bound)
    return PackResult(bins=bins, deferred=deferred, status=status, bound=bound, scale=scale,
                      build_s=build_s, solve_s=solve_s, extra=extra)
