"""The ``@triton.jit`` kernels of document-masked attention (forward, dQ, dK/dV, delta).

Only kernels live here; launch.py picks block sizes, uploads the host-built indices
(segments.py) and launches them. This module imports triton, so it is imported lazily, on
the first Triton call: ``import wlb_opt.kernels`` needs torch only.

Mask, per segment (q_start, q_len, k_start, k_len) with ``off = k_start + k_len - q_len -
q_start``: query row r sees key j iff ``k_start <= j <= r + off`` (bottom-right causal)::

        keys ->  k_start ........................ k_start+k_len-1
    q_start      x x x x x x x x x x x x . . . .      (k_len - q_len + 1 keys)
                 x x x x x x x x x x x x x . . .
                 x x x x x x x x x x x x x x . .
    q_end-1      x x x x x x x x x x x x x x x x      (all k_len keys)

A forward/dQ program owns one (segment, query tile) and one query head; programs form one
flat list, heaviest tile first and, within a tile, the query heads side by side (so the
heaviest work of every head starts first and a GQA group shares its K/V tiles in L2). Its key loop runs
from k_start in two parts: tiles every row of the tile sees in full (no mask work), then the
few tiles that straddle the diagonal (masked). A dK/dV program owns one aligned key tile and
one KV head (and, when a batch has too few key tiles for two waves of programs, one share
of its GQA group's query heads); it walks the transposed index (segments reading that
tile), and for each the query rows in masked blocks near the diagonal, then unmasked
blocks, summing over its query heads. Every output element is written by exactly one
program, in a fixed order, and the head shares are added in a fixed order: deterministic,
no atomics. The opt-in ``deterministic=False`` path instead computes dQ inside the dK/dV
kernel with fp32 atomics (FlashAttention's five matmuls instead of seven). Every load is
masked to the rows of its own segment, so nothing is read out of bounds.

Softmax runs in base 2 (scores are pre-multiplied by scale * log2(e)). The stored
log-sum-exp is natural-log, ``[Hq, Tq]``, fp32, as FlashAttention's varlen API returns it.
Lengths and row indices are runtime values (``do_not_specialize``), so new lengths never
recompile; row and head offsets are computed in int64 so that T * H * D, and the head
stride of a head-major view, may exceed 2**31.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the kernels inline these constants


@triton.jit
def _scores(q, k_tile, qk_scale, PRECISION: tl.constexpr):
    """[BM, D] x [BN, D] -> [BM, BN] scores in the log2 domain, fp32."""
    return tl.dot(q, tl.trans(k_tile), input_precision=PRECISION) * qk_scale


@triton.jit
def _row7(TABLE, i):
    """The seven int32 fields of row i of the forward/dQ index (rows of 7)."""
    base = TABLE + i * 7
    return (tl.load(base + 0), tl.load(base + 1), tl.load(base + 2), tl.load(base + 3), tl.load(base + 4),
            tl.load(base + 5), tl.load(base + 6))


@triton.jit
def _row6(TABLE, i):
    """The six int32 fields of row i of a host-built index table (rows of 6)."""
    base = TABLE + i * 6
    return (tl.load(base + 0), tl.load(base + 1), tl.load(base + 2), tl.load(base + 3), tl.load(base + 4),
            tl.load(base + 5))


@triton.jit
def _tile_and_head(n_heads):
    """(tile, head) of this program in the flat work list: the head varies fastest, so the
    heaviest tile runs first for every head and a GQA group's heads run side by side."""
    pid = tl.program_id(0)
    return pid // n_heads, (pid % n_heads).to(tl.int64)  # int64: head x head stride may pass 2**31


@triton.jit(do_not_specialize=["n_q", "n_heads"])
def _fwd_kernel(
    Q, K, V, O, LSE, O_PART, LSE_PART, TILES,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    n_q, n_heads, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (query tile[, key chunk], head). A key chunk of a split tile (slot >= 0) writes its
    normalised partial output and log-sum-exp to O_PART / LSE_PART ([slots, BLOCK_M, Hq, D]
    and [slots, BLOCK_M, Hq], fp32); the launcher combines the chunks in a fixed order."""
    tile, head = _tile_and_head(n_heads)
    kv_head = head // GROUP
    q0, q_end, off, k_start, full_end, k_end, slot = _row7(TILES, tile)

    rows = q0 + tl.arange(0, BLOCK_M)
    row_ok = rows < q_end
    dims = tl.arange(0, HEAD_DIM)
    cols0 = tl.arange(0, BLOCK_N)
    q_ptrs = Q + rows.to(tl.int64)[:, None] * stride_qt + head * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    k_base = K + kv_head * stride_kh + dims[None, :]
    v_base = V + kv_head * stride_vh + dims[None, :]


    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start in range(k_start, full_end, BLOCK_N):  # below the diagonal: no mask
        cols = (start + cols0).to(tl.int64)
        k_tile = tl.load(k_base + cols[:, None] * stride_kt)
        v_tile = tl.load(v_base + cols[:, None] * stride_vt)
        s = _scores(q, k_tile, qk_scale, PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=PRECISION)
        m_i = m_new
    for start in range(full_end, k_end, BLOCK_N):  # on the diagonal: masked
        cols = start + cols0
        col_ok = cols < k_end
        k_tile = tl.load(k_base + cols.to(tl.int64)[:, None] * stride_kt, mask=col_ok[:, None], other=0.0)
        v_tile = tl.load(v_base + cols.to(tl.int64)[:, None] * stride_vt, mask=col_ok[:, None], other=0.0)
        s = _scores(q, k_tile, qk_scale, PRECISION)
        visible = (cols[None, :] <= rows[:, None] + off) & col_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # -inf only in a key chunk of a split tile whose keys a row does not reach yet (a
        # whole tile always sees k_start): such a row keeps l = 0 and gets lse = -inf
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    if slot < 0:
        o_ptrs = O + rows.to(tl.int64)[:, None] * stride_ot + head * stride_oh + dims[None, :]
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + head.to(tl.int64) * n_q + rows, lse, mask=row_ok)
    else:
        part_rows = slot.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        part_ptrs = O_PART + (part_rows[:, None] * n_heads + head) * HEAD_DIM + dims[None, :]
        tl.store(part_ptrs, acc, mask=row_ok[:, None])
        tl.store(LSE_PART + part_rows * n_heads + head, lse, mask=row_ok)


@triton.jit(do_not_specialize=["n_q"])
def _delta_kernel(
    O, DO, DLSE, DELTA,
    stride_ot, stride_oh, stride_dot, stride_doh,
    n_q,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    """delta[h, r] = sum_d O * dO - dLSE (the lse gradient folds into delta: d lse / d s = p)."""
    head = tl.program_id(1).to(tl.int64)  # head x head stride may pass 2**31
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_q
    dims = tl.arange(0, HEAD_DIM)
    r64 = rows.to(tl.int64)[:, None]
    o = tl.load(O + r64 * stride_ot + head * stride_oh + dims[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + r64 * stride_dot + head * stride_doh + dims[None, :], mask=row_ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse_ptrs = head.to(tl.int64) * n_q + rows
    if HAS_DLSE:
        delta -= tl.load(DLSE + lse_ptrs, mask=row_ok, other=0.0)
    tl.store(DELTA + lse_ptrs, delta, mask=row_ok)


@triton.jit(do_not_specialize=["n_q", "n_heads"])
def _dq_kernel(
    Q, K, V, DO, DQ, DQ_PART, LSE, DELTA, TILES,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dqt, stride_dqh,
    n_q, n_heads, qk_scale, sm_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile, head = _tile_and_head(n_heads)
    kv_head = head // GROUP
    q0, q_end, off, k_start, full_end, k_end, slot = _row7(TILES, tile)

    rows = q0 + tl.arange(0, BLOCK_M)
    row_ok = rows < q_end
    r64 = rows.to(tl.int64)[:, None]
    dims = tl.arange(0, HEAD_DIM)
    cols0 = tl.arange(0, BLOCK_N)
    q = tl.load(Q + r64 * stride_qt + head * stride_qh + dims[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + r64 * stride_dot + head * stride_doh + dims[None, :], mask=row_ok[:, None], other=0.0)
    lse_ptrs = head.to(tl.int64) * n_q + rows
    lse2 = tl.load(LSE + lse_ptrs, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + lse_ptrs, mask=row_ok, other=0.0)
    k_base = K + kv_head * stride_kh + dims[None, :]
    v_base = V + kv_head * stride_vh + dims[None, :]


    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start in range(k_start, full_end, BLOCK_N):
        cols = (start + cols0).to(tl.int64)
        k_tile = tl.load(k_base + cols[:, None] * stride_kt)
        v_tile = tl.load(v_base + cols[:, None] * stride_vt)
        p = tl.exp2(_scores(q, k_tile, qk_scale, PRECISION) - lse2[:, None])
        dp = tl.dot(do, tl.trans(v_tile), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k_tile.dtype), k_tile, input_precision=PRECISION)
    for start in range(full_end, k_end, BLOCK_N):
        cols = start + cols0
        col_ok = cols < k_end
        k_tile = tl.load(k_base + cols.to(tl.int64)[:, None] * stride_kt, mask=col_ok[:, None], other=0.0)
        v_tile = tl.load(v_base + cols.to(tl.int64)[:, None] * stride_vt, mask=col_ok[:, None], other=0.0)
        visible = (cols[None, :] <= rows[:, None] + off) & col_ok[None, :]
        p = tl.exp2(_scores(q, k_tile, qk_scale, PRECISION) - lse2[:, None])
        p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v_tile), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k_tile.dtype), k_tile, input_precision=PRECISION)

    dq = dq * sm_scale
    if slot < 0:
        tl.store(DQ + r64 * stride_dqt + head * stride_dqh + dims[None, :], dq.to(DQ.dtype.element_ty),
                 mask=row_ok[:, None])
    else:  # a key chunk of a split tile: an fp32 partial sum, added by the launcher in order
        part_rows = slot.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(DQ_PART + (part_rows[:, None] * n_heads + head) * HEAD_DIM + dims[None, :], dq,
                 mask=row_ok[:, None])


@triton.jit
def _dkdv_block(
    dk, dv, k_tile, v_tile, cols, Q, DO, LSE, DELTA, DQ_ACC, r, q_end, k_start, k_stop, off, head,
    stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh, n_q, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
):
    """Add one block of query rows [r, r + BLOCK_M) of one query head to dK, dV of a key tile
    (and, with ATOMIC_DQ, its dQ contribution to the fp32 accumulator DQ_ACC).

    Works on transposed scores ([BLOCK_N keys, BLOCK_M rows], as the Triton tutorial does), so
    the four deterministic products have the key tile as their M side; the fifth (dQ = dS K,
    FlashAttention's structure) transposes dS once and adds atomically.
    """
    rows = r + tl.arange(0, BLOCK_M)
    row_ok = rows < q_end
    r64 = rows.to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    q_t = tl.load(Q + r64[None, :] * stride_qt + head * stride_qh + dims[:, None], mask=row_ok[None, :], other=0.0)
    do = tl.load(DO + r64[:, None] * stride_dot + head * stride_doh + dims[None, :], mask=row_ok[:, None], other=0.0)
    lse_ptrs = head.to(tl.int64) * n_q + rows
    lse2 = tl.load(LSE + lse_ptrs, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + lse_ptrs, mask=row_ok, other=0.0)
    p_t = tl.exp2(tl.dot(k_tile, q_t, input_precision=PRECISION) * qk_scale - lse2[None, :])
    if MASKED:
        visible = (
            (cols[:, None] >= k_start) & (cols[:, None] < k_stop)
            & (cols[:, None] <= rows[None, :] + off) & row_ok[None, :]
        )
        p_t = tl.where(visible, p_t, 0.0)
    # Unmasked blocks: rows past q_end load q = dO = delta = 0, so they add exactly zero.
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
    dp_t = tl.dot(v_tile, tl.trans(do), input_precision=PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), input_precision=PRECISION)
    if ATOMIC_DQ:
        dq = tl.dot(tl.trans(ds_t).to(k_tile.dtype), k_tile, input_precision=PRECISION) * sm_scale
        dq_ptrs = DQ_ACC + r64[:, None] * stride_dqt + head * stride_dqh + dims[None, :]
        tl.atomic_add(dq_ptrs, dq, mask=row_ok[:, None], sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["n_q", "n_k", "n_kv_heads", "n_split", "heads_per_split"])
def _dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, DQ_ACC, KV_TILES, ENTRIES,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dqt, stride_dqh, stride_ds, stride_dt, stride_dh,
    n_q, n_k, n_kv_heads, n_split, heads_per_split, qk_scale, sm_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
):
    """One program: one key tile, one KV head, one share of the GQA group's query heads.

    DK and DV are fp32 partial sums [n_split, Tk, Hkv, D]; the launcher adds the shares in a
    fixed order (deterministic). Splitting the group keeps short batches at >= 2 waves.
    """
    pid = tl.program_id(0)
    per_tile = n_kv_heads * n_split
    tile = pid // per_tile
    kv_head = ((pid % per_tile) // n_split).to(tl.int64)  # kv_head x head stride may pass 2**31
    split = pid % n_split
    k0 = tl.load(KV_TILES + tile * 3 + 0)
    e_lo = tl.load(KV_TILES + tile * 3 + 1)
    e_hi = tl.load(KV_TILES + tile * 3 + 2)

    cols = k0 + tl.arange(0, BLOCK_N)
    col_ok = cols < n_k
    c64 = cols.to(tl.int64)[:, None]
    dims = tl.arange(0, HEAD_DIM)
    k_tile = tl.load(K + c64 * stride_kt + kv_head * stride_kh + dims[None, :], mask=col_ok[:, None], other=0.0)
    v_tile = tl.load(V + c64 * stride_vt + kv_head * stride_vh + dims[None, :], mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    g_lo = split * heads_per_split

    for e in range(e_lo, e_hi):
        r0, r_mid, q_end, k_start, k_stop, off = _row6(ENTRIES, e)
        for g in range(g_lo, g_lo + heads_per_split):
            head = kv_head * GROUP + g
            for r in range(r0, r_mid, BLOCK_M):
                dk, dv = _dkdv_block(
                    dk, dv, k_tile, v_tile, cols, Q, DO, LSE, DELTA, DQ_ACC, r, q_end, k_start, k_stop, off,
                    head, stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh, n_q, qk_scale,
                    sm_scale, HEAD_DIM, BLOCK_M, True, PRECISION, ATOMIC_DQ,
                )
            for r in range(r_mid, q_end, BLOCK_M):
                dk, dv = _dkdv_block(
                    dk, dv, k_tile, v_tile, cols, Q, DO, LSE, DELTA, DQ_ACC, r, q_end, k_start, k_stop, off,
                    head, stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh, n_q, qk_scale,
                    sm_scale, HEAD_DIM, BLOCK_M, False, PRECISION, ATOMIC_DQ,
                )

    dk = dk * sm_scale
    out = split.to(tl.int64) * stride_ds + c64 * stride_dt + kv_head * stride_dh + dims[None, :]
    tl.store(DK + out, dk, mask=col_ok[:, None])
    tl.store(DV + out, dv, mask=col_ok[:, None])
