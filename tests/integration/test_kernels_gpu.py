"""GPU tier of the kernel tests: compiled Triton, bf16, autotuning, torch.compile, large offsets.

Skipped without CUDA (conftest). Run on a GPU with ``TRITON_INTERPRET=0``:
``TRITON_INTERPRET=0 pytest -m gpu tests/integration/test_kernels_gpu.py`` (scripts/gpu_check.sh does).
Numerics use FlashAttention's error-ratio rule against an fp32 reference, with the
explicit-mask torch reference run in the test dtype as the low-precision yardstick.
"""
from __future__ import annotations

import importlib
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from cp_tables import cp_shard_table  # noqa: E402

from wlb_opt.kernels import attention_reference, doc_attention, segments_from_lengths  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="GPU tests need TRITON_INTERPRET=0 (compiled kernels)"),
]
launch = importlib.import_module("wlb_opt.kernels.launch")
da = importlib.import_module("wlb_opt.kernels.attention_ops")


def _qkv(n_q, n_k, hq, hkv, d, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda n, h: torch.randn(n, h, d, device="cuda", generator=gen).to(dtype).requires_grad_()  # noqa: E731
    return mk(n_q, hq), mk(n_k, hkv), mk(n_k, hkv)


def _check(q, k, v, seg, check_lse=False, deterministic=True):
    gen = torch.Generator(device="cuda").manual_seed(1)
    out, lse = doc_attention(q, k, v, seg, return_lse=True, backend="triton", deterministic=deterministic)
    dout = torch.randn(out.shape, device="cuda", generator=gen).to(q.dtype)
    ref, lse_ref = attention_reference(q, k, v, seg, compute_dtype=torch.float32)
    low, _ = attention_reference(q, k, v, seg, compute_dtype=None)
    g = torch.autograd.grad(out, (q, k, v), dout)
    g_ref = torch.autograd.grad(ref, (q, k, v), dout.float())
    g_low = torch.autograd.grad(low, (q, k, v), dout)
    eps = torch.finfo(q.dtype).eps
    for name, x, r, lo in zip(("out", "dq", "dk", "dv"), (out,) + g, (ref,) + g_ref, (low,) + g_low):
        err = (x.float() - r.float()).abs().max().item()
        err_low = (lo.float() - r.float()).abs().max().item()
        atol = 4 * eps * max(r.abs().max().item(), 1.0)
        assert err <= 2 * err_low + atol, f"{q.dtype} {name}: {err:.3g} > 2 x {err_low:.3g} + {atol:.3g}"
    if check_lse:
        fin = torch.isfinite(lse_ref)
        assert torch.equal(torch.isfinite(lse), fin)
        assert (lse[fin] - lse_ref[fin]).abs().max().item() < 1e-2
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
def test_packed_documents(dtype, head_dim):
    rng = np.random.default_rng(head_dim)
    lengths = np.minimum(np.maximum(1, rng.lognormal(5.5, 1.0, 40).astype(int)), 1500)
    lengths = lengths[np.cumsum(lengths) <= 3000]
    seg = segments_from_lengths(np.concatenate([lengths, [1, 1, 129]]))
    n = int(seg[-1, 0] + seg[-1, 1]) + 7  # 7 uncovered rows at the end
    _check(*_qkv(n, n, 8, 2, head_dim, dtype), seg, check_lse=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cp_shards_gqa(dtype):
    seg, n_q, n_k = cp_shard_table([1000, 333, 2048, 5], cp=2, rank=1)
    _check(*_qkv(n_q, n_k, 8, 1, 128, dtype), seg)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_atomic_dq_backward(dtype):
    seg, n_q, n_k = cp_shard_table([1000, 333, 2048, 5], cp=2, rank=0)
    _check(*_qkv(n_q, n_k, 8, 2, 128, dtype), seg, deterministic=False)


def test_dkdv_split_on_few_key_tiles():
    # one KV head, a group of 8 and ~30 key tiles: the model splits the group into shares
    seg, n_q, n_k = cp_shard_table([2000, 1800], cp=2, rank=1)
    _check(*_qkv(n_q, n_k, 8, 1, 128, torch.bfloat16), seg)


def test_deterministic_backward_and_zero_segments():
    seg, n_q, n_k = cp_shard_table([1500, 700], cp=2, rank=0)
    q, k, v = _qkv(n_q, n_k, 4, 2, 64, torch.bfloat16)
    runs = []
    for _ in range(2):
        out = doc_attention(q, k, v, seg)
        runs.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    out = doc_attention(q, k, v, np.zeros((0, 4), dtype=np.int32))
    assert torch.all(out == 0)


def test_autotuned_configs_agree_with_pinned(monkeypatch):
    monkeypatch.setenv("WLB_KERNEL_AUTOTUNE", "1")  # gpu_check.sh pins configs for speed
    seg = segments_from_lengths([3000, 1200, 77])
    q, k, v = _qkv(4277, 4277, 8, 2, 128, torch.bfloat16)
    with launch.forced_configs(fwd=(64, 32), dq=(64, 32), dkdv=(32, 64)):
        pinned = doc_attention(q, k, v, seg)
    tuned = doc_attention(q, k, v, seg)
    assert (pinned.float() - tuned.float()).abs().max().item() < 2e-2


def _n_compiled(fn) -> int | None:
    caches = getattr(fn, "device_caches", None)
    if caches is None:
        return None
    return sum(len(c[0]) for c in caches.values())


def test_new_lengths_do_not_recompile():
    tk = importlib.import_module("wlb_opt.kernels.triton_kernels")
    q, k, v = _qkv(3000, 3000, 4, 4, 64, torch.float16)
    doc_attention(q, k, v, segments_from_lengths([1000, 1000, 1000])).sum().backward()
    before = _n_compiled(tk._fwd_kernel), _n_compiled(tk._dkdv_kernel)
    if None in before:
        pytest.skip("this triton has no JITFunction.device_caches")
    for lengths in ([2500, 333], [17, 2001, 900], [2999]):
        n = sum(lengths)
        q, k, v = _qkv(n, n, 4, 4, 64, torch.float16)
        doc_attention(q, k, v, segments_from_lengths(lengths)).sum().backward()
    assert (_n_compiled(tk._fwd_kernel), _n_compiled(tk._dkdv_kernel)) == before


def test_offsets_past_int32():
    # q rows * Hq * D > 2**31: the last rows are only reachable with 64-bit offsets.
    hq, d = 128, 128
    n = (2**31) // (hq * d) + 64
    q = torch.zeros(n, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = torch.zeros_like(q), torch.zeros_like(q)
    q[-64:].normal_()
    k[-64:].normal_()
    v[-64:].normal_()
    seg = np.array([[n - 64, 64, n - 64, 64]])
    out = doc_attention(q, k, v, seg)
    ref, _ = attention_reference(q[-64:], k[-64:], v[-64:], [[0, 64, 0, 64]], compute_dtype=torch.float32)
    assert (out[-64:].float() - ref).abs().max().item() < 3e-2
    assert torch.all(out[:-64] == 0)


def test_head_offsets_past_int32():
    # a head-major [Hq, T, D] tensor seen as [T, Hq, D] (the kernels take strides): the last
    # head starts past 2**31 elements, in q and in the output, which keeps q's layout
    hq, d = 4, 128
    n = (2**31) // ((hq - 1) * d) + 64
    q = torch.zeros(hq, n, d, device="cuda", dtype=torch.bfloat16)
    q[:, :64].normal_()
    q = q.transpose(0, 1)
    k = torch.randn(64, hq, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(64, hq, d, device="cuda", dtype=torch.bfloat16)
    seg = np.array([[0, 64, 0, 64]])
    out = doc_attention(q, k, v, seg)
    ref, _ = attention_reference(q[:64], k, v, seg, compute_dtype=torch.float32)
    assert (out[:64].float() - ref).abs().max().item() < 3e-2


def test_opcheck_on_cuda():
    seg = torch.tensor([[0, 300, 0, 300], [300, 100, 200, 200]], dtype=torch.int32)
    q, k, v = _qkv(400, 400, 4, 2, 64, torch.float16)
    torch.library.opcheck(da._fwd_op, (q, k, v, seg, 0.125, True))


def test_torch_compile_inductor():
    seg = torch.from_numpy(segments_from_lengths([700, 300, 24]).astype(np.int32))
    q, k, v = _qkv(1024, 1024, 8, 2, 128, torch.bfloat16)
    w = torch.randn(128, 128, device="cuda", dtype=torch.bfloat16)

    def step(q, k, v):
        return (doc_attention(q @ w, k, v, seg) @ w).float().square().mean()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want = torch.autograd.grad(step(q, k, v), (q, k, v))
    for a, b in zip(got, want):
        assert torch.allclose(a.float(), b.float(), atol=1e-2, rtol=1e-2)
