"""Documents before planning: cut to the window, and load users' length files.

Every method plans the same pieces: a document longer than the training window is cut into
window-sized pieces (the last one shorter) by `split_documents`, which keeps the document id
on every piece and records where each piece starts, so positions for RoPE stay right.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ._validate import check_int, validate_ids, validate_lengths


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
    n_pieces = -(-lengths // window)
    piece_ids = np.repeat(ids, n_pieces)
    first = np.repeat(np.cumsum(n_pieces) - n_pieces, n_pieces)
    k = np.arange(len(piece_ids), dtype=np.int64) - first  # piece index inside its document
    offsets = k * window
    pieces = np.minimum(window, np.repeat(lengths, n_pieces) - offsets)
    return pieces.astype(np.int64), piece_ids, offsets.astype(np.int64)


def load_lengths(path, field: str = "length") -> np.ndarray:
    """Document lengths from `.npy`, a text file (one length per line) or `.jsonl`.

    For `.jsonl`, each line is an object and `field` names its length entry (an int), or a
    string field whose length in characters / 4 is used as a token estimate.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"length file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".npy":
        arr = np.load(path, allow_pickle=False)
    elif suffix == ".jsonl":
        values = []
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
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
            values.append(max(1, -(-len(value) // 4)) if isinstance(value, str) else value)
        arr = np.asarray(values)
    else:
        rows = [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        try:
            arr = np.asarray([float(x) for x in rows])
        except ValueError as exc:
            raise ValueError(f"{path}: expected one integer length per line ({exc})") from None
    return validate_lengths(arr, name=f"lengths in {path.name}")
