"""Document-masked attention over a segment table with torch's fused CPU attention kernel.

The ``backend="torch"`` path of :func:`~wlb_opt.kernels.doc_attention` and of the executor's
CP attention on CPU. It calls ATen's flash-attention kernel for CPU (the one
``torch.nn.functional.scaled_dot_product_attention`` dispatches to there) through its
forward and backward ops, which take and return the log-sum-exp: so the backward needs no
recomputed forward, and the lse the API exposes comes from the kernel. reference.py's
per-segment loop stays the slow twin the tests compare against.

How a segment table becomes kernel calls (segment-table contract: docs/kernels.md). A short
micro-batch (``Tq * Tk <= _DENSE_MAX_PAIRS``) is **one call** over the packed tensors with
an additive ``[Tq, Tk]`` block-diagonal mask, bottom-right aligned per segment: for small
tables the per-call and gather overheads outweigh the masked work. Longer ones are bucketed:

* Every segment ``(q_start, q_len, k_start, k_len)`` is split into a **causal square**, its
  query rows against the last ``q_len`` keys of its range, where bottom-right and top-left
  causal alignment coincide, so the kernel's ``is_causal`` is exact; and, when
  ``k_len > q_len`` (a CP shard past a document's first chunk), a **full rectangle**, its
  query rows against the first ``k_len - q_len`` keys, all visible.
* Parts are bucketed by length (within a factor ``_BUCKET_RATIO``) and each bucket is one
  call on ``[n_seq, H, L, D]``. A square padded at its end needs no mask: a padded key comes
  after every real key, so ``is_causal`` hides it from every real query. A rectangle's padded
  keys are hidden by an additive ``[n_seq, 1, 1, Lk]`` mask. Padded query rows are dropped.
* A row's two parts are merged through their log-sum-exps, as split-K kernels do. The
  backward runs the kernel's backward on every part with the *merged* out and lse: the
  softmax gradient ``dS = P * (dP - delta)`` with ``P`` and ``delta`` of the whole row is
  exact for each part's keys, and the parts' dQ add up. Padded query rows get ``dout = 0``
  and ``lse = +inf`` there, so they contribute nothing.
* A gradient on the lse (``dS += P * dlse``) enters through one extra head-dim column: q, k
  and v get a zero column (scores unchanged), dout a column of ones and out a column of
  ``-dlse``, which turns the kernel's ``delta = rowsum(dout * out)`` into ``delta - dlse``.

fp16/bf16 inputs are computed in fp32 (as the per-segment path does); fp32 and fp64 in their
own dtype. Other devices than CPU run reference.py's per-segment path (logged once): the
CUDA default is the Triton backend, and the fused CUDA kernels' determinism differs by
kernel and device, which this module does not claim.
"""
from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .reference import attention_per_segment
from .segments import as_segment_array

__all__ = ["attention_sdpa", "sdpa_backward", "sdpa_forward"]

_LOG = logging.getLogger("wlb_opt")
_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

# A bucket holds parts whose padded length is at most this factor above their own: padding
# costs at most _BUCKET_RATIO**2 of a part's attention work, and fewer buckets mean fewer calls.
_BUCKET_RATIO = 1.25
# Parts this short share one bucket whatever their lengths: per-call overhead dominates them.
_SHORT_PART = 32
# Up to this many (query, key) pairs a micro-batch is one dense masked call (see above).
_DENSE_MAX_PAIRS = 384 * 384
_PLAN_CACHE_SIZE = 16


@dataclass(frozen=True, slots=True)
class _Bucket:
    """One batched kernel call: ``n_seq`` parts padded to ``q_len`` query and ``k_len`` key rows.

    ``q_index``/``k_index`` (int64, ``n_seq * q_len`` / ``n_seq * k_len``) name the packed row
    of every padded position; padding points at row ``n_q`` / ``n_k``, a zero row appended to
    the packed tensors. ``key_pad`` (``[n_seq, 1, 1, k_len]`` bool, True on padded keys) is
    None for causal squares, which need no mask.
    """

    causal: bool
    n_seq: int
    q_len: int
    k_len: int
    q_index: torch.Tensor
    k_index: torch.Tensor
    key_pad: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class _Plan:
    """How one table runs: bucketed parts, or (short micro-batches) one dense masked call.

    ``visible`` (``[n_q, n_k]`` bool) is the dense call's mask, with key 0 made visible to
    rows no segment covers (a row with no key would give NaN); ``uncovered`` (``[n_q]``
    bool, None when every row is covered) names those rows, whose results are then
    replaced by zeros and lse ``-inf``.
    ``additive`` caches the mask as ``0 / -inf`` per dtype.
    """

    squares: tuple[_Bucket, ...] = ()
    rectangles: tuple[_Bucket, ...] = ()
    visible: torch.Tensor | None = None
    uncovered: torch.Tensor | None = None
    additive: dict = field(default_factory=dict)

    def dense_mask(self, dtype: torch.dtype) -> torch.Tensor:
        mask = self.additive.get(dtype)
        if mask is None:
            mask = torch.zeros(self.visible.shape, dtype=dtype, device=self.visible.device)
            mask = self.additive[dtype] = mask.masked_fill_(~self.visible, float("-inf"))
        return mask


def _groups(lengths: np.ndarray) -> list[np.ndarray]:
    """Indices of ``lengths`` grouped longest first, each group within ``_BUCKET_RATIO``."""
    order = np.argsort(-lengths, kind="stable")
    groups, start = [], 0
    while start < len(order):
        top = lengths[order[start]]
        floor = 0 if top <= _SHORT_PART else top / _BUCKET_RATIO
        stop = start + 1
        while stop < len(order) and lengths[order[stop]] >= floor:
            stop += 1
        groups.append(order[start:stop])
        start = stop
    return groups


def _padded_index(starts: np.ndarray, lens: np.ndarray, width: int, pad_row: int) -> np.ndarray:
    pos = np.arange(width)[None, :]
    idx = starts[:, None] + pos
    return np.where(pos < lens[:, None], idx, pad_row).reshape(-1)


def _bucket(parts: np.ndarray, causal: bool, n_q: int, n_k: int, device) -> _Bucket:
    q_start, q_len, k_start, k_len = parts.T
    width_q, width_k = int(q_len.max()), int(k_len.max())
    key_pad = None
    if not causal:
        key_pad = torch.from_numpy(np.arange(width_k)[None, :] >= k_len[:, None]).view(len(parts), 1, 1, width_k)
        key_pad = key_pad.to(device)
    as_tensor = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    return _Bucket(causal, len(parts), width_q, width_k,
                   as_tensor(_padded_index(q_start, q_len, width_q, n_q)),
                   as_tensor(_padded_index(k_start, k_len, width_k, n_k)), key_pad)


def _dense_plan(seg: np.ndarray, n_q: int, n_k: int, device) -> _Plan:
    visible = np.zeros((n_q, n_k), dtype=bool)
    for q_start, q_len, k_start, k_len in seg.tolist():
        rows = np.arange(q_len)[:, None]
        visible[q_start:q_start + q_len, k_start:k_start + k_len] = np.arange(k_len)[None, :] <= rows + (k_len - q_len)
    uncovered = ~visible.any(axis=1)
    visible[uncovered, 0] = True
    return _Plan(visible=torch.from_numpy(visible).to(device),
                 uncovered=torch.from_numpy(uncovered).to(device) if uncovered.any() else None)


def _build_plan(seg: np.ndarray, n_q: int, n_k: int, device, dense: bool) -> _Plan:
    if dense:
        return _dense_plan(seg, n_q, n_k, device)
    q_start, q_len, k_start, k_len = seg.T
    squares = np.stack([q_start, q_len, k_start + k_len - q_len, q_len], axis=1)
    wide = k_len > q_len
    rects = np.stack([q_start, q_len, k_start, k_len - q_len], axis=1)[wide]
    return _Plan(
        tuple(_bucket(squares[g], True, n_q, n_k, device) for g in _groups(q_len)),
        tuple(_bucket(rects[g], False, n_q, n_k, device) for g in _groups(rects[:, 3])),
    )


_PLANS: OrderedDict[tuple, _Plan] = OrderedDict()


def _plan(seg: np.ndarray, n_q: int, n_k: int, device: torch.device) -> _Plan:
    """The plan of a table, cached: every layer of a micro-batch reuses its table."""
    dense = n_q * n_k <= _DENSE_MAX_PAIRS
    key = (hashlib.blake2b(np.ascontiguousarray(seg, dtype=np.int64).tobytes(), digest_size=16).digest(),
           n_q, n_k, str(device), dense)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _build_plan(seg, n_q, n_k, device, dense)
        if len(_PLANS) > _PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return plan


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _extended(x: torch.Tensor, fill: float = 0.0, dim: int = 0) -> torch.Tensor:
    """``x`` with one row (along ``dim``) of ``fill`` appended: the padding row."""
    shape = list(x.shape)
    shape[dim] = 1
    return torch.cat([x, x.new_full(shape, fill)], dim=dim)


def _gather(x_ext: torch.Tensor, index: torch.Tensor, n_seq: int) -> torch.Tensor:
    """Packed rows ``[T+1, H, D]`` -> the bucket's ``[n_seq, H, L, D]`` (a transposed view)."""
    rows = x_ext.index_select(0, index)
    return rows.view(n_seq, -1, *rows.shape[1:]).transpose(1, 2)


def _mask(b: _Bucket, dtype: torch.dtype) -> torch.Tensor | None:
    if b.key_pad is None:
        return None
    return torch.zeros(b.key_pad.shape, dtype=dtype, device=b.key_pad.device).masked_fill_(b.key_pad, float("-inf"))


def _run_parts(buckets, q_ext, k_ext, v_ext, n_q: int, scale: float):
    """Forward of one family of parts: packed (out ``[n_q, Hq, D]``, lse ``[Hq, n_q]``);
    rows no part covers keep out 0 and lse -inf."""
    hq, d = q_ext.shape[1], q_ext.shape[2]
    out = q_ext.new_zeros((n_q + 1, hq, d))
    lse = q_ext.new_full((hq, n_q + 1), float("-inf"))
    for b in buckets:
        o, l = _FWD(_gather(q_ext, b.q_index, b.n_seq), _gather(k_ext, b.k_index, b.n_seq),
                    _gather(v_ext, b.k_index, b.n_seq), 0.0, b.causal,
                    attn_mask=_mask(b, q_ext.dtype), scale=scale)
        out.index_copy_(0, b.q_index, o.transpose(1, 2).reshape(-1, hq, d))
        lse.index_copy_(1, b.q_index, l.transpose(0, 1).reshape(hq, -1))
    return out[:n_q], lse[:, :n_q]


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """Packed ``[T, H, D]`` -> ``[1, H, T, D]`` (a view): the dense call's layout."""
    return x.transpose(0, 1).unsqueeze(0)


def _dense_forward(plan: _Plan, q, k, v, scale: float):
    o, lse = _FWD(_heads_first(q), _heads_first(k), _heads_first(v), 0.0, False,
                  attn_mask=plan.dense_mask(q.dtype), scale=scale)
    out, lse = o[0].transpose(0, 1), lse[0]
    if plan.uncovered is not None:
        out = out.masked_fill(plan.uncovered[:, None, None], 0.0)
        lse = lse.masked_fill(plan.uncovered[None, :], float("-inf"))
    return out, lse


def _bucketed_forward(plan: _Plan, q, k, v, scale: float):
    n_q = q.shape[0]
    q_ext, k_ext, v_ext = _extended(q), _extended(k), _extended(v)
    out, lse = _run_parts(plan.squares, q_ext, k_ext, v_ext, n_q, scale)
    if plan.rectangles:
        out_r, lse_r = _run_parts(plan.rectangles, q_ext, k_ext, v_ext, n_q, scale)
        merged = torch.logaddexp(lse, lse_r)
        covered = torch.isfinite(merged)
        weight = lambda part: torch.where(covered, torch.exp(part - merged), 0.0).t()[:, :, None]  # noqa: E731
        out = out * weight(lse) + out_r * weight(lse_r)
        lse = merged
    return out, lse


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    """`t`, copied where its last dimension is strided: torch's CPU attention reads a head's
    channels as if they were adjacent whatever the stride (a view of every other channel gave
    wrong values, silently)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def sdpa_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Any,
                 softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out ``[Tq, Hq, D]`` in q's dtype, lse ``[Hq, Tq]`` in the compute dtype), no autograd.

    ``segments`` must already be validated against q and k (``validate_segments``). The lse
    keeps the compute dtype (fp64 for fp64 inputs) because :func:`sdpa_backward` rebuilds the
    softmax from it.
    """
    seg = as_segment_array(segments)
    dtype = _compute_dtype(q.dtype)
    if len(seg) == 0:
        return q.new_zeros(q.shape), q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=dtype)
    plan = _plan(seg, q.shape[0], k.shape[0], q.device)
    run = _dense_forward if plan.visible is not None else _bucketed_forward
    out, lse = run(plan, *(_dense_rows(t.to(dtype)) for t in (q, k, v)), softmax_scale)
    return out.to(q.dtype), lse


def _dense_backward(plan: _Plan, dout, q, k, v, out, lse, scale: float):
    if plan.uncovered is not None:
        dout = dout.masked_fill(plan.uncovered[:, None, None], 0.0)
        lse = lse.masked_fill(plan.uncovered[None, :], float("inf"))  # P = 0 on uncovered rows
    grads = _BWD(_heads_first(dout), _heads_first(q), _heads_first(k), _heads_first(v), _heads_first(out),
                 lse[None], 0.0, False, attn_mask=plan.dense_mask(q.dtype), scale=scale)
    return tuple(g[0].transpose(0, 1) for g in grads)


def _bucketed_backward(plan: _Plan, dout, q, k, v, out, lse, scale: float):
    q_ext, k_ext, v_ext, out_ext, dout_ext = (_extended(t) for t in (q, k, v, out, dout))
    lse_ext = _extended(lse, fill=float("inf"), dim=1)  # padded rows: P = 0
    dq = q_ext.new_zeros(q_ext.shape)
    dk, dv = k_ext.new_zeros(k_ext.shape), v_ext.new_zeros(v_ext.shape)
    for b in plan.squares + plan.rectangles:
        q_b, k_b, v_b = (_gather(x, ix, b.n_seq) for x, ix in ((q_ext, b.q_index), (k_ext, b.k_index),
                                                              (v_ext, b.k_index)))
        lse_b = lse_ext.index_select(1, b.q_index).view(-1, b.n_seq, b.q_len).transpose(0, 1)
        g_q, g_k, g_v = _BWD(_gather(dout_ext, b.q_index, b.n_seq), q_b, k_b, v_b,
                             _gather(out_ext, b.q_index, b.n_seq), lse_b, 0.0, b.causal,
                             attn_mask=_mask(b, q.dtype), scale=scale)
        dq.index_add_(0, b.q_index, g_q.transpose(1, 2).reshape(-1, *dq.shape[1:]))
        dk.index_add_(0, b.k_index, g_k.transpose(1, 2).reshape(-1, *dk.shape[1:]))
        dv.index_add_(0, b.k_index, g_v.transpose(1, 2).reshape(-1, *dv.shape[1:]))
    return dq[:-1], dk[:-1], dv[:-1]


def sdpa_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, dlse: torch.Tensor | None, segments: Any,
                  softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the dtypes of q, k, v from :func:`sdpa_forward`'s (out, lse).

    ``dlse``: the gradient of lse (``[Hq, Tq]``), or None. Rows no segment covers get zero
    gradients; key rows no segment reads get zero dK/dV.
    """
    seg = as_segment_array(segments)
    dtype = _compute_dtype(q.dtype)
    if len(seg) == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    d = q.shape[2]
    plan = _plan(seg, q.shape[0], k.shape[0], q.device)
    q_, k_, v_, out_, dout_ = (_dense_rows(t.to(dtype)) for t in (q, k, v, out, dout))
    if dlse is not None:  # one extra head-dim column carries dlse into the kernel's delta
        dlse_ = torch.nan_to_num(dlse.to(dtype), posinf=0.0, neginf=0.0).t()[:, :, None]
        q_, k_, v_ = (torch.nn.functional.pad(t, (0, 1)) for t in (q_, k_, v_))
        out_ = torch.cat([out_, -dlse_], dim=-1)
        dout_ = torch.cat([dout_, torch.ones_like(dlse_)], dim=-1)
    run = _dense_backward if plan.visible is not None else _bucketed_backward
    dq, dk, dv = run(plan, dout_, q_, k_, v_, out_, lse.to(dtype), softmax_scale)
    return dq[..., :d].to(q.dtype), dk[..., :d].to(k.dtype), dv[..., :d].to(v.dtype)


class _SegmentSDPA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seg, softmax_scale):
        out, lse = sdpa_forward(q, k, v, seg, softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.seg, ctx.softmax_scale = seg, softmax_scale
        ctx.set_materialize_grads(False)  # an unused lse costs no zero tensor
        return out, lse.float()

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = sdpa_backward(dout, q, k, v, out, lse, dlse, ctx.seg, ctx.softmax_scale)
        return dq, dk, dv, None, None


_FALLBACK_LOGGED: set[str] = set()


def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Any,
                   softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable (out ``[Tq, Hq, D]`` in q's dtype, lse ``[Hq, Tq]`` fp32, natural log).

    ``segments`` must already be validated (``validate_segments``); ``softmax_scale`` is a
    number. Rows no segment covers give zeros and lse ``-inf``. Off CPU this runs
    reference.py's per-segment path (one log line per device type says so).
    """
    if q.device.type != "cpu":
        if q.device.type not in _FALLBACK_LOGGED:
            _FALLBACK_LOGGED.add(q.device.type)
            _LOG.info("doc_attention backend='torch' on %s runs the per-segment torch path (the fused "
                      "SDPA path is CPU only)", q.device.type)
        return attention_per_segment(q, k, v, segments, softmax_scale)
    return _SegmentSDPA.apply(q, k, v, as_segment_array(segments), float(softmax_scale))
