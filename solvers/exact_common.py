"""What the exact packing models (CP-SAT in `cpsat.py`, PuLP in `milp.py`) share.

Both solve the paper's Eq. 2 (Eq. 1 is the same with max_tokens = window): put item i in one
of m bins, at most `max_tokens` tokens per bin, minimise the largest bin cost. With
`allow_defer=True` the objective is lexicographic: first maximise the placed tokens, then
minimise the largest cost among plans that place that many (two solves, see `solve_lex`).

This module fixes, for both models:
- the options (`ExactOptions`, read from PackProblem.options, with ValueErrors);
- the feasibility rules (`bounds.check_capacity` unless allow_defer; carried items are always
  placed);
- the symmetry breaking: items sorted by weight, descending (stable); the item of rank r may
  only use bins 0..r. Any plan can be relabelled to satisfy it (number bins in the order their
  first item appears), so no optimum is cut off; `canonical_bins` does that relabelling for
  hints, `variable_rows` creates the 0/1 variables it allows;
- the heuristic start (`wlb_ls`, or the user's `hint`), which bounds the makespan from above
  and is passed to the solver as a hint;
- the two-phase driver `solve_lex`: phase 1 (allow_defer, unless the start already places
  every placeable token) maximises placed tokens, phase 2 minimises the largest load among
  plans placing at least that many, skipped when the start already meets the lower bound
  (`PlanSource.START_MEETS_BOUND`). A solver supplies the model through `LexModel`;
- the final choice: a solver result is kept only if it is lexicographically no worse than
  the hint in exact float arithmetic, so an exact method never returns worse than its start.
"""
from __future__ import annotations

import enum
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from .bounds import check_capacity, makespan_lower_bound, max_placeable_tokens, placed_load_bound
from .local_search import wlb_local_search
from .problem import PackProblem, PackResult, assignment_to_bins, bins_to_assignment

def _hint_bin(items, k: int) -> np.ndarray:
    """Bin k of a `hint`: item indices as int64 (not floats, which would be truncated, nor
    bools, which numpy reads as 0 and 1)."""
    arr = np.asarray(items)
    bools = isinstance(items, (list, tuple)) and any(isinstance(v, (bool, np.bool_)) for v in items)
    if arr.size and (arr.dtype.kind not in "iu" or bools):
        raise ValueError(f"hint[{k}] must hold item indices (integers), got {arr.ravel().tolist()[:8]!r}")
    return arr.astype(np.int64).ravel()


_KNOWN = {"allow_defer", "deterministic", "hint", "num_workers", "gap_limit", "phase1_share", "max_iter"}


MAX_WORKERS = 10_000
"""Most solver threads an exact method takes (CP-SAT refuses more)."""
SEED_MAX = 2**31 - 1
"""Largest seed an exact method takes: CP-SAT's, CBC's and HiGHS's seeds are 32-bit."""


@dataclass(frozen=True)
class ExactOptions:
    allow_defer: bool = False
    """Lexicographic model: maximise placed tokens, then minimise the largest cost."""
    deterministic: bool = False
    """One worker and a deterministic time limit (tests, in-training use)."""
    hint: tuple | None = None
    """A starting plan: per bin, item positions (unlisted items are deferred)."""
    num_workers: int = 0
    """Solver threads; 0 = min(8, cpu count). Forced to 1 when deterministic."""
    gap_limit: float = 0.0
    """Stop when (objective - bound) / objective <= gap_limit (0: prove optimality)."""
    phase1_share: float = 0.4
    """Share of time_limit the max-placed-tokens phase may use (allow_defer only)."""

    @classmethod
    def from_problem(cls, problem: PackProblem) -> "ExactOptions":
        """The options of `problem`, checked (ValueError naming the value and what is valid)."""
        opts = dict(problem.options)
        unknown = sorted(set(opts) - _KNOWN)
        if unknown:
            raise ValueError(f"unknown options {unknown} for an exact packing method; valid: {sorted(_KNOWN)}")
        opts.pop("max_iter", None)
        for name in ("allow_defer", "deterministic"):
            if name in opts and not isinstance(opts[name], (bool, np.bool_)):
                raise ValueError(f"{name} must be True or False, got {opts[name]!r}")
        workers = opts.get("num_workers", 0)
        if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or not 0 <= workers <= MAX_WORKERS:
            raise ValueError(f"num_workers must be an integer in [0, {MAX_WORKERS}] (0 = automatic), got {workers!r}")
        if not 0 <= problem.seed <= SEED_MAX:  # the solvers' seeds are 32-bit
            raise ValueError(f"seed must be an integer in [0, {SEED_MAX}] for an exact method, got {problem.seed}")
        gap = opts.get("gap_limit", 0.0)
        if not isinstance(gap, (int, float)) or not 0.0 <= gap < 1.0:
            raise ValueError(f"gap_limit must be a number in [0, 1), got {gap!r}")
        share = opts.get("phase1_share", 0.4)
        if not isinstance(share, (int, float)) or not 0.0 < share < 1.0:
            raise ValueError(f"phase1_share must be a number in (0, 1), got {share!r}")
        hint = opts.get("hint")
        if hint is not None and not isinstance(hint, (list, tuple)):
            raise ValueError(f"hint must be one list of piece indices per micro-batch, got {type(hint).__name__}")
        if hint is not None:
            hint = tuple(_hint_bin(b, k) for k, b in enumerate(hint))
        return cls(allow_defer=bool(opts.get("allow_defer", False)), deterministic=bool(opts.get("deterministic", False)),
                   hint=hint, num_workers=int(workers), gap_limit=float(gap), phase1_share=float(share))

    def workers(self) -> int:
        if self.deterministic:
            return 1
        return self.num_workers or max(1, min(8, os.cpu_count() or 1))


def validate_hint(problem: PackProblem, bins, allow_defer: bool) -> np.ndarray:
    """Check a user hint; returns the deferred piece indices it implies."""
    n, m = problem.n_items, problem.n_bins
    if len(bins) != m:
        raise ValueError(f"hint must list {m} micro-batches (dp * n_micro), got {len(bins)}")
    count = np.zeros(n, dtype=np.int64)
    for j, b in enumerate(bins):
        if b.size and (b.min() < 0 or b.max() >= n):
            raise ValueError(f"hint micro-batch {j} has piece indices outside 0..{n - 1}: {b.tolist()}")
        np.add.at(count, b, 1)
        tok = int(problem.lengths[b].sum())
        if tok > problem.max_tokens:
            raise ValueError(f"hint micro-batch {j} holds {tok} tokens > max_tokens={problem.max_tokens}")
    if (count > 1).any():
        raise ValueError(f"hint places piece indices {np.flatnonzero(count > 1).tolist()} more than once")
    deferred = np.flatnonzero(count == 0)
    if deferred.size and not allow_defer:
        raise ValueError(f"hint leaves piece indices {deferred.tolist()} unplaced; every document must be placed "
                         "unless allow_defer=True")
    if deferred.size and (deferred < problem.carried).any():
        raise ValueError(f"hint defers carried piece indices {deferred[deferred < problem.carried].tolist()}")
    return deferred


@dataclass
class ExactData:
    """Everything a model builder needs, in the symmetry-breaking item order."""

    problem: PackProblem
    options: ExactOptions
    order: np.ndarray
    """Item positions sorted by weight descending: rank r -> item position."""
    max_bin: np.ndarray
    """Per item position, the highest bin index it may use (its rank, capped at m-1)."""
    mandatory: np.ndarray
    """Per item position: must be placed (always, or carried under allow_defer)."""
    start: PackResult
    """The heuristic (or user) start, relabelled to respect max_bin."""
    start_key: tuple[int, float]
    """`PackProblem.lex_key` of the start: (-placed tokens, largest load)."""
    start_assign: np.ndarray | None
    """The start as a bin index per item (-1 = deferred), or None when it defers an item
    that must be placed (then it is no plan of the model: neither hint nor fallback)."""
    placeable: int
    """Upper bound on placed tokens (all items when allow_defer is False)."""

    def lower_bound(self, placed_tokens: int | None = None) -> float:
        """Float lower bound (seconds, with bin_const) on the largest load."""
        p = self.problem
        if not self.options.allow_defer:
            return makespan_lower_bound(p.weights, p.n_bins, p.bin_const)
        tokens = self.placeable if placed_tokens is None else placed_tokens
        return placed_load_bound(p.lengths, p.weights, p.n_bins, tokens, p.bin_const)

    def reference_cost(self) -> float:
        """Seconds that the solver's cost unit is set from: the largest bin cost of the start
        without bin_const, or the total weight when there is no usable start (or it is 0)."""
        p = self.problem
        start_w = float(p.loads(self.start.bins).max() - p.bin_const) if p.n_bins else 0.0
        return start_w if self.start_assign is not None and start_w > 0 else float(p.weights.sum())


def canonical_bins(bins, rank: np.ndarray, m: int) -> list[np.ndarray]:
    """Relabel bins so that bins appear in the order of their best-ranked item (empty last)."""
    first = [int(rank[b].min()) if len(b) else np.iinfo(np.int64).max for b in bins]
    perm = sorted(range(len(bins)), key=lambda j: (first[j], j))
    out = [np.asarray(bins[j], dtype=np.int64) for j in perm]
    return out + [np.zeros(0, dtype=np.int64)] * (m - len(out))


def prepare(problem: PackProblem) -> ExactData:
    """Validate, check feasibility, order items, and compute the heuristic start."""
    opts = ExactOptions.from_problem(problem)
    n, m = problem.n_items, problem.n_bins
    if opts.allow_defer:
        carried = problem.lengths[: problem.carried]
        if int(carried.sum()) > m * int(problem.max_tokens):  # allow_defer defers the others, never these
            raise ValueError(f"the {problem.carried} carried items hold {int(carried.sum())} tokens, more than "
                             f"{m} micro-batches x {problem.max_tokens} = {m * int(problem.max_tokens)}: the exact "
                             "methods place every carried item, even with allow_defer=True; carry fewer")
        check_capacity(carried, m, problem.max_tokens)
        too_long = np.flatnonzero(problem.lengths > problem.max_tokens)
    else:
        check_capacity(problem.lengths, m, problem.max_tokens)
        too_long = np.zeros(0, dtype=np.int64)
    order = np.argsort(-problem.weights, kind="stable").astype(np.int64)
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    max_bin = np.minimum(rank, m - 1)
    mandatory = np.ones(n, dtype=bool) if not opts.allow_defer else (np.arange(n) < problem.carried)

    if opts.hint is not None:
        deferred = validate_hint(problem, opts.hint, opts.allow_defer)
        start = PackResult(bins=list(opts.hint), deferred=deferred, status="hint")
    else:
        start = wlb_local_search(problem)
        if start.deferred.size and not opts.allow_defer:
            start = _first_fit_start(problem)
        start.status = "wlb_ls"
    start.bins = canonical_bins(start.bins, rank, m)
    placeable = int(problem.lengths.sum())
    if opts.allow_defer:
        lengths = problem.lengths.copy()
        lengths[too_long] = 0
        placeable = max_placeable_tokens(lengths, m, problem.max_tokens)
    deferred = np.asarray(start.deferred, dtype=np.int64)
    complete = not mandatory[deferred].any() if deferred.size else True
    return ExactData(problem=problem, options=opts, order=order, max_bin=max_bin, mandatory=mandatory,
                     start=start, start_key=problem.lex_key(start.bins, start.deferred),
                     start_assign=bins_to_assignment(start.bins, n) if complete else None, placeable=placeable)


def _first_fit_start(problem: PackProblem) -> PackResult:
    """First-fit decreasing on tokens: a start that places everything when the greedy
    heuristics defer on a tight (but feasible-looking) instance. May still defer; the
    solvers then start without a hint."""
    m, cap = problem.n_bins, problem.max_tokens
    toks = np.zeros(m, dtype=np.int64)
    bins: list[list[int]] = [[] for _ in range(m)]
    deferred = []
    for i in np.argsort(-problem.lengths, kind="stable").tolist():
        room = np.flatnonzero(toks + problem.lengths[i] <= cap)
        if room.size == 0:
            deferred.append(i)
            continue
        b = int(room[0])
        toks[b] += problem.lengths[i]
        bins[b].append(i)
    return PackResult(bins=[np.asarray(b, dtype=np.int64) for b in bins], deferred=np.asarray(deferred, dtype=np.int64))




def plan_from_assignment(data: ExactData, assign: np.ndarray, extra: dict) -> tuple[list, np.ndarray]:
    """A solver's assignment as (bins, deferred), or the start plan when the start is
    lexicographically better (in float costs: scaling can make an integer optimum slightly
    worse); then extra["kept_start"] = True."""
    bins, deferred = assignment_to_bins(assign, data.problem.n_bins)
    if data.start_assign is not None and data.start_key < data.problem.lex_key(bins, deferred):
        extra["kept_start"] = True
        return data.start.bins, np.asarray(data.start.deferred, dtype=np.int64)
    return bins, deferred


# ------------------------------------------------------------------ model variables
Var = TypeVar("Var")


def variable_rows(data: ExactData, new_var: Callable[[int, int], Var]) -> list[list[Var]]:
    """Per item position i, the 0/1 variables x[i, b] = new_var(i, b) for the bins it may use,
    0..max_bin[i] (the symmetry breaking); none for an item longer than max_tokens (it can
    only be deferred, allow_defer only)."""
    p = data.problem
    cap = int(p.max_tokens)
    return [[new_var(i, b) for b in range(int(data.max_bin[i]) + 1)] if int(p.lengths[i]) <= cap else []
            for i in range(p.n_items)]


def read_assignment(rows: list[list[Var]], chosen: Callable[[Var], bool]) -> np.ndarray:
    """Bin index per item (-1 = deferred) from the variables of `variable_rows`: the first bin
    whose variable the solver set (`chosen`)."""
    assign = np.full(len(rows), -1, dtype=np.int64)
    for i, row in enumerate(rows):
        assign[i] = next((b for b, v in enumerate(row) if chosen(v)), -1)
    return assign


# ------------------------------------------------------------------ the two-phase driver
class PlanSource(enum.Enum):
    """Where the plan of phase 2 (smallest largest load) comes from. The values are the words
    recorded in extra["phase2"] when the solver did not run."""

    START_MEETS_BOUND = "start meets the lower bound"
    """The start is within gap_limit of the lower bound: optimal, the solver is not run."""
    SOLVER = "solver"
    """The solver's best plan (proven optimal or not: LexPlan.status)."""
    START_KEPT = "start kept"
    """The solver found no plan in time; the start (a complete plan) is returned."""


START_KEPT_STATUS = "feasible (start; no better plan found in time)"
"""The status of a plan that is the start because the solver found none in time."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PhaseSolve:
    """What one solver run of one phase found, in the solver's own terms."""

    status: str
    """The solver's status words, recorded as extra["phase1"] / extra["phase2"]."""
    assign: np.ndarray | None
    """Bin index per item (-1 = deferred) of the best plan found; None when it found none."""
    proven: bool
    """The plan is proven optimal for the phase's objective (within gap_limit)."""
    infeasible: bool = False
    """The solver proved that the phase has no plan at all."""
    bound: float | None = None
    """The solver's bound on the phase's objective, in its units (phase 1: at most this many
    tokens; phase 2: a largest load of at least this), when it reports one."""
    solve_s: float = 0.0
    """Seconds inside the solver."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LexPlan:
    """The driver's final plan, handed to `LexModel.bound` to find its lower bound."""

    bins: list
    deferred: np.ndarray
    source: PlanSource
    status: str
    """"optimal", "feasible" or START_KEPT_STATUS; the solver appends where its bound is from."""
    lower: float
    """The phase-2 lower bound on the largest load, in solver units (`LexModel.add_makespan`)."""
    phase2: PhaseSolve | None
    """The phase-2 solver run; None when the start met the bound."""
    placed_tokens: int
    """The phase-2 plans place at least this many tokens (the phase-1 result)."""


class LexModel(Protocol):
    """The solver side of `solve_lex`: one exact model (CP-SAT, PuLP), built and solved in
    solver units (integer or normalised costs, `scale` units per second)."""

    name: str
    """How error messages name the solver ("cpsat", "milp (cbc)")."""

    def maximize_placed(self, start: np.ndarray | None, time_limit: float) -> PhaseSolve:
        """Phase 1: build and solve the model that places the most tokens, from the hint
        `start` (an assignment; None: no hint)."""
        ...

    def add_makespan(self, placed_tokens: int, start: np.ndarray | None) -> tuple[float, float]:
        """Phase 2, build: minimise the largest load over plans placing >= placed_tokens (with
        allow_defer), hint `start`. Returns (lower, upper) bounds on that objective in
        solver units; upper is the load of `start` when there is one."""
        ...

    def minimize_makespan(self, start: np.ndarray | None, time_limit: float) -> PhaseSolve:
        """Phase 2, solve the model of `add_makespan`."""
        ...

    def bound(self, plan: LexPlan) -> tuple[float, str]:
        """A lower bound (seconds, with bin_const) on the largest load of any plan placing
        plan.placed_tokens, and the words appended to the status to say where it comes from."""
        ...


def solve_lex(data: ExactData, model: LexModel, *, scale: float, build_s: float, extra: dict) -> PackResult:
    """Run the two phases on `model` within data.problem.time_limit and return the plan.

    Phase 1 (allow_defer, when the start places fewer than the placeable tokens) may use
    phase1_share of the time; phase 2 the rest, at least 5% of time_limit. The start (when
    complete) is the hint of both and the fallback when the solver finds nothing; a solver
    plan that is worse than the start in float costs is replaced by it
    (`plan_from_assignment`). `extra` holds the solver's own details; the driver adds the
    start's, "phase1", "phase1_bound_tokens", "phase2" and "kept_start".
    """
    p, opts = data.problem, data.options
    extra = {"start": data.start.status, "start_objective": data.start_key[1], "start_placed": -data.start_key[0],
             **extra, "phase1": "not needed"}
    solve_s = 0.0
    budget = float(p.time_limit)
    start = data.start_assign
    # a start that leaves a carried document out is no plan: phase 1 then starts from nothing
    placed_target = -data.start_key[0] if start is not None else 0
    placed_proven = True

    # Phase 1 (allow_defer): maximise placed tokens, unless the start already places the maximum.
    if opts.allow_defer and placed_target < data.placeable:
        t0 = time.perf_counter()
        run = model.maximize_placed(start, budget * opts.phase1_share)
        build_s += time.perf_counter() - t0 - run.solve_s
        solve_s += run.solve_s
        # deterministic: phase 2 gets the rest of the budget by share, not by the wall clock
        # phase 1 took (which depends on the machine's load)
        spent = budget * opts.phase1_share if opts.deterministic else run.solve_s
        budget = max(budget - spent, 0.05 * float(p.time_limit))
        extra["phase1"] = run.status
        bound_tokens = data.placeable if run.bound is None else min(data.placeable, int(run.bound))
        extra["phase1_bound_tokens"] = bound_tokens
        if run.assign is not None:
            got = int(p.lengths[run.assign >= 0].sum())
            if got > placed_target or start is None:
                start, placed_target = run.assign, got
        # proven only where the bound meets the tokens placed (a gap_limit stops short of it)
        placed_proven = run.proven and bound_tokens <= placed_target

    # Phase 2: minimise the largest load among plans placing >= placed_target tokens.
    t0 = time.perf_counter()
    lower, upper = model.add_makespan(placed_target, start)
    build_s += time.perf_counter() - t0
    run = None
    if start is not None and upper - lower <= opts.gap_limit * upper:
        # The start is within gap_limit of the lower bound: nothing left to prove (the primer:
        # skip the solver).
        source, sol, status = PlanSource.START_MEETS_BOUND, start, _optimal(upper, lower, opts.gap_limit)
        extra["phase2"] = source.value
    else:
        run = model.minimize_makespan(start, budget)
        solve_s += run.solve_s
        extra["phase2"] = run.status
        if run.assign is not None:
            source, sol, status = PlanSource.SOLVER, run.assign, "optimal" if run.proven else "feasible"
            if run.proven and opts.gap_limit > 0:  # stopped at the gap: optimal only within it
                status = f"optimal within gap_limit={opts.gap_limit:g}"
        elif start is not None:
            source, sol, status = PlanSource.START_KEPT, start, START_KEPT_STATUS
        else:
            raise _no_plan_error(model.name, run, p, opts.allow_defer)
    bins, deferred = plan_from_assignment(data, sol, extra)

    bound, note = model.bound(LexPlan(bins=bins, deferred=deferred, source=source, status=status, lower=lower,
                                      phase2=run, placed_tokens=placed_target))
    status += note
    if opts.allow_defer and not placed_proven:
        status += " (placed tokens not proven maximal)"
    # Solver tolerances (1e-6 on T >= load) and float round-off may put a bound a hair above
    # the plan.
    bound = min(bound, float(p.loads(bins).max()) if p.n_bins else bound)
    return PackResult(bins=bins, deferred=deferred, status=status, bound=bound, scale=scale,
                      build_s=build_s, solve_s=solve_s, extra=extra)


def _optimal(upper: float, lower: float, gap_limit: float) -> str:
    """The status of a start that meets the lower bound, exactly or within gap_limit."""
    return "optimal" if upper - lower <= 1e-12 * max(abs(upper), 1.0) else f"optimal within gap_limit={gap_limit:g}"


def _no_plan_error(name: str, run: PhaseSolve, p: PackProblem, allow_defer: bool = False) -> ValueError:
    if run.infeasible and allow_defer:  # only the carried documents must be placed
        return ValueError(f"{name} proved that the {p.carried} carried documents (which are never deferred again) "
                          f"fit no plan of {p.n_bins} micro-batches of max_tokens={p.max_tokens} (infeasible); "
                          "carry fewer tokens into the step, or give it more micro-batches")
    if run.infeasible:
        return ValueError(f"{name} proved that no plan places every document in {p.n_bins} micro-batches of "
                          f"max_tokens={p.max_tokens} (infeasible); pass allow_defer=True to defer some")
    if allow_defer:
        return ValueError(f"{name} found no plan that places the {p.carried} carried documents within "
                          f"time_limit={p.time_limit} s ({run.status}); raise time_limit")
    return ValueError(f"{name} found no plan that places every document within time_limit={p.time_limit} s "
                      f"({run.status}); raise time_limit or pass allow_defer=True")
