"""Token ids and loss masks where they enter the library: checked, as int64 and bool arrays.

A document's tokens arrive as a list, a numpy array or a tensor. numpy would read a Python
`True` as 1, turn integers beyond int64 into floats or objects, and a uint64 array would wrap
when cast: each is refused here with a ValueError naming the document and the value.
"""
from __future__ import annotations

import numpy as np

_INT64_MAX = 2**63 - 1


def _first_bad_value(values, allow_bool: bool = False) -> tuple[int, object] | None:
    """The first entry of a Python sequence that is not an int64-representable integer (nor,
    with `allow_bool`, a boolean)."""
    for k, v in enumerate(values):
        if isinstance(v, (bool, np.bool_)):
            if allow_bool:
                continue
            return k, v
        if not isinstance(v, (int, np.integer)) or not -2**63 <= v <= _INT64_MAX:
            return k, v
    return None


def as_array(doc_id, values, what: str) -> np.ndarray:
    if hasattr(values, "detach") and hasattr(values, "cpu"):  # a torch tensor, without importing torch
        if values.is_floating_point() or values.is_complex():  # numpy has no bfloat16: say what is wrong first
            raise ValueError(f"document {doc_id}: {what} must hold integers{' or booleans' if what == 'loss_mask' else ''}"
                             f", got a tensor of dtype {values.dtype}")
        values = values.detach().cpu().numpy()
    if isinstance(values, (list, tuple)) and what != "loss_mask":
        # numpy would read True as 1 and turn ints beyond int64 into floats or objects: look first
        bad = _first_bad_value(values)
        if bad is not None and isinstance(bad[1], (bool, np.bool_)):
            raise ValueError(f"document {doc_id}: {what}[{bad[0]}] = {bad[1]!r} is a boolean, not a token id (a loss "
                             "mask goes third: (doc_id, tokens, loss_mask))")
        if bad is not None and isinstance(bad[1], (int, np.integer)):
            raise ValueError(f"document {doc_id}: {what}[{bad[0]}] = {bad[1]} does not fit in int64; token ids must be "
                             f"in [0, {_INT64_MAX}]")
    try:
        arr = np.asarray(values)
    except (OverflowError, ValueError):
        raise ValueError(f"document {doc_id}: {what} must be a 1-D sequence of integers representable in int64, "
                         f"got {type(values).__name__}") from None
    if arr.ndim == 0:
        raise ValueError(f"document {doc_id}: {what} must be a 1-D sequence of token ids, got "
                         f"{type(values).__name__} {values!r:.80}")
    if arr.ndim != 1:
        raise ValueError(f"document {doc_id}: {what} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind == "O" and arr.size:  # objects: integers only, each within int64
        bad = _first_bad_value(arr.tolist(), allow_bool=what == "loss_mask")
        if bad is not None:
            raise ValueError(f"document {doc_id}: {what}[{bad[0]}] = {bad[1]!r} is not an integer representable in "
                             "int64")
        arr = arr.astype(np.int64)  # (True and False of a loss mask become 1 and 0)
    return arr


def as_tokens(doc_id, tokens, what: str = "tokens") -> np.ndarray:
    """A document's token ids as a 1-D int64 array, checked where they enter: integers,
    non-negative and representable in int64 (an unsigned array is not wrapped). ValueError
    naming the document and the offending value otherwise. Always a copy: pieces are held
    across steps, and a source may refill the buffer it yielded (a reader's usual pattern)."""
    arr = as_array(doc_id, tokens, what)
    if arr.size == 0 and arr.dtype.kind in "fO":
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        hint = " (a loss mask goes third: (doc_id, tokens, loss_mask))" if arr.dtype == bool else ""
        raise ValueError(f"document {doc_id}: {what} must be integer token ids, got dtype {arr.dtype}{hint}")
    if arr.size:
        if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > _INT64_MAX:
            k = int(np.argmax(arr > _INT64_MAX))
            raise ValueError(f"document {doc_id}: {what}[{k}] = {int(arr[k])} does not fit in int64; token ids "
                             f"must be in [0, {_INT64_MAX}]")
        if arr.dtype.kind == "i" and int(arr.min()) < 0:
            k = int(np.argmax(arr < 0))
            raise ValueError(f"document {doc_id}: {what}[{k}] = {int(arr[k])} is negative; token ids must be >= 0")
    return arr.astype(np.int64, copy=True)


def as_mask(doc_id, mask, n: int) -> np.ndarray:
    """A loss mask: booleans (or 0/1 integers) of the document's length; a copy, as
    `as_tokens`."""
    arr = as_array(doc_id, mask, "loss_mask")
    if arr.dtype != bool:
        if arr.dtype.kind not in "iu" and arr.size:
            raise ValueError(f"document {doc_id}: loss_mask must be booleans (True where a token is a target), got "
                             f"dtype {arr.dtype}")
        bad = (arr != 0) & (arr != 1)
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(f"document {doc_id}: loss_mask[{k}] = {arr[k].item()!r}; a loss mask holds booleans or 0/1 "
                             "(True where a token is a target)")
    arr = arr.astype(bool, copy=True)
    if len(arr) != n:
        raise ValueError(f"document {doc_id}: loss mask of {len(arr)} entries for {n} tokens")
    return arr
