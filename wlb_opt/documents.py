"""Documents before planning: cut to the window, and load users' length files.

Every method plans the same pieces: a document longer than the training window is cut into
window-sized pieces (the last one shorter) by `split_documents`, which keeps the document id
on every piece and records where each piece starts, so positions for RoPE stay right.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from ._validate import check_int, validate_ids, validate_lengths

MAX_PIECES = 10**8
"""Most pieces `split_documents` makes (three int64 arrays of this size are 2.4 GB)."""


def split_documents(lengths, window: int, ids=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut documents longer than `window` into window-sized pieces.

    Returns (pieces, piece_ids, offsets): piece lengths, the id of the document each piece
    comes from (ids[i], or i when ids is None), and the start of each piece inside its
    document. Pieces of one document are consecutive and in order.

    >>> split_documents([5, 12], window=5)
    (array([5, 5, 5, 2]), array([0, 1, 1, 1]), array([ 0,  0,  5, 10]))
    """
    window = check_int("window", window, 1)
    lengths = validate_lengths(lengths)
    ids = validate_ids(ids, len(lengths))
    if len(ids) > 1:
        order = np.argsort(ids, kind="stable")
        repeated = ids[order][1:] == ids[order][:-1]
        if repeated.any():
            k = int(np.argmax(repeated))
            raise ValueError(f"ids must be distinct (one per document), got id {int(ids[order[k]])} at positions "
                             f"{int(order[k])} and {int(order[k + 1])}; the pieces split_documents makes of one "
                             f"document share its id")
    n_pieces = -(-lengths // window)
    if int(n_pieces.sum()) > MAX_PIECES:
        raise ValueError(f"split_documents would make {int(n_pieces.sum())} pieces (more than {MAX_PIECES}) from "
                         f"{int(lengths.sum())} tokens with window={window}; use a window of at least "
                         f"{-(-int(lengths.sum()) // MAX_PIECES)} tokens")
    piece_ids = np.repeat(ids, n_pieces)
    first = np.repeat(np.cumsum(n_pieces) - n_pieces, n_pieces)
    k = np.arange(len(piece_ids), dtype=np.int64) - first  # piece index inside its document
    offsets = k * window
    pieces = np.minimum(window, np.repeat(lengths, n_pieces) - offsets)
    return pieces.astype(np.int64), piece_ids, offsets.astype(np.int64)


def load_lengths(path, field: str = "length") -> np.ndarray:
    """Document lengths from `.npy`, a text file (one length per line) or `.jsonl`.

    For `.jsonl`, each line is an object and `field` names its length entry (an int), or a
    string field whose length in characters / 4 (rounded up) is used as a token estimate.
    Text is read as UTF-8 (a byte-order mark at the start is allowed). A string of digits in
    the default field, "length", is refused (a number written as a string, which would be read
    as a text of a few characters).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a file path (str or os.PathLike), got {type(path).__name__}")
    path = Path(path)
    if not path.exists():
        raise ValueError(f"length file {str(path)!r} does not exist")
    if not path.is_file():
        raise ValueError(f"length file {str(path)!r} is not a file (a directory?); give a .npy, .txt or .jsonl file")
    suffix = path.suffix.lower()
    if suffix == ".npy":
        try:
            arr = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:  # a .npz, a pickle or a truncated file renamed .npy
            raise ValueError(f"{path}: not a readable .npy array of lengths ({type(exc).__name__}: {exc})") from None
        if not isinstance(arr, np.ndarray):
            raise ValueError(f"{path}: holds an archive, not one .npy array of lengths")
    elif suffix == ".jsonl":
        values = []
        for lineno, line in enumerate(_read_text(path).splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object with a {field!r} field, got {line.strip()[:40]!r}")
            if field not in obj:
                raise ValueError(f"{path}:{lineno}: no field {field!r}; fields are {sorted(obj)}")
            value = obj[field]
            if isinstance(value, str):
                if not value:
                    raise ValueError(f"{path}:{lineno}: field {field!r} is an empty string: a document of no tokens")
                if field == "length" and value.strip().isdigit():
                    raise ValueError(f"{path}:{lineno}: field 'length' is the string {value!r}, which would be read "
                                     f"as a text of {len(value)} characters: write the length as a JSON integer, or "
                                     "give field= the name of the document's text")
                value = -(-len(value) // 4)
            elif isinstance(value, bool) or not isinstance(value, int):
                # JSON true would count as a length of 1, 12.5 would be truncated
                raise ValueError(f"{path}:{lineno}: field {field!r} must be an integer length or a string, "
                                 f"got {value!r}")
            values.append(value)
        arr = np.asarray(values, dtype=object if values and max(abs(v) for v in values) >= 2**63 else None)
        if arr.dtype == object:
            raise ValueError(f"{path}: lengths must be token counts below 2**62, got {max(values)}")
    else:
        rows = [(lineno, ln.strip()) for lineno, ln in enumerate(_read_text(path).splitlines(), 1)
                if ln.strip() and not ln.lstrip().startswith("#")]
        values = []
        for lineno, text in rows:
            values.append(_integer_line(path, lineno, text))
        if values and max(abs(v) for v in values) >= 2**62:
            raise ValueError(f"{path}: lengths must be token counts below 2**62, got {max(values, key=abs)}")
        arr = np.asarray(values, dtype=np.int64)
    return validate_lengths(arr, name=f"lengths in {path.name}")


def _integer_line(path: Path, lineno: int, text: str) -> int:
    """One length of a text file, exactly: int() first (float() would turn 2**53 + 1 into
    2**53); a float spelling ("1e3", "12.0") only if it is a whole number below 2**53."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isfinite(value) and abs(value) >= 2**62:
        raise ValueError(f"{path}:{lineno}: lengths must be token counts below 2**62, got {text[:40]!r}")
    if not math.isfinite(value) or value != int(value) or abs(value) >= 2**53:
        raise ValueError(f"{path}:{lineno}: expected one integer length per line, got {text[:40]!r}")
    return int(value)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")  # UTF-8, a byte-order mark at the start allowed
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file (give .npy for binary arrays)") from None
