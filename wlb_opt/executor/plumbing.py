"""Data plumbing between plans and tensors: cross-rank plan checks, per-rank inputs, and
waits that say who waited on what.

- `check_same_plan`: one digest per micro-batch over the PackPlan and its ShardPlan,
  compared across ranks before a step; a mismatch raises on every rank.
- `reporting_waits`: a collective or p2p wait that fails (a timeout, a peer gone) raises a
  RuntimeError naming the step, this rank and the operation, not only the backend's text.
"""
from __future__ import annotations

import hashlib
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist


def micro_batch_digests(plan, shards=None) -> list[tuple[str, str | None]]:
    """One (plan digest, shard digest) pair per micro-batch of `plan`, and a last pair for
    what is not in a micro-batch (the deferred pieces, dp and n_micro).

    The plan part hashes the micro-batch's pieces in packed order (id, offset, length) and
    its replica; the shard part is `shards[j].digest()` (None where `shards` is None, holds
    None, or the micro-batch is empty: an empty slot runs on zero rows whatever its shard).
    """
    out: list[tuple[str, str | None]] = []
    for j, mb in enumerate(plan.micro_batches):
        h = hashlib.sha256(f"mb {j} replica {int(plan.replica_of[j])}|".encode())
        for arr in (plan.doc_ids[mb], plan.offsets[mb], plan.lengths[mb]):
            h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
            h.update(b"|")
        shard = shards[j] if shards is not None and j < len(shards) and len(mb) else None
        out.append((h.hexdigest(), None if shard is None else shard.digest()))
    h = hashlib.sha256(f"dp {plan.dp} n_micro {plan.n_micro} pieces {len(plan.doc_ids)}|".encode())
    for arr in (plan.doc_ids[plan.deferred], plan.offsets[plan.deferred], plan.lengths[plan.deferred]):
        h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
        h.update(b"|")
    out.append((h.hexdigest(), None))
    return out


def first_difference(per_rank: list[list[tuple[str, str | None]]]) -> str | None:
    """What the first differing entry of `per_rank` (one `micro_batch_digests` list per rank)
    is, in words, or None if every rank agrees. Shard digests are compared among the ranks
    that hold one."""
    n = max(len(d) for d in per_rank)
    if any(len(d) != n for d in per_rank):
        return f"the number of micro-batches ({sorted({len(d) - 1 for d in per_rank})} across ranks)"
    for j in range(n):
        what = f"micro-batch {j}" if j < n - 1 else "the deferred pieces (or dp / n_micro)"
        if len({d[j][0] for d in per_rank}) > 1:
            ranks = _ranks_by_value([d[j][0] for d in per_rank])
            return f"{what}: its pieces differ (ranks grouped by what they hold: {ranks})"
        held = [d[j][1] for d in per_rank]
        if len({x for x in held if x is not None}) > 1:
            ranks = _ranks_by_value(held)
            return f"{what}: its CP shard plan differs (ranks grouped by what they hold: {ranks})"
    return None


def _ranks_by_value(values: list) -> list[list[int]]:
    groups: dict = {}
    for rank, value in enumerate(values):
        if value is not None:
            groups.setdefault(value, []).append(rank)
    return sorted(groups.values())


def check_same_plan(plan, shards=None, group=None) -> str:
    """Raise RuntimeError on every rank of `group` unless all of them hold the same plan.

    Each rank hashes every micro-batch of `plan` (its pieces and replica) together with
    `shards[j]`, the ShardPlan it will run it with (`micro_batch_digests`), and the ranks
    exchange the digests (one all_gather_object). A rank that drifted (other data order,
    seed, packer state or CP strategy) would otherwise deadlock or, worse, train silently
    on other tokens: two ranks sharding one micro-batch `per_doc` and `per_seq` make the
    same collectives and a wrong gradient. The error names the step (`plan.step`) and the
    first micro-batch that differs, on every rank alike. Shards are compared among the
    ranks that pass one for a micro-batch (None: not run here).

    Returns `plan.digest()` when `shards` is None, else one SHA-256 over the plan's and
    every shard's digest (equal on every rank once the check passed).
    """
    from ..plan import PackPlan, ShardPlan

    if not isinstance(plan, PackPlan):
        raise ValueError(f"plan must be a wlb_opt.PackPlan, got {type(plan).__name__}")
    if shards is not None and (not isinstance(shards, (list, tuple))
                               or any(s is not None and not isinstance(s, ShardPlan) for s in shards)):
        raise ValueError("shards must be None or a list with one ShardPlan (or None) per micro-batch, got "
                         f"{type(shards).__name__}")
    return _check_same_plan(plan, shards, group, plan.step)


def _check_same_plan(plan, shards, group, step) -> str:
    mine = micro_batch_digests(plan, shards)
    if dist.is_available() and dist.is_initialized():
        per_rank: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(per_rank, mine, group=group)
        problem = first_difference(per_rank)
        if problem is not None:
            where = "" if step is None else f"step {step}: "
            raise RuntimeError(f"{where}ranks hold different plans; first difference at {problem}. Every rank must "
                               "run the same PackPlan and ShardPlans (same data order, seed, packer state and CP "
                               "strategy); plan on one rank and broadcast_plan it if planning is not deterministic")
    if shards is None:
        return plan.digest()
    h = hashlib.sha256(plan.digest().encode())
    for _, shard_digest in mine:
        h.update((shard_digest or "-").encode())
    return h.hexdigest()


def broadcast_plan(plan, src: int = 0, group=None):
    """Plan on one rank, execute everywhere: rank `src` sends its PackPlan (or ShardPlan) to
    every rank of `group`, which returns an equal plan (same digest). For planners that are
    not deterministic across processes, e.g. an exact solver with a wall-clock limit."""
    if not dist.is_available() or not dist.is_initialized():
        return plan
    payload = [plan.to_dict() if dist.get_rank() == src else None]
    dist.broadcast_object_list(payload, src=src, group=group)
    if dist.get_rank() == src:
        return plan
    return type(plan).from_dict(payload[0]) if plan is not None else _from_dict(payload[0])


def _from_dict(d: dict):
    from ..plan import PackPlan, ShardPlan

    return ShardPlan.from_dict(d) if "chunks" in d else PackPlan.from_dict(d)


def local_inputs(tokens: torch.Tensor, shard, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, RoPE positions) of CP rank `rank` for one packed micro-batch.

    `tokens` is the micro-batch in packed order; the result is in shard.rank_indices[rank]
    order, the order context_parallel_attention expects for q, k and v.
    """
    idx = torch.tensor(shard.rank_indices[rank], dtype=torch.int64).to(tokens.device)
    pos = torch.tensor(shard.positions[rank], dtype=torch.int64).to(tokens.device)
    return tokens.index_select(0, idx), pos


_COMM_FAILURE_WORDS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe")


def _is_comm_failure(exc: BaseException) -> bool:
    backend_error = getattr(dist, "DistBackendError", None)
    text = str(exc).lower()
    return (backend_error is not None and isinstance(exc, backend_error)) or any(w in text for w in _COMM_FAILURE_WORDS)


@contextmanager
def reporting_waits(step, rank: int, operation):
    """Run a wait; if the backend fails it (a timeout, a peer gone), raise a RuntimeError
    naming `step`, `rank` and `operation` (a string, or a callable returning one, built
    only on failure). Other errors pass through unchanged."""
    try:
        yield
    except RuntimeError as exc:
        if not _is_comm_failure(exc):
            raise
        what = operation() if callable(operation) else operation
        where = "step ?" if step is None else f"step {step}"
        raise RuntimeError(f"{where}, rank {rank}: {what} did not complete ({type(exc).__name__}: "
                           f"{str(exc).strip()[:300]}). A peer rank stalled or failed: look at the ranks this one "
                           "waited on; make_mesh(timeout=...) sets how long the mesh's groups wait") from exc
