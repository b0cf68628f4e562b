"""Document-masked attention over segment tables: a Triton kernel and its torch twins.

``from wlb_opt.kernels import doc_attention``. Importing this package imports torch but not
triton: Triton is imported on the first call that uses the Triton backend, so that CPU-only
processes and the torch backend never pay for it (and a missing triton only fails there).
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "doc_attention": "doc_attention",
    "BACKENDS": "doc_attention",
    "TRITON_HEAD_DIMS": "doc_attention",
    "attention_reference": "reference",
    "attention_per_segment": "reference",
    "segment_mask": "reference",
    "validate_segments": "segments",
    "segments_from_lengths": "segments",
    "visible_pairs": "segments",
    "attention_flops": "segments",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'wlb_opt.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
