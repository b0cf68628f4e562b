"""Document-masked attention over segment tables: a Triton kernel and its torch twins.

``from wlb_opt.kernels import doc_attention``. Importing this package imports torch but not
triton: triton is imported on the first call that uses the Triton backend, so CPU-only
processes and the torch backend never pay for it (and a missing triton only fails there).

``wlb_opt.kernels.doc_attention`` is the function; the module that defines it, with its
``torch.library`` custom ops, is ``wlb_opt.kernels.attention_ops``.
"""
from __future__ import annotations

from .attention_ops import BACKENDS, TRITON_HEAD_DIMS, doc_attention
from .reference import attention_per_segment, attention_reference, segment_mask
from .segments import attention_flops, segments_from_lengths, validate_segments, visible_pairs

__all__ = [
    "BACKENDS",
    "TRITON_HEAD_DIMS",
    "attention_flops",
    "attention_per_segment",
    "attention_reference",
    "doc_attention",
    "segment_mask",
    "segments_from_lengths",
    "validate_segments",
    "visible_pairs",
]
