"""Torch implementations of document-masked attention over a segment table.

Two slow, obviously-correct twins of the Triton kernel (docs/architecture.md: every fast path
has one):

* :func:`attention_reference` builds the whole ``[Tq, Tk]`` boolean mask and runs dense
  softmax attention. Tests use it in fp64 as ground truth and in the low precision
  (fp32/fp16) for FlashAttention's error-ratio rule. Memory is O(Hq * Tq * Tk).
* :func:`attention_per_segment` loops over segments and only materialises each segment's
  ``[Hq, q_len, k_len]`` scores: the ``backend="torch"`` path of ``doc_attention`` off CPU
  (on CPU that path is torch_attention.py's fused kernel calls).

Both align the causal mask bottom-right (query row i of a segment sees the first
``k_len - q_len + i + 1`` keys of its range). SDPA's ``is_causal`` aligns top-left, which is
why neither uses it. Rows covered by no segment give zeros (and zero gradients); their
log-sum-exp is ``-inf``. Both are differentiable with plain torch autograd.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .segments import as_segment_array

__all__ = ["attention_reference", "attention_per_segment", "segment_mask"]


def segment_mask(segments: Any, n_q: int, n_k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean ``[n_q, n_k]`` mask: True where query row r may attend to key row j."""
    seg = as_segment_array(segments)
    mask = torch.zeros(n_q, n_k, dtype=torch.bool, device=device)
    for q_start, q_len, k_start, k_len in seg.tolist():
        rows = torch.arange(q_len, device=device)[:, None]
        cols = torch.arange(k_len, device=device)[None, :]
        mask[q_start : q_start + q_len, k_start : k_start + k_len] = cols <= rows + (k_len - q_len)
    return mask


def _expand_kv(x: torch.Tensor, n_heads_q: int) -> torch.Tensor:
    """[T, Hkv, D] -> [T, Hq, D] for grouped-query attention (query head h reads h // G)."""
    group = n_heads_q // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _masked_softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Tq,H,D], k/v [Tk,H,D], mask [Tq,Tk] -> out [Tq,H,D], lse [H,Tq] (natural log).

    Rows with no visible key give zero output, zero gradient and lse = -inf.
    """
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    covered = mask.any(dim=1)  # [Tq]
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(covered[None, :, None], row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)  # exactly 0 where masked
    denom = p.sum(dim=-1, keepdim=True)
    safe = torch.where(covered[None, :, None], denom, torch.ones_like(denom))
    out = torch.einsum("hqk,khd->qhd", p / safe, v)
    lse = torch.where(covered[None, :], (row_max + torch.log(safe)).squeeze(-1), float("-inf"))
    return out, lse


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Any,
    softmax_scale: float | None = None,
    compute_dtype: torch.dtype | None = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense explicit-mask attention: returns (out [Tq,Hq,D], lse [Hq,Tq], natural log).

    ``compute_dtype``: the dtype the math runs in and the outputs come back in (fp64 for
    ground truth); ``None`` computes in the inputs' own dtype (the "low-precision
    reference" of FlashAttention's error-ratio rule).
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    dtype = compute_dtype or q.dtype
    mask = segment_mask(segments, q.shape[0], k.shape[0], device=q.device)
    hq = q.shape[1]
    out, lse = _masked_softmax_attention(
        q.to(dtype), _expand_kv(k.to(dtype), hq), _expand_kv(v.to(dtype), hq), mask, scale
    )
    return out, lse


def attention_per_segment(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Any,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Memory-lean torch path: one masked softmax per segment.

    Returns (out [Tq,Hq,D] in q's dtype, lse [Hq,Tq] fp32, natural log). fp16/bf16 inputs are
    computed in fp32; fp32 and fp64 in their own dtype. Peak extra memory is one segment's
    ``[Hq, q_len, k_len]`` scores.
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    seg = as_segment_array(segments)
    n_q, hq, _ = q.shape
    dtype = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
    out = q.new_zeros(q.shape, dtype=dtype)
    lse = torch.full((hq, n_q), float("-inf"), dtype=torch.float32, device=q.device)
    for q_start, q_len, k_start, k_len in seg.tolist():
        rows = torch.arange(q_len, device=q.device)[:, None]
        cols = torch.arange(k_len, device=q.device)[None, :]
        mask = cols <= rows + (k_len - q_len)
        o_seg, lse_seg = _masked_softmax_attention(
            q[q_start : q_start + q_len].to(dtype),
            _expand_kv(k[k_start : k_start + k_len].to(dtype), hq),
            _expand_kv(v[k_start : k_start + k_len].to(dtype), hq),
            mask,
            scale,
        )
        out[q_start : q_start + q_len] = o_seg
        lse[:, q_start : q_start + q_len] = lse_seg.float()
    if len(seg) == 0:  # keep the (all-zero) result on the autograd graph, like the kernel's
        out = torch.cat([q[:0].to(dtype), out])
        lse = torch.cat([q[:0, :, 0].t().float(), lse], dim=1)
    return out.to(q.dtype), lse
