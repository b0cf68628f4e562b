"""`wlb-opt bench pack-speed`: CPU time of solve_pack on one large global batch.

The paper reports 20 ms per batch for WLB-LLM with 2 queues (Table 2). Timed as CPU time of
this process (`time.process_time`), so that other processes on a shared machine are not
counted; reports the median of repeated runs with p10 and p90. Methods built on Algorithm 1
("wlb", "wlb_ls", and "wlb_phases", the streaming packer's default) are timed twice when
numba is installed (the `fast` extra): with the compiled loops and with the pure-Python ones
(column `loop`). The streaming planner
(`WLBPacker.pack` step after step) is timed by `wlb-opt bench stream-speed`.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from ..solvers.greedy import warm_up_compiled
from ..cost_args import add_cost_args, cost_from_args, count, natural
from ..solvers.greedy import compiled_available, use_compiled
from ..step_pack import PACK_METHODS, solve_pack
from ..workloads import DISTRIBUTIONS, global_batch
from ._provenance import provenance


_COMPILED_LOOPS = ("wlb", "wlb_ls", "wlb_phases")
"""Methods whose time depends on which loops run (Algorithm 1's, the balanced placement's)."""


def measure(lengths, ids, offsets, n_micro, max_tokens, cost, method, repeats, compiled: bool) -> dict:
    with use_compiled(compiled):
        solve_pack(lengths, n_micro, max_tokens, cost, method, ids=ids, offsets=offsets)  # warm-up (and compile)
        times = []
        for _ in range(repeats):
            t0 = time.process_time()
            plan = solve_pack(lengths, n_micro, max_tokens, cost, method, ids=ids, offsets=offsets)
            times.append(time.process_time() - t0)
    t = np.array(times) * 1e3
    loop = ("compiled" if compiled else "python") if method in _COMPILED_LOOPS else "-"
    return dict(method=method, loop=loop, documents=int(len(lengths)), micro_batches=n_micro, max_tokens=max_tokens,
                clock="cpu", median_ms=float(np.median(t)), p10_ms=float(np.percentile(t, 10)),
                p90_ms=float(np.percentile(t, 90)), imbalance=plan.imbalance, repeats=repeats)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt bench pack-speed", description=__doc__.splitlines()[0])
    p.add_argument("--dist", default="default", choices=sorted(DISTRIBUTIONS),
                   help="built-in length distribution (default: default)")
    p.add_argument("--n-micro", type=count, default=32, help="micro-batches of the one global batch (default 32)")
    p.add_argument("--window", type=count, default=131072, help="training context length (default 131072)")
    p.add_argument("--repeats", type=count, default=50, help="timed runs per method (median reported; default 50)")
    p.add_argument("--methods", default="wlb,wlb_phases,original,fixed",
                   help="comma-separated solve_pack methods (default wlb,wlb_phases,original,fixed)")
    p.add_argument("--seed", type=natural, default=0, help="sampling seed (default 0)")
    p.add_argument("--out", default=None, help="folder for pack_speed.json (default: print only)")
    add_cost_args(p, layout=("tp", "cp", "pp"))  # one replica: dp stays 1
    args = p.parse_args(argv)
    warm_up_compiled()  # numba's compile (or cache load) is no step's planning time
    bad = [m for m in args.methods.split(",") if m not in PACK_METHODS]
    if bad:
        p.error(f"unknown methods {bad}; valid: {', '.join(sorted(PACK_METHODS))}")
    cost = cost_from_args(args, parser=p)
    lengths, ids, offsets = global_batch(args.dist, args.window, args.n_micro * args.window, seed=args.seed)
    rows = []
    print(f"{len(lengths)} documents, {int(lengths.sum())} tokens, {args.n_micro} micro-batches, "
          f"dist={args.dist}, {args.repeats} repeats")
    print(f"{'method':>10} {'loop':>9} {'max_tokens':>10} {'median ms':>10} {'p10':>7} {'p90':>7} {'imbalance':>10}")
    for method in args.methods.split(","):
        max_tokens = int(1.25 * args.window) if method not in ("original", "fixed") else args.window
        loops = [True, False] if method in _COMPILED_LOOPS and compiled_available() else [False]
        for compiled in loops:
            r = measure(lengths, ids, offsets, args.n_micro, max_tokens, cost, method, args.repeats, compiled)
            rows.append(r)
            print(f"{method:>10} {r['loop']:>9} {max_tokens:>10} {r['median_ms']:>10.2f} {r['p10_ms']:>7.2f} "
                  f"{r['p90_ms']:>7.2f} {r['imbalance']:>10.3f}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "pack_speed.json").write_text(json.dumps(dict(provenance=provenance("pack_speed", argv), rows=rows), indent=2))
        print(f"wrote {out / 'pack_speed.json'}")
    return 0
