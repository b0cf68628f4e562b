"""The host-built kernel indices (kernels/segments.py), checked by replaying the kernels' loops.

The Triton kernels take their loop bounds from these tables and apply only the masks named
in triton_kernels.py. Replaying those loops in numpy over random segment tables (hypothesis)
checks, for every block shape the launchers may pick, that each visible (query, key) pair is
visited exactly once, that unmasked tiles hold only visible pairs, and that no unmasked load
reaches past the key rows: much faster and wider than running the interpreter.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")  # wlb_opt.kernels imports torch

from wlb_opt.kernels import attention_flops, segment_mask, segments_from_lengths, validate_segments, visible_pairs
from wlb_opt.kernels.segments import forward_index, forward_tiles, key_tiles

BLOCKS = st.sampled_from([16, 32, 64, 128])


@st.composite
def segment_tables(draw):
    """Random valid tables: disjoint q ranges with gaps, k ranges anywhere (overlaps allowed)."""
    n = draw(st.integers(0, 6))
    rows, q = [], draw(st.integers(0, 5))
    for _ in range(n):
        q_len = draw(st.integers(1, 90))
        k_len = q_len + draw(st.sampled_from([0, 0, 1, draw(st.integers(0, 150))]))
        rows.append([q, q_len, 0, k_len])
        q += q_len + draw(st.sampled_from([0, 0, draw(st.integers(1, 9))]))
    n_q = q + draw(st.integers(0, 3))
    n_k = max([r[3] for r in rows], default=0) + draw(st.integers(0, 40))
    for r in rows:
        r[2] = draw(st.integers(0, n_k - r[3]))
    order = draw(st.permutations(range(n)))  # table rows need not be sorted
    seg = np.array([rows[i] for i in order], dtype=np.int64).reshape(-1, 4)
    return seg, n_q, n_k


def _mask(seg, n_q, n_k):
    return segment_mask(seg, n_q, n_k).numpy()


def replay_forward(seg, n_q, n_k, block_m, block_n, max_blocks=None):
    """Visit counts of the forward/dQ kernels' loops, asserting the unmasked-tile invariant.
    With `max_blocks`, chunks of split tiles must add up to the whole tile and none may be
    longer than `max_blocks` key tiles."""
    mask = _mask(seg, n_q, n_k)
    count = np.zeros((n_q, n_k), dtype=np.int64)
    tiles, n_chunks, targets = forward_index(seg, block_m, block_n, max_blocks)
    slots = tiles[:, 6]
    assert len(set(slots[slots >= 0].tolist())) == int((slots >= 0).sum()), "two chunks share a slot"
    for q0, q_end, off, k_start, full_end, k_end, slot in tiles.tolist():
        rows = np.arange(q0, min(q0 + block_m, q_end))
        if slot < 0:
            assert rows.size and k_start <= rows[0] + off  # every row sees a key of the first tile
        else:
            assert max_blocks is not None and -(-(k_end - k_start) // block_n) <= max_blocks
            t = slot // n_chunks
            np.testing.assert_array_equal(targets[t * block_m:t * block_m + len(rows)], rows)
        assert (full_end - k_start) % block_n == 0 and k_start <= full_end <= k_end <= n_k
        for start in range(k_start, full_end, block_n):
            cols = np.arange(start, start + block_n)
            assert cols[-1] < n_k, "unmasked key load past the key rows"
            assert mask[np.ix_(rows, cols)].all(), "unmasked tile holds masked pairs"
            count[np.ix_(rows, cols)] += 1
        for start in range(full_end, k_end, block_n):
            cols = np.arange(start, start + block_n)
            cols = cols[cols < k_end]
            count[np.ix_(rows, cols)] += cols[None, :] <= rows[:, None] + off
    return count, mask


def replay_dkdv(seg, n_q, n_k, block_m, block_n):
    """Visit counts of the dK/dV kernel's loops over the transposed index."""
    mask = _mask(seg, n_q, n_k)
    count = np.zeros((n_q, n_k), dtype=np.int64)
    tiles, entries = key_tiles(seg, block_m, block_n)
    assert len(set(tiles[:, 0].tolist())) == len(tiles), "two programs own one key tile"
    for k0, e_lo, e_hi in tiles.tolist():
        assert k0 % block_n == 0 and k0 < n_k
        cols = np.arange(k0, k0 + block_n)
        for r0, r_mid, q_end, k_start, k_stop, off in entries[e_lo:e_hi].tolist():
            for r in range(r0, r_mid, block_m):
                rows = np.arange(r, r + block_m)
                vis = ((cols[None, :] >= k_start) & (cols[None, :] < k_stop)
                       & (cols[None, :] <= rows[:, None] + off) & (rows[:, None] < q_end))
                keep = rows < q_end
                count[np.ix_(rows[keep], cols[cols < n_k])] += vis[keep][:, cols < n_k]
                assert not vis[:, cols >= n_k].any()
            for r in range(r_mid, q_end, block_m):
                rows = np.arange(r, min(r + block_m, q_end))
                assert k_start <= cols[0] and cols[-1] < k_stop <= n_k, "unmasked tile leaves its segment"
                assert mask[np.ix_(rows, cols)].all(), "unmasked block holds masked pairs"
                count[np.ix_(rows, cols)] += 1
    return count, mask


@settings(max_examples=150)
@given(segment_tables(), BLOCKS, BLOCKS)
def test_forward_index_visits_every_visible_pair_once(table, block_m, block_n):
    seg, n_q, n_k = table
    count, mask = replay_forward(seg, n_q, n_k, block_m, block_n)
    np.testing.assert_array_equal(count, mask.astype(np.int64))


@settings(max_examples=100)
@given(segment_tables(), BLOCKS, BLOCKS, st.integers(1, 4))
def test_split_forward_index_visits_every_visible_pair_once(table, block_m, block_n, max_blocks):
    seg, n_q, n_k = table
    count, mask = replay_forward(seg, n_q, n_k, block_m, block_n, max_blocks)
    np.testing.assert_array_equal(count, mask.astype(np.int64))


@settings(max_examples=150)
@given(segment_tables(), BLOCKS, BLOCKS)
def test_transposed_index_visits_every_visible_pair_once(table, block_m, block_n):
    seg, n_q, n_k = table
    count, mask = replay_dkdv(seg, n_q, n_k, block_m, block_n)
    np.testing.assert_array_equal(count, mask.astype(np.int64))


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (16, 32), (32, 16)])
def test_indices_on_single_segments_near_tile_boundaries(block_m, block_n):
    """Sweep q_len and k_len - q_len around the tile sizes, where off-by-one bugs live."""
    for k_start in (0, 3, 16):
        for q_len in (1, 2, 3, 15, 16, 17, 31, 33):
            for extra in range(0, 35):
                seg = np.array([[1, q_len, k_start, q_len + extra]])
                n_q, n_k = q_len + 2, k_start + q_len + extra + 1
                for replay in (replay_forward, replay_dkdv):
                    count, mask = replay(seg, n_q, n_k, block_m, block_n)
                    np.testing.assert_array_equal(count, mask.astype(np.int64))


@given(segment_tables())
def test_valid_tables_pass_and_flops_count_visible_pairs(table):
    seg, n_q, n_k = table
    validate_segments(seg, n_q, n_k)
    pairs = int(_mask(seg, n_q, n_k).sum())
    assert visible_pairs(seg) == pairs
    assert attention_flops(seg, n_heads_q=3, head_dim=8, phase="fwd_bwd") == 3.5 * 4 * pairs * 3 * 8


def test_forward_index_is_heaviest_first():
    seg = segments_from_lengths([10, 300, 40])
    tiles = forward_tiles(seg, 64, 64)
    assert tiles.shape[1] == 7 and np.all(tiles[:, 6] == -1)  # no split without max_blocks
    work = -(-(tiles[:, 5] - tiles[:, 3]) // 64)
    assert np.all(np.diff(work) <= 0)
    assert tiles[0, 0] == 10 + 256  # the last query tile of the long document


def test_segments_from_lengths_and_flops_phase():
    np.testing.assert_array_equal(segments_from_lengths([2, 3]), [[0, 2, 0, 2], [2, 3, 2, 3]])
    with pytest.raises(ValueError, match="lengths must be >= 1"):
        segments_from_lengths([2, 0])
    with pytest.raises(ValueError, match="phase must be one of"):
        attention_flops([[0, 1, 0, 1]], 1, 16, phase="both")


# --- index upload: alignment and the specialisation key -------------------------------------

def test_every_index_part_starts_on_16_bytes():
    from wlb_opt.kernels.launch import INDEX_ALIGN, pack_index

    rng = np.random.default_rng(0)
    for _ in range(50):
        parts = {name: rng.integers(0, 9, size=(int(rng.integers(0, 40)), width)).astype(np.int32)
                 for name, width in (("tiles", 3), ("entries", 6))}
        flat, offsets = pack_index(parts)
        for name, arr in parts.items():
            assert offsets[name] * 4 % 16 == 0
            np.testing.assert_array_equal(flat[offsets[name]:offsets[name] + arr.size], arr.reshape(-1))
        assert len(flat) % INDEX_ALIGN == 0 and len(flat) > sum(a.size for a in parts.values())


def test_new_lengths_keep_the_triton_specialisation_key():
    """Tables with different tile counts ([1000]*3 -> 24 key tiles, [2500, 333] -> 23) give the
    same key for every index pointer (Triton specialises pointers on 16-byte alignment)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from wlb_opt.kernels.launch import BlockConfig, device_index

    cfg = BlockConfig(64, 128)
    keys = set()
    for lengths in ([1000, 1000, 1000], [2500, 333], [7], [129, 5, 3000, 17]):
        seg = segments_from_lengths(lengths)
        for kind, max_blocks in (("fwd", None), ("fwd", 3), ("dkdv", None)):
            index = device_index(seg, kind, cfg, torch.device("cpu"), max_blocks)
            for name in ("tiles", "entries", "targets"):
                if name not in index:
                    continue
                t = index[name]
                keys.add((kind, name, native_specialize_impl(BaseBackend, t, False, True, True)))
    assert {key for _, _, key in keys} == {("*i32", "D")}, sorted(keys)


# --- the launch-order model (kernels/work_model.py) ---------------------------------------

def test_list_schedule_by_hand():
    from wlb_opt.kernels.work_model import list_schedule, makespan_ratio

    assert list_schedule([5, 4, 3, 3, 2], 2) == 9.0  # 5+3 | 4+3+2 -> 8, 9
    assert list_schedule([1, 1, 1], 4) == 1.0
    span, ideal, ratio = makespan_ratio([8, 8, 8, 8], 3, 8)  # one slot runs two of them
    assert (span, ratio) == (16.0, 16.0 / (32 / 3))


@settings(max_examples=60)
@given(segment_tables(), BLOCKS, BLOCKS, st.integers(1, 5))
def test_model_items_are_the_kernels_index_rows(table, block_m, block_n, max_blocks):
    """The model's split items are exactly the work of the split index the launcher uploads."""
    from wlb_opt.kernels import work_model as wm

    seg, _, _ = table
    tiles = forward_tiles(seg, block_m, block_n, max_blocks).astype(np.int64)
    work = -(-(tiles[:, 5] - tiles[:, 3]) // block_n)
    modelled = wm.split_work(wm.forward_work(seg, block_m, block_n), max_blocks)
    np.testing.assert_array_equal(np.sort(work)[::-1], modelled)
    assert np.all(np.diff(work) <= 0)  # launched heaviest first


def test_splits_are_chosen_only_where_they_pay():
    from wlb_opt.kernels import work_model as wm

    many = np.full(2000, 10)  # many equal rows: nothing to gain
    assert wm.choose_forward_split(many, 4, 132) is None
    few = np.full(140, 1000)  # just over one wave of heavy rows: split-K pays
    blocks = wm.choose_forward_split(few, 1, 132)
    assert blocks is not None and blocks < 1000
    before = wm.makespan_ratio(wm.forward_order(few, 1, "flat"), 132, 1000)[2]
    after = wm.makespan_ratio(wm.forward_order(wm.split_work(few, blocks), 1, "flat"), 132, 1000)[2]
    assert before > 1.8 and after <= 1.05
    assert wm.choose_dkdv_split(np.arange(128, 0, -1), 1, 4, 132) == 2  # causal, 128 key tiles, 1 KV head: 2 shares suffice
    assert wm.choose_dkdv_split(np.full(5000, 50), 8, 4, 132) == 1
