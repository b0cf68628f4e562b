"""The fused torch path of doc_attention (kernels/torch_attention.py) against the dense
explicit-mask reference (kernels/reference.py): forward, lse and gradients (dq, dk, dv, and
through the lse), on random segment tables, CP shards whose key ranges overlap, GQA, length-1
documents and uncovered rows. Tolerances: 1e-12 relative in fp64, 1e-5 in fp32.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from wlb_opt.kernels import attention_reference, doc_attention, segments_from_lengths, validate_segments  # noqa: E402
from wlb_opt.kernels import torch_attention as ta  # noqa: E402
from cp_tables import cp_shard_table  # noqa: E402

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}
# The two ways a table runs: every micro-batch bucketed, or every one a single dense call.
MODES = {"bucketed": 0, "dense": 10**9}


@pytest.fixture(params=sorted(MODES))
def mode(request, monkeypatch):  # one value for all of a hypothesis test's examples
    monkeypatch.setattr(ta, "_DENSE_MAX_PAIRS", MODES[request.param])
    return request.param


def _qkv(n_q, n_k, hq, hkv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    def make(n, h):
        return torch.randn(n, h, d, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()

    return make(n_q, hq), make(n_k, hkv), make(n_k, hkv)


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-300)).item()


def _check(q, k, v, seg, scale=None, with_lse=True, seed=1):
    """doc_attention(backend="torch") and the reference: out, lse, and the gradients of
    ``<out, dout> + <lse, dlse>`` agree within the dtype's relative tolerance."""
    tol = TOLERANCE[q.dtype]
    out, lse = doc_attention(q, k, v, seg, softmax_scale=scale, return_lse=True, backend="torch")
    ref, lse_ref = attention_reference(q, k, v, seg, softmax_scale=scale)  # fp64
    assert out.dtype == q.dtype and out.shape == q.shape and lse.dtype == torch.float32
    assert torch.equal(torch.isfinite(lse), torch.isfinite(lse_ref))
    covered = torch.isfinite(lse_ref)
    assert _rel_err(out, ref) <= tol
    # lse comes back in fp32 whatever the inputs (the API's layout): compare at fp32 precision
    assert _rel_err(lse[covered], lse_ref[covered]) <= 1e-6

    gen = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    # the lse is fp32, so its gradient is too: draw one that fp32 holds exactly
    dlse = torch.randn(lse.shape, generator=gen).double().masked_fill(~covered, 0.0)
    outs = lambda o, l: [o, torch.where(covered, l, torch.zeros_like(l))] if with_lse else [o]  # noqa: E731
    grads_out = [dout.to(q.dtype), dlse.float()] if with_lse else [dout.to(q.dtype)]
    grads = torch.autograd.grad(outs(out, lse), (q, k, v), grads_out, allow_unused=True)
    grads_ref = torch.autograd.grad(outs(ref, lse_ref), (q, k, v), [dout, dlse] if with_lse else [dout])
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        g = torch.zeros_like(g_ref) if g is None else g
        assert _rel_err(g, g_ref) <= tol, f"{name}: {_rel_err(g, g_ref):.3g} > {tol}"
    return out, lse, grads


@st.composite
def segment_tables(draw):
    """Random tables of the contract: q ranges disjoint with gaps (uncovered rows), key ranges
    anywhere in K (overlapping), 1 <= q_len <= k_len, length-1 segments included."""
    n = draw(st.integers(0, 7))
    rows, q_pos = [], 0
    k_lens = [draw(st.integers(1, 70)) for _ in range(n)]
    n_k = max(k_lens, default=0) + draw(st.integers(0, 30))
    for k_len in k_lens:
        q_pos += draw(st.integers(0, 3))
        q_len = draw(st.integers(1, k_len))
        rows.append((q_pos, q_len, draw(st.integers(0, n_k - k_len)), k_len))
        q_pos += q_len
    n_q = q_pos + draw(st.integers(0, 3))
    return np.array(rows, dtype=np.int64).reshape(-1, 4), max(n_q, 1), max(n_k, 1)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(table=segment_tables(), heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]),
       dtype=st.sampled_from([torch.float64, torch.float32]), scale=st.sampled_from([None, 0.07]))
def test_random_tables_match_reference(mode, table, heads, dtype, scale):
    seg, n_q, n_k = table
    validate_segments(seg, n_q, n_k)
    _check(*_qkv(n_q, n_k, *heads, 8, dtype), seg, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_views_whose_channels_are_strided_match_reference(mode, dtype):
    # q, k and v as views of every other channel (stride 2 along the head dimension): torch's
    # CPU attention reads such a view as if its channels were adjacent, so they are copied first
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(13, 2, 16, 2, generator=gen, dtype=torch.float64).to(dtype)[..., 0].requires_grad_()
               for _ in range(3))
    assert q.stride(-1) == 2
    seg = segments_from_lengths([3, 1, 9])
    _check(q, k, v, seg)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 90), min_size=1, max_size=6), cp=st.sampled_from([2, 3]),
       dtype=st.sampled_from([torch.float64, torch.float32]))
def test_cp_shards_with_overlapping_keys_match_reference(mode, lengths, cp, dtype):
    for rank in range(cp):
        seg, n_q, n_k = cp_shard_table(lengths, cp, rank)
        if len(seg):
            _check(*_qkv(n_q, n_k, 4, 2, 16, dtype, seed=rank), seg)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_many_lengths_fill_several_buckets(dtype, monkeypatch):
    # lengths 1..64 and a few long ones: short parts share a bucket, long ones split by ratio
    lengths = list(range(1, 65)) + [150, 170, 300]
    seg = segments_from_lengths(lengths)
    n = sum(lengths)
    monkeypatch.setattr(ta, "_DENSE_MAX_PAIRS", 0)
    plan = ta._build_plan(validate_segments(seg, n, n), n, n, torch.device("cpu"), dense=False)
    assert len(plan.squares) >= 3 and not plan.rectangles
    _check(*_qkv(n, n, 2, 1, 16, dtype), seg, with_lse=False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_length_one_documents_and_uncovered_rows(mode, dtype):
    seg = segments_from_lengths([1, 1, 37, 1, 70, 3, 1, 33])
    q, k, v = _qkv(160, 160, 2, 2, 32, dtype)
    out, lse, (dq, dk, dv) = _check(q, k, v, seg)
    assert torch.all(out[147:] == 0) and torch.all(torch.isneginf(lse[:, 147:]))
    assert torch.all(dq[147:] == 0) and torch.all(dk[147:] == 0) and torch.all(dv[147:] == 0)


def test_empty_table_gives_zeros_and_zero_gradients(mode):
    q, k, v = _qkv(12, 9, 2, 1, 8, torch.float64)
    out, lse = doc_attention(q, k, v, np.zeros((0, 4), dtype=np.int32), return_lse=True, backend="torch")
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out), allow_unused=True)
    assert all(g is None or torch.all(g == 0) for g in grads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_compute_in_fp32(mode, dtype):
    """fp16/bf16 run in fp32: the result is the fp32 result rounded once to the input dtype."""
    seg = np.array([[0, 40, 0, 40], [40, 30, 20, 50], [70, 26, 70, 26]])
    q, k, v = _qkv(96, 96, 4, 2, 16, dtype)
    out = doc_attention(q, k, v, seg, backend="torch")
    ref, _ = attention_reference(q, k, v, seg)
    assert out.dtype == dtype
    assert _rel_err(out, ref) <= 2 * torch.finfo(dtype).eps
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    dq_ref, dk_ref, dv_ref = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))
    for g, g_ref in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert g.dtype == dtype and _rel_err(g, g_ref) <= 4 * torch.finfo(dtype).eps


def test_functional_pair_matches_reference(mode):
    """sdpa_forward / sdpa_backward (what the executor's CP attention calls, no autograd)."""
    seg, n_q, n_k = cp_shard_table([50, 23, 64], 2, 1)
    q, k, v = _qkv(n_q, n_k, 4, 1, 16, torch.float64)
    with torch.no_grad():
        out, lse = ta.sdpa_forward(q, k, v, seg, 0.25)
    ref, _ = attention_reference(q, k, v, seg, softmax_scale=0.25)
    dout = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads_ref = torch.autograd.grad(ref, (q, k, v), dout)
    assert lse.dtype == torch.float64 and _rel_err(out, ref) <= 1e-12
    grads = ta.sdpa_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, None, seg, 0.25)
    for g, g_ref in zip(grads, grads_ref):
        assert _rel_err(g, g_ref) <= 1e-12


def test_bucket_padding_is_invisible(mode):
    """Two documents of lengths 40 and 33 share a bucket padded to 40: the shorter one's
    padded keys must not leak into its queries (compared with each document alone)."""
    q, k, v = _qkv(73, 73, 1, 1, 8, torch.float64)
    both = doc_attention(q, k, v, np.array([[0, 40, 0, 40], [40, 33, 40, 33]]), backend="torch")
    alone = doc_attention(q[40:], k[40:], v[40:], np.array([[0, 33, 0, 33]]), backend="torch")
    ref, _ = attention_reference(q[40:], k[40:], v[40:], np.array([[0, 33, 0, 33]]))
    assert _rel_err(both[40:], ref) <= 1e-12 and _rel_err(alone, ref) <= 1e-12


def test_backward_is_bitwise_reproducible(mode):
    """The CPU kernels and the index_add of overlapping key ranges add in a fixed order."""
    seg, n_q, n_k = cp_shard_table([150, 70, 33, 200], 2, 0)
    q, k, v = _qkv(n_q, n_k, 4, 2, 16, torch.float32)
    runs = []
    for _ in range(2):
        out = doc_attention(q, k, v, seg, backend="torch")
        runs.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
