"""One training step of a PackPlan under CP x DP, with loss normalised over the global batch.

For every micro-batch of its replica (plan.replica_of), a rank gathers its CP shard's token
ids, RoPE positions and labels, runs the model with context_parallel_attention, and
back-propagates `sum(token losses) / (target tokens of the whole global batch)`. Dividing by
the global count, never per micro-batch, keeps variable-length micro-batches from
re-weighting tokens (docs/architecture.md, "Invariants"). Gradients and the loss are then summed over all CP and DP
ranks, which gives exactly the single-process gradient of the global mean loss.

With a pipeline (mesh.pp > 1) each rank holds one stage (`split_stages`) and runs the
1F1B order; see `train_step`.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..schedule import stage_order
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


class StageOutputs:
    """Per-step record of what a rank ran: (phase, micro-batch, seconds) per operation.

    Seconds count compute only (from after the receive of the op's input to the end of the
    op, its send included), so they are the per-operation durations `simulate_pipeline`
    takes; time spent waiting for a neighbour stage is bubble, which the simulator predicts.
    """

    def __init__(self) -> None:
        self.ops: list[tuple[str, int, float]] = []

    def busy_s(self) -> float:
        return float(sum(t for _, _, t in self.ops))


def train_step(model: torch.nn.Module, plan, shards: list, doc_tokens: Callable[[int], torch.Tensor],
               mesh: Mesh | None = None, backend: str = "auto", check_plan: bool = True,
               record: StageOutputs | None = None) -> float:
    """Forward and backward of one global batch; returns the global mean token loss.

    `model` is this rank's pipeline stage (the whole model when pp = 1; see
    `split_stages`). `shards[j]` is the ShardPlan of micro-batch j (cp ranks = mesh.cp).
    Micro-batches of this rank's DP replica run in the 1F1B order of
    `wlb_opt.schedule.stage_order` (the simulator's too); activations and their gradients go between stages with
    point-to-point sends whose sizes come from the plan (variable-length pipeline: every
    rank knows every micro-batch's length, so no shape handshake is needed). Gradients are
    summed over the ranks that hold the same stage, and left in `param.grad`.
    """
    cp, pp = (mesh.cp, mesh.pp) if mesh else (1, 1)
    cp_rank, pp_rank, dp_rank = (mesh.cp_rank, mesh.pp_rank, mesh.dp_rank) if mesh else (0, 0, 0)
    first, last = pp_rank == 0, pp_rank == pp - 1
    if mesh and plan.dp != mesh.dp:
        raise ValueError(f"plan has dp={plan.dp} replicas but the mesh has dp={mesh.dp}")
    if check_plan:
        check_same_plan(plan)
    total = target_tokens(plan)
    if total == 0:
        raise ValueError("the global batch has no target tokens (every piece has length 1)")
    param = next(model.parameters())
    device, act_dtype = param.device, param.dtype
    hidden = getattr(model, "hidden", None)
    if pp > 1 and hidden is None:
        raise ValueError("pipeline stages need a `hidden` attribute (activation width); use split_stages")

    mbs = [j for j in plan.replica_micro_batches(dp_rank) if len(plan.micro_batches[j])]
    for j in mbs:
        if len(shards[j].rank_indices) != cp:
            raise ValueError(f"shard of micro-batch {j} has {len(shards[j].rank_indices)} CP ranks, mesh has {cp}")

    def local(j: int):
        lengths = plan.lengths[plan.micro_batches[j]]
        idx = torch.tensor(shards[j].rank_indices[cp_rank], dtype=torch.int64).to(device)
        tokens = pack_tokens(plan, j, doc_tokens).to(device)
        positions = torch.from_numpy(packed_positions(lengths, plan.offsets[plan.micro_batches[j]])).to(device)
        return idx, tokens[idx], positions[idx], packed_labels(tokens, lengths)[idx]

    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    sends: list = []
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for phase, k, _ in stage_order(pp_rank, pp, len(mbs)):
        j = mbs[k]
        if phase == "F":
            idx, tok, pos, lab = local(j)
            if first:
                x = tok
            else:
                x = torch.empty(len(idx), hidden, dtype=act_dtype, device=device)
                if len(idx):
                    dist.recv(x, src=mesh.prev_stage_rank)
                x.requires_grad_()
            t0 = time.perf_counter()  # compute time only: waiting for the previous stage is bubble

            def attend(q, k_, v, shard=shards[j]):
                return context_parallel_attention(q, k_, v, shard, group=mesh.cp_group if mesh else None,
                                                  backend=backend)

            out = model(x, pos, attend)
            if last:
                loss = F.cross_entropy(out.float() if out.dtype == torch.float16 else out, lab,
                                       ignore_index=IGNORE, reduction="sum") / total
                loss_sum += loss.detach().to(torch.float64)
                out = loss
            elif len(idx):
                sends.append(dist.isend(out.detach().contiguous(), dst=mesh.next_stage_rank))
            inputs[j], outputs[j] = x, out
        else:
            out, x = outputs.pop(j), inputs.pop(j)
            if last:
                t0 = time.perf_counter()
                out.backward()
            else:
                grad = torch.zeros_like(out)
                if out.shape[0]:
                    dist.recv(grad, src=mesh.next_stage_rank)
                t0 = time.perf_counter()
                torch.autograd.backward(out, grad)
            if not first and x.shape[0]:
                sends.append(dist.isend(x.grad.contiguous(), dst=mesh.prev_stage_rank))
        if record is not None:
            record.ops.append((phase, j, time.perf_counter() - t0))
    for handle in sends:
        handle.wait()
    if mesh is not None and dist.is_initialized():
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=mesh.stage_group if mesh.stage_group is not None else None)
        dist.all_reduce(loss_sum)  # only last-stage ranks hold a share of the loss
    return float(loss_sum)
