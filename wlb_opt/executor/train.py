"""One training step of a PackPlan under CP x DP, with loss normalised over the global batch.

For every micro-batch of its replica (plan.replica_of), a rank gathers its CP shard's token
ids, RoPE positions and labels, runs the model with context_parallel_attention, and
back-propagates `sum(token losses) / (target tokens of the whole global batch)`. Dividing by
the global count, never per micro-batch, keeps variable-length micro-batches from
re-weighting tokens (DESIGN.md). Gradients and the loss are then summed over all CP and DP
ranks, which gives exactly the single-process gradient of the global mean loss.

The pipeline dimension is not executed here (see wlb_opt.simulate for its timing model).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from .cp_attention import context_parallel_attention
from .mesh import Mesh
from .plumbing import check_same_plan

IGNORE = -100


def packed_positions(lengths, offsets) -> np.ndarray:
    """Position of every packed token inside its document (piece offset + index in the piece)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) - starts + np.repeat(np.asarray(offsets, np.int64), lengths)


def packed_labels(tokens: torch.Tensor, lengths) -> torch.Tensor:
    """Next-token targets inside each piece; IGNORE at the last token of every piece."""
    labels = torch.full_like(tokens, IGNORE)
    start = 0
    for d in np.asarray(lengths, dtype=np.int64).tolist():
        labels[start: start + d - 1] = tokens[start + 1: start + d]
        start += d
    return labels


def target_tokens(plan) -> int:
    """Target tokens of the whole global batch (all replicas and micro-batches of the plan)."""
    placed = np.concatenate(plan.micro_batches) if plan.micro_batches else np.zeros(0, np.int64)
    return int((plan.lengths[placed] - 1).sum())


def pack_tokens(plan, j: int, doc_tokens: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """Token ids of micro-batch j in packed order; doc_tokens(id) returns a whole document."""
    parts = [doc_tokens(int(plan.doc_ids[i]))[int(plan.offsets[i]): int(plan.offsets[i] + plan.lengths[i])]
             for i in plan.micro_batches[j]]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def train_step(model: torch.nn.Module, plan, shards: list, doc_tokens: Callable[[int], torch.Tensor],
               mesh: Mesh | None = None, backend: str = "auto", check_plan: bool = True) -> float:
    """Forward and backward of one global batch; returns the global mean token loss.

    `shards[j]` is the ShardPlan of micro-batch j (cp ranks = mesh.cp). Gradients are left
    in `param.grad`, summed over all ranks; call the optimiser afterwards.
    """
    cp_rank = mesh.cp_rank if mesh else 0
    dp_rank = mesh.dp_rank if mesh else 0
    cp_group = mesh.cp_group if mesh else None
    if mesh and plan.dp != mesh.dp:
        raise ValueError(f"plan has dp={plan.dp} replicas but the mesh has dp={mesh.dp}")
    if check_plan:
        check_same_plan(plan)
    total = target_tokens(plan)
    if total == 0:
        raise ValueError("the global batch has no target tokens (every piece has length 1)")
    device = next(model.parameters()).device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for j in plan.replica_micro_batches(dp_rank):
        if len(plan.micro_batches[j]) == 0:
            continue
        lengths = plan.lengths[plan.micro_batches[j]]
        offsets = plan.offsets[plan.micro_batches[j]]
        shard = shards[j]
        if len(shard.rank_indices) != (mesh.cp if mesh else 1):
            raise ValueError(f"shard of micro-batch {j} has {len(shard.rank_indices)} CP ranks, mesh has {mesh.cp if mesh else 1}")
        tokens = pack_tokens(plan, j, doc_tokens).to(device)
        labels = packed_labels(tokens, lengths)
        positions = torch.from_numpy(packed_positions(lengths, offsets)).to(device)
        idx = torch.from_numpy(np.asarray(shard.rank_indices[cp_rank], dtype=np.int64)).to(device)

        def attend(q, k, v, shard=shard):
            return context_parallel_attention(q, k, v, shard, group=cp_group, backend=backend)

        logits = model(tokens[idx], positions[idx], attend)
        loss = F.cross_entropy(logits.float() if logits.dtype == torch.float16 else logits, labels[idx],
                               ignore_index=IGNORE, reduction="sum") / total
        loss.backward()
        loss_sum += loss.detach().to(torch.float64)
    if mesh is not None and dist.is_initialized():
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
        dist.all_reduce(loss_sum)
    return float(loss_sum)
