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
from wlb_opt.kernels.segments import forward_tiles, key_tiles

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


def replay_forward(seg, n_q, n_k, block_m, block_n):
    """Visit counts of the forward/dQ kernels' loops, asserting the unmasked-tile invariant."""
    mask = _mask(seg, n_q, n_k)
    count = np.zeros((n_q, n_k), dtype=np.int64)
    for q0, q_end, off, k_start, full_end, k_end in forward_tiles(seg, block_m, block_n).tolist():
        rows = np.arange(q0, min(q0 + block_m, q_end))
        assert rows.size and k_start <= rows[0] + off  # every row sees a key of the first tile
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
        for kind in ("fwd", "dkdv"):
            index = device_index(seg, kind, cfg, torch.device("cpu"))
            for name, t in index.items():
                keys.add((kind, name, native_specialize_impl(BaseBackend, t, False, True, True)))
    assert {key for _, _, key in keys} == {("*i32", "D")}, sorted(keys)
