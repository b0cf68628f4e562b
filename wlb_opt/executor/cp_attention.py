"""Context-parallel attention over a ShardPlan: all-gather K/V, attend, reduce-scatter dK/dV.

Llama-3-style CP (paper §4.2): each CP rank holds the tokens `shard.rank_indices[rank]` of
one packed micro-batch. Forward all-gathers K and V (one collective, K and V side by side),
restores the micro-batch's packed order from the rank-major gather, and runs one
document-masked attention call over `shard.segments[rank]`. Backward is autograd through
the same steps: the gradient of the order restore scatters dK/dV back to rank-major order,
and the gradient of the gather reduce-scatters it, so each rank receives the summed
gradient of exactly its own tokens.

The released WLB-LLM code reduce-scatters dK/dV while they are still in packed order, which
hands gradients to the wrong ranks (the released WLB-LLM code's dK/dV layout bug; docs/architecture.md, "Invariants"); tests/test_executor.py compares this
path with a single-process reference, never with itself.

Ranks may hold different token counts (per_doc differs by one, hybrid by more): only the
communication buffers are padded to the largest count, never the attention.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def _rank_and_world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class _GatherRankMajor(torch.autograd.Function):
    """All-gather variable-size row blocks in rank order; backward is a reduce-scatter."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: tuple[int, ...], rank: int, group: Any) -> torch.Tensor:
        width = max(counts)
        buf = x.new_zeros((width,) + tuple(x.shape[1:]))
        buf[: x.shape[0]] = x
        parts = [torch.empty_like(buf) for _ in counts]
        dist.all_gather(parts, buf, group=group)
        ctx.counts, ctx.rank, ctx.group = counts, rank, group
        return torch.cat([p[:c] for p, c in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        counts, rank, group = ctx.counts, ctx.rank, ctx.group
        width = max(counts)
        padded = grad.new_zeros((len(counts), width) + tuple(grad.shape[1:]))
        for r, chunk in enumerate(torch.split(grad, list(counts))):
            padded[r, : chunk.shape[0]] = chunk
        if dist.get_backend(group) == "nccl":
            out = grad.new_empty((width,) + tuple(grad.shape[1:]))
            dist.reduce_scatter_tensor(out, padded.reshape((-1,) + tuple(grad.shape[1:])), group=group)
        else:  # gloo has no reduce-scatter: all-reduce, keep this rank's block (same result)
            dist.all_reduce(padded, group=group)
            out = padded[rank]
        return out[: counts[rank]], None, None, None


def packed_order_index(shard, device: torch.device | str = "cpu") -> torch.Tensor:
    """Index that maps the rank-major gather (rank 0's tokens, rank 1's, ...) to packed order."""
    rank_major = np.concatenate([np.asarray(ix, dtype=np.int64) for ix in shard.rank_indices])
    if len(rank_major) and not np.array_equal(np.sort(rank_major), np.arange(len(rank_major))):
        raise ValueError("shard.rank_indices must partition the micro-batch's token positions 0..T-1")
    return torch.from_numpy(np.argsort(rank_major, kind="stable")).to(device)


def gather_packed(x: torch.Tensor, shard, group=None) -> torch.Tensor:
    """This rank's rows `x` -> the whole micro-batch in packed order (differentiable)."""
    rank, world = _rank_and_world(group)
    counts = tuple(int(len(ix)) for ix in shard.rank_indices)
    if len(counts) != world:
        raise ValueError(f"shard plan has {len(counts)} CP ranks but the process group has {world}")
    if x.shape[0] != counts[rank]:
        raise ValueError(f"rank {rank} holds {counts[rank]} tokens in the shard plan, got a tensor of {x.shape[0]} rows")
    full = x if world == 1 else _GatherRankMajor.apply(x, counts, rank, group)
    return full.index_select(0, packed_order_index(shard, x.device))


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard, group=None,
                               softmax_scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """Document-masked causal attention of this CP rank's queries over the whole micro-batch.

    Args:
        q: ``[Tq, Hq, D]`` this rank's queries, rows in the order of shard.rank_indices[rank].
        k, v: ``[Tq, Hkv, D]`` this rank's keys and values, same rows.
        shard: a ShardPlan (rank_indices, segments) made for this micro-batch and CP size.
        group: the CP process group (None: the default group; no group initialised: cp=1).
        softmax_scale, backend: passed to `wlb_opt.kernels.doc_attention`.

    Returns ``[Tq, Hq, D]``: attention output for this rank's queries.
    """
    from ..kernels import doc_attention

    rank, _ = _rank_and_world(group)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k hold different token counts: {q.shape[0]} vs {k.shape[0]}")
    kv = gather_packed(torch.cat([k, v], dim=-1), shard, group)  # one collective for K and V
    k_full, v_full = kv.split(k.shape[-1], dim=-1)
    return doc_attention(q, k_full.contiguous(), v_full.contiguous(), shard.segments[rank],
                         softmax_scale=softmax_scale, backend=backend)
