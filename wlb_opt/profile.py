"""Measure one transformer block on this device and fit a CostModel (paper §3: W_a, W_l
"derived from offline profiling").

Two measurements, both with the real kernels (`wlb_opt.kernels.doc_attention`, backend auto):

1. Micro-batches of packed documents with varied length mixes run through one block
   forward and backward. Each sample gives features (causal pairs, tokens, documents, 1)
   and times; non-negative least squares fits the four-term cost per phase (attn, linear +
   comm, doc_const, mb_const), scaled by the number of layers.
2. Single attention segments of growing query length over a fixed key range give the
   achieved attention throughput by query length, normalised to the longest: the
   `eff_q_len` / `eff_scale` table that `attention_latency` uses (paper §4.3, Fig. 10).

`fit_cost_model` is pure numpy (no torch) and is checked in the tests against a known model.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from ._optional import progress, require
from .cost import CostModel
from .specs import ModelSpec


@dataclass
class Sample:
    """One measured micro-batch: its document lengths and seconds per phase (one layer or all)."""

    lengths: np.ndarray
    fwd_s: float
    bwd_s: float


def _features(lengths: np.ndarray) -> np.ndarray:
    d = np.asarray(lengths, dtype=np.float64)
    return np.array([(d * (d + 1) / 2).sum(), d.sum(), float(len(d)), 1.0])


def _nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares by active-set iterations (Lawson-Hanson), small problems."""
    n = A.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(3 * n + 10):
        w = A.T @ (b - A @ x)
        if passive.all() or np.max(np.where(passive, -np.inf, w)) <= 1e-12 * (np.abs(w).max() + 1e-30):
            break
        passive[int(np.argmax(np.where(passive, -np.inf, w)))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(A[:, passive], b, rcond=None)[0]
            if np.all(z[passive] > 0):
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


def fit_cost_model(samples: list[Sample], layers: int = 1, tile: int = 128,
                   eff_q_len=None, eff_scale=None, attn_flops_per_pair: float | None = None,
                   meta: dict | None = None, model: ModelSpec | None = None) -> CostModel:
    """Fit the four-term CostModel to measured micro-batches (times per `layers` x sample).

    Rows are weighted by 1 / time so that short micro-batches count as much as long ones
    (relative error). `attn_flops_per_pair` (FLOPs per causal pair over all layers on one
    rank) and the fitted attention coefficient give the attention throughput that
    `attention_latency` divides by. `model` becomes `cost.model`; a fitted model has no
    layout (`cost.parallel` is None: one device, any dp/pp/cp accepted).
    """
    if len(samples) < 4:
        raise ValueError(f"fit_cost_model needs at least 4 samples (one per coefficient), got {len(samples)}")
    A = np.stack([_features(s.lengths) for s in samples])
    coef = {}
    for phase in ("fwd", "bwd"):
        t = np.array([getattr(s, f"{phase}_s") for s in samples], dtype=np.float64)
        if np.any(t <= 0) or not np.all(np.isfinite(t)):
            raise ValueError(f"measured {phase} times must be positive and finite")
        w = 1.0 / t
        attn, linear, doc_const, mb_const = _nnls(A * w[:, None], t * w) * layers
        coef[phase] = dict(attn=float(attn), linear=float(linear), comm=0.0, doc_const=float(doc_const),
                           mb_const=float(mb_const))
    flops = attn_flops_per_pair or 1.0
    # attention_latency = tiles * tile^2 * flops / (peak * scale): choose peak so a long
    # segment reproduces the fitted per-pair forward coefficient.
    peak = flops / max(coef["fwd"]["attn"], 1e-30)
    bwd_ratio = coef["bwd"]["attn"] / coef["fwd"]["attn"] if coef["fwd"]["attn"] > 0 else 2.5
    kwargs = {}
    if eff_q_len is not None:
        kwargs = dict(eff_q_len=tuple(int(x) for x in eff_q_len), eff_scale=tuple(float(x) for x in eff_scale),
                      efficiency_source="measured by wlb_opt.profile")
    return CostModel(coef=coef, attn_flops_per_pair=flops, attn_bwd_ratio=float(bwd_ratio), attn_peak_flops=peak,
                     tile=tile, meta=dict(kind="profiled", **(meta or {})), model=model, **kwargs)


def _time(fn, device, repeats: int) -> float:
    torch = require("torch", "profiling")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def profile_block(model: ModelSpec, window: int = 4096, n_samples: int = 12, device: str | None = None,
                  dtype: str | None = None, repeats: int = 3, seed: int = 0, show_progress: bool = True,
                  q_lens=(16, 64, 128, 256, 512, 1024)) -> CostModel:
    """Measure one block of `model` (full width, one layer) on `device` and fit a CostModel.

    Micro-batches hold `window` tokens split into documents whose lengths range from many
    short ones to one long one. On CPU keep `model` and `window` small ("tiny", 512).
    """
    torch = require("torch", "profiling")
    from .executor.model import Block
    from .kernels import doc_attention
    from .kernels.segments import segments_from_lengths

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = getattr(torch, dtype) if dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    block = Block(model.hidden, model.heads, model.kv_heads, model.ffn, model.head_dim).to(dev, dt)
    rng = np.random.default_rng(seed)

    samples = []
    for lengths in progress(_sample_mixes(window, n_samples, rng), total=n_samples, desc="profile micro-batches",
                            enable=show_progress):
        seg = segments_from_lengths(lengths)
        T = int(lengths.sum())
        x = torch.randn(T, model.hidden, device=dev, dtype=dt, requires_grad=True)
        pos = torch.from_numpy(np.concatenate([np.arange(d) for d in lengths])).to(dev)
        grad = torch.randn_like(x)

        def attend(q, k, v, seg=seg):
            return doc_attention(q, k, v, seg)

        def fwd():  # with autograd on, as in training (saving activations costs time too)
            block(x, pos, attend)

        def fwd_bwd():
            out = block(x, pos, attend)
            out.backward(grad)

        f = _time(fwd, dev, repeats)
        fb = _time(fwd_bwd, dev, repeats)
        samples.append(Sample(lengths, f, max(fb - f, 1e-9)))

    eff_q, eff_s = _efficiency_table(model, dev, dt, q_lens, repeats)
    head_fwd, head_bwd = _head_seconds_per_token(model, dev, dt, window, repeats)
    flops = 4.0 * model.q_dim * model.layers
    cost = fit_cost_model(samples, layers=model.layers, eff_q_len=eff_q, eff_scale=eff_s,
                          attn_flops_per_pair=flops, model=model,
                          meta=dict(device=str(dev), dtype=str(dt), window=window,
                                    head_s_per_token=dict(fwd=head_fwd, bwd=head_bwd)))
    # The embedding, final norm, LM head and loss run once per token (not per layer): add them
    # to the per-token term so micro_batch_cost covers the whole model, as the analytic one does.
    coef = {ph: dict(cost.coef[ph]) for ph in ("fwd", "bwd")}
    coef["fwd"]["linear"] += head_fwd
    coef["bwd"]["linear"] += head_bwd
    return dataclasses.replace(cost, coef=coef)


def _head_seconds_per_token(model: ModelSpec, dev, dt, window: int, repeats: int) -> tuple[float, float]:
    """Seconds per token of embedding + final norm + LM head + cross-entropy, fwd and bwd."""
    torch = require("torch", "profiling")
    embed = torch.nn.Embedding(model.vocab, model.hidden).to(dev, dt)
    norm = torch.nn.RMSNorm(model.hidden).to(dev, dt)
    head = torch.nn.Linear(model.hidden, model.vocab, bias=False).to(dev, dt)
    tokens = torch.randint(0, model.vocab, (window,), device=dev)
    labels = torch.randint(0, model.vocab, (window,), device=dev)

    def fwd():
        x = embed(tokens)
        return torch.nn.functional.cross_entropy(head(norm(x)).float(), labels)

    def fwd_bwd():
        fwd().backward()

    f = _time(fwd, dev, repeats)
    fb = _time(fwd_bwd, dev, repeats)
    return f / window, max(fb - f, 0.0) / window


def _sample_mixes(window: int, n_samples: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Micro-batches of `window` tokens whose document count and causal-pair count vary
    independently (so the least-squares fit can tell the per-document, per-pair and
    per-token terms apart): half are k equal documents with k from 1 to window / 8 on a
    geometric grid, half hold one long document (a share of the window) plus short ones."""
    n_equal = (n_samples + 1) // 2
    out = []
    for k in np.unique(np.geomspace(1, max(1, window // 8), n_equal).astype(int)):
        d = np.full(k, window // k, dtype=np.int64)
        d[: window - int(d.sum())] += 1
        out.append(d)
    for frac in np.linspace(0.2, 0.9, n_samples - len(out)):
        long_len = max(1, int(frac * window))
        rest, short = window - long_len, []
        while rest > 0:
            s = int(min(rest, rng.integers(4, max(5, window // 32))))
            short.append(s)
            rest -= s
        out.append(np.array([long_len] + short, dtype=np.int64))
    return out


def _efficiency_table(model: ModelSpec, dev, dt, q_lens, repeats):
    """Achieved attention FLOP/s by query length over a fixed key range, normalised to the max."""
    torch = require("torch", "profiling")
    from .kernels import doc_attention

    kv = int(max(q_lens)) * 2
    rates = []
    for q_len in q_lens:
        q = torch.randn(q_len, model.heads, model.head_dim, device=dev, dtype=dt)
        k = torch.randn(kv, model.kv_heads, model.head_dim, device=dev, dtype=dt)
        seg = np.array([[0, q_len, 0, kv]], dtype=np.int32)
        t = _time(lambda: doc_attention(q, k, k, seg), dev, repeats)
        pairs = q_len * kv - q_len * (q_len - 1) / 2
        rates.append(pairs / t)
    rates = np.array(rates)
    scale = np.clip(rates / rates.max(), 1e-3, 1.0)
    q_lens = np.array(q_lens)
    q_lens[0] = 1  # the first bucket covers every shorter query
    return q_lens.tolist(), scale.tolist()


def efficiency_table(cost: CostModel) -> dict[int, float]:
    """{q_len: achieved-efficiency scale} of `cost` as plain ints and floats (3 decimals)."""
    return {int(q): round(float(s), 3) for q, s in zip(cost.eff_q_len, cost.eff_scale)}


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="wlb-opt profile", description="Measure one block here and fit a CostModel.")
    p.add_argument("--model", default="tiny", help="ModelSpec preset (default tiny; use 7b on a GPU)")
    p.add_argument("--window", type=int, default=512, help="tokens per measured micro-batch (default 512)")
    p.add_argument("--samples", type=int, default=10, help="measured micro-batches, >= 4 (default 10)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="tensor dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement, median kept (default 3)")
    p.add_argument("--out", default="cost.json", help="where to save the fitted CostModel (default cost.json)")
    args = p.parse_args(argv)
    cost = profile_block(ModelSpec.preset(args.model), window=args.window, n_samples=args.samples,
                         device=args.device, dtype=args.dtype, repeats=args.repeats)
    cost.save(args.out)
    print(cost.describe())
    print("attention efficiency by q_len:", efficiency_table(cost))
    print(f"wrote {args.out}")
    return 0
