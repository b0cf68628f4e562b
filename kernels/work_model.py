"""A list-scheduling model of the kernels' work lists on a GPU, to compare launch orders on CPU.

Why: the kernels' grids are flat work lists built on the host (segments.py), and the GPU
hands programs to free SM slots in launch order. How long a launch takes is then decided by
that order and by the size of the items, which this module computes exactly from a segment
table, without a GPU. It models:

- an item's duration as the number of (query block, key block) tile pairs it computes, the
  unit every kernel's inner loop works in (masked or not); the dK/dV item of one key tile
  and one share of a GQA group counts its query blocks times the heads it loops over;
- ``slots`` = SMs x programs resident per SM (H100/H200: 132 SMs; the configs chosen for
  head dim 128 hold one program per SM, see ``aot_check``), greedy list scheduling: each
  item in launch order starts on the slot that frees first.

``ideal = max(total work / slots, the largest single (tile, head) unit)``: no order of any
split of the work into per-head items can finish sooner. ``makespan / ideal`` is the figure
of merit (``wlb-opt bench kernel --schedule``). Numpy only.
"""
from __future__ import annotations

import heapq

import numpy as np

from .segments import forward_tiles, key_tiles


def _cdiv(a, b):
    return -(-a // b)


def list_schedule(durations, slots: int) -> float:
    """Makespan of greedy list scheduling: items in order, each on the first free slot."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    durations = np.asarray(durations, dtype=np.float64)
    if durations.size <= slots:
        return float(durations.max(initial=0.0))
    free = [0.0] * slots
    for d in durations.tolist():
        start = heapq.heappop(free)
        heapq.heappush(free, start + d)
    return max(free)


def forward_work(seg: np.ndarray, block_m: int, block_n: int) -> np.ndarray:
    """Tile pairs of each forward/dQ row (one per segment query tile), in index order."""
    tiles = forward_tiles(np.asarray(seg, dtype=np.int64), block_m, block_n).astype(np.int64)
    return _cdiv(tiles[:, 5] - tiles[:, 3], block_n) if len(tiles) else np.zeros(0, np.int64)


def dkdv_work(seg: np.ndarray, block_m: int, block_n: int) -> np.ndarray:
    """Tile pairs of each key tile for one query head, in index order (heaviest first)."""
    tiles, entries = key_tiles(np.asarray(seg, dtype=np.int64), block_m, block_n)
    if len(tiles) == 0:
        return np.zeros(0, np.int64)
    per_entry = _cdiv(entries[:, 2].astype(np.int64) - entries[:, 0], block_m)
    csum = np.concatenate([[0], np.cumsum(per_entry)])
    return csum[tiles[:, 2]] - csum[tiles[:, 1]]


def forward_order(work: np.ndarray, heads: int, order: str) -> np.ndarray:
    """Item durations in launch order: "flat" (tile-major, heads fastest: the kernels' order)
    or "head_major" (a 2-D grid (tiles, heads) launched x-fastest: all of head 0 first)."""
    if order == "flat":
        return np.repeat(work, heads)
    if order == "head_major":
        return np.tile(work, heads)
    raise ValueError(f"order must be 'flat' or 'head_major', got {order!r}")


def dkdv_order(work: np.ndarray, kv_heads: int, group: int, split: int, order: str) -> np.ndarray:
    """dK/dV item durations in launch order: one item per (key tile, KV head, share of the
    group); a share loops over group / split query heads. "flat": tile-major, KV heads and
    shares fastest (the kernels' order); "head_major": the 2-D grid (tiles, KV heads)."""
    if group % split:
        raise ValueError(f"split={split} must divide the GQA group {group}")
    item = work * (group // split)
    if order == "flat":
        return np.repeat(item, kv_heads * split)
    if order == "head_major":
        return np.tile(np.repeat(item, split), kv_heads)
    raise ValueError(f"order must be 'flat' or 'head_major', got {order!r}")


def makespan_ratio(durations: np.ndarray, slots: int, unit_max: float) -> tuple[float, float, float]:
    """(makespan, ideal, makespan / ideal) of a launch order on `slots` slots."""
    durations = np.asarray(durations, dtype=np.float64)
    ideal = max(float(durations.sum()) / slots, float(unit_max))
    span = list_schedule(durations, slots)
    return span, ideal, (span / ideal if ideal > 0 else 1.0)


def choose_dkdv_split(work: np.ndarray, kv_heads: int, group: int, slots: int, target: float = 1.05) -> int:
    """Shares to split a GQA group's query heads into in the dK/dV kernel: the smallest
    divisor s of `group` whose modelled makespan / ideal is within `target` (fewer shares
    mean fewer fp32 partial sums to add), else the divisor with the lowest ratio. `work` is
    `dkdv_work` of the table (tile pairs per key tile and query head)."""
    work = np.asarray(work, dtype=np.float64)
    if len(work) == 0 or group == 1:
        return 1
    unit = float(work.max())
    best, best_ratio = 1, np.inf
    for s in range(1, group + 1):
        if group % s:
            continue
        ratio = makespan_ratio(dkdv_order(work, kv_heads, group, s, "flat"), slots, unit)[2]
        if ratio <= target:
            return s
        if ratio < best_ratio - 1e-9:
            best, best_ratio = s, ratio
    return best


def split_work(work: np.ndarray, max_blocks: int | None) -> np.ndarray:
    """Forward items after cutting rows longer than `max_blocks` key tiles into balanced
    chunks (the rule of `segments.forward_index`), heaviest first."""
    work = np.asarray(work, dtype=np.int64)
    if max_blocks is None or not len(work) or work.max() <= max_blocks:
        return np.sort(work)[::-1]
    long = work > max_blocks
    chunks = _cdiv(work[long], max_blocks)
    per = _cdiv(work[long], chunks)
    t = np.repeat(np.arange(len(chunks)), chunks)
    j = np.arange(int(chunks.sum())) - np.repeat(np.cumsum(chunks) - chunks, chunks)
    pieces = np.minimum(per[t], work[long][t] - j * per[t])
    return np.sort(np.concatenate([work[~long], pieces]))[::-1]


def choose_forward_split(work: np.ndarray, heads: int, slots: int, target: float = 1.05) -> int | None:
    """`max_blocks` for the forward/dQ index: None (no split) when the flat launch is within
    `target` of the ideal; else the largest chunk size (a fraction 1/2, 1/4, 1/8, 1/16 of a
    slot's fair share of the work) that is, else the best of them. The ideal keeps the
    unsplit (tile, head) unit, so a split can reach a ratio below 1."""
    work = np.asarray(work, dtype=np.int64)
    if not len(work):
        return None
    unit = float(work.max())
    if makespan_ratio(forward_order(work, heads, "flat"), slots, unit)[2] <= target:
        return None
    fair = float(work.sum()) * heads / slots
    best, best_ratio = None, makespan_ratio(forward_order(work, heads, "flat"), slots, unit)[2]
    for frac in (2, 4, 8, 16):
        blocks = max(1, int(np.ceil(fair / frac)))
        ratio = makespan_ratio(forward_order(split_work(work, blocks), heads, "flat"), slots, unit)[2]
        if ratio <= target:
            return blocks
        if ratio < best_ratio - 1e-9:
            best, best_ratio = blocks, ratio
    return best
