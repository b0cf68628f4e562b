"""`wlb-opt bench parity`: outlier-delay settings over several independent streams.

Table 2 runs one 200-step stream; a single stream holds only ~100 outliers, so one stream's
imbalance and delay are noisy. This runs each setting on `--seeds` independent streams of
the same distribution (the global batches of `wlb_opt.workloads.global_batches`, seed
DEFAULT_SEED + s) and reports per-stream and mean PP imbalance (max/mean forward time per
step, averaged over the steps after a `--warmup` of 20), the same mean of the simulated 1F1B
pipeline's step time over that of balanced micro-batches (`sim`: the forward imbalance leaves
the backward phase out, a pipeline pays both) and displacement per token (mean
|training step - arrival step|, token-weighted, after `drain()`; the delay per token without
lookahead), against the paper-parity target of <= 1.05 at <= 0.5 iterations per token.

Settings (7B, (8,2,4,1), H100, window W = 131072, N = 4, S_max = 1.25 W):
- "paper": release="paper", thresholds [32768, 73728], max_delay None (the best point of a
  threshold sweep on the Table 2 stream);
- "group": release="group", thresholds [W/4, 9W/16], max_delay 16, balance_tolerance 1.3
  (chosen on streams with seeds 10-12, not on the streams reported);
- "default": `WLBPacker(N, max_tokens, cost)`, nothing tuned (wlb_opt.packer.defaults; its
  constants were chosen on seeds 100-102, not on the streams reported); "paper" and "group"
  pack each step by Algorithm 1 (`method="wlb"`), the default by "wlb_phases";
- "default+K" (K = 1, 2, 4): the same with lookahead=K; "group+K": "group" with lookahead=K.

Each stream's "delay floor" row is `solvers.bounds.delay_floor`: the least displacement per
token ANY plan without lookahead needs on that stream just to fit it (n_micro pieces longer
than max_tokens / 2 per step, n_micro x max_tokens tokens per step), whatever its balance.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from ..solvers.greedy import warm_up_compiled
from .._optional import progress
from ..cost_args import add_cost_args, cost_from_args, count, natural
from ..packer import PackerConfig, WLBPacker, per_step_imbalance
from ..solvers.bounds import delay_floor
from ..workloads import DEFAULT_SEED, DISTRIBUTIONS, global_batches
from .data import run_packer
from .step_packers import pipeline_ratio
from ._provenance import provenance


def settings(window: int) -> dict[str, dict]:
    group = dict(thresholds=[window // 4, 9 * window // 16], max_delay=16, release="group", balance_tolerance=1.3,
                 method="wlb")
    return {
        "paper": dict(thresholds=[32768, 73728], max_delay=None, release="paper", method="wlb"),
        "group": group,
        "default": {},
        **{f"default+{k}": dict(lookahead=k) for k in (1, 2, 4)},
        **{f"group+{k}": dict(group, lookahead=k) for k in (1, 2, 4)},
    }


def run_stream(batches, cost, n_micro: int, max_tokens: int, warmup: int = 20, plan_cost=None, **kw) -> dict:
    """One setting on one stream: mean forward imbalance of the stream's steps after
    `warmup`, the same mean of the simulated 1F1B step time over that of balanced micro-batches
    (`sim`, `step_packers.pipeline_ratio`), displacement per token after the drain, median
    planning milliseconds per global batch (with lookahead the first K calls plan nothing and
    are left out). `plan_cost`, if given, is the cost model the packer plans with (default
    `cost`); the measures are `cost`'s either way."""
    packer = WLBPacker(n_micro, max_tokens, cost if plan_cost is None else plan_cost, config=PackerConfig(**kw))
    run = run_packer(packer, batches)
    k = packer.lookahead
    plans = [plan for plan in run.plans if plan is not None] + list(run.drained[:k])
    imbs = [per_step_imbalance(plan, cost, "fwd") for plan in plans]
    sims = [pipeline_ratio(plan, cost, cost.degree("pp")) for plan in plans]
    s = run.stats
    return dict(imbalance=float(np.mean(imbs[warmup:] or imbs)), sim=float(np.mean(sims[warmup:] or sims)),
                delay_per_token=float(s["displacement_per_token"]),
                early_token_share=s["early_token_share"], late_token_share=s["late_token_share"],
                late_pieces=s["late_pieces"], ms_per_batch=1e3 * float(np.median(run.seconds[k:] or run.seconds)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt bench parity", description=__doc__.splitlines()[0])
    p.add_argument("--dist", default="default", choices=sorted(DISTRIBUTIONS),
                   help="built-in length distribution (default: default)")
    p.add_argument("--seeds", default="0,1,2,3,4,5,6",
                   help="comma-separated stream seeds, offsets from DEFAULT_SEED (default 0,...,6)")
    p.add_argument("--steps", type=count, default=200, help="global batches per stream (default 200)")
    p.add_argument("--window", type=count, default=131072, help="training context length (default 131072)")
    p.add_argument("--n-micro", type=count, default=4, help="micro-batches per step (default 4)")
    p.add_argument("--settings", default="paper,group,default",
                   help="comma-separated settings (default paper,group,default; also default+1, default+2, "
                        "default+4, group+1, group+2, group+4)")
    p.add_argument("--warmup", type=natural, default=20, help="steps left out of the mean imbalance (default 20)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", default="results/parity", help="folder for parity.json (default results/parity)")
    add_cost_args(p, layout=("tp", "cp", "pp"))  # one replica: dp stays 1
    args = p.parse_args(argv)
    warm_up_compiled()  # numba's compile (or cache load) is no step's planning time
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must be more than --warmup ({args.warmup}): the means leave out the warm-up")
    cost = cost_from_args(args, parser=p)
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if len(set(seeds)) < len(seeds):  # a stream counted twice in every mean
        p.error(f"--seeds must not repeat a seed, got {args.seeds!r}")
    W, N = args.window, args.n_micro
    named = args.settings.split(",")
    unknown = [name for name in named if name not in settings(W)]
    if unknown or len(set(named)) < len(named):
        p.error(f"--settings must name distinct settings among {sorted(settings(W))}, got {args.settings!r}"
                + (f" (unknown: {unknown})" if unknown else ""))
    chosen = {k: v for k, v in settings(W).items() if k in named}
    results: dict[str, list[dict]] = {name: [] for name in chosen}
    floors = []
    for s in progress(seeds, desc="streams", enable=not args.no_progress):
        batches = global_batches(args.dist, W, N * W, args.steps, seed=DEFAULT_SEED + s)
        floors.append(delay_floor(batches, N, int(1.25 * W)))
        for name, kw in chosen.items():
            results[name].append(dict(seed=s, **run_stream(batches, cost, N, int(1.25 * W), args.warmup, **kw)))
    print(f"{args.dist}: {len(seeds)} streams x {args.steps} steps; cells = mean imbalance (after {args.warmup} "
          f"steps) / displacement per token (target <= 1.05 / <= 0.5)")
    print(f"{'setting':<10} " + " ".join(f"{'s' + str(s):>11}" for s in seeds) + f" {'mean':>13} {'ms':>6} {'sim':>7}")
    summary = {}
    for name, rows in results.items():
        imb = np.mean([r["imbalance"] for r in rows])
        delay = np.mean([r["delay_per_token"] for r in rows])
        sim = np.mean([r["sim"] for r in rows])
        ms = np.median([r["ms_per_batch"] for r in rows])
        summary[name] = dict(imbalance=float(imb), delay_per_token=float(delay), sim=float(sim), ms_per_batch=float(ms),
                             settings={k: v for k, v in chosen[name].items()})
        cells = " ".join(f"{r['imbalance']:.3f}/{r['delay_per_token']:.2f}".rjust(11) for r in rows)
        print(f"{name:<10} {cells} {f'{imb:.3f}/{delay:.3f}':>13} {ms:>6.2f} {sim:>7.4f}")
    cells = " ".join(f"-/{f:.2f}".rjust(11) for f in floors)
    print(f"{'floor':<10} {cells} {f'-/{np.mean(floors):.3f}':>13}   "
          "(least displacement of any plan without lookahead)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "parity.json").write_text(json.dumps(dict(provenance=provenance("parity", argv), dist=args.dist, seeds=seeds, steps=args.steps,
                                                     streams=results, summary=summary,
                                                     delay_floor=floors), indent=2))
    print(f"wrote {out / 'parity.json'}")
    return 0
