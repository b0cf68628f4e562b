"""Document-masked attention over a segment table: its ``torch.library`` custom ops and the
public ``doc_attention`` function.

Layering (docs/architecture.md, "Kernels"): ``triton_kernels.py`` (jit kernels) -> ``launch.py``
(launchers, config choice) -> the ``torch.library`` custom ops below, whose autograd
formula is registered with ``register_autograd`` (the custom-op form of an
``autograd.Function``) -> :func:`doc_attention`. The custom ops carry fake (meta)
implementations, so a training loop under ``torch.compile`` can call the kernel without a
graph break; ``torch.library.opcheck`` checks the registration in the tests.

``backend="torch"`` runs torch_attention.py instead: torch's fused CPU attention kernel over
the segment table, bucketed (reference.py's per-segment loop off CPU).
"""
# No ``from __future__ import annotations`` here: torch.library infers the custom ops' schemas
# from real annotation objects (string annotations need a newer torch to be understood).
import math
import numbers
import weakref
from typing import Any, Literal, Optional

import torch

from . import launch as _launch
from .torch_attention import attention_sdpa
from .segments import as_segment_array, validate_segments

__all__ = ["doc_attention", "BACKENDS", "TRITON_HEAD_DIMS"]

BACKENDS = ("auto", "triton", "torch")
TRITON_HEAD_DIMS = (16, 32, 64, 128)
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TORCH_DTYPES = _TRITON_DTYPES + (torch.float64,)
_INT32_MAX = 2**31 - 1


# --- custom ops (the Triton backend) ------------------------------------------------------

_VALIDATED: dict[int, tuple] = {}  # id(segments tensor) -> (tensor version, n_q, n_k, table, its values)


def _segments_np(segments: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    # Validated here, on concrete values, so that traced (torch.compile) calls check too. The
    # same table tensor (CP attention passes one per micro-batch to every layer) is validated
    # once: a hit needs the same object, unmodified (its version counter, and its values: a
    # buffer refilled through numpy or `.data` keeps its version), and the same sizes.
    key = id(segments)
    hit = _VALIDATED.get(key)
    if (hit is not None and hit[0] == segments._version and hit[1:3] == (q.shape[0], k.shape[0])
            and hit[4].shape == segments.shape and torch.equal(hit[4], segments)):
        return hit[3]
    seg = validate_segments(segments, q.shape[0], k.shape[0])
    if key not in _VALIDATED:
        weakref.finalize(segments, _VALIDATED.pop, key, None)
    _VALIDATED[key] = (segments._version, q.shape[0], k.shape[0], seg, segments.detach().clone())
    return seg


def _interpreter_upcast(*tensors: torch.Tensor) -> list[torch.Tensor]:
    # The interpreter's tl.dot multiplies bf16 bit patterns: compute bf16 in fp32 there.
    if _launch.interpreting() and tensors[0].dtype == torch.bfloat16:
        return [t.float().contiguous() if t is not None else None for t in tensors]
    return [t.contiguous() if t is not None and t.stride(-1) != 1 else t for t in tensors]


@torch.library.custom_op("wlb_opt::doc_attention_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor,
            softmax_scale: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [Tq, Hq, D], lse [Hq, Tq] fp32): Triton forward; ``segments`` is a CPU int tensor."""
    q_, k_, v_ = _interpreter_upcast(q, k, v)
    out, lse = _launch.forward(q_, k_, v_, _segments_np(segments, q, k), softmax_scale)
    return out.to(q.dtype), lse


def _like_dense(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor laid out as the kernels' results over `t` are: `t`'s layout where its
    last dimension is dense (the kernels take strides), else contiguous (`t` is copied first)."""
    return torch.empty_like(t if t.stride(-1) == 1 else t.contiguous())


@_fwd_op.register_fake
def _(q, k, v, segments, softmax_scale, deterministic):
    return _like_dense(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("wlb_opt::doc_attention_bwd", mutates_args=())
def _bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, dlse: Optional[torch.Tensor], segments: torch.Tensor,
            softmax_scale: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the Triton backward; ``dlse`` is the gradient of lse, or None."""
    return backward_with_hook(dout, q, k, v, out, lse, dlse, segments, softmax_scale, deterministic)


def backward_with_hook(dout, q, k, v, out, lse, dlse, segments, softmax_scale: float, deterministic: bool,
                       on_dkdv=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton backward; ``on_dkdv(dk, dv)`` runs once dK/dV are final and before the dQ
    kernel (see `launch.backward`), in the dtypes of k and v. Not called when no query
    attends to anything (dK/dV are zeros then). For CP attention, which overlaps its dK/dV
    reduce-scatter with the dQ kernel; `doc_attention`'s autograd goes through `_bwd_op`."""
    dout_, q_, k_, v_, out_ = _interpreter_upcast(dout, q, k, v, out)
    dlse_ = dlse.contiguous() if dlse is not None else None
    hook = None if on_dkdv is None else (lambda dk, dv: on_dkdv(dk.to(k.dtype), dv.to(v.dtype)))
    dq, dk, dv = _launch.backward(dout_, q_, k_, v_, out_, lse.contiguous(), dlse_,
                                  _segments_np(segments, q, k), softmax_scale, deterministic, on_dkdv=hook)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@_bwd_op.register_fake
def _(dout, q, k, v, out, lse, dlse, segments, softmax_scale, deterministic):
    # dK and dV come out of the kernels' fp32 partial sums: contiguous
    return _like_dense(q), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, segments, softmax_scale, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, segments)
    ctx.softmax_scale = softmax_scale
    ctx.deterministic = deterministic
    ctx.set_materialize_grads(False)  # an unused lse must not cost a zero tensor and a pass


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, segments = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = _bwd_op(dout, q, k, v, out, lse, dlse, segments, ctx.softmax_scale, ctx.deterministic)
    return dq, dk, dv, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# --- public API ---------------------------------------------------------------------------

def _check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtypes: tuple) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must have shape [T, H, D], got shape {tuple(t.shape)}")
        if t.dtype not in dtypes:
            raise ValueError(f"{name} has dtype {t.dtype}; valid: {[str(d) for d in dtypes]}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head dims differ: q has {q.shape[2]}, k/v have {k.shape[2]}")
    if q.shape[2] == 0:
        raise ValueError(f"head dim must be >= 1, got shape {tuple(q.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


_LOG2E = 1.4426950408889634
_FP32_MAX = 3.4028234663852886e38


def _checked_scale(softmax_scale, head_dim: int) -> float:
    """The softmax scale to use: `softmax_scale`, or 1/sqrt(head_dim) for None. NaN or inf would
    give NaN output on every row without an error, so anything but a finite number > 0 is refused."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)
            or not math.isfinite(softmax_scale) or not softmax_scale > 0
            or not softmax_scale * _LOG2E < _FP32_MAX):  # the kernels scale scores in fp32 (base 2)
        raise ValueError(f"softmax_scale must be a finite number > 0 (or None for 1/sqrt(D)) that fp32 holds, "
                         f"got {softmax_scale!r}")
    return float(softmax_scale)


def doc_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Any,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: Literal["auto", "triton", "torch"] = "auto",
    deterministic: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of query rows over key ranges given by a segment table.

    Args:
        q: ``[Tq, Hq, D]`` queries (fp16, bf16 or fp32; fp64 with ``backend="torch"``).
        k, v: ``[Tk, Hkv, D]`` keys and values, ``Hq % Hkv == 0`` (grouped-query attention:
            query head h reads key/value head ``h // (Hq // Hkv)``).
        segments: int array ``(S, 4)`` of rows ``(q_start, q_len, k_start, k_len)``, numpy
            or a CPU tensor (copied to the device once; a CUDA tensor forces a sync). Query
            rows ``[q_start, q_start+q_len)`` attend to keys ``[k_start, k_start+k_len)``,
            causally aligned bottom-right; ``1 <= q_len <= k_len``; query ranges disjoint,
            key ranges may overlap. With q_len=3, k_len=5 (x = visible)::

                k: 0 1 2 3 4
                q0 x x x . .
                q1 x x x x .
                q2 x x x x x

        softmax_scale: defaults to ``1 / sqrt(D)``.
        return_lse: also return the log-sum-exp, ``[Hq, Tq]`` fp32, natural log, ``-inf`` on
            uncovered rows (FlashAttention's varlen layout); it is differentiable.
        backend: "auto" (Triton on CUDA, torch on CPU), "triton" (on CPU only under
            ``TRITON_INTERPRET=1``; head dims 16/32/64/128), or "torch" (torch's fused CPU
            attention kernel over length buckets of the table; off CPU, a per-segment loop).
        deterministic: True (default): the Triton backward adds every gradient in a fixed
            order (bitwise reproducible for a given kernel config; see launch.py for pinning
            configs across ranks). False: dQ is accumulated with fp32 atomics inside the
            dK/dV kernel (FlashAttention's five-matmul backward, about 30% fewer matmuls;
            results vary in the last bits between runs). The torch backend ignores it: on CPU
            its kernels add in a fixed order; off CPU it runs plain matmuls per segment.

    Returns:
        ``out [Tq, Hq, D]`` in q's dtype, zeros on rows no segment covers (whose gradients
        are zero too); ``(out, lse)`` with ``return_lse``. Rows no segment covers must still
        hold finite values: the torch backend's one-call path over small tables and the
        Triton dK/dV kernel's tiles read them (masked), and NaN or inf there reaches covered
        rows (0 x NaN). The library's callers pass no such rows.

    Raises:
        ValueError: bad shapes, dtypes, devices, head counts or segment rows (the message
            names the offending row or shape).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        _check_tensors(q, k, v, _TORCH_DTYPES + _TRITON_DTYPES)  # before q.is_cuda: q may be no tensor
        backend = "triton" if q.is_cuda else "torch"
    _check_tensors(q, k, v, _TORCH_DTYPES if backend == "torch" else _TRITON_DTYPES)
    scale = _checked_scale(softmax_scale, q.shape[-1])
    for name, flag in (("return_lse", return_lse), ("deterministic", deterministic)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")

    if backend == "torch":
        seg = validate_segments(segments, q.shape[0], k.shape[0])
        out, lse = attention_sdpa(q, k, v, seg, scale)
        return (out, lse) if return_lse else out

    seg = _segments_tensor(segments)  # range-checked before any narrowing to int32
    if q.shape[-1] not in TRITON_HEAD_DIMS:
        raise ValueError(f"head dim {q.shape[-1]} is not supported by the Triton backend; "
                         f"valid: {TRITON_HEAD_DIMS} (or use backend='torch')")
    if not q.is_cuda and not _launch.interpreting():
        raise ValueError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before "
                         "the kernels are first used (for CPU tensors); use backend='torch' on CPU")
    out, lse = _fwd_op(q, k, v, seg, scale, deterministic)
    return (out, lse) if return_lse else out


def _segments_tensor(segments: Any) -> torch.Tensor:
    """The table as a CPU int32 tensor for the custom op (validated there, on concrete values).

    Tensors pass through untouched, so the call traces under ``torch.compile``.
    """
    if isinstance(segments, torch.Tensor):
        if segments.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"segments must be an int32/int64 tensor, got dtype {segments.dtype}")
        if segments.dtype == torch.int64 and segments.numel():
            # a narrowing cast would wrap (2**32 + 16 -> 16) and run a different mask silently
            low, high = int(segments.min()), int(segments.max())
            if high > _INT32_MAX or low < -_INT32_MAX:
                raise ValueError(f"segment values must fit in int32, got range [{low}, {high}]")
        return segments.to(device="cpu", dtype=torch.int32)
    seg = as_segment_array(segments)
    if len(seg) and (seg.max() > _INT32_MAX or seg.min() < -_INT32_MAX):
        raise ValueError(f"segment values must fit in int32, got range [{seg.min()}, {seg.max()}]")
    return torch.from_numpy(seg.astype("int32"))
