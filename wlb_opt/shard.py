"""`solve_shard()`: which tokens of one packed micro-batch each context-parallel rank holds.

Paper §4. Context parallelism with an all-gather of K/V (Llama 3 style) gives every rank a
share of the queries; ranks are synchronous, so the micro-batch takes as long as its slowest
rank. Strategies (all padding-free; the chunk rules are in `wlb_opt.solvers.chunk_rules`):

- "per_seq":  head-tail over the whole packed sequence (Llama 3, Plain-4D's CP).
- "per_doc":  head-tail inside every document, remainders round-robin (§4.1).
- "adaptive": per micro-batch, the one of per_seq / per_doc with the lower predicted
              max-rank time (§4.3; the prediction takes the max over ranks).
- "hybrid":   beyond the paper: per document, cut it (per_doc) or place it whole on one
              rank (`solvers.chunk_rules.hybrid_assign`); never predicts worse than "adaptive",
              because the best of {hybrid decision, per_doc, per_seq} is returned.
- "cpsat":    the exact version of hybrid's decision (OR-Tools CP-SAT, <= 48 documents),
              the quality reference for "hybrid".

Token bound of hybrid and cpsat: every rank holds at most ceil((1 + token_skew) * T / CP)
tokens (T tokens in the micro-batch; default token_skew = 1/16), so activation memory and
all-gather buffers stay within 6.25% of an even split. per_seq and per_doc differ by at most
one token between ranks.

Loads (seconds, units of `CostModel.micro_batch_cost`): rank r's load is the sum of
`cost.attention_latency(q_len, k_len)` over its segments (tile-padded, shape-dependent
efficiency), plus the linear work of its tokens, plus `doc_const` once per segment, plus
`mb_const`. The cost model's linear coefficient is per token of a micro-batch spread over
the CP group it was built for (`CostModel.analytic` divides by tp x cp), so rank r's linear
time is `cost.linear_cost(cp * tokens_r)`: `cp` is the cost model's own CP degree
(`cost.parallel.cp`; a `cp` argument that disagrees with it raises), and a model without a
layout is taken to describe the whole micro-batch.
"""
from __future__ import annotations

import math
import time

import numpy as np

from typing import Literal

from ._validate import check_choice, check_int, check_positive_real, is_float, validate_lengths, validate_offsets
from .cost import CostModel, default_cost
from .plan import PackPlan, ShardPlan, SolveInfo, chunk_tokens, merge_chunk_rows, merge_chunks
from .solvers.exact_common import MAX_WORKERS, SEED_MAX
from .solvers.chunk_rules import (chunks_of, hybrid_assign, hybrid_chunks, per_doc_chunk_sizes, per_doc_chunks,
                                  per_seq_chunks, per_seq_chunks_many)

ShardStrategy = Literal["per_seq", "per_doc", "adaptive", "hybrid", "cpsat"]
SHARD_STRATEGIES: tuple[str, ...] = ("per_seq", "per_doc", "adaptive", "hybrid", "cpsat")
CPSAT_MAX_DOCS = 48
DEFAULT_TOKEN_SKEW = 1.0 / 16

__all__ = ["solve_shard", "solve_shards", "SHARD_STRATEGIES", "CPSAT_MAX_DOCS", "ShardCosts",
           "cut_or_whole_lower_bound"]


class ShardCosts:
    """Per-segment and per-rank costs of chunk tables under one cost model and CP degree."""

    def __init__(self, cost: CostModel, cp: int):
        self.cost = cost
        self.cp = cost.degree("cp", cp)
        self.token_s = float(cost.linear_cost(1.0)) * float(self.cp)  # seconds per token on one rank
        self.doc_const = float(cost.coef["fwd"]["doc_const"] + cost.coef["bwd"]["doc_const"])
        self.mb_const = float(cost.mb_const())

    def segment_cost(self, q_len: np.ndarray, k_len: np.ndarray) -> np.ndarray:
        """Seconds a segment adds to its rank: attention + linear work of its queries + doc_const."""
        q_len = np.asarray(q_len, dtype=np.int64)
        if len(q_len) == 0:
            return np.zeros(0)
        att = np.asarray(self.cost.attention_latency(q_len, np.asarray(k_len, dtype=np.int64)), dtype=np.float64)
        return att + self.token_s * q_len + self.doc_const

    def loads(self, chunks: np.ndarray) -> np.ndarray:
        """Per-rank load of a canonical chunk table (rows rank, doc, start, length)."""
        return self.loads_of(chunks)[0]

    def loads_of(self, *tables: np.ndarray) -> list[np.ndarray]:
        """`loads` of each chunk table, from one `segment_cost` call over all their rows (the
        costs are per row, and each table's rows are summed per rank in their own order: the
        same floats as one call per table)."""
        rows = np.concatenate(tables) if len(tables) > 1 else tables[0]
        length = rows[:, 3]
        seg = self.segment_cost(length, rows[:, 2] + length)
        out, at = [], 0
        for table in tables:
            n = len(table)
            loads = np.bincount(table[:, 0], weights=seg[at:at + n], minlength=self.cp)[: self.cp] + self.mb_const
            out.append(loads)
            at += n
        return out


MAX_CP = 2**16
"""Largest context-parallel degree solve_shard takes: it holds 2 x cp chunks per document."""


def _cp_and_cost(cp, cost) -> tuple[int, CostModel]:
    """(cp, cost) checked; cp None takes the cost model's, cost None the default one."""
    if cost is not None and not isinstance(cost, CostModel):
        raise ValueError(f"cost must be a wlb_opt.CostModel or None, got {type(cost).__name__}")
    cost = cost if cost is not None else default_cost()
    cp = cost.degree("cp", cp)
    if cp > MAX_CP:
        raise ValueError(f"cp must be an integer >= 1 and <= {MAX_CP} (a document is cut into 2 x cp chunks), "
                         f"got {cp}")
    return cp, cost


def _validate(lengths, cp, strategy, offsets, cost):
    """(lengths, cp, offsets, cost) checked; cp None takes the cost model's."""
    cp, cost = _cp_and_cost(cp, cost)
    check_choice("strategy", strategy, SHARD_STRATEGIES)
    lengths = validate_lengths(lengths)
    return lengths, cp, validate_offsets(offsets, len(lengths)), cost


def solve_shard(
    lengths,
    cp: int | None = None,
    strategy: ShardStrategy | str = "per_doc",
    cost: CostModel | None = None,
    offsets=None,
    *,
    token_skew: float = DEFAULT_TOKEN_SKEW,
    time_limit: float = 10.0,
    workers: int = 1,
    seed: int = 0,
) -> ShardPlan:
    """Shard one packed micro-batch over `cp` context-parallel ranks.

    Args:
        lengths: token counts of the micro-batch's documents (pieces), in packed order.
        cp: context-parallel degree (>= 1; None: the cost model's `parallel.cp`, 1 without a
            layout; a value that disagrees with the cost model's layout raises).
        strategy: one of SHARD_STRATEGIES (see the module docstring).
        cost: the cost model of the loads (default: `default_cost()`).
        offsets: start of each piece inside its document (for RoPE positions; default 0).
        token_skew: hybrid / cpsat token bound, ranks hold <= ceil((1 + token_skew) T / cp).
        time_limit, workers, seed: CP-SAT only (one worker is deterministic where it proves its
            optimum; a search stopped by `time_limit`, wall-clock seconds, depends on the
            machine's load).

    Returns a ShardPlan; `plan.strategy` is the strategy actually taken.
    """
    t0 = time.perf_counter()
    lengths, cp, offsets, cost = _validate(lengths, cp, strategy, offsets, cost)
    if not (is_float(token_skew) and token_skew >= 0):
        raise ValueError(f"token_skew must be a number >= 0 (or math.inf), got {token_skew!r}")
    time_limit = check_positive_real("time_limit", time_limit, "seconds", allow_inf=True)
    workers = check_int("workers", workers, 1, MAX_WORKERS)  # CP-SAT's most threads
    seed = check_int("seed", seed, 0, SEED_MAX)  # CP-SAT's seed is 32-bit
    if strategy == "cpsat" and len(lengths) > CPSAT_MAX_DOCS:
        raise ValueError(f"strategy 'cpsat' handles at most {CPSAT_MAX_DOCS} documents (its size cap), got "
                         f"{len(lengths)}; use strategy='hybrid' for larger micro-batches")
    costs = ShardCosts(cost, cp)
    total = int(lengths.sum())
    token_cap = (1.0 + float(token_skew)) * total / cp
    token_cap = math.ceil(token_cap) if math.isfinite(token_cap) else math.inf  # a skew of 1e308: no cap
    extra: dict = {}
    status = "heuristic"

    def candidate(name, table):
        chunks = merge_chunks(lengths, *table)
        return name, chunks, costs.loads(chunks)

    if strategy == "per_seq":
        chosen = candidate("per_seq", per_seq_chunks(lengths, cp))
    elif strategy == "per_doc":
        chosen = candidate("per_doc", per_doc_chunks(lengths, cp))
    else:
        doc_chunks = merge_chunks(lengths, *per_doc_chunks(lengths, cp))
        seq_chunks = merge_chunks(lengths, *per_seq_chunks(lengths, cp))
        doc_loads, seq_loads = costs.loads_of(doc_chunks, seq_chunks)
        doc_cand, seq_cand = ("per_doc", doc_chunks, doc_loads), ("per_seq", seq_chunks, seq_loads)
        # ties go to per_doc (token counts balanced per document, fewer cross-document chunks)
        cands = [doc_cand, seq_cand]
        if strategy in ("hybrid", "cpsat"):
            whole_cost, cut_cost, cut_tokens = _decision_costs(lengths, cp, costs, doc_cand[1])
            if strategy == "hybrid":
                res = hybrid_assign(whole_cost, cut_cost, lengths, cut_tokens, token_cap)
                cut, whole_rank = res.cut, res.whole_rank
                extra.update(evaluated=res.evaluated)
            else:
                from .solvers.shard_cpsat import solve_cut_or_whole

                hint = hybrid_assign(whole_cost, cut_cost, lengths, cut_tokens, token_cap)
                res = solve_cut_or_whole(whole_cost, cut_cost, lengths, cut_tokens, token_cap,
                                         mb_const=costs.mb_const, hint=(hint.cut, hint.whole_rank),
                                         time_limit=time_limit, workers=workers, seed=seed)
                cut, whole_rank = res["cut"], res["whole_rank"]
                status = res["status"]
                extra.update({k: res[k] for k in ("objective", "bound", "scale", "build_s", "solve_s")})
            mixed = candidate(strategy, hybrid_chunks(lengths, cp, cut, whole_rank))
            n_cut = int(np.count_nonzero(cut))
            extra.update(cut_documents=n_cut, whole_documents=len(lengths) - n_cut)
            if strategy == "cpsat":
                cands = [mixed]  # the exact reference reports its own decision, not a fallback
            elif n_cut == len(lengths):
                cands = [doc_cand, seq_cand]  # identical to per_doc: report it as such
            else:
                cands = [mixed, doc_cand, seq_cand]
            mixed_tokens = np.bincount(mixed[1][:, 0], weights=mixed[1][:, 3], minlength=cp)
            if mixed_tokens.max(initial=0) > token_cap:  # pragma: no cover - the solvers enforce it
                raise RuntimeError(f"{strategy} broke its token bound {token_cap}: {mixed_tokens.tolist()}")
        chosen = min(cands, key=lambda c: float(np.max(c[2])))
        extra.update(predicted_max={c[0]: float(np.max(c[2])) for c in cands})

    name, chunks, loads = chosen
    tokens = chunk_tokens(chunks, cp)
    objective = float(np.max(loads))
    bound = gap = None
    if extra.get("bound") is not None:
        bound = extra["bound"]
        gap = max(0.0, (objective - bound) / objective) if objective > 0 else 0.0
    info = SolveInfo(method=strategy, status=status, objective=objective, bound=bound, gap=gap,
                     wall_s=time.perf_counter() - t0, extra=extra)
    return ShardPlan(cp=cp, strategy=name, lengths=lengths, offsets=offsets, chunks=chunks, loads=loads,
                     tokens=tokens, requested=strategy, info=info)


BATCHED_STRATEGIES = ("per_seq", "per_doc", "adaptive", "hybrid")
"""The strategies `solve_shards` makes the chunk tables of for all micro-batches at once
("cpsat": one `solve_shard` per micro-batch)."""


def solve_shards(plan: PackPlan, cp: int | None = None, strategy: ShardStrategy | str = "per_doc",
                 cost: CostModel | None = None, **options) -> list[ShardPlan | None]:
    """`solve_shard` of every micro-batch of a step's `plan`: one ShardPlan per micro-batch,
    in `plan.micro_batches` order (None for an empty micro-batch).

    Each is the ShardPlan `solve_shard(plan.lengths[mb], cp, strategy, cost,
    offsets=plan.offsets[mb], **options)` returns: the same chunk table, loads (the same
    floats) and tokens, the same strategy taken ("cpsat": where its searches prove their
    optimum, see `solve_shard`); only `info.wall_s` differs (each gets the
    batch's time over its micro-batches). For "per_seq", "per_doc", "adaptive" and "hybrid"
    the chunk tables and their costs are made for all micro-batches together, a few array
    operations per step rather than per micro-batch ("hybrid" still decides each
    micro-batch's documents apart, `chunk_rules.hybrid_assign`); "cpsat" runs `solve_shard`
    on each. `options`: `solve_shard`'s keyword options (`token_skew`, `time_limit`,
    `workers`, `seed`), which only "hybrid" and "cpsat" read.
    """
    if not isinstance(plan, PackPlan):
        raise ValueError(f"plan must be a wlb_opt.PackPlan (a step's packing), got {type(plan).__name__}")
    cp, cost = _cp_and_cost(cp, cost)  # checked once, even when every micro-batch is empty
    mbs = [np.asarray(mb, dtype=np.int64) for mb in plan.micro_batches]
    unknown = sorted(set(options) - {"token_skew", "time_limit", "workers", "seed"})
    if unknown:
        raise ValueError(f"unknown options {unknown}; solve_shard takes token_skew, time_limit, workers, seed")
    n = len(plan.lengths)
    every = np.concatenate(mbs) if mbs else np.zeros(0, dtype=np.int64)
    if len(every) and (int(every.min()) < 0 or int(every.max()) >= n):
        k, mb = next((k, mb) for k, mb in enumerate(mbs) if len(mb) and (mb.min() < 0 or mb.max() >= n))
        raise ValueError(f"plan.micro_batches[{k}] holds piece index {int(mb[(mb < 0) | (mb >= n)][0])}, outside "
                         f"0 .. {n - 1} (the plan's pieces)")
    all_lengths = validate_lengths(plan.lengths, "plan.lengths")  # an error names the plan's piece index
    if strategy not in BATCHED_STRATEGIES:
        check_choice("strategy", strategy, SHARD_STRATEGIES)
        return [solve_shard(plan.lengths[mb], cp, strategy, cost, offsets=plan.offsets[mb], **options)
                if len(mb) else None for mb in mbs]
    t0 = time.perf_counter()
    token_skew = options.get("token_skew", DEFAULT_TOKEN_SKEW)
    if not (is_float(token_skew) and token_skew >= 0):
        raise ValueError(f"token_skew must be a number >= 0 (or math.inf), got {token_skew!r}")
    check_positive_real("time_limit", options.get("time_limit", 10.0), "seconds", allow_inf=True)  # as solve_shard
    check_int("workers", options.get("workers", 1), 1, MAX_WORKERS)  # as solve_shard
    check_int("seed", options.get("seed", 0), 0, SEED_MAX)
    full = [k for k, mb in enumerate(mbs) if len(mb)]
    out: list[ShardPlan | None] = [None] * len(mbs)
    if not full:
        return out
    order = every  # the non-empty micro-batches' pieces, in their order
    lengths = all_lengths[order]
    offsets = validate_offsets(plan.offsets[order], len(lengths))
    counts = np.array([len(mbs[k]) for k in full], dtype=np.int64)
    n_mb, costs = len(full), ShardCosts(cost, cp)
    doc_at = np.concatenate([[0], np.cumsum(counts)]).tolist()
    tables, raw_doc = {}, None
    if strategy != "per_seq":
        raw_doc = _per_doc_raw(lengths, counts, cp)
        tables["per_doc"] = merge_chunk_rows(lengths, counts, *raw_doc)
    if strategy != "per_doc":
        tables["per_seq"] = merge_chunk_rows(lengths, counts, *per_seq_chunks_many(lengths, counts, cp))
    loads = _table_loads(tables, costs, n_mb, lengths if strategy == "hybrid" else None)
    extras: list[dict] = [{} for _ in full]
    if strategy == "hybrid":
        whole_cost = loads.pop("whole")
        cut, whole_rank = _hybrid_decisions(lengths, counts, doc_at, cp, tables["per_doc"], loads.pop("segments"),
                                            whole_cost, float(token_skew), extras)
        tables["hybrid"] = _hybrid_rows(lengths, counts, raw_doc, cut, whole_rank)
        loads["hybrid"] = _table_loads({"hybrid": tables["hybrid"]}, costs, n_mb)["hybrid"]
    else:
        loads.pop("segments")
    ends = {name: np.searchsorted(table[:, 0], np.arange(n_mb + 1)).tolist() for name, table in tables.items()}
    maxima = {name: table.max(axis=1).tolist() for name, table in loads.items()}
    each_s = (time.perf_counter() - t0) / n_mb
    for j, k in enumerate(full):
        extra = extras[j]
        if strategy in ("adaptive", "hybrid"):
            # the candidates in solve_shard's order; the first of the least maxima is taken
            names = ["per_doc", "per_seq"]
            if strategy == "hybrid" and extra["whole_documents"]:
                names.insert(0, "hybrid")
            name = min(names, key=lambda c: maxima[c][j])
            extra["predicted_max"] = {c: maxima[c][j] for c in names}
        else:
            name = strategy
        chunks = tables[name][ends[name][j]:ends[name][j + 1], 1:]
        tokens = chunk_tokens(chunks, cp)
        if name == "hybrid" and tokens.max(initial=0) > extra.pop("token_cap"):  # pragma: no cover
            raise RuntimeError(f"hybrid broke its token bound: {tokens.tolist()}")
        extra.pop("token_cap", None)
        info = SolveInfo(method=strategy, status="heuristic", objective=maxima[name][j], wall_s=each_s, extra=extra)
        span = slice(doc_at[j], doc_at[j + 1])
        out[k] = ShardPlan(cp=cp, strategy=name, lengths=lengths[span], offsets=offsets[span], chunks=chunks,
                           loads=loads[name][j], tokens=tokens, requested=strategy, info=info)
    return out


def _table_loads(tables: dict, costs: ShardCosts, n_mb: int, whole: np.ndarray | None = None) -> dict:
    """{name: [n_mb, cp] loads} of `merge_chunk_rows` tables, their rows costed in one
    `segment_cost` call and summed per (micro-batch, rank) in each table's own row order (the
    floats of `ShardCosts.loads` on each micro-batch's table), and "segments": the first
    table's row costs; with `whole` (lengths), "whole": the cost of each of those documents
    whole on one rank (`_decision_costs`' whole_cost), from the same call."""
    q_len = [table[:, 4] for table in tables.values()]
    k_len = [table[:, 3] + table[:, 4] for table in tables.values()]
    if whole is not None:
        q_len.append(whole)
        k_len.append(whole)
    seg = costs.segment_cost(np.concatenate(q_len), np.concatenate(k_len))
    cp, out, at = costs.cp, {}, 0
    for n, (name, table) in enumerate(tables.items()):
        rows = len(table)
        if n == 0:
            out["segments"] = seg[:rows]
        out[name] = np.bincount(table[:, 0] * cp + table[:, 1], weights=seg[at:at + rows],
                                minlength=n_mb * cp).reshape(n_mb, cp) + costs.mb_const
        at += rows
    if whole is not None:
        out["whole"] = seg[at:]
    return out


def _hybrid_decisions(lengths, counts, doc_at, cp, doc_table, doc_segments, whole_cost, token_skew, extras):
    """(cut, whole_rank) over all documents: `hybrid_assign` on each micro-batch, with the
    decision costs of `_decision_costs` (the per_doc rows of each document summed per rank,
    in the table's order) and `solve_shard`'s token cap; each micro-batch's `extras` get
    evaluated, cut_documents, whole_documents and token_cap."""
    n = len(lengths)
    doc = np.asarray(doc_at[:-1], dtype=np.int64)[doc_table[:, 0]] + doc_table[:, 2]  # numbered over all micro-batches
    cut_cost, cut_tokens = _cut_costs(n, cp, doc, doc_table[:, 1], doc_segments, doc_table[:, 4])
    totals = np.add.reduceat(lengths, doc_at[:-1]).tolist()
    cut, whole_rank = np.zeros(n, dtype=bool), np.full(n, -1, dtype=np.int64)
    for j, extra in enumerate(extras):
        span = slice(doc_at[j], doc_at[j + 1])
        token_cap = (1.0 + token_skew) * totals[j] / cp
        token_cap = math.ceil(token_cap) if math.isfinite(token_cap) else math.inf
        res = hybrid_assign(whole_cost[span], cut_cost[span], lengths[span], cut_tokens[span], token_cap)
        cut[span], whole_rank[span] = res.cut, res.whole_rank
        n_cut = int(np.count_nonzero(res.cut))
        extra.update(evaluated=res.evaluated, cut_documents=n_cut, whole_documents=len(res.cut) - n_cut,
                     token_cap=token_cap)
    return cut, whole_rank


def _hybrid_rows(lengths, counts, raw_doc, cut, whole_rank) -> np.ndarray:
    """`hybrid_chunks` of every micro-batch, as `merge_chunk_rows`: the per_doc chunks of the
    documents cut, each other document whole on its rank."""
    mb, rank, doc, start, length = raw_doc
    first_doc = np.cumsum(counts) - counts
    keep = cut[first_doc[mb] + doc]
    whole = np.flatnonzero(~cut)
    whole_mb = np.repeat(np.arange(len(counts)), counts)[whole]
    return merge_chunk_rows(lengths, counts, np.concatenate([mb[keep], whole_mb]),
                           np.concatenate([rank[keep], whole_rank[whole]]),
                           np.concatenate([doc[keep], whole - first_doc[whole_mb]]),
                           np.concatenate([start[keep], np.zeros(len(whole), np.int64)]),
                           np.concatenate([length[keep], lengths[whole]]))


def _per_doc_raw(lengths: np.ndarray, counts: np.ndarray, cp: int) -> tuple[np.ndarray, ...]:
    """The per_doc chunks of consecutive micro-batches (`counts` documents each) of
    `lengths`, before `merge_chunk_rows`: (micro-batch, rank, doc inside it, start, length);
    the round-robin pointer restarts at 0 in each micro-batch."""
    mb_of = np.repeat(np.arange(len(counts)), counts)
    first_doc = np.cumsum(counts) - counts
    rem = lengths % (2 * cp)
    restart = -(np.cumsum(rem) - rem)[first_doc][mb_of]  # the remainders before the micro-batch, undone
    rank, doc, start, length = chunks_of(per_doc_chunk_sizes(lengths, cp, restart), np.arange(len(lengths)), cp)
    mb = mb_of[doc]
    return mb, rank, doc - first_doc[mb], start, length


def _decision_costs(lengths: np.ndarray, cp: int, costs: ShardCosts, per_doc_chunks_table: np.ndarray):
    """whole_cost[i] (document whole on one rank), cut_cost[i, r] and cut_tokens[i, r]
    (document cut per document; rows of the canonical per_doc chunk table summed by rank)."""
    whole_cost = costs.segment_cost(lengths, lengths)
    rank, doc, start, length = (per_doc_chunks_table[:, j] for j in range(4))
    seg = costs.segment_cost(length, start + length)
    return (whole_cost, *_cut_costs(len(lengths), cp, doc, rank, seg, length))


def _cut_costs(n: int, cp: int, doc: np.ndarray, rank: np.ndarray, seg: np.ndarray, length: np.ndarray):
    """(cut_cost [n, cp], cut_tokens [n, cp]) of n documents from the rows of their per_doc
    chunk tables (document, rank, cost, tokens), summed per (document, rank) in row order."""
    key = doc * cp + rank
    cut_cost = np.bincount(key, weights=seg, minlength=n * cp).reshape(n, cp)
    cut_tokens = np.bincount(key, weights=length, minlength=n * cp).reshape(n, cp).astype(np.int64)
    return cut_cost, cut_tokens


def per_doc_sizes(lengths, cp: int) -> np.ndarray:
    """[n, 2*CP] per-document chunk sizes under the round-robin remainder rule (docs/architecture.md, "Invariants")."""
    lengths, cp, _, _ = _validate(lengths, cp, "per_doc", None, None)
    return per_doc_chunk_sizes(lengths, cp)


def cut_or_whole_lower_bound(lengths, cp: int, cost: CostModel | None = None) -> float:
    """A lower bound (seconds) on the max-rank load of every cut-or-whole plan (hybrid, cpsat).

    Each document costs at least min(whole cost, sum over ranks of its cut cost) in total, and
    the slowest rank carries at least the mean: sum_i min(...) / cp + mb_const.
    """
    lengths, cp, _, cost = _validate(lengths, cp, "hybrid", None, cost)
    costs = ShardCosts(cost, cp)
    chunks = merge_chunks(lengths, *per_doc_chunks(lengths, cp))
    whole_cost, cut_cost, _ = _decision_costs(lengths, cp, costs, chunks)
    return float(np.minimum(whole_cost, cut_cost.sum(axis=1)).sum() / cp + costs.mb_const)
