"""`wlb-opt` command line: demo, pack, bench.

    wlb-opt demo                      the main job (see wlb_opt.bench.demo)
    wlb-opt pack --dist default --n-micro 4 --max-tokens 163840 --method wlb
    wlb-opt profile --model tiny      writes results/profile/cost.json (--out to choose)
    wlb-opt bench NAME [args]         runs wlb_opt.bench.<NAME>.main(args); NAME may use '-'

Benchmarks are discovered by module name, so adding bench/<name>.py with a
`main(argv) -> int` adds `wlb-opt bench <name>`.

Exit status: 0 on success, 2 for bad input (usage errors from argparse, and any
ValueError, TypeError, OSError or ImportError raised for the arguments or files given),
printed as one line `wlb-opt CMD: error: ...` on stderr, never a traceback (set
WLB_OPT_TRACEBACK=1 to see one). `main(argv)` returns the status instead of exiting, so it
can be called in-process.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import sys

import numpy as np

from .cost_args import count, natural, seconds


def _bench_names() -> list[str]:
    """Benchmark modules of `wlb_opt.bench`, by name ('_' shown as '-'), without importing them.

    `data` holds the calibration command (`python -m wlb_opt.bench.data`) and `demo` is
    `wlb-opt demo`; neither is a benchmark."""
    from . import bench

    return sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(bench.__path__)
                  if not m.name.startswith("_") and m.name not in {"data", "demo"})


def _pack(argv: list[str]) -> int:
    from .cost_args import add_cost_args, cost_from_args
    from .documents import load_lengths, split_documents
    from .step_pack import PACK_METHODS, solve_pack
    from .workloads import DISTRIBUTIONS, global_batch

    p = argparse.ArgumentParser(prog="wlb-opt pack", description="Pack one global batch and print the micro-batches.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", metavar="FILE", help="document lengths: .npy, .txt (one per line) or .jsonl")
    src.add_argument("--dist", choices=sorted(DISTRIBUTIONS), help="sample a global batch from a built-in distribution")
    p.add_argument("--n-micro", type=count, default=4, help="micro-batches per DP replica (default 4)")
    p.add_argument("--window", type=count, default=131072, help="training context length (default 131072)")
    p.add_argument("--max-tokens", type=count, default=None, help="token cap per micro-batch (default 1.25 x window)")
    p.add_argument("--method", default="wlb", choices=sorted(PACK_METHODS), help="packing method (default wlb)")
    p.add_argument("--field", default=None, help="field name for .jsonl files (default length)")
    p.add_argument("--seed", type=natural, default=0, help="planner and sampling seed (default 0)")
    p.add_argument("--time-limit", type=seconds, default=10.0, help="seconds for an exact method (default 10)")
    p.add_argument("--backend", default=None, choices=["cbc", "highs"], help="milp backend (default cbc)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_cost_args(p)
    args = p.parse_args(argv)
    if args.field is not None and not (args.lengths and args.lengths.lower().endswith(".jsonl")):
        p.error("--field names a field of a .jsonl file; give --lengths FILE.jsonl or leave it out")
    try:
        cost = cost_from_args(args)
        max_tokens = int(1.25 * args.window) if args.max_tokens is None else args.max_tokens
        if args.lengths:
            loaded = load_lengths(args.lengths, field=args.field or "length")
            if not len(loaded):
                raise ValueError(f"no document lengths in {args.lengths}")
            lengths, ids, offsets = split_documents(loaded, args.window)
        else:
            lengths, ids, offsets = global_batch(args.dist, args.window, args.dp * args.n_micro * args.window,
                                                 seed=args.seed)
        from .solvers.greedy import warm_up_compiled

        warm_up_compiled()  # numba's import and compilation (or cache load) are not the solve's time
        plan = solve_pack(lengths, args.n_micro, max_tokens, cost, args.method, ids=ids, offsets=offsets,
                          dp=args.dp, time_limit=args.time_limit, seed=args.seed, backend=args.backend)
    except (ValueError, TypeError, ImportError, OSError) as exc:
        print(f"wlb-opt pack: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_dict()))
        return 0
    print(f"method {args.method}: {len(np.unique(ids))} documents in {len(lengths)} pieces, {int(lengths.sum())} tokens, "
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
        print("usage: wlb-opt bench NAME [options]\n\nbenchmarks: " + ", ".join(names),
              file=sys.stdout if argv else sys.stderr)
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
        print(usage, file=sys.stdout if argv else sys.stderr)  # no command is a usage error
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "--version":
        from . import __version__

        print(__version__)
        return 0
    if cmd not in _COMMANDS:
        print(f"wlb-opt: unknown command {cmd!r}\n\n{usage}", file=sys.stderr)
        return 2
    try:
        return _COMMANDS[cmd](rest)
    except SystemExit as exc:  # argparse: usage errors exit 2, --help 0
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except BrokenPipeError:  # the reader left (`wlb-opt ... | head`): not bad input; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own flush at exit must not fail
        return 1
    except _BAD_INPUT as exc:
        if os.environ.get("WLB_OPT_TRACEBACK"):
            raise
        name = f"{cmd} {rest[0]}" if cmd == "bench" and rest else cmd
        print(f"wlb-opt {name}: error: {type(exc).__name__ + ': ' if isinstance(exc, OSError) else ''}{exc}",
              file=sys.stderr)
        return 2


_BAD_INPUT = (ValueError, TypeError, OSError, ImportError)
"""What a command raises for bad arguments or files (the library's own errors name the value)."""


def _profile(argv: list[str]) -> int:
    from .profile import main as profile_main

    return int(profile_main(argv) or 0)


def _demo(argv: list[str]) -> int:
    from .bench import demo

    return int(demo.main(argv) or 0)


_COMMANDS = {"pack": _pack, "bench": _bench, "profile": _profile, "demo": _demo}


if __name__ == "__main__":  # pragma: no cover
    np.set_printoptions(linewidth=120)
    sys.exit(main())
