"""Context-parallel attention over a ShardPlan: all-gather K/V, attend, reduce-scatter dK/dV.

Llama-3-style CP (paper §4.2): each CP rank holds the tokens `shard.rank_indices[rank]` of
one packed micro-batch. Forward all-gathers K and V (one `all_gather_into_tensor`, K and V
side by side in one padded buffer), restores the micro-batch's packed order with one
permutation copy, and runs one document-masked attention call over `shard.segments[rank]`
(K and V are strided views of the gathered buffer; the kernel takes strides). Backward
scatters dK/dV back to the rank-major layout and reduce-scatters them, so each rank receives
the summed gradient of exactly its own tokens.

The released WLB-LLM code reduce-scatters dK/dV while they are still in packed order, which
hands gradients to the wrong ranks (docs/architecture.md, "Invariants"); tests/distributed/test_executor.py
compares this path with a single-process reference, never with itself.

Hot path: everything that depends only on the ShardPlan (the packed-order permutation into
the padded gather buffer, token counts, the segment table) is built once per plan and
device, validated then, uploaded pinned and non-blocking, and reused by every layer
(`cp_context`). Ranks may hold different token counts (per_doc differs by one, hybrid by
more): only the communication buffers are padded to the largest count, never the attention.

`regather=True` (the default on GPU) does not keep the gathered K/V for backward: backward
gathers them again from the local K/V, as TransformerEngine does, trading one all-gather per
layer for cp x the local K/V of activation memory. Both give identical gradients.

Overlap: the next layer's K/V depend on this layer's output, so the all-gather can only
overlap work of its own layer that does not need K/V: the Q projection and its RoPE. A model
that computes K and V first calls `prefetch_kv(k, v, shard, group)` (an asynchronous
`all_gather_into_tensor`: NCCL's own stream on a GPU, gloo's worker thread on CPU), computes
Q, and passes the pending gather to `context_parallel_attention(..., prefetched=...)`
(`TinyLM`'s blocks do, through the executor's attention callable). The dK/dV reduce-scatter
feeds the K/V projections' backward directly (and through them the previous layer's whole
backward), so the previous layer cannot run under it. What can: the attention's own dQ
kernel. On the Triton path the dK/dV kernel runs first, its result starts an asynchronous
reduce-scatter (NCCL's stream), and the dQ kernel runs while it travels; the wait comes only
when autograd needs dK/dV. Also possible, not done: the Q projection's backward (it needs
only dQ) would need the attention and the projections in one autograd node. The gloo/torch
path stays synchronous.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .mesh import SELF_GROUP


def _rank_and_world(group) -> tuple[int, int]:
    if isinstance(group, str) and group == SELF_GROUP:  # a dimension of size 1: no communication
        return 0, 1
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def packed_order_index(shard, device: torch.device | str = "cpu") -> torch.Tensor:
    """Index that maps the rank-major gather (rank 0's tokens, rank 1's, ...) to packed order."""
    return _upload(packed_order(shard), device)


def packed_order(shard) -> np.ndarray:
    """`packed_order_index` on the host: the shard validated (a sort), then the argsort."""
    rank_major = np.concatenate([np.asarray(ix, dtype=np.int64) for ix in shard.rank_indices])
    if len(rank_major) and not np.array_equal(np.sort(rank_major), np.arange(len(rank_major))):
        raise ValueError("shard.rank_indices must partition the micro-batch's token positions 0..T-1")
    return np.argsort(rank_major, kind="stable")


def _upload(arr: np.ndarray, device) -> torch.Tensor:
    host = torch.from_numpy(np.ascontiguousarray(arr))
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class CPContext:
    """What every layer's CP attention needs from one ShardPlan, built once on one device.

    - `counts[r]`: tokens of rank r; `width`: the largest (the padded row count per rank);
    - `gather_index[t]`: row of packed position t in the padded rank-major gather buffer
      (rank r's i-th token sits at row r * width + i), on the device;
    - `segments`: this rank's segment table as a CPU int32 tensor (validated once).
    """

    def __init__(self, shard, rank: int, world: int, device: torch.device):
        counts = tuple(int(len(ix)) for ix in shard.rank_indices)
        if len(counts) != world:
            raise ValueError(f"shard plan has {len(counts)} CP ranks but the process group has {world}")
        rank_major = np.concatenate([np.asarray(ix, dtype=np.int64) for ix in shard.rank_indices])
        if len(rank_major) and not np.array_equal(np.sort(rank_major), np.arange(len(rank_major))):
            raise ValueError("shard.rank_indices must partition the micro-batch's token positions 0..T-1")
        self.rank, self.world, self.counts = rank, world, counts
        self.width = max(counts) if counts else 0
        padded_row = np.repeat(np.arange(world, dtype=np.int64) * self.width, counts) + (
            np.arange(len(rank_major), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts))
        gather_index = np.empty(len(rank_major), dtype=np.int64)
        gather_index[rank_major] = padded_row
        self.gather_index = _upload(gather_index, device)
        from ..kernels.segments import validate_segments

        segments = validate_segments(shard.segments[rank], counts[rank], len(rank_major))
        self.segments = torch.from_numpy(segments.astype(np.int32))


_CONTEXTS: OrderedDict[tuple, tuple[Any, CPContext]] = OrderedDict()
_CONTEXT_CACHE_SIZE = 64


def cp_context(shard, group=None, device: torch.device | str = "cpu", *, rank: int | None = None,
               world: int | None = None) -> CPContext:
    """The CPContext of `shard` on `device` for `group`, built on first use and then reused
    (a small cache keyed by the plan object, whose entry leaves when the plan is freed;
    ShardPlans are frozen, so it cannot go stale).
    `rank` and `world` override the group's (benchmarks and tools without a process group)."""
    if rank is None or world is None:
        rank, world = _rank_and_world(group)
    key = (id(shard), id(group), str(torch.device(device)), rank, world)
    hit = _CONTEXTS.get(key)
    if hit is not None and hit[0]() is shard:
        _CONTEXTS.move_to_end(key)
        return hit[1]
    ctx = CPContext(shard, rank, world, torch.device(device))
    # the entry leaves with its plan: a finished step's index tensors are not kept until 64 more come
    _CONTEXTS[key] = (weakref.ref(shard, lambda _, key=key: _CONTEXTS.pop(key, None)), ctx)
    if len(_CONTEXTS) > _CONTEXT_CACHE_SIZE:
        _CONTEXTS.popitem(last=False)
    return ctx


_NO_REDUCE_SCATTER: set[int] = set()


def _start_gather(x: torch.Tensor, cpx: CPContext, group, async_op: bool):
    """(padded rank-major buffer, work handle or None) of the all-gather of this rank's rows."""
    if cpx.world == 1:
        return x, None
    buf = x.new_zeros((cpx.width,) + tuple(x.shape[1:]))
    buf[: x.shape[0]] = x
    full = x.new_empty((cpx.world * cpx.width,) + tuple(x.shape[1:]))
    work = dist.all_gather_into_tensor(full, buf, group=group, async_op=async_op)
    return full, work


def _pack_kv(k: torch.Tensor, v: torch.Tensor, rows: int) -> torch.Tensor:
    """K and V side by side in one [rows, 2, Hkv, D] buffer (zero-padded past this rank's
    tokens): the one copy of each that the collective needs."""
    buf = k.new_zeros((rows, 2) + tuple(k.shape[1:])) if rows > k.shape[0] else k.new_empty((rows, 2) + tuple(k.shape[1:]))
    buf[: k.shape[0], 0] = k
    buf[: v.shape[0], 1] = v
    return buf


def _gather_kv(k: torch.Tensor, v: torch.Tensor, cpx: CPContext, group, async_op: bool = False):
    """(padded rank-major [world * width, 2, Hkv, D] buffer, work or None) of the K/V all-gather."""
    if cpx.world == 1:
        return _pack_kv(k, v, k.shape[0]), None
    buf = _pack_kv(k, v, cpx.width)
    full = k.new_empty((cpx.world * cpx.width, 2) + tuple(k.shape[1:]))
    return full, dist.all_gather_into_tensor(full, buf, group=group, async_op=async_op)


def _start_scatter_reduce_kv(dk: torch.Tensor, dv: torch.Tensor, cpx: CPContext, group,
                             async_op: bool = False) -> "_PendingGrad":
    """Packed-order dK, dV -> (pending) summed [rows, 2, Hkv, D] gradient of this rank's K and V rows."""
    padded = dk.new_zeros((cpx.world * cpx.width, 2) + tuple(dk.shape[1:]))
    padded[:, 0].index_copy_(0, cpx.gather_index, dk)
    padded[:, 1].index_copy_(0, cpx.gather_index, dv)
    return _start_reduce_scatter(padded, cpx, group, async_op)


def _gather(x: torch.Tensor, cpx: CPContext, group) -> torch.Tensor:
    """This rank's rows -> the whole micro-batch in packed order (no autograd)."""
    full, _ = _start_gather(x, cpx, group, async_op=False)
    return full.index_select(0, cpx.gather_index)


class PendingKV:
    """An all-gather of K and V in flight (from `prefetch_kv`); `result()` waits for it once and
    returns the gathered K/V in packed order, [T, 2, Hkv, D]."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, shard, group):
        self.cpx = cp_context(shard, group, k.device)
        self.shard, self.group = shard, group
        self._full, self._work = _gather_kv(k.detach(), v.detach(), self.cpx, group, async_op=True)
        self._kv = None

    def result(self) -> torch.Tensor:
        if self._kv is None:
            if self._work is not None:
                self._work.wait()
            self._kv = self._full.index_select(0, self.cpx.gather_index)
            self._full = self._work = None
        return self._kv


def prefetch_kv(k: torch.Tensor, v: torch.Tensor, shard, group=None) -> PendingKV:
    """Start the K/V all-gather of `context_parallel_attention` now, so that it overlaps the
    work that follows (the Q projection); pass the result as ``prefetched=``."""
    return PendingKV(k, v, shard, group)


def _scatter_reduce(grad: torch.Tensor, cpx: CPContext, group) -> torch.Tensor:
    """Packed-order gradient of the gathered rows -> the summed gradient of this rank's rows."""
    padded = grad.new_zeros((cpx.world * cpx.width,) + tuple(grad.shape[1:]))
    padded.index_copy_(0, cpx.gather_index, grad)
    return _reduce_scatter_padded(padded, cpx, group)


class _PendingGrad:
    """A reduce-scatter in flight: `result()` waits for it (on a GPU: the current stream waits
    on NCCL's, the host does not block) and returns this rank's rows of the sum."""

    def __init__(self, work, rows: torch.Tensor):
        self._work, self._rows = work, rows

    def result(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._rows


def _start_reduce_scatter(padded: torch.Tensor, cpx: CPContext, group, async_op: bool) -> _PendingGrad:
    """Start summing the padded rank-major buffer over the group (this rank's rows of the sum).
    Reduce-scatter where the group's backend has it, else an all-reduce (found out once per
    group: by capability, not by the backend's name)."""
    if cpx.world == 1:
        return _PendingGrad(None, padded[: cpx.counts[0]])
    if id(group) not in _NO_REDUCE_SCATTER:
        out = padded.new_empty((cpx.width,) + tuple(padded.shape[1:]))
        try:
            work = dist.reduce_scatter_tensor(out, padded, group=group, async_op=async_op)
            return _PendingGrad(work, out[: cpx.counts[cpx.rank]])
        except (RuntimeError, NotImplementedError) as exc:  # a backend without reduce-scatter
            if "support" not in str(exc).lower() and not isinstance(exc, NotImplementedError):
                raise
            _NO_REDUCE_SCATTER.add(id(group))
    work = dist.all_reduce(padded, group=group, async_op=async_op)
    return _PendingGrad(work, padded[cpx.rank * cpx.width: cpx.rank * cpx.width + cpx.counts[cpx.rank]])


def _reduce_scatter_padded(padded: torch.Tensor, cpx: CPContext, group) -> torch.Tensor:
    """Sum the padded rank-major buffer over the group; this rank's rows of the sum."""
    return _start_reduce_scatter(padded, cpx, group, async_op=False).result()


class _GatherPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cpx, group):
        ctx.cpx, ctx.group = cpx, group
        return _gather(x, cpx, group)

    @staticmethod
    def backward(ctx, grad):
        return _scatter_reduce(grad.contiguous(), ctx.cpx, ctx.group), None, None


def gather_packed(x: torch.Tensor, shard, group=None) -> torch.Tensor:
    """This rank's rows `x` -> the whole micro-batch in packed order (differentiable)."""
    cpx = cp_context(shard, group, x.device)
    if x.shape[0] != cpx.counts[cpx.rank]:
        raise ValueError(f"rank {cpx.rank} holds {cpx.counts[cpx.rank]} tokens in the shard plan, got a tensor of "
                         f"{x.shape[0]} rows")
    return _GatherPacked.apply(x, cpx, group)


def _attention_forward(q, k_full, v_full, cpx, scale, backend, deterministic):
    from ..kernels import attention_ops as _da
    from ..kernels import torch_attention as _ta
    from ..kernels.reference import attention_per_segment

    if backend == "torch":
        with torch.no_grad():
            if q.device.type == "cpu":  # the fused kernel's forward, its lse kept for the backward
                return _ta.sdpa_forward(q, k_full, v_full, cpx.segments.numpy(), scale)
            return attention_per_segment(q, k_full, v_full, cpx.segments.numpy(), scale)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or q.shape[-1] not in _da.TRITON_HEAD_DIMS:
        raise ValueError(f"the Triton backend takes fp16/bf16/fp32 and head dims {_da.TRITON_HEAD_DIMS}, got "
                         f"{q.dtype} and head dim {q.shape[-1]}; use backend='torch'")
    return _da._fwd_op(q, k_full, v_full, cpx.segments, scale, deterministic)


def _attention_backward(dout, q, k_full, v_full, out, lse, cpx, scale, backend, deterministic, on_dkdv=None):
    from ..kernels import attention_ops as _da
    from ..kernels import torch_attention as _ta
    from ..kernels.reference import attention_per_segment

    if backend == "torch" and q.device.type == "cpu":  # the fused kernel's backward, no recompute
        return _ta.sdpa_backward(dout, q, k_full, v_full, out, lse, None, cpx.segments.numpy(), scale)
    if backend == "torch":  # recompute the per-segment path under autograd
        with torch.enable_grad():
            qd, kd, vd = (t.detach().requires_grad_() for t in (q, k_full, v_full))
            o, _ = attention_per_segment(qd, kd, vd, cpx.segments.numpy(), scale)
            if not o.requires_grad:  # no segment on this rank (zero rows): nothing flows back
                return torch.zeros_like(q), torch.zeros_like(k_full), torch.zeros_like(v_full)
            grads = torch.autograd.grad(o, (qd, kd, vd), dout, allow_unused=True)
            return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, (qd, kd, vd)))
    return _da.backward_with_hook(dout, q, k_full, v_full, out, lse, None, cpx.segments, scale, deterministic,
                                  on_dkdv=on_dkdv)


class _CPAttention(torch.autograd.Function):
    """Gather K/V, attend; backward: (re-gather,) attention backward, reduce-scatter dK/dV."""

    @staticmethod
    def forward(ctx, q, k, v, cpx, group, scale, backend, deterministic, regather, prefetched):
        if prefetched is not None:  # started earlier, overlapping the Q projection
            kv = prefetched.result()
        else:  # [T, 2, Hkv, D] in packed order: one pack, the collective, one permutation copy
            kv = _gather_kv(k, v, cpx, group)[0].index_select(0, cpx.gather_index)
        out, lse = _attention_forward(q, kv[:, 0], kv[:, 1], cpx, scale, backend, deterministic)
        ctx.cpx, ctx.group, ctx.scale, ctx.backend = cpx, group, scale, backend
        ctx.deterministic, ctx.regather = deterministic, regather
        ctx.save_for_backward(q, k, v, out, lse, *(() if regather else (kv,)))
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *kept = ctx.saved_tensors
        kv = kept[0] if kept else _gather_kv(k, v, ctx.cpx, ctx.group)[0].index_select(0, ctx.cpx.gather_index)
        pending: list[_PendingGrad] = []

        def start_reduce(dk_full, dv_full):  # before the dQ kernel: the collective overlaps it
            pending.append(_start_scatter_reduce_kv(dk_full, dv_full, ctx.cpx, ctx.group, async_op=True))

        dq, dk_full, dv_full = _attention_backward(dout.contiguous(), q, kv[:, 0], kv[:, 1], out, lse, ctx.cpx,
                                                   ctx.scale, ctx.backend, ctx.deterministic, start_reduce)
        if not pending:  # the torch path, or no query attends to anything
            pending.append(_start_scatter_reduce_kv(dk_full, dv_full, ctx.cpx, ctx.group))
        dkv = pending[0].result()
        return dq, dkv[:, 0], dkv[:, 1], None, None, None, None, None, None, None


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard, group=None,
                               softmax_scale: float | None = None, backend: str = "auto",
                               regather: bool | None = None, deterministic: bool = True,
                               prefetched: PendingKV | None = None) -> torch.Tensor:
    """Document-masked causal attention of this CP rank's queries over the whole micro-batch.

    Args:
        q: ``[Tq, Hq, D]`` this rank's queries, rows in the order of shard.rank_indices[rank].
        k, v: ``[Tq, Hkv, D]`` this rank's keys and values, same rows.
        shard: a ShardPlan (rank_indices, segments) made for this micro-batch and CP size.
        group: the CP process group (None: the default group; no group initialised: cp=1).
        softmax_scale: defaults to 1 / sqrt(D).
        backend: "auto" (Triton on CUDA, torch on CPU), "triton" or "torch".
        regather: re-gather K/V in backward instead of saving them (default: True on GPU).
        deterministic: the Triton backward's mode (see `wlb_opt.kernels.doc_attention`).
        prefetched: the `prefetch_kv(k, v, shard, group)` of these k and v, already in flight.

    Returns ``[Tq, Hq, D]``: attention output for this rank's queries.
    """
    from ..kernels import attention_ops as _da

    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be one of ['auto', 'triton', 'torch'], got {backend!r}")
    if backend == "auto":
        _da._check_tensors(q, k, v, _da._TORCH_DTYPES)  # before q.is_cuda: q may be no tensor
        backend = "triton" if q.is_cuda else "torch"
    _da._check_tensors(q, k, v, _da._TORCH_DTYPES if backend == "torch" else _da._TRITON_DTYPES)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k hold different token counts: {q.shape[0]} vs {k.shape[0]}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    scale = _da._checked_scale(softmax_scale, q.shape[-1])
    cpx = cp_context(shard, group, q.device)
    if q.shape[0] != cpx.counts[cpx.rank]:
        raise ValueError(f"rank {cpx.rank} holds {cpx.counts[cpx.rank]} tokens in the shard plan, got q with "
                         f"{q.shape[0]} rows")
    regather = q.is_cuda if regather is None else bool(regather)
    if prefetched is not None and (prefetched.shard is not shard or prefetched.group is not group):
        raise ValueError("prefetched= comes from prefetch_kv of another shard plan or group")
    return _CPAttention.apply(q, k, v, cpx, group, scale, backend, deterministic, regather, prefetched)
