"""Exact cut-or-whole CP sharding with OR-Tools CP-SAT: the quality reference for "hybrid".

The decision is hybrid's (see `solvers.chunk_rules.hybrid_assign`): each document is either cut
per document, adding the fixed row cut_cost[i, :] to the ranks, or placed whole on one rank
r, adding whole_cost[i] to rank r only. Minimise the largest rank load, with every rank
holding at most `token_cap` tokens.

Model (CP-SAT primer order: data, variables, constraints, objective, solve, read):
- Booleans cut[i] and x[i, r]; cut[i] + sum_r x[i, r] = 1.
- load[r] = mb_const + sum_i cut_cost[i, r] cut[i] + whole_cost[i] x[i, r]   (integers)
- tokens[r] = sum_i cut_tokens[i, r] cut[i] + d_i x[i, r] <= token_cap
- T >= load[r]; minimise T. The hybrid heuristic's decision is the hint.
Costs are floored to integers with `scale` units per second (the hint's makespan maps to
about 1e8 units), so integer loads never exceed true loads and the solver's bound divided
by `scale` is a valid lower bound in seconds; the objective is recomputed exactly by the
caller from the decision.
"""
from __future__ import annotations

import math
import time

import numpy as np

from .._optional import require
from .chunk_rules import decision_arrays

SCALE_TARGET = 1e8


def solve_cut_or_whole(whole_cost, cut_cost, lengths, cut_tokens, token_cap, *, mb_const: float = 0.0,
                       hint=None, time_limit: float = 10.0, workers: int = 1, seed: int = 0) -> dict:
    """Exact cut-or-whole decision. Returns dict(cut, whole_rank, status, objective, bound,
    scale, build_s, solve_s); objective and bound in seconds (bound includes mb_const)."""
    cp_model = require("ortools.sat.python.cp_model", "strategy='cpsat'")
    # data
    t0 = time.perf_counter()
    whole_cost, cut_cost, lengths, cut_tokens = decision_arrays(whole_cost, cut_cost, lengths, cut_tokens)
    n, cp = cut_cost.shape
    if n == 0:
        return dict(cut=np.zeros(0, bool), whole_rank=np.zeros(0, np.int64), status="optimal",
                    objective=mb_const, bound=mb_const, scale=1.0, build_s=0.0, solve_s=0.0)
    if hint is not None:
        h_cut, h_rank = (np.asarray(x) for x in hint)
        h_loads = cut_cost[h_cut].sum(axis=0) + np.bincount(h_rank[~h_cut], weights=whole_cost[~h_cut],
                                                             minlength=cp)[:cp]
        ref = float(h_loads.max())
    else:
        ref = float(cut_cost.sum(axis=0).max())
    scale = SCALE_TARGET / ref if ref > 0 else 1.0
    w_int = np.floor(whole_cost * scale).astype(np.int64).tolist()
    c_int = np.floor(cut_cost * scale).astype(np.int64).tolist()
    d, ct = lengths.tolist(), cut_tokens.tolist()
    cap = int(min(token_cap, int(lengths.sum()))) if math.isfinite(token_cap) else int(lengths.sum())

    # variables
    model = cp_model.CpModel()
    cut = [model.new_bool_var(f"cut{i}") for i in range(n)]
    x = [[model.new_bool_var(f"x{i}_{r}") for r in range(cp)] for i in range(n)]
    upper = sum(max(w_int[i], max(c_int[i])) for i in range(n))
    T = model.new_int_var(0, upper, "T")

    # constraints
    for i in range(n):
        model.add_exactly_one([cut[i], *x[i]])
        for r in range(cp):
            if d[i] > cap:
                model.add(x[i][r] == 0)
    for r in range(cp):
        load = sum(c_int[i][r] * cut[i] + w_int[i] * x[i][r] for i in range(n))
        model.add(T >= load)
        model.add(sum(ct[i][r] * cut[i] + d[i] * x[i][r] for i in range(n)) <= cap)

    # objective and hint
    model.minimize(T)
    if hint is not None:
        for i in range(n):
            model.add_hint(cut[i], bool(h_cut[i]))
            for r in range(cp):
                model.add_hint(x[i][r], (not h_cut[i]) and int(h_rank[i]) == r)
    build_s = time.perf_counter() - t0

    # solve
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = int(workers)
    solver.parameters.random_seed = int(seed)
    t1 = time.perf_counter()
    status = solver.solve(model)
    solve_s = time.perf_counter() - t1
    name = solver.status_name(status).lower()
    if status == cp_model.MODEL_INVALID:  # the model is valid by construction: its parameters are not
        raise ValueError(f"CP-SAT refused its parameters (workers={workers}, seed={seed}, time_limit={time_limit}): "
                         f"{solver.solution_info() or 'model invalid'}")

    # read
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if hint is None:
            raise ValueError(f"cpsat found no sharding within time_limit={time_limit} s ({name}); raise time_limit")
        out_cut, out_rank, name = np.asarray(h_cut, bool), np.asarray(h_rank, np.int64), f"hint ({name})"
        bound = None
    else:
        out_cut = np.array([solver.boolean_value(v) for v in cut], dtype=bool)
        out_rank = np.full(n, -1, dtype=np.int64)
        for i in range(n):
            for r in range(cp):
                if solver.boolean_value(x[i][r]):
                    out_rank[i] = r
        bound = float(solver.best_objective_bound) / scale + mb_const
    loads = cut_cost[out_cut].sum(axis=0) + np.bincount(out_rank[~out_cut], weights=whole_cost[~out_cut],
                                                        minlength=cp)[:cp] + mb_const
    return dict(cut=out_cut, whole_rank=out_rank, status=name, objective=float(loads.max()),
                bound=bound, scale=scale, build_s=build_s, solve_s=solve_s)
