"""Segment tables on the host: validation, tile indices for the kernels, FLOP accounting.

A segment table (docs/architecture.md, "The segment table") is an int array of rows
``(q_start, q_len, k_start, k_len)``: query rows ``[q_start, q_start + q_len)`` attend to key
rows ``[k_start, k_start + k_len)``, causally aligned bottom-right, so query row ``i`` of the
segment sees keys ``k_start .. k_start + k_len - q_len + i``. Everything here is numpy only
and runs on the host: the Triton launchers upload the indices built here in one copy.

Two indices are built from a table, both vectorised:

* the forward index (also used by the dQ kernel): one row per (segment, query tile) with the
  tile's first query row, the segment's query end, the diagonal offset
  ``off = k_start + k_len - q_len - q_start`` (key ``j`` is visible from query row ``r`` iff
  ``k_start <= j <= r + off``) and the key loop bounds: unmasked tiles up to ``full_end``,
  masked tiles up to ``k_end``;
* the transposed index for the dK/dV kernel: for each key tile (aligned to the packed K
  rows), the list of segments whose key range meets it, with the first query row that sees
  any key of the tile and the row from which the whole tile is visible (no mask needed).

Both lists are ordered heaviest first (longest-processing-time order), so that the long
programs start early and the short ones fill the tail of the grid.
"""
from __future__ import annotations

from typing import Any

import numpy as np

SEGMENT_COLUMNS = ("q_start", "q_len", "k_start", "k_len")
_INT32_MAX = np.iinfo(np.int32).max


def _cdiv(a: np.ndarray | int, b: int) -> np.ndarray | int:
    return -(-a // b)


def as_segment_array(segments: Any) -> np.ndarray:
    """Return ``segments`` as an int64 numpy array of shape (S, 4), or raise ValueError.

    Accepts numpy arrays, torch tensors (any device; copied to the host) and nested lists.
    """
    if hasattr(segments, "detach") and hasattr(segments, "cpu"):  # a torch tensor
        if segments.dtype.is_floating_point or segments.dtype.is_complex:
            raise ValueError(f"segments must be an integer tensor, got dtype {segments.dtype}")
        segments = segments.detach().cpu().numpy()
    arr = np.asarray(segments)
    if arr.size == 0:
        arr = arr.reshape(0, 4) if arr.ndim != 2 or arr.shape[1] == 4 else arr
    if arr.ndim != 2 or arr.shape[1] != 4:
        raise ValueError(
            f"segments must have shape (S, 4) with columns {SEGMENT_COLUMNS}, got shape {arr.shape}"
        )
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"segments must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def validate_segments(segments: Any, n_q: int, n_k: int) -> np.ndarray:
    """Check a segment table against ``n_q`` query rows and ``n_k`` key rows.

    Returns the table as int64 (S, 4). Raises ValueError naming the first offending row for:
    q_len < 1, q_len > k_len, negative starts, ranges past ``n_q`` / ``n_k``, and overlapping
    query ranges (key ranges may overlap: two shards of one document read the same prefix).
    """
    seg = as_segment_array(segments)
    if len(seg) == 0:
        return seg
    q_start, q_len, k_start, k_len = seg.T

    def _fail(mask: np.ndarray, what: str) -> None:
        rows = np.flatnonzero(mask)
        if rows.size:
            r = int(rows[0])
            raise ValueError(
                f"segment row {r} {tuple(int(x) for x in seg[r])} (q_start, q_len, k_start, "
                f"k_len): {what}" + (f" ({rows.size} rows fail)" if rows.size > 1 else "")
            )

    _fail(q_len < 1, "q_len must be >= 1")
    _fail(q_len > k_len, "q_len must be <= k_len (bottom-right causal alignment)")
    _fail(q_start < 0, "q_start must be >= 0")
    _fail(k_start < 0, "k_start must be >= 0")
    _fail(q_start + q_len > n_q, f"query range ends past the {n_q} rows of q")
    _fail(k_start + k_len > n_k, f"key range ends past the {n_k} rows of k/v")
    order = np.argsort(q_start, kind="stable")
    ends = (q_start + q_len)[order]
    clash = np.flatnonzero(q_start[order][1:] < ends[:-1])
    if clash.size:
        a, b = int(order[clash[0]]), int(order[clash[0] + 1])
        raise ValueError(
            f"segment rows {a} {tuple(int(x) for x in seg[a])} and {b} "
            f"{tuple(int(x) for x in seg[b])} have overlapping query ranges; q ranges must be "
            "disjoint (key ranges may overlap)"
        )
    if seg.max() > _INT32_MAX:
        raise ValueError(f"segment values must fit in int32, got max {int(seg.max())}")
    return seg


def visible_pairs(segments: Any) -> int:
    """Number of (query, key) pairs the mask keeps: sum of q_len*(k_len-q_len) + q_len(q_len+1)/2."""
    seg = as_segment_array(segments)
    q_len, k_len = seg[:, 1], seg[:, 3]
    return int(np.sum(q_len * (k_len - q_len) + q_len * (q_len + 1) // 2))


def attention_flops(segments: Any, n_heads_q: int, head_dim: int, phase: str = "fwd") -> float:
    """Useful FLOPs (unmasked pairs only) of attention over a segment table.

    Forward is 4 * pairs * heads * head_dim (two matmuls); backward counts 2.5x forward
    (four matmuls plus the recomputed QK^T), the convention of FlashAttention and the Triton
    tutorial. ``phase`` is "fwd", "bwd" or "fwd_bwd".
    """
    factor = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
    if phase not in factor:
        raise ValueError(f"phase must be one of {sorted(factor)}, got {phase!r}")
    return factor[phase] * 4.0 * visible_pairs(segments) * n_heads_q * head_dim


def segments_from_lengths(lengths: Any) -> np.ndarray:
    """Segment table of a packed causal micro-batch: one full document per row, q == k ranges.
    `lengths`: a 1-D sequence of integers >= 1 (ValueError otherwise)."""
    arr = np.asarray(lengths)
    has_bool = isinstance(lengths, (list, tuple)) and any(isinstance(x, (bool, np.bool_)) for x in lengths)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu") or has_bool:
        raise ValueError(f"document lengths must be a 1-D sequence of integers, got {lengths!r:.80}")
    lengths = arr.astype(np.int64)
    if lengths.size and lengths.min() < 1:
        raise ValueError(f"document lengths must be >= 1, got min {int(lengths.min())}")
    starts = np.cumsum(lengths) - lengths
    return np.stack([starts, lengths, starts, lengths], axis=1)


FORWARD_COLUMNS = ("q0", "q_end", "off", "k_lo", "full_end", "k_hi", "slot")


def forward_tiles(seg: np.ndarray, block_m: int, block_n: int, max_blocks: int | None = None) -> np.ndarray:
    """Forward/dQ index: int32 rows (q0, q_end, off, k_lo, full_end, k_hi, slot), one per
    (segment, query tile of ``block_m`` rows[, key chunk]); see `forward_index`."""
    return forward_index(seg, block_m, block_n, max_blocks)[0]


def forward_index(seg: np.ndarray, block_m: int, block_n: int, max_blocks: int | None = None
                  ) -> tuple[np.ndarray, int, np.ndarray]:
    """(tiles, n_chunks, targets): the forward/dQ index and, for split tiles, where they go.

    ``tiles``: int32 rows (q0, q_end, off, k_lo, full_end, k_hi, slot). The program for a
    row visits keys [k_lo, full_end) in unmasked tiles of ``block_n`` (every query row of the
    tile sees all of them) and [full_end, k_hi) in masked tiles; query row r sees key j iff
    ``k_start <= j <= r + off``. Rows are sorted by the number of key tiles visited, largest
    first.

    ``max_blocks``: a query tile whose key loop is longer than that many key tiles is cut
    into chunks of at most ``max_blocks`` tiles (split-K, as flash-decoding does), so that a
    few long rows do not leave most SMs idle at the end of a launch. Chunk j of split tile t
    has ``slot = t * n_chunks + j`` (``n_chunks``: the most chunks any tile needs) and writes
    a partial result that `launch.py` combines; unsplit rows have ``slot = -1``.
    ``targets[t * block_m + i]`` is the query row that row i of split tile t combines into
    (-1 past the tile's end); empty without split tiles.
    """
    if len(seg) == 0:
        return np.zeros((0, 7), dtype=np.int32), 1, np.zeros(0, np.int64)
    q_start, q_len, k_start, k_len = seg.T
    n_tiles = _cdiv(q_len, block_m)
    seg_of = np.repeat(np.arange(len(seg)), n_tiles)
    first = np.cumsum(n_tiles) - n_tiles
    tile_in_seg = np.arange(int(n_tiles.sum())) - np.repeat(first, n_tiles)
    q0 = q_start[seg_of] + tile_in_seg * block_m
    q_end = (q_start + q_len)[seg_of]
    ks = k_start[seg_of]
    off = (k_start + k_len - q_len - q_start)[seg_of]
    k_end = np.minimum(q0 + block_m, q_end) + off  # one past the last key any row sees
    full_end = ks + (q0 + off + 1 - ks) // block_n * block_n  # first row sees these whole
    work = _cdiv(k_end - ks, block_n)
    rows = np.stack([q0, q_end, off, ks, full_end, k_end, np.full(len(q0), -1)], axis=1)
    n_chunks, targets = 1, np.zeros(0, np.int64)
    if max_blocks is not None and work.max() > max_blocks:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        long = work > max_blocks
        chunks = _cdiv(work[long], max_blocks)
        n_chunks = int(chunks.max())
        per = _cdiv(work[long], chunks)  # key tiles per chunk, balanced inside a row
        src = rows[long]
        t = np.repeat(np.arange(len(src)), chunks)
        j = np.arange(int(chunks.sum())) - np.repeat(np.cumsum(chunks) - chunks, chunks)
        lo = src[t, 3] + j * per[t] * block_n
        hi = np.minimum(lo + per[t] * block_n, src[t, 5])
        split = np.stack([src[t, 0], src[t, 1], src[t, 2], lo, np.clip(src[t, 4], lo, hi), hi,
                          t * n_chunks + j], axis=1)
        rows = np.concatenate([rows[~long], split])
        work = _cdiv(rows[:, 5] - rows[:, 3], block_n)
        r = src[:, 0, None] + np.arange(block_m)[None, :]
        targets = np.where(r < src[:, 1, None], r, -1).reshape(-1)
    order = np.argsort(-work, kind="stable")
    return rows[order].astype(np.int32), n_chunks, targets


def key_tiles(seg: np.ndarray, block_m: int, block_n: int) -> tuple[np.ndarray, np.ndarray]:
    """Transposed index for dK/dV: (tiles, entries).

    ``tiles``: int32 rows (k0, first_entry, end_entry), one per key tile (``block_n`` rows,
    aligned to the packed K) that some segment reads, heaviest first. ``entries``: int32 rows
    (r0, r_mid, q_end, k_start, k_end, off) per (key tile, segment): query rows [r0, r_mid)
    are visited in masked blocks of ``block_m`` rows, rows [r_mid, q_end) in unmasked blocks
    (the whole tile is visible from them and lies inside the segment's key range).
    """
    if len(seg) == 0:
        return np.zeros((0, 3), dtype=np.int32), np.zeros((0, 6), dtype=np.int32)
    q_start, q_len, k_start, k_len = seg.T
    k_stop = k_start + k_len
    first_tile = k_start // block_n
    n_tiles = (k_stop - 1) // block_n - first_tile + 1
    seg_of = np.repeat(np.arange(len(seg)), n_tiles)
    first = np.cumsum(n_tiles) - n_tiles
    tile = np.repeat(first_tile, n_tiles) + np.arange(int(n_tiles.sum())) - np.repeat(first, n_tiles)
    order = np.lexsort((seg_of, tile))  # by tile, then segment: a fixed accumulation order
    tile, seg_of = tile[order], seg_of[order]

    k0 = tile * block_n
    q_end = (q_start + q_len)[seg_of]
    ks, ke = k_start[seg_of], k_stop[seg_of]
    off = (k_stop - q_len - q_start)[seg_of]
    r0 = np.maximum(q_start[seg_of], np.maximum(k0, ks) - off)
    inside = (k0 >= ks) & (k0 + block_n <= ke)
    r_full = np.where(inside, np.clip(k0 + block_n - 1 - off, r0, q_end), q_end)
    r_mid = np.minimum(r0 + _cdiv(r_full - r0, block_m) * block_m, q_end)
    entries = np.stack([r0, r_mid, q_end, ks, ke, off], axis=1).astype(np.int32)

    uniq, start, count = np.unique(tile, return_index=True, return_counts=True)
    work = np.add.reduceat(_cdiv(q_end - r0, block_m), start)
    tiles = np.stack([uniq * block_n, start, start + count], axis=1)
    tiles = tiles[np.argsort(-work, kind="stable")].astype(np.int32)
    return tiles, entries
