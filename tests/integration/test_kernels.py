"""doc_attention (Triton under the interpreter, and the torch path) against an fp64 reference.

Numerics follow FlashAttention's error-ratio rule: the error of the kernel against the fp64
explicit-mask reference may be at most twice the error of a low-precision torch reference
(the same explicit-mask math run in the test dtype), plus a few ulps. The interpreter cannot
run bf16 ``tl.dot`` (it multiplies bit patterns), so bf16 runs on GPU only
(test_kernels_gpu.py); here fp32 and fp16. Sizes stay <= 256 tokens with 32-row blocks
(and a few 16-row ones) so the whole file runs in well under a minute on two cores.
"""
from __future__ import annotations

import importlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from wlb_opt.kernels import attention_reference, doc_attention, segment_mask, segments_from_lengths  # noqa: E402
from wlb_opt.kernels.launch import forced_configs

da = importlib.import_module("wlb_opt.kernels.attention_ops")

BACKENDS = ["triton", "torch"]
DTYPES = [torch.float32, torch.float16]


def _qkv(n_q, n_k, hq, hkv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n_q, hq, d, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(n_k, hkv, d, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(n_k, hkv, d, generator=gen).to(dtype).requires_grad_()
    return q, k, v


def _max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (x.double() - ref.double()).abs()
    both_inf = torch.isinf(x.double()) & torch.isinf(ref.double()) & (x.double() == ref.double())
    return diff.masked_fill(both_inf, 0.0).max().item() if diff.numel() else 0.0


def check_against_reference(q, k, v, segments, backend, check_lse=False, seed=1, deterministic=True):
    """Run doc_attention forward and backward and apply the error-ratio rule to all outputs."""
    gen = torch.Generator().manual_seed(seed)
    out, lse = doc_attention(q, k, v, segments, return_lse=True, backend=backend, deterministic=deterministic)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0])
    dout = torch.randn(out.shape, generator=gen).to(q.dtype)
    covered = torch.isfinite(lse)
    dlse = torch.randn(lse.shape, generator=gen).masked_fill(~covered, 0.0) if check_lse else None

    ref, lse_ref = attention_reference(q, k, v, segments)  # fp64 ground truth
    low, lse_low = attention_reference(q, k, v, segments, compute_dtype=None)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(lse_ref))

    def grads(o, l, dtype):
        outs, gs = [o], [dout.to(dtype)]
        if check_lse:
            outs.append(torch.where(covered, l, torch.zeros_like(l)))
            gs.append(dlse.to(dtype))
        return torch.autograd.grad(outs, (q, k, v), gs, allow_unused=True)

    eps = torch.finfo(q.dtype).eps
    results = [("out", out, ref, low), ("lse", lse, lse_ref, lse_low)]
    for name, g, g_ref, g_low in zip(
        ("dq", "dk", "dv"), grads(out, lse, q.dtype), grads(ref, lse_ref, torch.float64),
        grads(low, lse_low, q.dtype),
    ):
        results.append((name, g, g_ref, g_low))
    for name, x, x_ref, x_low in results:
        err, err_low = _max_err(x, x_ref), _max_err(x_low, x_ref)
        scale = max(x_ref.abs().nan_to_num(posinf=0.0, neginf=0.0).max().item(), 1.0) if x_ref.numel() else 1.0
        atol = 8 * eps * scale
        assert err <= 2 * err_low + atol, (
            f"{backend} {q.dtype} {name}: error {err:.3g} > 2 x reference error {err_low:.3g} + {atol:.3g}"
        )
    return out, lse


def _random_lengths(total, seed, max_len=90):
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(min(rng.lognormal(3.0, 1.0) + 1, max_len)))
    lengths[-1] -= sum(lengths) - total
    return [x for x in lengths if x > 0]


# --- numerics on the cases the issue lists ----------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_random_packed_documents(backend, dtype):
    lengths = _random_lengths(200, seed=3)
    seg = segments_from_lengths(lengths)
    check_against_reference(*_qkv(200, 200, 2, 2, 32, dtype), seg, backend)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_length_one_and_ragged_documents(backend, dtype):
    # length-1 documents; lengths that are not multiples of 16/32/64; a gap (uncovered) at the end
    seg = segments_from_lengths([1, 1, 37, 1, 70, 3, 1, 33])
    q, k, v = _qkv(160, 160, 2, 2, 32, dtype)
    out, lse = check_against_reference(q, k, v, seg, backend)
    assert torch.all(out[147:] == 0) and torch.all(torch.isneginf(lse[:, 147:]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_cp_shards_with_overlapping_key_ranges(backend, dtype):
    """Rank 0 of per-document CP=2: chunks 0 and 3 of each document, K all-gathered.

    Two shards of one document read the same key prefix (overlapping K ranges), and the
    second shard has q_len < k_len (bottom-right alignment).
    """
    docs, rows, local = [120, 77], [], 0
    k_off = 0
    for d in docs:
        cuts = np.linspace(0, d, 5).astype(int)  # 2*CP = 4 chunks
        for c in (0, 3):
            q_len = int(cuts[c + 1] - cuts[c])
            rows.append((local, q_len, k_off, int(cuts[c + 1])))
            local += q_len
        k_off += d
    seg = np.array(rows)
    assert seg[0, 2] == seg[1, 2] and seg[1, 1] < seg[1, 3]
    check_against_reference(*_qkv(local, sum(docs), 2, 1, 32, dtype), seg, backend, check_lse=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_q_shorter_than_k_range_uncovered_rows_and_keys(backend):
    # q rows 0-9 and 50-59 uncovered, keys 0-19 and 190-199 read by no segment.
    seg = np.array([[10, 25, 20, 60], [35, 15, 20, 100], [60, 40, 150, 40], [100, 3, 80, 110]])
    q, k, v = _qkv(110, 200, 2, 2, 32, torch.float32)
    check_against_reference(q, k, v, seg, backend)
    out = doc_attention(q, k, v, seg, backend=backend)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert torch.all(out[:10] == 0) and torch.all(out[50:60] == 0) and torch.all(out[103:] == 0)
    assert torch.all(dq[:10] == 0) and torch.all(dq[50:60] == 0)
    for g in (dk, dv):
        assert torch.all(g[:20] == 0) and torch.all(g[190:] == 0)


@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 1)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa(backend, hq, hkv):
    seg = np.array([[0, 40, 0, 40], [40, 30, 20, 50], [70, 26, 70, 26]])
    check_against_reference(*_qkv(96, 96, hq, hkv, 16, torch.float16), seg, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_segments(backend):
    q, k, v = _qkv(40, 24, 2, 1, 16, torch.float32)
    for seg in (np.zeros((0, 4), dtype=np.int32), []):
        out, lse = doc_attention(q, k, v, seg, return_lse=True, backend=backend)
        assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out), allow_unused=True)
        assert all(g is None or torch.all(g == 0) for g in grads)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_head_dims_triton(head_dim):
    seg = np.array([[0, 30, 0, 30], [30, 34, 10, 54]])
    check_against_reference(*_qkv(64, 64, 1, 1, head_dim, torch.float16), seg, "triton")


@pytest.mark.parametrize(
    "configs",
    [dict(fwd=(16, 16), dq=(16, 16), dkdv=(16, 16)), dict(fwd=(64, 16), dq=(16, 64), dkdv=(16, 64))],
    ids=["16x16", "mixed"],
)
def test_triton_block_shapes(configs):
    """Many tiles per segment: the unmasked/masked loop split and the r_mid split are exercised."""
    seg = np.array([[0, 100, 0, 100], [100, 60, 60, 100], [160, 17, 160, 17]])
    with forced_configs(**configs):
        check_against_reference(*_qkv(180, 180, 1, 1, 16, torch.float32), seg, "triton", check_lse=True)


def test_a_head_stride_past_int32():
    """A query view whose head stride puts head 2 past 2**31 elements (the kernels take
    strides, so a head-major layout's view is accepted as it is): with head offsets in int64
    every head reads its own rows, forward and backward (in int32 they fell outside the
    tensor). Only the pages the view covers are written: the rest of its storage is never
    touched."""
    t, h, d, stride = 16, 3, 16, 2**30 + 1024
    store = torch.empty(2 * stride + t * d, dtype=torch.float16)
    dense, k, v = _qkv(t, t, h, 1, d, torch.float16)
    q = store.as_strided((t, h, d), (d, stride, 1))
    with torch.no_grad():
        q.copy_(dense)
    q.requires_grad_()
    check_against_reference(q, k, v, [[0, t, 0, t]], "triton", check_lse=True)


def test_lse_gradient_and_scale():
    seg = np.array([[0, 48, 0, 48], [48, 20, 30, 38]])
    q, k, v = _qkv(70, 70, 2, 1, 32, torch.float32)
    for backend in BACKENDS:
        check_against_reference(q, k, v, seg, backend, check_lse=True)
    ref, _ = attention_reference(q, k, v, seg, softmax_scale=0.3)
    for backend in BACKENDS:
        out = doc_attention(q, k, v, seg, softmax_scale=0.3, backend=backend)
        assert _max_err(out, ref) < 1e-5


def test_bf16_through_interpreter_upcast():
    # The interpreter computes bf16 in fp32 (its tl.dot is wrong for bf16); the wrapper must
    # still return bf16 results that match the reference to bf16 precision.
    seg = np.array([[0, 40, 0, 40], [40, 24, 40, 24]])
    q, k, v = _qkv(64, 64, 2, 2, 16, torch.bfloat16)
    check_against_reference(q, k, v, seg, "triton")


def test_backward_is_deterministic():
    seg = np.array([[0, 64, 0, 64], [64, 32, 32, 64]])  # overlapping K ranges
    q, k, v = _qkv(96, 96, 2, 1, 16, torch.float16)
    runs = []
    for _ in range(2):
        out = doc_attention(q, k, v, seg, backend="triton")
        runs.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_atomic_dq_backward_matches_the_reference_and_the_deterministic_one(dtype):
    seg = np.array([[0, 64, 0, 64], [64, 32, 32, 64], [96, 40, 96, 40]])  # overlapping K ranges
    q, k, v = _qkv(136, 136, 4, 2, 16, dtype)
    check_against_reference(q, k, v, seg, "triton", check_lse=True, deterministic=False)
    grads = []
    for det in (True, False):
        out = doc_attention(q, k, v, seg, backend="triton", deterministic=det)
        grads.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **tol)
    with pytest.raises(ValueError, match="deterministic"):
        doc_attention(q, k, v, seg, backend="triton", deterministic="yes")


def _small_gpu_spying(monkeypatch, n_sm: int, chooser: str) -> tuple:
    """(launch module, list of the choices `chooser` of the work model returns) on a "GPU" of
    `n_sm` SMs, so that the launch model splits work on the interpreter's small tables."""
    launch = importlib.import_module("wlb_opt.kernels.launch")
    monkeypatch.setattr(launch, "sm_count", lambda device: n_sm)
    chosen = []
    real = getattr(launch._work, chooser)
    monkeypatch.setattr(launch._work, chooser, lambda *a, **k: chosen.append(real(*a, **k)) or chosen[-1])
    return launch, chosen


@pytest.mark.parametrize("group", [2, 4])
def test_dkdv_split_over_the_gqa_group_matches_the_reference(monkeypatch, group):
    # 64 SMs and a few key tiles: the model splits the group's heads into shares
    launch, chosen = _small_gpu_spying(monkeypatch, 64, "choose_dkdv_split")
    seg = np.array([[0, 50, 0, 50], [50, 30, 20, 60]])
    q, k, v = _qkv(80, 80, group, 1, 16, torch.float32, seed=group)
    check_against_reference(q, k, v, seg, "triton")
    assert chosen and chosen[-1] > 1


@pytest.mark.parametrize("deterministic", [True, False])
def test_split_k_forward_and_dq_match_the_reference(monkeypatch, deterministic):
    # 3 SMs and one long document among short ones: the model cuts the long rows' key loops
    # into chunks (split-K) whose partial results are combined on the host
    launch, chosen = _small_gpu_spying(monkeypatch, 3, "choose_forward_split")
    seg = np.array([[0, 64, 0, 256], [64, 10, 256, 10]])  # a CP shard's long rows, and a short one
    q, k, v = _qkv(74, 266, 2, 1, 16, torch.float32, seed=3)
    launch._SPLIT_MEMO.clear()
    check_against_reference(q, k, v, seg, "triton", check_lse=True, deterministic=deterministic)
    assert chosen and chosen[0] is not None


def test_tuned_configs_export_and_pin_round_trip(tmp_path):
    launch = importlib.import_module("wlb_opt.kernels.launch")
    key = ("fwd", "cuda:0", torch.bfloat16, 128, 4, 16384, 16384)
    saved = dict(launch._TUNED), dict(launch._PINNED)
    try:
        launch._TUNED[key] = launch.BlockConfig(128, 64, 8, 3)
        exported = launch.export_tuned()
        assert exported["fwd/bf16/128/4/16384/16384"] == [128, 64, 8, 3]
        path = tmp_path / "configs.json"
        import json

        path.write_text(json.dumps(exported))
        launch._TUNED.clear()
        launch.load_tuned(path)
        assert launch._pinned(key) == launch.BlockConfig(128, 64, 8, 3)
        with pytest.raises(ValueError, match="is not 'kernel/dtype/head_dim/group/q/k'"):
            launch.load_tuned({"fwd/bf16": [1, 2]})
        with pytest.raises(ValueError, match="block_m"):
            launch.load_tuned({"fwd/bf16/128/4/16384/16384": [1, 2]})
    finally:
        launch._TUNED.clear(), launch._TUNED.update(saved[0])
        launch._PINNED.clear(), launch._PINNED.update(saved[1])


def test_auto_backend_is_torch_on_cpu(monkeypatch):
    seg = np.array([[0, 20, 0, 20]])
    q, k, v = _qkv(20, 20, 1, 1, 24, torch.float64)  # head dim 24, fp64: torch path only
    out = doc_attention(q, k, v, seg)
    ref, _ = attention_reference(q, k, v, seg)
    assert _max_err(out, ref) < 1e-12


def test_segment_mask_is_bottom_right():
    mask = segment_mask(np.array([[1, 3, 2, 5]]), 5, 8)
    expected = torch.zeros(5, 8, dtype=torch.bool)
    expected[1, 2:5] = True
    expected[2, 2:6] = True
    expected[3, 2:7] = True
    assert torch.equal(mask, expected)


def test_a_table_refilled_in_place_is_validated_and_used_again():
    """The Triton path validates a table once per tensor; a host buffer refilled through numpy
    keeps its tensor and version counter, and its new values must still be read and checked."""
    q, k, v = _qkv(32, 32, 1, 1, 16, torch.float32)
    buf = np.array([[0, 32, 0, 32]], dtype=np.int32)
    seg = torch.from_numpy(buf)
    doc_attention(q, k, v, seg, backend="triton")
    buf[:] = [[0, 16, 16, 16]]
    got = doc_attention(q, k, v, seg, backend="triton")
    torch.testing.assert_close(got, attention_reference(q, k, v, torch.tensor([[0, 16, 16, 16]], dtype=torch.int32))[0].float(),
                               rtol=1e-5, atol=1e-5)
    buf[:] = [[0, 40, 0, 999]]
    with pytest.raises(ValueError, match="query range ends past the 32 rows of q"):
        doc_attention(q, k, v, seg, backend="triton")


# --- registration -------------------------------------------------------------------------

def test_opcheck_custom_ops():
    seg = torch.tensor([[0, 40, 0, 40], [40, 20, 20, 40]], dtype=torch.int32)
    q, k, v = _qkv(64, 64, 2, 1, 16, torch.float32)
    torch.library.opcheck(da._fwd_op, (q, k, v, seg, 0.25, True))
    out, lse = da._fwd_op(q, k, v, seg, 0.25, True)
    dout = torch.randn_like(out)
    for dlse in (None, torch.zeros_like(lse).normal_().masked_fill(torch.isinf(lse), 0)):
        args = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), dlse, seg, 0.25, True)
        torch.library.opcheck(da._bwd_op, args)
    # the layouts callers pass (transformers' heads-major views; a q whose last dimension is
    # strided): the fakes declare the outputs' real strides
    g = torch.Generator().manual_seed(1)
    k_hm, v_hm = (torch.randn(1, 64, 16, generator=g).transpose(0, 1) for _ in range(2))
    q_strided = torch.randn(16, 64, 2, generator=g).permute(1, 2, 0)
    for q_, k_, v_ in ((q.detach(), k_hm, v_hm), (q_strided, k.detach(), v.detach())):
        torch.library.opcheck(da._fwd_op, (q_, k_, v_, seg, 0.25, True))
        out, lse = da._fwd_op(q_, k_, v_, seg, 0.25, True)
        torch.library.opcheck(da._bwd_op, (torch.randn_like(out), q_, k_, v_, out, lse, None, seg, 0.25, True))


def test_torch_compile_fullgraph():
    seg = torch.tensor([[0, 40, 0, 40], [40, 24, 16, 48]], dtype=torch.int32)
    q, k, v = _qkv(64, 64, 2, 2, 16, torch.float32)

    def loss(q, k, v):
        return doc_attention(q, k, v, seg, backend="triton").square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    grads = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    ref, _ = attention_reference(q, k, v, seg)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        assert _max_err(g, r) < 1e-4


# --- bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "seg,match",
    [
        ([[0, 10, 0, 10], [5, 10, 0, 20]], r"rows 0 .* and 1 .*overlapping query ranges"),
        ([[0, 10, 0, 10], [10, 12, 0, 8]], r"row 1 .*q_len must be <= k_len"),
        ([[0, 0, 0, 4]], r"row 0 .*q_len must be >= 1"),
        ([[0, 10, 0, 10], [20, 20, 10, 30]], r"row 1 .*past the 32 rows of q"),
        ([[0, 10, 20, 20]], r"row 0 .*past the 32 rows of k/v"),
        ([[-1, 4, 0, 4]], r"row 0 .*q_start must be >= 0"),
        ([[0, 4, -2, 4]], r"row 0 .*k_start must be >= 0"),
        ([[0, 4, 0]], r"shape \(S, 4\).*\(1, 3\)"),
        (np.array([[0.0, 4, 0, 4]]), r"integers"),
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_segments(backend, seg, match):
    q, k, v = _qkv(32, 32, 2, 1, 16, torch.float32)
    with pytest.raises(ValueError, match=match):
        doc_attention(q, k, v, seg, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_tensors(backend):
    seg = [[0, 8, 0, 8]]
    q, k, v = _qkv(8, 8, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match=r"multiple of key/value heads \(3\)"):
        doc_attention(q, k[:, :1].expand(8, 3, 16), v[:, :1].expand(8, 3, 16), seg, backend=backend)
    with pytest.raises(ValueError, match=r"q must have shape \[T, H, D\], got shape \(8, 64\)"):
        doc_attention(q.reshape(8, 64), k, v, seg, backend=backend)
    with pytest.raises(ValueError, match=r"k and v must have the same shape"):
        doc_attention(q, k, v[:4], seg, backend=backend)
    with pytest.raises(ValueError, match=r"share a dtype"):
        doc_attention(q, k.half(), v.half(), seg, backend=backend)
    with pytest.raises(ValueError, match=r"head dims differ"):
        doc_attention(q, k[..., :8], v[..., :8], seg, backend=backend)
    with pytest.raises(ValueError, match=r"head dim must be >= 1, got shape \(8, 4, 0\)"):
        doc_attention(q[..., :0], k[..., :0], v[..., :0], seg, backend=backend)
    with pytest.raises(ValueError, match=r"dtype torch.int64"):
        doc_attention(q.long(), k.long(), v.long(), seg, backend=backend)
    with pytest.raises(ValueError, match=r"one device"):
        doc_attention(q, k.to("meta"), v.to("meta"), seg, backend=backend)
    with pytest.raises(ValueError, match=r"backend must be one of"):
        doc_attention(q, k, v, seg, backend="flash")


def test_triton_rejects_what_it_cannot_run(monkeypatch):
    seg = [[0, 8, 0, 8]]
    q, k, v = _qkv(8, 8, 2, 1, 16, torch.float64)
    with pytest.raises(ValueError, match=r"dtype torch.float64"):
        doc_attention(q, k, v, seg, backend="triton")
    q, k, v = _qkv(8, 8, 2, 1, 24, torch.float32)
    with pytest.raises(ValueError, match=r"head dim 24"):
        doc_attention(q, k, v, seg, backend="triton")
    q, k, v = _qkv(8, 8, 2, 1, 16, torch.float32)
    with pytest.raises(ValueError, match=r"int32/int64 tensor"):
        doc_attention(q, k, v, torch.tensor([[0.0, 8, 0, 8]]), backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"needs CUDA tensors"):
        doc_attention(q, k, v, seg, backend="triton")


def test_tuning_times_on_the_current_stream_never_the_whole_device(monkeypatch):
    """The autotuner runs inside a pipeline step, where the interleaved schedule keeps
    receives posted that wait for this rank's later work: a device-wide synchronize there
    would never return. Its timing waits on the current stream and its end event alone."""
    import torch

    from wlb_opt.kernels import launch

    waited = []

    class Stream:
        def synchronize(self):
            waited.append("stream")

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self, stream=None):
            assert isinstance(stream, Stream)  # recorded on the stream the candidates run on
            self.at = len(calls)

        def synchronize(self):
            waited.append("event")

        def elapsed_time(self, other):
            return float(other.at - self.at)

    def device_wide():
        raise AssertionError("torch.cuda.synchronize() inside a pipeline step can deadlock")

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", device_wide)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    assert launch._time_ms(lambda: calls.append(1), reps=3) == 1.0  # 3 timed calls between the events
    assert len(calls) == 4 and waited == ["stream", "event"]  # the warm-up call, then the timed ones
