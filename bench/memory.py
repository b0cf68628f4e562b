"""`wlb-opt bench memory`: the memory model against the peak measured on this CPU.

    wlb-opt bench memory --out results/memory          (CPU, about a minute)

Runs real training steps of a small Llama-style model (`TinyLM`, fp32, one process, pp = 1)
through the executor (`train_step`: chunked loss, the torch attention path) on micro-batches
of different shapes (one long document, many short ones, a mix) and measures the peak memory
of each step with `torch.profiler(profile_memory=True)` (it sees libtorch's allocations,
which tracemalloc does not), above what existed before the step: weights and the gradients
of an earlier step (as in the steady state of gradient accumulation), so the peak holds the
activations kept for backward and the working memory. It compares that with the memory
model's prediction of the same parts (`MemoryModel.breakdown`: activations + transient),
twice:

- analytic: `MemoryModel.analytic`, counted from what the Block saves (hardware "cpu": the
  torch attention path with its per-document score matrices);
- calibrated: one block's stored and working bytes fitted to measured peaks by
  `wlb_opt.profile` (as `wlb-opt profile` saves it), on other micro-batches than these.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
from ..cost_args import count
from ._provenance import provenance


def _shapes(window: int) -> dict[str, list[int]]:
    return {"one document": [window], "64-token documents": [64] * (window // 64),
            "long + short": [window // 2] + [32] * (window // 64),
            "two halves": [window // 2] * 2, "quarter window": [window // 4]}


def measure_step(model, lengths, loss_chunk: int) -> int:
    """Peak bytes of one executor step (pp = 1) on one micro-batch of `lengths`, above what
    existed before it (weights and the gradients of the warm-up step)."""
    import torch

    import wlb_opt as wlb
    import wlb_opt.executor as ex
    from wlb_opt.profile import measure_peak_bytes

    lengths = np.asarray(lengths, dtype=np.int64)
    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny")).without_layout()
    plan = wlb.solve_pack(lengths, 1, int(lengths.sum()), cost, "wlb")
    shards = [wlb.solve_shard(plan.lengths[mb], 1, "per_seq", cost, offsets=plan.offsets[mb]) for mb in plan.micro_batches]
    vocab = model.head.out_features

    def doc_tokens(i: int) -> torch.Tensor:
        return torch.randint(0, vocab, (int(lengths[i]),), generator=torch.Generator().manual_seed(i))

    def step():
        ex.train_step(model, plan, shards, data=doc_tokens, backend="torch", loss_chunk=loss_chunk,
                      check_plan=False)

    model.zero_grad(set_to_none=True)
    step()  # warm-up: allocates the gradients (accumulated into from now on) and first-call caches
    _, peak = measure_peak_bytes(step, torch.device("cpu"))
    model.zero_grad(set_to_none=True)
    return peak


def run(dim: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 2, vocab: int = 2048, window: int = 1024,
        loss_chunk: int = 512, calibrate_window: int = 512, seed: int = 0) -> dict:
    import torch

    import wlb_opt as wlb
    import wlb_opt.executor as ex
    from wlb_opt.cost_memory import MemoryModel
    from wlb_opt.profile import _BlockBench, _calibrate_memory

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    spec = wlb.ModelSpec(name="bench", hidden=dim, layers=layers, heads=heads, kv_heads=kv_heads, ffn=2 * dim + 16,
                         vocab=vocab)
    model = ex.TinyLM.from_spec(spec)
    options = dict(dtype="fp32", optimizer="none", loss_chunk=loss_chunk)
    analytic = MemoryModel.analytic(spec, wlb.ParallelSpec(), wlb.HardwareSpec.preset("cpu"), **options)
    calibrated, _ = _calibrate_memory(_BlockBench(spec, torch.device("cpu"), torch.float32), calibrate_window,
                                      "cpu", "fp32", np.random.default_rng(seed + 7))
    calibrated = calibrated.with_options(**options)
    rows = []
    for name, lengths in _shapes(window).items():
        measured = measure_step(model, lengths, loss_chunk)
        row = dict(shape=name, tokens=int(sum(lengths)), documents=len(lengths), measured_mb=measured / 2**20)
        for label, mem in (("analytic", analytic), ("calibrated", calibrated)):
            parts = mem.breakdown(lengths, 0)
            predicted = parts["activations"] + parts["transient"]
            row[f"{label}_mb"] = predicted / 2**20
            row[f"{label}_error"] = predicted / measured - 1.0
        rows.append(row)
    summary = {label: dict(median_abs_error=float(np.median([abs(r[f"{label}_error"]) for r in rows])),
                           worst_abs_error=float(max(abs(r[f"{label}_error"]) for r in rows)))
               for label in ("analytic", "calibrated")}
    return dict(config=dict(dim=dim, layers=layers, heads=heads, kv_heads=kv_heads, vocab=vocab, window=window,
                            loss_chunk=loss_chunk, calibrate_window=calibrate_window, dtype="fp32",
                            measured_with="torch.profiler(profile_memory=True)"),
                rows=rows, summary=summary, calibrated=calibrated.to_dict())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt bench memory", description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=count, default=128, help="model width (default 128)")
    p.add_argument("--layers", type=count, default=4, help="blocks (default 4)")
    p.add_argument("--vocab", type=count, default=2048, help="vocabulary (default 2048)")
    p.add_argument("--window", type=count, default=1024, help="tokens of the largest micro-batch (default 1024)")
    p.add_argument("--loss-chunk", type=count, default=512, help="tokens per loss chunk (default 512)")
    p.add_argument("--out", type=Path, default=Path("results/memory"), help="folder for memory.json")
    args = p.parse_args(argv)
    if args.window < 64:  # the shapes include 64-token documents and a quarter window
        p.error(f"--window must be an integer >= 64 (the shapes hold 64-token documents), got {args.window}")
    os.environ.setdefault("KINETO_LOG_LEVEL", "99")
    res = run(dim=args.dim, layers=args.layers, vocab=args.vocab, window=args.window, loss_chunk=args.loss_chunk)
    c = res["config"]
    print(f"TinyLM dim {c['dim']}, {c['layers']} layers, vocab {c['vocab']}, fp32, pp=1, loss chunk "
          f"{c['loss_chunk']}; peak of one train_step above weights and gradients (activations + working), "
          f"measured with {c['measured_with']}")
    print(f"{'micro-batch':>20} {'tokens':>6} {'docs':>4} {'measured MB':>11} {'analytic MB':>11} {'error':>7} "
          f"{'calibrated MB':>13} {'error':>7}")
    for r in res["rows"]:
        print(f"{r['shape']:>20} {r['tokens']:>6} {r['documents']:>4} {r['measured_mb']:>11.1f} "
              f"{r['analytic_mb']:>11.1f} {r['analytic_error']:>+7.1%} {r['calibrated_mb']:>13.1f} "
              f"{r['calibrated_error']:>+7.1%}")
    for label, s in res["summary"].items():
        print(f"{label}: median |error| {s['median_abs_error']:.1%}, worst {s['worst_abs_error']:.1%}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory.json").write_text(json.dumps(dict(provenance=provenance("memory", argv), **res), indent=1))
    print(f"wrote {args.out / 'memory.json'}")
    return 0
