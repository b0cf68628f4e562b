"""Input validation shared by every public entry point: lengths, ids, offsets, integers.

Each message is written once here, names the argument and the offending value, and says
what would be valid. Callers pass the argument's name so that a message reads as the user
wrote the call (``sample_lengths must be ...``, ``offsets must be >= 0 ...``).
"""
from __future__ import annotations

import math
import numbers

import numpy as np


MAX_TOKENS = 2**62
"""Token counts (each length, and their total) stay below this so int64 sums cannot wrap."""


INT64_MAX = 2**63 - 1
"""The largest integer an int64 array holds: ids, counts and limits above it would wrap."""


def check_int(name: str, value, low: int = 0, high: int = INT64_MAX) -> int:
    """`value` as an int if it is an integer >= `low` and <= `high` (default: it fits in
    int64; bools are not integers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if value > high:
        limit = {INT64_MAX: "2**63 - 1 (int64)", MAX_TOKENS - 1: "2**62 - 1 (token counts stay below 2**62)"}.get(
            high, str(high))
        raise ValueError(f"{name} must be an integer >= {low} and <= {limit}, got {value!r}")
    return int(value)


def check_max_tokens(max_tokens) -> int:
    """A micro-batch's token cap: an integer in [1, 2**62) (a length at the cap must be a
    valid length, and sums of capacities must not wrap)."""
    return check_int("max_tokens", max_tokens, 1, MAX_TOKENS - 1)


def is_float(value) -> bool:
    """Whether `value` is a real number (not a bool) that a float holds: an int beyond
    float range (10**400) would raise OverflowError in the arithmetic that follows."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _too_large(value) -> str:
    """A note for an integer that no float holds (its digits alone do not say what is wrong)."""
    too_large = isinstance(value, int) and not isinstance(value, bool) and not is_float(value)
    return " (too large for a float)" if too_large else ""


def check_positive_real(name: str, value, unit: str = "", allow_inf: bool = False) -> float:
    """`value` as a float if it is a real number > 0 (finite unless `allow_inf`)."""
    if (not is_float(value) or math.isnan(value)
            or not value > 0 or (not allow_inf and math.isinf(value))):
        what = "a number" if allow_inf else "a finite number"
        raise ValueError(f"{name} must be {what} > 0{' ' + unit if unit else ''}, got {value!r}"
                         f"{_too_large(value)}")
    return float(value)


def check_real(name: str, value, *, low: float = 0.0, strict: bool = False, high: float | None = None,
               unit: str = "") -> float:
    """`value` as a float if it is a finite real number >= `low` (> `low` if `strict`) and, if
    given, <= `high` (bools and strings are not numbers here)."""
    ok = (is_float(value) and math.isfinite(value)
          and (value > low if strict else value >= low) and (high is None or value <= high))
    if not ok:
        rel = ">" if strict else ">="
        limit = f" and <= {high:g}" if high is not None else ""
        raise ValueError(f"{name} must be a finite number {rel} {low:g}{limit}{' ' + unit if unit else ''}, "
                         f"got {value!r}{_too_large(value)}")
    return float(value)


def check_choice(name: str, value, choices) -> str:
    """`value` if it is one of `choices`, else a ValueError listing them."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def bool_position(values) -> tuple | None:
    """Index of the first bool (Python or numpy) in nested lists/tuples `values`, else None.

    numpy turns ``[True, 3]`` into an int array and ``[True, 2.5]`` into a float one, so a
    bool among numbers is only visible in the sequence itself (an array of dtype bool is
    caught by its dtype)."""
    if isinstance(values, (bool, np.bool_)):
        return ()
    if isinstance(values, (list, tuple)):
        for i, value in enumerate(values):
            inner = bool_position(value)
            if inner is not None:
                return (i, *inner)
    return None


def _bool_index(values, arr: np.ndarray) -> int | None:
    """Index of the first bool in a 1-D list/tuple `values` (read as `arr`), else None. A
    bool becomes 0 or 1 in `arr`, so only those entries are looked at, and an array given
    as such (the fast path) is not looked at at all."""
    if not isinstance(values, (list, tuple)):
        return None
    maybe = (arr == 0) | (arr == 1)
    n_maybe = int(np.count_nonzero(maybe))
    if n_maybe == 0 or (n_maybe > 64 and not {bool, np.bool_} & set(map(type, values))):
        return None  # many ones, none a bool: one C-level pass instead of a Python loop
    for i in np.flatnonzero(maybe).tolist():
        if isinstance(values[i], (bool, np.bool_)):
            return i
    return None


def validate_lengths(lengths, name: str = "lengths") -> np.ndarray:
    """Positive integer token counts as a 1-D int64 array (a scalar becomes one length)."""
    if isinstance(lengths, np.ma.MaskedArray):  # np.asarray would keep the masked entries
        raise ValueError(f"{name} must not be a masked array (its mask would be ignored): pass the lengths to "
                         "plan, e.g. lengths.compressed()")
    arr = np.asarray(lengths)
    if arr.ndim == 0 and arr.dtype.kind == "O" and not isinstance(lengths, (int, np.integer)):
        # a set, a generator, None: numpy wraps it whole in one object
        raise ValueError(f"{name} must be a 1-D sequence (list, tuple or array) of token counts, got "
                         f"{type(lengths).__name__} {lengths!r:.80}")
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of token counts, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)):
            i = int(np.argmin(np.isfinite(arr)))
            raise ValueError(f"{name} must be finite positive integers, got NaN/inf ({float(arr[i])}) at index {i}")
        if np.any(arr != np.round(arr)):
            i = int(np.argmax(arr != np.round(arr)))
            raise ValueError(f"{name} must be integers, got {float(arr[i])} at index {i}")
        too_big = np.abs(arr.astype(np.float64)) >= 2.0**62  # compared in float64: float16 overflows 2**62
        if np.any(too_big):
            i = int(np.argmax(too_big))
            raise ValueError(f"{name} must be token counts below 2**62, got {float(arr[i])} at index {i}")
    elif arr.dtype.kind not in "iu":
        if arr.dtype.kind in "OUS":  # name the first entry that is not an int64 token count
            values = arr.tolist() if isinstance(lengths, np.ndarray) else list(lengths)
            for i, value in enumerate(values):
                if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                    raise ValueError(f"{name} must be integer token counts, got {value!r:.80} at index {i}")
                if not 0 < value < MAX_TOKENS:
                    raise ValueError(f"{name} must be positive token counts below 2**62, got {value} at index {i}")
        raise ValueError(f"{name} must be integers, got dtype {arr.dtype}")
    i = _bool_index(lengths, arr)
    if i is not None:
        raise ValueError(f"{name} must be integer token counts, got the bool {bool(lengths[i])} at index {i}")
    if arr.dtype.kind == "u" and np.any(arr >= np.uint64(MAX_TOKENS)):
        i = int(np.argmax(arr >= np.uint64(MAX_TOKENS)))
        raise ValueError(f"{name} must be token counts below 2**62, got {int(arr[i])} at index {i}")
    arr = arr.astype(np.int64)
    low, high = int(np.minimum.reduce(arr)), int(np.maximum.reduce(arr))
    if low <= 0:
        i = int(np.argmax(arr <= 0))
        raise ValueError(f"{name} must be positive token counts, got {int(arr[i])} at index {i}")
    if high >= MAX_TOKENS:
        i = int(np.argmax(arr >= MAX_TOKENS))
        raise ValueError(f"{name} must be token counts below 2**62, got {int(arr[i])} at index {i}")
    if high * arr.size >= MAX_TOKENS and float(arr.sum(dtype=np.float64)) >= MAX_TOKENS:
        # int64 sums of token counts (micro-batches, cumulative offsets) would wrap
        raise ValueError(f"{name} must hold fewer than 2**62 tokens in total, got about "
                         f"{float(arr.sum(dtype=np.float64)):.3e}")
    return arr


def validate_ids(ids, n: int, name: str = "ids") -> np.ndarray:
    """Integer ids, one per length, as int64 (default 0..n-1)."""
    if ids is None:
        return np.arange(n, dtype=np.int64)
    arr = np.asarray(ids)
    if arr.ndim != 1 or len(arr) != n:
        raise ValueError(f"{name} must be a 1-D sequence of the same size as lengths ({n}), got shape {arr.shape}")
    if arr.size and arr.dtype.kind in "fO":
        # Python ints outside int64 make a float array (2**63 next to a small id, precision lost)
        # or an object one (2**64): name the id, read from what was given
        values = arr.tolist() if isinstance(ids, np.ndarray) else list(ids)
        for i, value in enumerate(values):
            if (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
                    and not -INT64_MAX - 1 <= value <= INT64_MAX):
                raise ValueError(f"{name} must fit in int64 (-2**63 <= id < 2**63), got {value} at position {i}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must be integers, got dtype {arr.dtype}")
    i = _bool_index(ids, arr) if arr.size else None
    if i is not None:
        raise ValueError(f"{name} must be integers, got the bool {bool(ids[i])} at position {i}")
    if arr.size and arr.dtype.kind == "u" and np.any(arr > np.uint64(2**63 - 1)):
        i = int(np.argmax(arr > np.uint64(2**63 - 1)))
        # a cast to int64 would wrap it to a negative id (and maybe onto another document's)
        raise ValueError(f"{name} must fit in int64 (-2**63 <= id < 2**63), got {int(arr[i])} at position {i}")
    return arr.astype(np.int64)


def validate_offsets(offsets, n: int, name: str = "offsets") -> np.ndarray:
    """Start of each piece inside its document (>= 0), one per length, as int64 (default 0)."""
    if offsets is None:
        return np.zeros(n, np.int64)
    arr = validate_ids(offsets, n, name)
    if arr.size and arr.min() < 0:
        i = int(np.argmin(arr))
        raise ValueError(f"{name} must be >= 0 (start of each piece inside its document), got {int(arr[i])} "
                         f"at position {i}")
    if arr.size and arr.max() >= MAX_TOKENS:
        i = int(np.argmax(arr))
        # a document holds fewer than 2**62 tokens, and offset + length must not wrap
        raise ValueError(f"{name} must be below 2**62 (start of each piece inside its document), got "
                         f"{int(arr[i])} at position {i}")
    return arr


def check_unique_pieces(ids: np.ndarray, offsets: np.ndarray, what: str = "in the input",
                        lengths: np.ndarray | None = None) -> None:
    """Each (id, offset) names one piece: a repeated pair would be planned twice and then
    fail `check_pack` (or train a document twice). With `lengths`, the pieces of one document
    must not overlap either (tokens [offset, offset + length) of one document in two pieces
    would be trained twice)."""
    if len(ids) < 2 or (ids[1:] > ids[:-1]).all():  # increasing ids (automatic ones): distinct pieces
        return
    by_id = np.sort(ids)
    if not (by_id[1:] == by_id[:-1]).any():  # distinct ids: distinct pieces, whatever the offsets
        return
    order = np.lexsort((offsets, ids))
    ids_o, offsets_o = ids[order], offsets[order]
    one_doc = ids_o[1:] == ids_o[:-1]
    same = one_doc & (offsets_o[1:] == offsets_o[:-1])
    if same.any():
        k = int(order[1:][np.argmax(same)])
        hint = "" if np.any(offsets) else " (pieces of one document need distinct offsets: see split_documents)"
        raise ValueError(f"ids: id {int(ids[k])} with offset {int(offsets[k])} is repeated {what} "
                         f"(position {k}){hint}")
    if lengths is None:
        return
    overlap = one_doc & (offsets_o[:-1] + lengths[order][:-1] > offsets_o[1:])
    if overlap.any():
        j = int(np.argmax(overlap))
        a, b = int(order[j]), int(order[j + 1])
        raise ValueError(f"pieces of document {int(ids[a])} overlap {what}: tokens [{int(offsets[a])}, "
                         f"{int(offsets[a] + lengths[a])}) at position {a} and [{int(offsets[b])}, "
                         f"{int(offsets[b] + lengths[b])}) at position {b} (a piece is tokens [offset, "
                         f"offset + length) of its document)")


def check_index(name: str, value, n: int, what: str = "an integer") -> int:
    """`value` as an int if it is an integer in [0, n) (not a bool); else a ValueError naming
    `name`, `what` it must be and the range."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or not 0 <= value < n:
        raise ValueError(f"{name} must be {what} in [0, {n}), got {value!r}")
    return int(value)


def exact_integers(values, name: str) -> np.ndarray:
    """`values` as an array of whole numbers that fit int64 (integers, or floats with no
    fraction), so that a later int64 cast changes nothing; else a ValueError naming `name`."""
    arr = np.asarray(values)
    if arr.size == 0 or (arr.dtype.kind == "i"):
        return arr
    if arr.dtype.kind == "u":
        if np.any(arr > np.uint64(2**63 - 1)):
            raise ValueError(f"{name} must hold int64 integers, got {int(arr.max())}")
        return arr
    if arr.dtype.kind == "f":
        whole = np.isfinite(arr) & (arr == np.round(arr)) & (np.abs(arr) < 2.0**63)
        if not np.all(whole):
            raise ValueError(f"{name} must hold integers, got {float(arr[~whole].reshape(-1)[0])!r}")
        return arr
    raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")


def read_only(arr, dtype=None) -> np.ndarray:
    """A contiguous copy of `arr` (as `dtype`) that cannot be written to."""
    out = np.array(arr, dtype=dtype, copy=True)
    out.flags.writeable = False
    return out
