"""`wlb-opt` command line: demo, pack, bench.

    wlb-opt demo                      the main job (see wlb_opt.bench.demo)
    wlb-opt pack --dist default --n-micro 4 --max-tokens 163840 --method wlb
    wlb-opt profile --model tiny --out cost.json
    wlb-opt bench NAME [args]         runs wlb_opt.bench.<NAME>.main(args); NAME may use '-'

Benchmarks are discovered by module name, so adding bench/<name>.py with a
`main(argv) -> int` adds `wlb-opt bench <name>`.
"""
from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys

import numpy as np


def _bench_names() -> list[str]:
    from . import bench

    names = []
    for m in pkgutil.iter_modules(bench.__path__):
        if m.name.startswith("_") or m.name in {"data", "common", "demo"}:
            continue
        mod_spec = importlib.util.find_spec(f"wlb_opt.bench.{m.name}")
        if mod_spec is not None:
            names.append(m.name.replace("_", "-"))
    return sorted(names)


def add_cost_args(p: argparse.ArgumentParser, pp: int = 4, tp: int = 8, cp: int = 2) -> None:
    """Options that build a CostModel (shared by pack and the benchmarks)."""
    g = p.add_argument_group("cost model")
    g.add_argument("--cost", metavar="JSON", help="a saved CostModel (overrides the options below)")
    g.add_argument("--model", default="7b", help="ModelSpec preset: tiny, 550m, 7b, 30b, 70b (default 7b)")
    g.add_argument("--hardware", default="h100", help="HardwareSpec preset: h100, h200, cpu (default h100)")
    g.add_argument("--tp", type=int, default=tp)
    g.add_argument("--cp", type=int, default=cp)
    g.add_argument("--pp", type=int, default=pp)
    g.add_argument("--dp", type=int, default=1)


def cost_from_args(args):
    from .cost import CostModel
    from .specs import HardwareSpec, ModelSpec, ParallelSpec

    if getattr(args, "cost", None):
        return CostModel.load(args.cost)
    return CostModel.analytic(ModelSpec.preset(args.model),
                              ParallelSpec(tp=args.tp, cp=args.cp, pp=args.pp, dp=args.dp),
                              HardwareSpec.preset(args.hardware))


def _pack(argv: list[str]) -> int:
    from .bench.data import DISTRIBUTIONS, global_batch
    from .docs import load_lengths, split_documents
    from .pack import PACK_METHODS, solve_pack

    p = argparse.ArgumentParser(prog="wlb-opt pack", description="Pack one global batch and print the micro-batches.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", metavar="FILE", help="document lengths: .npy, .txt (one per line) or .jsonl")
    src.add_argument("--dist", choices=sorted(DISTRIBUTIONS), help="sample a global batch from a built-in distribution")
    p.add_argument("--n-micro", type=int, default=4, help="micro-batches per DP replica (default 4)")
    p.add_argument("--window", type=int, default=131072, help="training context length (default 131072)")
    p.add_argument("--max-tokens", type=int, default=None, help="token cap per micro-batch (default 1.25 x window)")
    p.add_argument("--method", default="wlb", help=f"one of {sorted(PACK_METHODS)} (default wlb)")
    p.add_argument("--field", default="length", help="field name for .jsonl files")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=10.0)
    p.add_argument("--backend", default=None, help="milp backend: cbc or highs")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_cost_args(p)
    args = p.parse_args(argv)
    try:
        cost = cost_from_args(args)
        max_tokens = int(1.25 * args.window) if args.max_tokens is None else args.max_tokens
        if args.lengths:
            lengths, ids, offsets = split_documents(load_lengths(args.lengths, field=args.field), args.window)
        else:
            lengths, ids, offsets = global_batch(args.dist, args.window, args.dp * args.n_micro * args.window,
                                                 seed=args.seed)
        plan = solve_pack(lengths, args.n_micro, max_tokens, cost, args.method, ids=ids, offsets=offsets,
                          dp=args.dp, time_limit=args.time_limit, seed=args.seed, backend=args.backend)
    except (ValueError, ImportError) as exc:
        print(f"wlb-opt pack: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_dict()))
        return 0
    print(f"method {args.method}: {len(lengths)} documents, {int(lengths.sum())} tokens, "
          f"{plan.dp * plan.n_micro} micro-batches of <= {max_tokens} tokens")
    print(f"{'mb':>3} {'replica':>7} {'docs':>5} {'tokens':>8} {'model ms':>9} {'share':>6}")
    for r in plan.summary_rows():
        print(f"{r['micro_batch']:>3} {r['replica']:>7} {r['documents']:>5} {r['tokens']:>8} {r['ms']:>9.1f} {r['share']:>6.1%}")
    print(f"imbalance (max/mean load): {plan.imbalance:.3f}   deferred: {len(plan.deferred)} pieces, "
          f"{plan.deferred_tokens} tokens   solve: {1e3 * plan.info.wall_s:.2f} ms ({plan.info.status})")
    return 0


def _bench(argv: list[str]) -> int:
    names = _bench_names()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: wlb-opt bench NAME [options]\n\nbenchmarks: " + ", ".join(names))
        return 0 if argv else 2
    name = argv[0].replace("-", "_")
    if name.replace("_", "-") not in names:
        print(f"wlb-opt bench: unknown benchmark {argv[0]!r}; valid: {', '.join(names)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"wlb_opt.bench.{name}")
    return int(module.main(argv[1:]) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = ("usage: wlb-opt {demo,pack,profile,bench} [options]\n\n"
             "  demo    the main job: pack and simulate the default workload, print tables, write PNGs\n"
             "  pack    pack one global batch with a chosen method and print the micro-batches\n"
             "  profile measure one transformer block on this device and fit a CostModel (JSON)\n"
             "  bench   run a benchmark: " + ", ".join(_bench_names()))
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "pack":
        return _pack(rest)
    if cmd == "bench":
        return _bench(rest)
    if cmd == "profile":
        from .profile import main as profile_main

        return int(profile_main(rest) or 0)
    if cmd == "demo":
        from .bench import demo

        return int(demo.main(rest) or 0)
    if cmd == "--version":
        from . import __version__

        print(__version__)
        return 0
    print(f"wlb-opt: unknown command {cmd!r}\n\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    np.set_printoptions(linewidth=120)
    sys.exit(main())
