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
  hints;
- the heuristic start (`wlb_ls`, or the user's `hint`), which bounds the makespan from above
  and is passed to the solver as a hint;
- the final choice: a solver result is kept only if it is lexicographically no worse than
  the hint in exact float arithmetic, so an exact method never returns worse than its start.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from .bounds import check_capacity, makespan_lower_bound, max_placeable_tokens, placed_load_bound
from .local_search import wlb_local_search
from .problem import PackProblem, PackResult

_KNOWN = {"allow_defer", "deterministic", "hint", "num_workers", "gap_limit", "phase1_share", "max_iter"}


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
        opts = dict(problem.options)
        unknown = sorted(set(opts) - _KNOWN)
        if unknown:
            raise ValueError(f"unknown options {unknown} for an exact packing method; valid: {sorted(_KNOWN)}")
        opts.pop("max_iter", None)
        for name in ("allow_defer", "deterministic"):
            if name in opts and not isinstance(opts[name], (bool, np.bool_)):
                raise ValueError(f"{name} must be True or False, got {opts[name]!r}")
        workers = opts.get("num_workers", 0)
        if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 0:
            raise ValueError(f"num_workers must be an integer >= 0 (0 = automatic), got {workers!r}")
        gap = opts.get("gap_limit", 0.0)
        if not isinstance(gap, (int, float)) or not 0.0 <= gap < 1.0:
            raise ValueError(f"gap_limit must be a number in [0, 1), got {gap!r}")
        share = opts.get("phase1_share", 0.4)
        if not isinstance(share, (int, float)) or not 0.0 < share < 1.0:
            raise ValueError(f"phase1_share must be a number in (0, 1), got {share!r}")
        hint = opts.get("hint")
        if hint is not None:
            hint = tuple(np.asarray(b, dtype=np.int64).ravel() for b in hint)
        return cls(allow_defer=bool(opts.get("allow_defer", False)), deterministic=bool(opts.get("deterministic", False)),
                   hint=hint, num_workers=int(workers), gap_limit=float(gap), phase1_share=float(share))

    def workers(self) -> int:
        if self.deterministic:
            return 1
        return self.num_workers or max(1, min(8, os.cpu_count() or 1))


def validate_hint(problem: PackProblem, bins, allow_defer: bool) -> np.ndarray:
    """Check a user hint; returns the deferred positions it implies."""
    n, m = problem.n_items, problem.n_bins
    if len(bins) != m:
        raise ValueError(f"hint must list {m} micro-batches (dp * n_micro), got {len(bins)}")
    count = np.zeros(n, dtype=np.int64)
    for j, b in enumerate(bins):
        if b.size and (b.min() < 0 or b.max() >= n):
            raise ValueError(f"hint micro-batch {j} has positions outside 0..{n - 1}: {b.tolist()}")
        np.add.at(count, b, 1)
        tok = int(problem.lengths[b].sum())
        if tok > problem.max_tokens:
            raise ValueError(f"hint micro-batch {j} holds {tok} tokens > max_tokens={problem.max_tokens}")
    if (count > 1).any():
        raise ValueError(f"hint places positions {np.flatnonzero(count > 1).tolist()} more than once")
    deferred = np.flatnonzero(count == 0)
    if deferred.size and not allow_defer:
        raise ValueError(f"hint leaves positions {deferred.tolist()} unplaced; every document must be placed "
                         "unless allow_defer=True")
    if deferred.size and (deferred < problem.carried).any():
        raise ValueError(f"hint defers carried positions {deferred[deferred < problem.carried].tolist()}")
    return deferred


def lex_key(problem: PackProblem, bins, deferred) -> tuple[int, float]:
    """(-placed tokens, largest load): smaller is better."""
    placed = int(problem.lengths.sum()) - int(problem.lengths[np.asarray(deferred, dtype=np.int64)].sum())
    loads = problem.loads(bins)
    return -placed, float(loads.max()) if len(loads) else 0.0


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
    placeable: int
    """Upper bound on placed tokens (all items when allow_defer is False)."""

    def lower_bound(self, placed_tokens: int | None = None) -> float:
        """Float lower bound (seconds, with bin_const) on the largest load."""
        p = self.problem
        if not self.options.allow_defer:
            return makespan_lower_bound(p.weights, p.n_bins, p.bin_const)
        tokens = self.placeable if placed_tokens is None else placed_tokens
        return placed_load_bound(p.lengths, p.weights, p.n_bins, tokens, p.bin_const)


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
    return ExactData(problem=problem, options=opts, order=order, max_bin=max_bin, mandatory=mandatory,
                     start=start, start_key=lex_key(problem, start.bins, start.deferred), placeable=placeable)


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


def assignment_to_bins(assign: np.ndarray, m: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Bin index per item (-1 = deferred) -> (bins, deferred)."""
    bins = [np.flatnonzero(assign == b).astype(np.int64) for b in range(m)]
    return bins, np.flatnonzero(assign < 0).astype(np.int64)


def bins_to_assignment(bins, n: int) -> np.ndarray:
    assign = np.full(n, -1, dtype=np.int64)
    for b, items in enumerate(bins):
        assign[np.asarray(items, dtype=np.int64)] = b
    return assign


def start_is_complete(data: ExactData) -> bool:
    """Whether the start places every item it must (when allow_defer is False: all)."""
    deferred = np.asarray(data.start.deferred, dtype=np.int64)
    return not data.mandatory[deferred].any() if deferred.size else True


def plan_from_assignment(data: ExactData, assign: np.ndarray, m: int, extra: dict) -> tuple[list, np.ndarray]:
    """A solver's assignment as (bins, deferred), or the start plan when it is better
    (then extra["kept_start"] = True). Shared by the CP-SAT and MILP models."""
    bins, deferred = assignment_to_bins(assign, m)
    bins, deferred, used_start = pick_better(data, bins, deferred)
    if used_start:
        extra["kept_start"] = True
    return bins, deferred


def pick_better(data: ExactData, bins, deferred) -> tuple[list, np.ndarray, bool]:
    """The solver's plan, or the start when the start is lexicographically better (in float
    costs: scaling can make an integer optimum slightly worse). Returns (bins, deferred,
    used_start)."""
    if bins is None:
        return data.start.bins, np.asarray(data.start.deferred, dtype=np.int64), True
    key = lex_key(data.problem, bins, deferred)
    if start_is_complete(data) and data.start_key < key:
        return data.start.bins, np.asarray(data.start.deferred, dtype=np.int64), True
    return bins, np.asarray(deferred, dtype=np.int64), False
