"""`solve_pack()`: pack one global batch into dp x n_micro micro-batches.

The facade validates the input, turns documents into a solver problem (lengths and
modelled costs), runs the chosen method from `PACK_METHODS`, and assembles a PackPlan whose
loads are recomputed from the cost model, never taken from the solver. Methods:

- "original": Plain-4D, data order, fixed-length sequences, documents cut at boundaries.
- "fixed":    Fixed-4D, greedy fixed-length packing balanced on modelled cost.
- "wlb":      WLB-LLM Algorithm 1, variable length up to max_tokens.
- "wlb_ls":   Algorithm 1 plus a deterministic move/swap local search (wlb_opt.solvers.local_search).
- "wlb_fill": large documents balanced first (moves and swaps among them), short ones into
              the gaps by Algorithm 1's rule, then a move/swap polish (wlb_opt.solvers.fill).
- "wlb_phases": Algorithm 1 with forward and backward time balanced apart, never deferring
              what Algorithm 1 places (from 32 micro-batches: Algorithm 1 over the same lumps
              of the short tail; wlb_opt.solvers.phases); the streaming packer's default.
- "cpsat", "milp": exact models (`wlb-opt[exact]`), see wlb_opt.solvers.cpsat / .milp.

More methods can be added with `register_method`. The stateful streaming packer with
outlier queues is `WLBPacker` (wlb_opt.packer), which calls this facade once per step.

The layout: `dp` defaults to the cost model's (`cost.parallel.dp`); an explicit `dp` that
disagrees with a cost model built for a layout raises. Micro-batches are dealt to DP
replicas heaviest first onto the least-loaded replica (`wlb_opt.solvers.deal`).
"""
from __future__ import annotations

import importlib
import time
from typing import Callable, Literal

import numpy as np

from ._validate import (check_int, check_max_tokens, check_positive_real, check_unique_pieces, validate_ids,
                        validate_lengths, validate_offsets)
from .cost import CostModel, default_cost
from .cost_memory import resolve_max_tokens
from .plan import PackPlan, SolveInfo
from .solvers.deal import deal_to_replicas
from .solvers.greedy import bin_tokens, fixed_greedy, original_sequential, wlb_greedy
from .solvers.problem import PackProblem, PackResult

PackMethod = Literal["original", "fixed", "wlb", "wlb_ls", "wlb_fill", "wlb_phases", "cpsat", "milp"]

# name -> solver callable, or "module:function" resolved on first use (optional deps).
PACK_METHODS: dict[str, Callable[[PackProblem], PackResult] | str] = {
    "original": original_sequential,
    "fixed": fixed_greedy,
    "wlb": wlb_greedy,
    "cpsat": "wlb_opt.solvers.cpsat:solve",
    "milp": "wlb_opt.solvers.milp:solve",
    "wlb_ls": "wlb_opt.solvers.local_search:wlb_local_search",
    "wlb_fill": "wlb_opt.solvers.fill:wlb_fill",
    "wlb_phases": "wlb_opt.solvers.phases:wlb_phases",
}
# Options each heuristic understands (exact methods validate their own option names).
_OPTIONS: dict[str, set] = {"original": set(), "fixed": set(), "wlb": set(), "wlb_ls": {"max_iter"}, "wlb_fill": set(),
                            "wlb_phases": set()}
# Methods that read each item's forward and backward costs (PackProblem.phase_weights).
PHASE_METHODS = {"wlb_phases"}
# Methods that keep documents whole in fixed-length micro-batches balance tokens too.
_BALANCE_REPLICAS = {"original": False, "fixed": False}

MAX_MICRO_BATCHES = 2**22
"""Most micro-batches (dp x n_micro) one step may plan: a plan holds an array per micro-batch
and the solvers a bin per micro-batch (a real step has thousands)."""


def register_method(name: str, solver: Callable[[PackProblem], PackResult] | str,
                    balance_replicas: bool = True) -> None:
    """Add a packing method (a callable on PackProblem, or "module:function")."""
    PACK_METHODS[name] = solver
    _BALANCE_REPLICAS[name] = balance_replicas


def get_method(name: str) -> Callable[[PackProblem], PackResult]:
    try:
        solver = PACK_METHODS[name]
    except (KeyError, TypeError):  # TypeError: an unhashable name, such as a list
        raise ValueError(f"unknown packing method {name!r}; valid: {sorted(PACK_METHODS)}") from None
    if isinstance(solver, str):
        module, func = solver.split(":")
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("wlb_opt"):
                raise ValueError(f"packing method {name!r} is not available in this version") from None
            raise
        solver = getattr(mod, func)
        PACK_METHODS[name] = solver
    return solver


def solve_pack(
    lengths,
    n_micro: int,
    max_tokens: int | Literal["auto"],
    cost: CostModel | None = None,
    method: PackMethod | str = "wlb",
    *,
    memory_bytes: float | None = None,
    ids=None,
    offsets=None,
    dp: int | None = None,
    carried: int = 0,
    time_limit: float = 10.0,
    seed: int = 0,
    backend: str | None = None,
    **options,
) -> PackPlan:
    """Pack one global batch of documents into dp x n_micro micro-batches.

    Args:
        lengths: token count of each document (or piece, see `split_documents`).
        n_micro: micro-batches per DP replica (N).
        max_tokens: token cap of one micro-batch, inclusive (S_max; the window for
            fixed-length methods); "auto": the largest whose worst case fits in
            `memory_bytes` under the cost model's memory model (`wlb.max_tokens_for`). Without
            a calibrated one it counts the 1F1B schedule's in-flight micro-batches; the
            interleaved schedule keeps more: set the cost model's `memory_model` to
            `MemoryModel.analytic(..., virtual_stages=v)`, or pass `max_tokens_for(...,
            virtual_stages=v)`.
        memory_bytes: bytes of memory per GPU, read with max_tokens="auto" only.
        cost: the cost model the loads are measured with (default: 7B on H100, no parallelism).
        method: one of PACK_METHODS.
        ids: document ids (default 0..n-1); pieces of one document may share an id.
        offsets: start of each piece inside its document (default 0).
        dp: data-parallel replicas; dp x n_micro micro-batches are packed jointly (None:
            the cost model's `parallel.dp`, 1 without a layout; a disagreeing value raises).
        carried: the first `carried` documents come from an earlier step; placed first.
        time_limit, seed, backend: for exact methods ("milp" backend "cbc" | "highs").
        **options: method-specific (e.g. allow_defer=True for exact methods).

    Returns a PackPlan; tokens that do not fit are in `plan.deferred`, never dropped.
    """
    t0 = time.perf_counter()
    lengths = validate_lengths(lengths)
    n_micro = check_int("n_micro", n_micro, 1)
    if not (isinstance(max_tokens, str) and max_tokens == "auto"):
        max_tokens = check_max_tokens(max_tokens)
    carried = check_int("carried", carried, 0)
    if carried > len(lengths):
        raise ValueError(f"carried={carried} is out of range: only {len(lengths)} documents were given")
    time_limit = check_positive_real("time_limit", time_limit, "seconds", allow_inf=True)
    seed = check_int("seed", seed, 0)
    solver = get_method(method)
    if backend is not None and method != "milp":
        raise ValueError(f"backend={backend!r} chooses the solver of method='milp' ('cbc' or 'highs'); "
                         f"method={method!r} takes no backend")
    ids = validate_ids(ids, len(lengths))
    offsets = validate_offsets(offsets, len(lengths))
    check_unique_pieces(ids, offsets, lengths=lengths)
    if cost is not None and not isinstance(cost, CostModel):
        raise ValueError(f"cost must be a wlb_opt.CostModel or None, got {type(cost).__name__}")
    cost = cost if cost is not None else default_cost()
    known = cost.parallel is not None  # the cost model's layout, else the memory model's own where dp is None
    max_tokens = resolve_max_tokens(max_tokens, cost, memory_bytes, pp=cost.parallel.pp if known else None,
                                    dp=cost.degree("dp", dp) if known or dp is not None else None)
    dp = cost.degree("dp", dp)
    if dp * n_micro > MAX_MICRO_BATCHES:
        raise ValueError(f"dp x n_micro must be <= {MAX_MICRO_BATCHES} micro-batches per step (a plan holds an "
                         f"array per micro-batch), got dp={dp} x n_micro={n_micro} = {dp * n_micro}")
    allowed = _OPTIONS.get(method)
    if allowed is not None and set(options) - allowed:
        raise ValueError(f"method {method!r} takes no option(s) {sorted(set(options) - allowed)}; "
                         f"valid: {sorted(allowed) or 'none'}")
    if len(lengths) and lengths.max() > max_tokens:
        i = int(np.argmax(lengths))
        raise ValueError(
            f"document {int(ids[i])} (position {i}) has {int(lengths[i])} tokens > max_tokens={max_tokens}; "
            "cut documents to the window first with wlb_opt.split_documents(lengths, window)")

    phases = {}
    if method in PHASE_METHODS:
        phases = dict(phase_weights=tuple(cost.doc_cost(lengths, phase) if len(lengths) else np.zeros(0)
                                          for phase in ("fwd", "bwd")),
                      phase_consts=(cost.mb_const("fwd"), cost.mb_const("bwd")))
    problem = PackProblem(
        lengths=lengths, weights=cost.doc_cost(lengths) if len(lengths) else np.zeros(0),
        n_bins=dp * n_micro, max_tokens=max_tokens, carried=carried, bin_const=cost.mb_const(),
        time_limit=float(time_limit), seed=int(seed), backend=backend, options=dict(options), **phases)
    result = solver(problem)

    if result.pieces is not None:
        src, plen, poff = result.pieces
        p_ids, p_len, p_off = ids[src], plen.astype(np.int64), offsets[src] + poff
    else:
        p_ids, p_len, p_off = ids, lengths, offsets
    bins = [np.asarray(b, dtype=np.int64) for b in result.bins]
    if result.pieces is None:
        piece_cost = problem.weights  # the documents are the pieces
    else:
        piece_cost = cost.doc_cost(p_len) if len(p_len) else np.zeros(0)
    mb_const = cost.mb_const()
    # Same values as cost.micro_batch_cost(p_len[b]) (same terms, same summation order).
    loads = np.array([piece_cost[b].sum() + mb_const for b in bins], dtype=np.float64)
    tokens = bin_tokens(p_len, bins)
    if _BALANCE_REPLICAS.get(method, True):
        replica_of = deal_to_replicas(loads, dp, n_micro)
    else:
        replica_of = np.arange(dp * n_micro, dtype=np.int64) // n_micro

    objective = float(loads.max()) if len(loads) else 0.0
    bound = result.bound
    gap = None
    if bound is not None and objective > 0:
        gap = max(0.0, (objective - bound) / objective)
    info = SolveInfo(method=method, status=result.status, objective=objective, bound=bound, gap=gap,
                     scale=result.scale, build_s=result.build_s, solve_s=result.solve_s,
                     wall_s=time.perf_counter() - t0, extra=dict(result.extra))
    return PackPlan(doc_ids=p_ids, lengths=p_len, offsets=p_off, micro_batches=bins, replica_of=replica_of,
                    deferred=result.deferred, loads=loads, tokens=tokens,
                    n_micro=n_micro, dp=dp, max_tokens=max_tokens, info=info)
