"""`wlb-opt bench step-speed`: `train_step` against transformers' packed path, one process, CPU.

    wlb-opt bench step-speed --out results/step_speed                 (CPU, a few minutes)
    wlb-opt bench step-speed --workloads readme --steps 4 --out /tmp/s   (quick)

Both sides train the same steps of one `WLBStream` with one Llama config and the same initial
weights, the attention on torch's CPU kernels on both:

- "wlb": `train_step(stage, step.plan, step.shards, data=step)` of the model built with
  ``attn_implementation="wlb"`` (the executor, its default loss: cross-entropy over chunks
  of logits, each recomputed in the backward, which bounds the logits' memory);
- "wlb_full": the same with ``loss_fn`` the plain cross-entropy of the full logits, the loss
  setting transformers' own forward uses (the like-for-like ratio);
- "transformers": every micro-batch of the step as one packed row (`hf.hf_batch`: position
  ids restart at every piece) through transformers' own ``attn_implementation="sdpa"``,
  forward and backward, its loss weighted to the step's targets as train_step weighs it.

Planning is outside the timers (the stream plans before the step is handed over) and no
optimiser step runs, so the weights stay equal and the two losses of a step must agree
(reported). Each step is timed in CPU time of this process (``time.process_time``, all
threads) and in wall time, the sides interleaved step by step, in rotating order; the
figures are medians over the timed steps, with the load average beside them, and each
ratio is a wlb side's tokens/s over transformers' tokens/s in the same clock.

Workloads: "readme" is the README's loop (its model, documents, packer and stream);
"4x2560" is the same model on 4 micro-batches of up to 2,560 tokens per step (window 2,048,
S_max 1.25 x window) of log-normal documents.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from ..cost_args import count, natural
from ._provenance import provenance

WORKLOADS = ("readme", "4x2560")
SIDES = ("wlb", "wlb_full", "transformers")


def _config():
    import transformers

    return transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2)


def _stream(workload: str, steps: int, cost):
    """(stream, window) of a workload: enough documents for `steps` full steps."""
    import torch

    import wlb_opt as wlb

    if workload == "readme":
        gen = torch.Generator().manual_seed(0)
        lengths = [30, 7, 120, 12, 64, 300, 45, 9] * max(6, steps + 2)
        docs = [(i, torch.randint(0, 256, (n,), generator=gen)) for i, n in enumerate(lengths)]
        packer = wlb.WLBPacker(n_micro=2, max_tokens=320, cost=cost)
        return wlb.WLBStream(docs, packer, tokens_per_step=512, window=256)
    if workload == "4x2560":
        rng = np.random.default_rng(0)
        window, total, docs = 2048, 0, []
        while total < (steps + 2) * 5 * window:
            n = int(np.clip(rng.lognormal(6.0, 1.0), 2, 6000))
            docs.append((len(docs), torch.from_numpy(rng.integers(0, 256, n))))
            total += n
        packer = wlb.WLBPacker(n_micro=4, max_tokens=int(1.25 * window), cost=cost)
        return wlb.WLBStream(docs, packer, tokens_per_step=4 * int(1.25 * window), window=window)
    raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")


def _timed(fn):
    c0, w0 = time.process_time(), time.perf_counter()
    value = fn()
    return value, time.process_time() - c0, time.perf_counter() - w0


def run_workload(workload: str, steps: int, warmup: int) -> dict:
    """Per-step CPU and wall seconds of both sides over `warmup` + `steps` steps (the first
    `warmup` untimed), their medians, tokens per step and the largest loss difference."""
    import torch
    import transformers

    import wlb_opt as wlb
    from ..executor import train_step
    from ..integrations import hf

    hf.register()
    cfg = _config()
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="wlb")
    theirs = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
    theirs.load_state_dict(ours.state_dict())
    stage = hf.split_hf_stages(ours, pp=1)[0]
    cost = wlb.CostModel.analytic(wlb.ModelSpec.from_hf_config(cfg), wlb.ParallelSpec(), wlb.HardwareSpec.preset("cpu"))

    def wlb_side(step, **kw):
        ours.zero_grad(set_to_none=True)
        return float(train_step(stage, step.plan, step.shards, data=step, **kw))

    def full_logits_loss(hidden, labels, head):
        return torch.nn.functional.cross_entropy(head(hidden).float(), labels, ignore_index=-100, reduction="sum")

    def hf_side(step):
        theirs.zero_grad(set_to_none=True)
        total = 0.0
        for j, mb in enumerate(step.plan.micro_batches):
            if len(mb):
                batch = hf.hf_batch(step, j)
                n_targets = int((batch["labels"][0, 1:] != -100).sum())
                loss = theirs(**batch).loss * (n_targets / step.target_tokens)
                loss.backward()
                total += float(loss.detach())
        return total

    sides = dict(wlb=wlb_side, wlb_full=lambda step: wlb_side(step, loss_fn=full_logits_loss), transformers=hf_side)
    rows, loss_diff = [], 0.0
    for k, step in enumerate(_stream(workload, steps + warmup, cost)):  # (indices may skip an empty step)
        if k >= steps + warmup:
            break
        tokens = int(sum(step.plan.lengths[mb].sum() for mb in step.plan.micro_batches))
        turn = k % len(SIDES)
        timed = {name: _timed(lambda name=name: sides[name](step)) for name in SIDES[turn:] + SIDES[:turn]}
        base = timed["transformers"][0]
        loss_diff = max(loss_diff, *(abs(timed[n][0] - base) / max(abs(base), 1e-12) for n in SIDES))
        if k >= warmup:
            rows.append(dict(tokens=tokens, **{f"{name}_{clock}_s": timed[name][i] for name in SIDES
                                               for i, clock in ((1, "cpu"), (2, "wall"))}))
    med = lambda key: float(statistics.median(r[key] for r in rows))  # noqa: E731
    tokens = float(statistics.median(r["tokens"] for r in rows))
    out = dict(workload=workload, steps=len(rows), tokens_per_step=tokens, max_loss_rel_diff=loss_diff)
    for clock in ("cpu", "wall"):
        for name in SIDES:
            out[f"{name}_{clock}_s"] = med(f"{name}_{clock}_s")
            out[f"{name}_{clock}_tokens_per_s"] = tokens / out[f"{name}_{clock}_s"]
        for name in SIDES[:-1]:
            theirs_rate = out[f"transformers_{clock}_tokens_per_s"]
            out[f"ratio_{name}_{clock}"] = out[f"{name}_{clock}_tokens_per_s"] / theirs_rate
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt bench step-speed", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/step_speed"), help="folder for step_speed.json")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--steps", type=count, default=8, help="timed steps per workload (default 8)")
    p.add_argument("--warmup", type=natural, default=2, help="untimed steps first (default 2)")
    p.add_argument("--threads", type=count, default=1, help="torch threads (default 1: CPU time per thread)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    result = dict(provenance=provenance("step_speed", argv), threads=args.threads, rows=[])
    print(f"{'workload':>8} {'tokens':>6} {'clock':>5} {'wlb tok/s':>10} {'full-loss':>10} {'hf tok/s':>10} "
          f"{'ratio':>6} {'full':>6} {'load avg, start, end':>24}")
    for workload in args.workloads:
        load_before = os.getloadavg()
        row = run_workload(workload, args.steps, args.warmup)
        row["load_average"] = " ".join(f"{x:.1f}" for x in (*load_before, *os.getloadavg()))  # start, end
        result["rows"].append(row)
        for clock in ("cpu", "wall"):
            print(f"{workload:>8} {row['tokens_per_step']:>6.0f} {clock:>5} {row[f'wlb_{clock}_tokens_per_s']:>10,.0f} "
                  f"{row[f'wlb_full_{clock}_tokens_per_s']:>10,.0f} {row[f'transformers_{clock}_tokens_per_s']:>10,.0f} "
                  f"{row[f'ratio_wlb_{clock}']:>6.2f} {row[f'ratio_wlb_full_{clock}']:>6.2f} "
                  f"{row['load_average']:>24}")
        (args.out / "step_speed.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out / 'step_speed.json'}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
