"""`wlb-opt bench stream-speed`: CPU time per step of the streaming planner.

`WLBPacker` with the no-tuning defaults (`PackerConfig()`, lookahead 0 and 4) plans a
stream of global batches of dp x n_micro x window tokens, one `pack` per step (`--dp`: data-
parallel replicas, default 1; with more, each step's micro-batches are also dealt to the
replicas, `solvers.deal`). Only `pack` is
timed, as CPU time of this process (`time.process_time`, so other processes on a shared
machine are not counted); the median, p99 and worst step are over every step of every seed.

- CP sharding of a step is timed apart, per step, on the plans of the first seed, for each
  strategy of `--shard-strategies` (default "adaptive"): `solve_shards` (every micro-batch of
  the step at once, what `WLBStream` runs) and `solve_shard` called on each micro-batch (the
  same ShardPlans).
- With `--repeats R` each stream is planned R times and each step counts its least time over
  the passes: the plans are the same each pass, and a shared machine only adds time, so the
  minimum is the planner's own cost with the least noise (the median and tail are then over
  those minima). `median_of_runs_ms` is the median of the R passes' own medians (each over
  every step of every seed), the plain "median of repeated runs".
- The harness's own objects (imported modules, numba's, the generated streams) are frozen
  out of Python's garbage collection (`gc.freeze`) while a stream is timed: a full
  collection walks every tracked object of the process, and would count them in whichever
  step triggers it. The planner's own objects are collected as usual.
- With `--jobs J` the streams are timed in J worker processes at once, each in its own CPU
  time (on a machine with at least J idle cores).
- A machine reference is timed before the streams and after them (`reference_ms`): the least
  CPU time of a fixed workload of the two kinds a step spends its time on (a pure-Python heap
  loop and small numpy calls), code of this module that does not change with the planner: a
  shared machine's speed varies, so runs are compared by their times over their reference.
- Each stream is timed with the packing loops in pure Python (the default install) and, when
  numba is installed (the `fast` extra), compiled (`--loops`: Algorithm 1's loop and the
  balanced placement's). `--methods wlb_phases,wlb,wlb_fill` also times Algorithm 1 as the
  step packer and the `wlb_fill` step packer, whose release candidates are scored without
  packing.

Streams: `real` and the heavy-tailed `heavy` (`wlb_opt.workloads`), seeds
DEFAULT_SEED + 300 + i (not the calibration seeds).

    wlb-opt bench stream-speed --n-micro 32                 2,000 steps x 3 seeds per stream
    wlb-opt bench stream-speed --n-micro 4 --quick          200 steps x 1 seed
    wlb-opt bench stream-speed --n-micro 4 --repeats 3      each step's least time of 3 passes
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import heapq
import json
import random
import time
from pathlib import Path

import numpy as np

from ..cost_args import add_cost_args, cost_from_args, count
from ..packer import PackerConfig, WLBPacker
from ..shard import SHARD_STRATEGIES, solve_shard, solve_shards
from ..solvers.greedy import compiled_available, use_compiled, warm_up_compiled
from ..workloads import DEFAULT_SEED, DISTRIBUTIONS, global_batches
from ._provenance import provenance

SEED_OFFSET = 300
"""Streams of this benchmark start at DEFAULT_SEED + SEED_OFFSET (away from calibration seeds)."""


REFERENCE_REPEATS = 7
"""Runs of the reference workload per measurement; its least CPU time counts."""


def _reference_workload() -> None:
    """Fixed work of the kinds a planning step does: 20,000 placements of a heap loop over 32
    (load, micro-batch) pairs, then 2,000 rounds of small numpy calls."""
    rng = random.Random(0)
    heap = [(0.0, b) for b in range(32)]
    for _ in range(20000):
        load, b = heap[0]
        heapq.heapreplace(heap, (load + rng.random(), b))
    a = np.arange(64, dtype=np.int64)
    for _ in range(2000):
        np.concatenate([a[:10], a[np.searchsorted(a, a[::-7])]])


def reference_ms(repeats: int = REFERENCE_REPEATS) -> float:
    """Least CPU milliseconds (`time.process_time`) of `_reference_workload` over `repeats` runs."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        _reference_workload()
        best = min(best, time.process_time() - t0)
    return 1e3 * best


def _percentiles(times_s: list[float]) -> dict:
    t = np.asarray(times_s, dtype=np.float64) * 1e3
    return dict(median_ms=float(np.median(t)), p99_ms=float(np.percentile(t, 99)), worst_ms=float(t.max()),
                mean_ms=float(t.mean()))


def time_stream(batches, n_micro: int, max_tokens: int, cost, lookahead: int, shard_cp: int | None,
                method: str = "wlb_phases", shard_strategies: tuple[str, ...] = ("adaptive",)) -> tuple:
    """(CPU seconds of each `pack` that plans a step, {(call, strategy): CPU seconds of
    sharding each emitted plan}, call "solve_shards" (the plan at once) or "solve_shard" (one
    micro-batch at a time); {} without `shard_cp`). With lookahead K the first K calls plan
    nothing and are left out, and the drain that plans the last K steps is not timed."""
    packer = WLBPacker(n_micro, max_tokens, cost, config=PackerConfig(lookahead=lookahead, method=method))
    pack_s = []
    shard_s = {} if shard_cp is None else {(call, s): [] for s in shard_strategies
                                           for call in ("solve_shards", "solve_shard")}
    for batch in batches:
        t0 = time.process_time()
        plan = packer.pack(*batch)
        if plan is None:
            continue
        pack_s.append(time.process_time() - t0)
        if shard_cp is None:
            continue
        for strategy in shard_strategies:
            t0 = time.process_time()
            solve_shards(plan, shard_cp, strategy, cost)
            shard_s["solve_shards", strategy].append(time.process_time() - t0)
            t0 = time.process_time()
            for mb in plan.micro_batches:
                if len(mb):
                    solve_shard(plan.lengths[mb], shard_cp, strategy, cost, offsets=plan.offsets[mb])
            shard_s["solve_shard", strategy].append(time.process_time() - t0)
    return pack_s, shard_s


@contextlib.contextmanager
def _harness_frozen():
    """Within the block, the objects that exist at its start (the harness's: imported
    modules, the generated stream) are left out of Python's garbage collection (`gc.freeze`):
    a full collection walks every tracked object of the process, and the harness's would be
    counted in the step that happens to trigger one. The planner's own objects are collected
    as usual."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def time_job(job: tuple, spec: dict) -> tuple:
    """One stream of one row: (each step's least CPU seconds over the passes, each pass's
    times, the sharding times of the first seed's first pass or {})."""
    n_micro, dist, method, loop, k, i = job
    batches = global_batches(dist, spec["window"], spec["dp"] * n_micro * spec["window"], spec["steps"],
                             seed=DEFAULT_SEED + SEED_OFFSET + i)
    shard_cp = spec["cp"] if i == 0 and (loop, k, method) == spec["first"] else None
    with use_compiled(loop == "compiled"), _harness_frozen():
        if loop == "compiled":  # compile (or load from numba's cache) the loops before anything is timed
            warm_up_compiled()
            gc.freeze()  # numba's objects are the harness's too
        times, shard_s = time_stream(batches, n_micro, spec["max_tokens"], spec["cost"], k, shard_cp, method,
                                     spec["shard_strategies"])
        runs = [times]
        for _ in range(1, spec["repeats"]):  # the same plans again: each step's least time
            again = time_stream(batches, n_micro, spec["max_tokens"], spec["cost"], k, None, method)[0]
            runs.append(again)
            times = np.minimum(times, again).tolist()
    return times, runs, shard_s


def _job_results(jobs: list[tuple], spec: dict, pool=None):
    """`time_job` of each job, in order, each as soon as it is done: timed in this process
    when `pool` is None, else submitted to the worker processes of `pool` at once (each
    worker times its own `pack` calls in its own CPU time)."""
    if pool is None:
        for job in jobs:
            yield time_job(job, spec)
        return
    futures = [pool.submit(time_job, job, spec) for job in jobs]
    for future in futures:
        yield future.result()


def _worker_pool(n_workers: int):
    """A pool of `n_workers` processes (spawned: nothing of this process's state is shared),
    or a null context for 1."""
    if n_workers <= 1:
        return contextlib.nullcontext()
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    return ProcessPoolExecutor(n_workers, mp_context=multiprocessing.get_context("spawn"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt bench stream-speed", description=__doc__.splitlines()[0])
    p.add_argument("--n-micro", default="32", help="micro-batches per step, comma-separated (default 32)")
    p.add_argument("--dists", default="real,heavy", help="comma-separated length distributions (default real,heavy)")
    p.add_argument("--lookaheads", default="0,4", help="comma-separated lookaheads (default 0,4)")
    p.add_argument("--steps", type=count, default=None, help="steps per stream (default 2000; --quick 200)")
    p.add_argument("--seeds", type=count, default=None, help="streams per distribution (default 3; --quick 1)")
    p.add_argument("--quick", action="store_true", help="200 steps x 1 seed (unless given)")
    p.add_argument("--repeats", type=count, default=1,
                   help="plan each stream this many times and count each step's least time (default 1)")
    p.add_argument("--window", type=count, default=131072, help="training context length (default 131072)")
    p.add_argument("--no-shard", action="store_true", help="do not time solve_shard")
    p.add_argument("--shard-strategies", default="adaptive",
                   help="CP sharding strategies to time, comma-separated (default adaptive; cpsat is not timed)")
    p.add_argument("--loops", default="python,compiled",
                   help="packing loops to time, comma-separated: python (the default install), compiled "
                        "(the `fast` extra, skipped without numba); default python,compiled")
    p.add_argument("--methods", default="wlb_phases",
                   help="step packers (PackerConfig.method), comma-separated: wlb_phases (the default), wlb, wlb_fill")
    p.add_argument("--jobs", type=count, default=1,
                   help="worker processes, each timing whole streams in its own CPU time (default 1: this process; "
                        "on a many-core machine, at most its physical cores)")
    p.add_argument("--out", default=None, help="folder for stream_speed.json (default: print only)")
    add_cost_args(p, layout=("tp", "cp", "pp", "dp"))
    args = p.parse_args(argv)
    dists = args.dists.split(",")
    methods = args.methods.split(",")
    if [m for m in methods if m not in ("wlb_phases", "wlb", "wlb_fill")]:
        p.error(f"--methods must name some of wlb_phases, wlb, wlb_fill, got {args.methods!r}")
    shard_strategies = tuple(args.shard_strategies.split(","))
    bad_shard = [s for s in shard_strategies if s not in SHARD_STRATEGIES or s == "cpsat"]
    if bad_shard:
        p.error(f"--shard-strategies must name some of {', '.join(s for s in SHARD_STRATEGIES if s != 'cpsat')}, "
                f"got {args.shard_strategies!r}")
    bad_loops = [loop for loop in args.loops.split(",") if loop not in ("python", "compiled")]
    if bad_loops:
        p.error(f"unknown loops {bad_loops}; valid: python, compiled")
    bad = [d for d in dists if d not in DISTRIBUTIONS]
    if bad:
        p.error(f"unknown distributions {bad}; valid: {', '.join(sorted(DISTRIBUTIONS))}")
    try:
        lookaheads = [int(k) for k in args.lookaheads.split(",")]
    except ValueError:
        p.error(f"--lookaheads must be comma-separated integers >= 0, got {args.lookaheads!r}")
    if any(k < 0 for k in lookaheads):
        p.error(f"--lookaheads must be >= 0, got {args.lookaheads!r}")
    try:
        n_micros = [count(n) for n in args.n_micro.split(",")]
    except argparse.ArgumentTypeError:
        p.error(f"--n-micro must be comma-separated integers >= 1, got {args.n_micro!r}")
    steps = args.steps or (200 if args.quick else 2000)  # --quick sets only what is not given
    seeds = args.seeds or (1 if args.quick else 3)
    if steps <= max(lookaheads):  # with lookahead K the first K calls plan nothing: no step would be timed
        p.error(f"--steps ({steps}) must be more than the largest of --lookaheads ({max(lookaheads)}): with "
                "lookahead K the first K calls plan nothing")
    cost = cost_from_args(args, parser=p)
    cp = cost.parallel.cp if cost.parallel is not None else 1
    max_tokens = int(1.25 * args.window)
    rows, shard_rows = [], []
    reference = [dict(when="before", reference_ms=reference_ms())]
    print(f"max_tokens={max_tokens}, dp={args.dp}, {steps} steps x {seeds} seeds, CPU ms per pack(); "
          f"machine reference {reference[0]['reference_ms']:.2f} ms")
    loops = [loop for loop in args.loops.split(",") if loop == "python" or compiled_available()]
    if len(loops) < len(args.loops.split(",")):
        print("numba is not installed (the `fast` extra): the compiled loop is not timed")
    print(f"{'N':>3} {'dist':>6} {'method':>8} {'K':>2} {'loop':>9} {'median':>8} {'p99':>8} {'worst':>8} {'vs K=0':>7}")
    # every stream of every row is one job: (n_micro, dist, method, loop, k, seed index)
    jobs = [(n, d, m, loop, k, i) for n in n_micros for d in dists for m in methods for loop in loops
            for k in lookaheads for i in range(seeds)]
    first = (loops[0], lookaheads[0], methods[0])
    spec = dict(window=args.window, dp=args.dp, steps=steps, max_tokens=max_tokens, cost=cost, repeats=args.repeats,
                cp=None if args.no_shard else cp, shard_strategies=shard_strategies, first=first)
    with _worker_pool(args.jobs) as pool:  # rows are printed as their streams are done
        results = _job_results(jobs, spec, pool)
        for n_micro, dist, method in [(n, d, m) for n in n_micros for d in dists for m in methods]:
            for loop in loops:
                k0_median = None
                for k in lookaheads:
                    # each step's least time; each pass's times
                    pack_s, passes = [], [[] for _ in range(args.repeats)]
                    for i in range(seeds):
                        times, runs, shard_s = next(results)  # the jobs in the order of these loops
                        pack_s += times
                        for r, run in enumerate(runs):
                            passes[r] += run
                        for (call, strategy), seconds in shard_s.items():
                            shard_rows.append(dict(dist=dist, n_micro=n_micro, cp=cp, strategy=strategy, call=call,
                                                   steps=len(seconds), clock="cpu", **_percentiles(seconds)))
                    row = dict(dist=dist, method=method, lookahead=k, n_micro=n_micro, dp=args.dp, loop=loop,
                               max_tokens=max_tokens, steps=steps, seeds=seeds, repeats=args.repeats, clock="cpu",
                               **_percentiles(pack_s),
                               median_of_runs_ms=float(np.median([_percentiles(t)["median_ms"] for t in passes])))
                    k0_median = row["median_ms"] if k == 0 else k0_median
                    row["median_vs_k0"] = row["median_ms"] / k0_median if k0_median else None
                    rows.append(row)
                    ratio = f"{row['median_vs_k0']:.2f}" if row["median_vs_k0"] is not None else "-"
                    print(f"{n_micro:>3} {dist:>6} {method:>8} {k:>2} {loop:>9} {row['median_ms']:>8.2f} "
                          f"{row['p99_ms']:>8.2f} {row['worst_ms']:>8.2f} {ratio:>7}", flush=True)
    reference.append(dict(when="after", reference_ms=reference_ms()))
    print(f"machine reference after the streams: {reference[1]['reference_ms']:.2f} ms")
    for r in shard_rows:
        print(f"{r['call']} {r['strategy']} (N={r['n_micro']}, {r['dist']}, cp={r['cp']}, all micro-batches of a step): "
              f"median {r['median_ms']:.2f} ms, "
              f"p99 {r['p99_ms']:.2f}, worst {r['worst_ms']:.2f}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        data = dict(provenance=provenance("stream_speed", argv), rows=rows, shard=shard_rows, reference=reference)
        (out / "stream_speed.json").write_text(json.dumps(data, indent=2))
        print(f"wrote {out / 'stream_speed.json'}")
    return 0
