"""Data plumbing between plans and tensors: cross-rank plan checks and per-rank inputs."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist


def check_same_plan(plan, group=None) -> str:
    """Raise RuntimeError unless every rank of `group` holds a plan with the same digest.

    Heuristic planning is deterministic given (lengths, ids, seed, state), so ranks that
    plan independently must agree; this catches a rank that drifted (different data order,
    seed or packer state) before it deadlocks or trains on the wrong tokens.
    """
    digest = plan.digest()
    if not dist.is_available() or not dist.is_initialized():
        return digest
    digests: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) != 1:
        raise RuntimeError(f"ranks hold different plans: digests {sorted(set(d[:12] for d in digests))}")
    return digest


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
