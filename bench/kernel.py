"""`wlb-opt bench kernel`: useful TFLOP/s of doc_attention against SDPA and FlexAttention.

    wlb-opt bench kernel --out results/kernel            # on a CUDA GPU (H100/H200: ~5 min)
    wlb-opt bench kernel --cpu-smoke --out /tmp/k         # tiny CPU run (tests use it)
    wlb-opt bench kernel --schedule --out results/kernel_schedule   # launch-order model, CPU

Cases (same tensors for every method, bf16, Hq=32, Hkv=8, head dim 128 by default):
  packed  micro-batches of 8K..128K tokens cut from the "default" length distribution
          (wlb_opt.workloads), one segment per document;
  single  one causal document of 4K..128K tokens;
  scaling 32K tokens of equal documents of 512..32K tokens: time should follow sum(d^2).
Methods: ours (Triton), SDPA called once per document (is_causal, K/V expanded for GQA),
FlexAttention with a document block mask (torch.compile'd). Only unmasked FLOPs count
(kernels.attention_flops: forward 4*pairs*H*D, backward 2.5x forward). A correctness check
runs the bf16 kernel against an fp32 per-segment reference, next to SDPA's bf16 error, on
a packed 16K micro-batch with CP-style overlapping segments (FlashAttention's ratio rule).
Writes kernel_bench.json under --out and prints a table. --budget-s bounds the wall time:
past it, remaining comparisons are skipped and marked so in the JSON, and no case starts
past 1.1 x the budget.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from ..cost_args import count, natural, seconds
from ..workloads import document_stream
from ._provenance import provenance

_DEFAULT_PACKED = [8192, 16384, 32768, 65536, 131072]
_DEFAULT_SINGLE = [4096, 16384, 65536, 131072]
_DEFAULT_SCALING = [512, 2048, 8192, 32768]


def packed_lengths(n_tokens: int, seed: int, dist: str = "default") -> np.ndarray:
    """Document lengths filling exactly ``n_tokens``: a stream cut at the micro-batch end."""
    out, left = [], n_tokens
    for d in document_stream(n_tokens, dist, seed):
        if left <= 0:
            break
        out.append(int(min(d, left)))
        left -= out[-1]
    if left > 0:
        out.append(left)
    return np.array(out, dtype=np.int64)


def _timer(device):
    import torch

    def run(fn, warmup: int, reps: int) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return run


class _Methods:
    """The three implementations, each as fwd and fwd+bwd closures over one case's tensors."""

    def __init__(self, q, k, v, lengths, backend, use_flex):
        import torch

        from wlb_opt.kernels import doc_attention, segments_from_lengths

        self.q, self.k, self.v = q, k, v
        self.seg = segments_from_lengths(lengths)
        self.lengths = lengths
        self.dout = torch.randn_like(q)
        self.doc_attention, self.backend = doc_attention, backend
        group = q.shape[1] // k.shape[1]
        # SDPA: one [1, H, L, D] leaf per document (K/V expanded for GQA), built outside the
        # timing, so that neither slicing nor gradient accumulation is charged to it.
        bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        per_doc = lambda t, g: [t.detach()[a:b].repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0)  # noqa: E731
                                .contiguous().requires_grad_() for a, b in zip(bounds[:-1], bounds[1:])]
        self.sdpa_q, self.sdpa_k, self.sdpa_v = per_doc(q, 1), per_doc(k, group), per_doc(v, group)
        self.sdpa_dout = [t.detach() for t in per_doc(self.dout, 1)]
        self.flex = None
        if use_flex:
            self.flex = _flex_setup(q, k, v, lengths)

    def ours(self, backward: bool):
        out = self.doc_attention(self.q, self.k, self.v, self.seg, backend=self.backend)
        if backward:
            out.backward(self.dout)
        return out

    def sdpa(self, backward: bool):
        import torch
        import torch.nn.functional as F

        outs = [F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
                for qd, kd, vd in zip(self.sdpa_q, self.sdpa_k, self.sdpa_v)]
        if backward:
            torch.autograd.backward(outs, self.sdpa_dout)
        return outs

    def flex_run(self, backward: bool):
        fn, qf, kf, vf, block_mask = self.flex
        out = fn(qf, kf, vf, block_mask=block_mask, enable_gqa=True)
        if backward:
            out.backward(self.dout.transpose(0, 1).unsqueeze(0))
        return out

    def zero_grads(self):
        for t in [self.q, self.k, self.v] + self.sdpa_q + self.sdpa_k + self.sdpa_v:
            t.grad = None
        if self.flex is not None:
            for t in self.flex[1:4]:
                t.grad = None


_FLEX_FN = None


def _flex_setup(q, k, v, lengths):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _FLEX_FN
    if _FLEX_FN is None:
        _FLEX_FN = torch.compile(flex_attention)
    doc_id = torch.repeat_interleave(torch.arange(len(lengths), device=q.device),
                                     torch.as_tensor(lengths, device=q.device))

    def document_causal(b, h, q_idx, kv_idx):
        return (doc_id[q_idx] == doc_id[kv_idx]) & (q_idx >= kv_idx)

    n = q.shape[0]
    try:  # _compile=True builds the block mask without materialising the dense n x n mask
        block_mask = create_block_mask(document_causal, None, None, n, n, device=q.device, _compile=True)
    except TypeError:
        block_mask = create_block_mask(document_causal, None, None, n, n, device=q.device)
    qf, kf, vf = (t.detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for t in (q, k, v))
    return _FLEX_FN, qf, kf, vf, block_mask


def _measure_case(name, lengths, args, device, dtype, timer, deadline):
    import torch

    from wlb_opt.kernels import attention_flops, segments_from_lengths

    n = int(np.sum(lengths))
    gen = torch.Generator(device=device).manual_seed(args.seed)
    mk = lambda h: torch.randn(n, h, args.head_dim, device=device, dtype=dtype, generator=gen).requires_grad_()  # noqa: E731
    q, k, v = mk(args.heads), mk(args.kv_heads), mk(args.kv_heads)
    seg = segments_from_lengths(lengths)
    flops = {ph: attention_flops(seg, args.heads, args.head_dim, ph) for ph in ("fwd", "fwd_bwd")}
    row = dict(case=name, tokens=n, n_docs=int(len(lengths)), max_doc=int(np.max(lengths)),
               sum_d2=float(np.sum(lengths.astype(np.float64) ** 2)), fwd_gflop=flops["fwd"] / 1e9)
    use_flex = device.type == "cuda" and not args.no_flex and time.monotonic() < deadline
    try:
        methods = _Methods(q, k, v, lengths, args.backend, use_flex)
    except Exception as exc:  # noqa: BLE001 - flex setup is optional
        row["flex_error"] = f"{type(exc).__name__}: {exc}"[:200]
        methods = _Methods(q, k, v, lengths, args.backend, False)
    runs = [("ours", methods.ours)]
    if not args.no_sdpa:
        runs.append(("sdpa", methods.sdpa))
    if methods.flex is not None:
        runs.append(("flex", methods.flex_run))
    for label, fn in runs:
        for phase, backward in (("fwd", False), ("fwd_bwd", True)):
            key = f"{label}_{phase}"
            if label != "ours" and time.monotonic() > deadline:
                row[key + "_ms"] = None
                row[key + "_skipped"] = "time budget"
                continue
            try:
                ms = timer(lambda: (methods.zero_grads(), fn(backward)), args.warmup, args.reps)
            except Exception as exc:  # noqa: BLE001 - a failing baseline is reported, not fatal
                row[key + "_error"] = f"{type(exc).__name__}: {exc}"[:300]
                continue
            row[key + "_ms"] = ms
            row[key + "_tflops"] = flops[phase] / (ms * 1e-3) / 1e12
    del methods, q, k, v
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _correctness(args, device, dtype, n_tokens):
    """bf16 kernel vs fp32 per-segment reference, next to SDPA-bf16 (or torch-lowp) error."""
    import torch
    import torch.nn.functional as F

    from wlb_opt.kernels import attention_per_segment, doc_attention

    lengths = packed_lengths(n_tokens, args.seed + 1)
    # CP-style table: rank 0 of per-document CP=2 over these documents (overlapping K ranges)
    rows, local, k_off = [], 0, 0
    for d in lengths.tolist():
        cuts = np.linspace(0, d, 5).astype(int)
        for c in (0, 3):
            q_len = int(cuts[c + 1] - cuts[c])
            if q_len:
                rows.append((local, q_len, k_off, int(cuts[c + 1])))
                local += q_len
        k_off += d
    seg = np.array(rows, dtype=np.int64)
    hq, hkv = 4, 1
    gen = torch.Generator(device=device).manual_seed(args.seed)
    q = torch.randn(local, hq, args.head_dim, device=device, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(k_off, hkv, args.head_dim, device=device, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(k_off, hkv, args.head_dim, device=device, generator=gen).to(dtype).requires_grad_()
    dout = torch.randn(q.shape, device=device, generator=gen).to(dtype)

    def grads(out, *inputs):
        return [out] + list(torch.autograd.grad(out, inputs, dout.to(out.dtype)))

    ours = grads(doc_attention(q, k, v, seg, backend=args.backend), q, k, v)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = grads(attention_per_segment(q32, k32, v32, seg)[0], q32, k32, v32)
    # low-precision reference: SDPA in the test dtype, one call per segment (explicit mask)
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    outs = torch.zeros_like(ql)
    parts = []
    for q_start, q_len, k_start, k_len in seg.tolist():
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)
        o = F.scaled_dot_product_attention(
            ql[q_start:q_start + q_len].transpose(0, 1),
            kl[k_start:k_start + k_len].transpose(0, 1).repeat_interleave(hq // hkv, 0),
            vl[k_start:k_start + k_len].transpose(0, 1).repeat_interleave(hq // hkv, 0),
            attn_mask=mask)
        parts.append((q_start, q_len, o.transpose(0, 1)))
    outs = torch.cat([p[2] for p in parts]) if parts else outs
    low = grads(outs, ql, kl, vl)
    report = {"tokens_q": local, "tokens_k": k_off, "segments": len(seg), "dtype": str(dtype)}
    ok = True
    for name, a, r, lo in zip(("out", "dq", "dk", "dv"), ours, ref, low):
        err = (a.float() - r).abs().max().item()
        err_low = (lo.float() - r).abs().max().item()
        atol = 2 * torch.finfo(dtype).eps * max(r.abs().max().item(), 1.0)
        passed = err <= 2 * err_low + atol
        ok &= passed
        report[name] = dict(err=err, err_lowp_ref=err_low, ratio=err / max(err_low, 1e-30), passed=passed)
    report["passed"] = ok
    return report


def _scaling_fit(rows):
    """Least-squares time = a + b * sum(d^2) over the scaling cases (same token count)."""
    pts = [(r["sum_d2"], r["ours_fwd_ms"]) for r in rows if r.get("ours_fwd_ms")]
    if len(pts) < 2:
        return {}
    x, y = np.array(pts).T
    b, a = np.polyfit(x, y, 1)
    pred = a + b * x
    r2 = 1 - np.sum((y - pred) ** 2) / max(np.sum((y - y.mean()) ** 2), 1e-30)
    return dict(intercept_ms=float(a), ms_per_gd2=float(b * 1e9), r2=float(r2),
                time_ratio_vs_sum_d2_ratio=[float((yy / y[0]) / (xx / x[0])) for xx, yy in pts])


def _print_table(rows):
    cols = ["case", "tokens", "n_docs", "ours_fwd_tflops", "ours_fwd_bwd_tflops", "sdpa_fwd_tflops",
            "sdpa_fwd_bwd_tflops", "flex_fwd_tflops", "flex_fwd_bwd_tflops"]
    print(" | ".join(f"{c:>14}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            val = r.get(c)
            cells.append(f"{val:>14.1f}" if isinstance(val, float) else f"{str(val if val is not None else '-'):>14}")
        print(" | ".join(cells))


def _write_json(path: Path, result: dict) -> None:
    """Write `result` whole or not at all: a kill while writing leaves the previous file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--schedule" in argv:  # the CPU model of the launch order (bench/_kernel_schedule.py)
        from . import _kernel_schedule

        return _kernel_schedule.main([a for a in argv if a != "--schedule"])
    p = argparse.ArgumentParser(prog="wlb-opt bench kernel", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/kernel"), help="folder for kernel_bench.json")
    p.add_argument("--packed", type=count, nargs="*", default=_DEFAULT_PACKED, help="micro-batch sizes (tokens)")
    p.add_argument("--single", type=count, nargs="*", default=_DEFAULT_SINGLE, help="single-document lengths")
    p.add_argument("--scaling", type=count, nargs="*", default=_DEFAULT_SCALING, help="equal doc lengths")
    p.add_argument("--scaling-tokens", type=count, default=32768, help="tokens of each scaling case (default 32768)")
    p.add_argument("--heads", type=count, default=32, help="query heads (default 32)")
    p.add_argument("--kv-heads", type=count, default=8, help="key/value heads, GQA (default 8)")
    p.add_argument("--head-dim", type=count, default=128, help="head dimension (default 128)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="tensor dtype (default bf16)")
    p.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"],
                   help="doc_attention backend (default auto)")
    p.add_argument("--warmup", type=natural, default=1, help="untimed runs per measurement (default 1)")
    p.add_argument("--reps", type=count, default=3, help="timed runs per measurement (default 3)")
    p.add_argument("--seed", type=natural, default=0, help="length and tensor seed (default 0)")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    p.add_argument("--no-sdpa", action="store_true", help="skip SDPA")
    p.add_argument("--correctness-tokens", type=count, default=16384,
                   help="tokens of the correctness micro-batch (default 16384)")
    p.add_argument("--budget-s", type=seconds, default=360.0, help="skip baselines after this many seconds")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU (no GPU figures)")
    p.add_argument("--schedule", action="store_true",
                   help="instead: model the kernels' launch order on 132 SMs (CPU; see --schedule --help)")
    args = p.parse_args(argv)
    sizing = ("packed", "single", "scaling", "scaling_tokens", "heads", "kv_heads", "head_dim", "correctness_tokens",
              "warmup", "reps")
    given = [f"--{name.replace('_', '-')}" for name in sizing if getattr(args, name) != p.get_default(name)]
    if args.cpu_smoke and given:  # the smoke run sets its own tiny sizes
        p.error(f"--cpu-smoke sets its own sizes; drop {', '.join(given)}")
    uneven = [d for d in args.scaling if args.scaling_tokens % d]
    if uneven and not args.cpu_smoke:
        p.error(f"--scaling lengths must divide --scaling-tokens ({args.scaling_tokens}), got {uneven}")

    import torch

    if args.cpu_smoke:
        device = torch.device("cpu")
        args.packed, args.single, args.scaling, args.scaling_tokens = [96], [64], [32, 128], 128
        args.heads, args.kv_heads, args.head_dim, args.correctness_tokens = 2, 1, 32, 64
        args.dtype = "fp32" if args.dtype == "bf16" else args.dtype
        args.no_flex, args.warmup, args.reps = True, 0, 1
    elif not torch.cuda.is_available():
        print("wlb-opt bench kernel needs a CUDA GPU for real figures (none found); "
              "`--cpu-smoke` runs a tiny functional check on CPU.", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    timer = _timer(device)

    result = dict(
        provenance=provenance("kernel", argv),
        device=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__, python=platform.python_version(),
        triton=_version("triton"), args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        flops_convention="useful (unmasked) FLOPs: fwd 4*pairs*Hq*D, fwd_bwd 3.5x fwd",
        cases=[],
    )
    print(f"device: {result['device']}  torch {result['torch']}  triton {result['triton']}", flush=True)
    try:
        result["correctness"] = _correctness(args, device, dtype, args.correctness_tokens)
    except Exception as exc:  # noqa: BLE001 - recorded; the timing still runs
        result["correctness"] = {"error": f"{type(exc).__name__}: {exc}"[:500], "passed": False}
    print("correctness:", json.dumps(result["correctness"]), flush=True)

    cases = [(f"packed_{n // 1024}k" if n >= 1024 else f"packed_{n}", packed_lengths(n, args.seed + i))
             for i, n in enumerate(args.packed)]
    cases += [(f"single_{n // 1024}k" if n >= 1024 else f"single_{n}", np.array([n])) for n in args.single]
    scaling = [(f"scaling_{d}", np.full(args.scaling_tokens // d, d)) for d in args.scaling]
    for name, lengths in cases + scaling:
        # no case starts past 1.1 x the budget: one case (ours alone, past the deadline) stays
        # well inside a caller's limit of budget + a quarter of it
        if time.monotonic() > deadline + args.budget_s * 0.1:
            result["cases"].append(dict(case=name, skipped="time budget"))
            continue
        row = _measure_case(name, lengths, args, device, dtype, timer, deadline)
        result["cases"].append(row)
        print(json.dumps(row), flush=True)
        _write_json(args.out / "kernel_bench.json", result)  # partial results survive a timeout

    result["scaling_fit"] = _scaling_fit([r for r in result["cases"] if r["case"].startswith("scaling")])
    result["wall_s"] = time.monotonic() - t_start
    _write_json(args.out / "kernel_bench.json", result)
    _print_table([r for r in result["cases"] if "skipped" not in r])
    print(f"scaling fit: {result['scaling_fit']}")
    print(f"wrote {args.out / 'kernel_bench.json'} ({result['wall_s']:.0f} s)")
    return 0 if result["correctness"].get("passed") else 1


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    sys.exit(main())
