"""`wlb-opt bench table2`: paper Table 2 (packing balance and overhead, 7B-128K), reproduced.

Setup (paper §7.4): the 7B model with (tp, cp, pp, dp) = (8, 2, 4, 1) on H100, window 131072,
N = 4 micro-batches per step, variable-length S_max = 1.25 x window. One stream of global
batches (N x window tokens each, `wlb_opt.workloads.global_batches`) feeds every row:

- original:            data order, fixed-length sequences ("original"), deferred pieces carried.
- fixed greedy k:      pool k global batches (plus the carry), pack k x N fixed-length
                       micro-batches together ("fixed"), emit N per step in bin order.
- fixed exact k:       the same pools solved by CP-SAT (`method="cpsat", allow_defer=True`)
                       under `--exact-time-limit` seconds, on the first `--exact-steps` steps;
                       "pending" if the exact solver is not available.
- WLB 1/2/3 queues:    `WLBPacker`, paper-faithful (max_delay=None), hand thresholds evenly
                       spaced above half the window: [W/2], [W/2, 3W/4], [W/2, 2W/3, 5W/6]
                       (the paper's §2 split: documents under half the window are the bulk).
- WLB 2 queues, balance: the 2-queue hand thresholds, max_delay=None, release="balance"
                       (outliers the step can balance leave early; beyond the paper).
- WLB group:           thresholds [W/4, 9W/16] (one pool: only W/4 matters), max_delay=16,
                       release="group", balance_tolerance=1.3 (chosen on other streams).
- WLB calibrated:      `WLBPacker.calibrate` (2 queues) on a held-out sample of 16 global
                       batches (another seed; with `--lengths`, the file's last batches, up
                       to 16, never scored), max_delay=8, release="balance".
- WLB auto:            thresholds="auto" (calibrated on the first global batch), max_delay=8,
                       release="balance" (balance rows: balance_tolerance 1.02, the old default).
- WLB default:         `WLBPacker(N, max_tokens, cost)`, nothing tuned (wlb_opt.packer.defaults:
                       one pool from 0.3 x max_tokens, release="marginal", max_delay 32,
                       balance_tolerance "auto", each step packed by "wlb_phases"). The rows
                       above pack each step by Algorithm 1 ("wlb"), as the paper.
- WLB default, lookahead K: the same with lookahead=K (K = 1, 2, 4): the packer sees K
                       batches ahead and may train outliers up to min(K, 2) steps early;
                       the delay column is then displacement per token (mean |step -
                       arrival|).

Imbalance of a step = max / mean of the modelled forward time of its N micro-batches
(`cost.micro_batch_cost(..., phase="fwd")`, the paper's Max x N / Total); the table shows the
mean over steps (and p90). WLB rows measure the streaming steps; their delays (iterations per
token, token-weighted, undelayed tokens count 0) include the final drain. ms/batch is the
median CPU time (summed over a solver's threads) of planning one global batch (a pool's time / k for pooled rows; WLB rows
include queueing; calibration is reported apart).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from ..solvers.greedy import warm_up_compiled
from ..cost_args import add_cost_args, cost_from_args, count, natural, seconds
from ..documents import load_lengths
from ..packer import PackerConfig, WLBPacker, per_step_imbalance
from ..plan import imbalance
from ..step_pack import solve_pack
from ..workloads import DEFAULT_SEED, DISTRIBUTIONS, global_batches
from .data import carried_plans, run_packer
from ._provenance import provenance

PAPER = {
    "original": (1.44, 0),
    "fixed greedy k=1": (1.41, 4), "fixed greedy k=2": (1.22, 5), "fixed greedy k=4": (1.11, 5),
    "fixed greedy k=8": (1.08, 5),
    "fixed exact k=1": (1.40, 467), "fixed exact k=2": (1.18, 1488), "fixed exact k=4": (1.09, 25313),
    "WLB 1 queue": (1.24, 8), "WLB 2 queues": (1.05, 20), "WLB 3 queues": (1.05, 23),
}


def _fwd_imbalances(plan, cost, bins_per_step: int) -> list[float]:
    """Per emitted step (consecutive groups of bins_per_step bins): forward-load imbalance."""
    loads = np.array([cost.micro_batch_cost(plan.lengths[mb], "fwd") for mb in plan.micro_batches])
    return [imbalance(loads[s:s + bins_per_step]) for s in range(0, len(loads), bins_per_step)]


def pooled_rows(batches, cost, bins_per_step: int, window: int, method: str, k: int, show: bool,
                **solve_kw) -> dict:
    """Fixed-length packing of k pooled global batches at a time (k = 1: one batch per step)."""
    imbs, times, end = [], [], 0
    for plan, solve_s in carried_plans(batches, k * bins_per_step, window, cost, method, pool=k,
                                       desc=f"{method} k={k}", show=show, **solve_kw):
        times.append(solve_s / k)
        imbs += _fwd_imbalances(plan, cost, bins_per_step)
        end = plan.deferred_tokens
    return dict(steps=len(imbs), imbalance=float(np.mean(imbs)), imbalance_p90=float(np.percentile(imbs, 90)),
                ms_per_batch=1e3 * float(np.median(times)), delay_per_token=None, carried_tokens_end=int(end))


def wlb_row(batches, cost, n_micro: int, dp: int, max_tokens: int, thresholds, max_delay, seed: int,
            show: bool, label: str, calibration_sample=None, release: str = "paper",
            balance_tolerance: float | str = 1.02, packer: WLBPacker | None = None) -> dict:
    """One WLB row; `packer` (if given) replaces the configuration arguments."""
    if packer is None:
        config = PackerConfig(thresholds=thresholds, max_delay=max_delay, release=release,
                              balance_tolerance=balance_tolerance, method="wlb")  # Algorithm 1, as the paper
        packer = WLBPacker(n_micro, max_tokens, cost, dp=dp, seed=seed, config=config)
    calib_s = None
    if calibration_sample is not None:
        t0 = time.perf_counter()
        packer.calibrate(calibration_sample, tokens_per_batch=int(packer.capacity_tokens / 1.25))
        calib_s = time.perf_counter() - t0
    run = run_packer(packer, batches, desc=label, show=show)
    k = packer.lookahead  # the first k pack calls return None; the drain plans the last k steps
    plans = [plan for plan in run.plans if plan is not None] + list(run.drained[:k])
    imbs = [per_step_imbalance(plan, cost, "fwd") for plan in plans]
    times = run.seconds[k:] or run.seconds
    if thresholds == "auto":
        calib_s = packer.calibration["seconds"] if packer.calibration else None
        times = times[1:] or times  # the first step ran the calibration (reported apart)
    s = run.stats
    return dict(steps=len(imbs), imbalance=float(np.mean(imbs)), imbalance_p90=float(np.percentile(imbs, 90)),
                ms_per_batch=1e3 * float(np.median(times)), delay_per_token=s["delay_per_token"],
                delay_mean_per_doc=s["delay_mean_per_doc"], delay_max=s["delay_max"],
                delayed_token_share=s["delayed_token_share"], late_pieces=s["late_pieces"],
                displacement_per_token=s["displacement_per_token"], early_token_share=s["early_token_share"],
                thresholds=packer.thresholds, max_delay=packer.max_delay, release=packer.release,
                lookahead=packer.lookahead, calibration_s=calib_s,
                drain_steps=s["steps"] - run.streamed_stats["steps"])


def _exact_available() -> str | None:
    """None if the exact solver runs, else why not."""
    try:
        solve_pack([1, 2, 3], 2, 4, cost=None, method="cpsat", allow_defer=True, time_limit=1.0)
    except ImportError as exc:
        return f"pending ({exc})"
    except ValueError as exc:
        if "not available" in str(exc):
            return "pending"
        raise
    return None


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def print_table(rows: list[dict]) -> None:
    print(f"{'method':<26} {'steps':>5} {'imbalance':>9} {'p90':>6} {'delay/tok':>9} {'ms/batch':>9}   "
          f"{'paper imb':>9} {'paper ms':>8}")
    for r in rows:
        pi, pm = PAPER.get(r["row"], (None, None))
        if r.get("pending"):
            print(f"{r['row']:<26} {r['pending']:>5}")
            continue
        print(f"{r['row']:<26} {r['steps']:>5} {r['imbalance']:>9.3f} {r['imbalance_p90']:>6.3f} "
              f"{_fmt(r.get('displacement_per_token', r.get('delay_per_token')), '9.3f'):>9} "
              f"{r['ms_per_batch']:>9.2f}   "
              f"{_fmt(pi, '9.2f'):>9} {_fmt(pm, '8d'):>8}")


def plot(rows: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    done = [r for r in rows if not r.get("pending")]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    y = np.arange(len(done))
    ax.barh(y, [r["imbalance"] - 1 for r in done], left=1, color=["C0" if "WLB" in r["row"] else "C7" for r in done])
    right = 1.0
    for i, r in enumerate(done):
        end = r["imbalance"]
        if r["row"] in PAPER:
            ax.plot(PAPER[r["row"]][0], i, "kx")
            end = max(end, PAPER[r["row"]][0])
        if r.get("delay_per_token") is not None:  # right of both the bar and the paper's x
            ax.annotate(f"delay {r.get('displacement_per_token', r['delay_per_token']):.2f}", (end, i), xytext=(9, 0), textcoords="offset points",
                        va="center", fontsize=8)
        right = max(right, end)
    ax.set_xlim(1.0, right + 0.12 * (right - 1.0) + 0.06)
    ax.set_yticks(y, [r["row"] for r in done])
    ax.invert_yaxis()
    ax.set_xlabel("mean PP imbalance (max x N / total of forward time); x = paper")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt bench table2", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--lengths", metavar="FILE", help="document lengths in stream order (.npy, .txt, .jsonl)")
    src.add_argument("--dist", default="default", choices=sorted(DISTRIBUTIONS),
                     help="built-in length distribution (default: default)")
    p.add_argument("--steps", type=count, default=None, help="global batches (default 200; --quick 40)")
    p.add_argument("--exact-steps", type=natural, default=None,
                   help="steps for the exact rows, in whole groups of k (default 8; --quick 4; 0: no exact rows; "
                        "a row of k above it is skipped)")
    p.add_argument("--exact-time-limit", type=seconds, default=None,
                   help="seconds per exact solve (default 10; --quick 2)")
    p.add_argument("--quick", action="store_true", help="40 steps, 4 exact steps of 2 s (unless given)")
    p.add_argument("--window", type=count, default=131072, help="training context length (default 131072)")
    p.add_argument("--n-micro", type=count, default=4, help="micro-batches per DP replica and step (default 4)")
    p.add_argument("--max-delay", type=count, default=8, help="max_delay of the calibrated / auto rows (default 8)")
    p.add_argument("--seed", type=natural, default=0, help="stream seed, an offset from DEFAULT_SEED (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--out", default="results/table2", help="folder for table2.json and table2.png")
    add_cost_args(p)
    args = p.parse_args(argv)
    warm_up_compiled()  # numba's compile (or cache load) is no step's planning time
    for name, full, quick in (("steps", 200, 40), ("exact_steps", 8, 4), ("exact_time_limit", 10.0, 2.0)):
        if getattr(args, name) is None:  # --quick sets only what is not given
            setattr(args, name, quick if args.quick else full)
    cost = cost_from_args(args, parser=p)  # the WLB rows: dp replicas of N micro-batches
    pool_cost = cost_from_args(args, parser=p, dp=1)  # the pooled rows pack all dp x N bins as one replica
    W, N, dp = args.window, args.n_micro, args.dp
    bins = dp * N
    max_tokens = int(1.25 * W)
    tokens_per_batch = bins * W
    if args.lengths:
        stream = load_lengths(args.lengths)
        whole = int(stream.sum() // tokens_per_batch)
        if whole < 2:
            print(f"wlb-opt bench table2: {args.lengths} holds fewer tokens than two global batches "
                  f"({2 * tokens_per_batch}): one to score, one held out to calibrate on")
            return 2
        held_out = min(16, max(1, whole // 4))  # the file's last batches: calibration never sees a scored one
        steps = min(args.steps, whole - held_out)
        cut = global_batches("default", W, tokens_per_batch, whole, lengths=stream)
        batches, sample_batches = cut[:steps], cut[whole - held_out:]
        source = args.lengths
    else:
        batches = global_batches(args.dist, W, tokens_per_batch, args.steps, seed=DEFAULT_SEED + args.seed)
        source = f"dist={args.dist}"
        sample_batches = global_batches(args.dist, W, tokens_per_batch, 16, seed=DEFAULT_SEED + args.seed + 1)
    sample = np.concatenate([b[0] for b in sample_batches])
    show = not args.no_progress
    print(f"Table 2: {len(batches)} global batches ({source}), {N} micro-batches x dp {dp}, window {W}, "
          f"var-len max_tokens {max_tokens}; imbalance over forward time")

    rows = []
    r = pooled_rows(batches, pool_cost, bins, W, "original", 1, show)
    rows.append(dict(row="original", **r))
    for k in (1, 2, 4, 8):
        if len(batches) < k:
            rows.append(dict(row=f"fixed greedy k={k}", pending="skip"))
            continue
        rows.append(dict(row=f"fixed greedy k={k}", **pooled_rows(batches, pool_cost, bins, W, "fixed", k, show)))
    why = _exact_available()
    for k in (1, 2, 4):
        name = f"fixed exact k={k}"
        if why:
            rows.append(dict(row=name, pending=why))
            continue
        ex = batches[:args.exact_steps // k * k]  # whole groups of k steps (--exact-steps 0: none)
        if len(ex) < k:
            rows.append(dict(row=name, pending="skip"))
            continue
        rows.append(dict(row=name, **pooled_rows(ex, pool_cost, bins, W, "cpsat", k, show, allow_defer=True,
                                                       time_limit=args.exact_time_limit, seed=args.seed)))
    # Algorithm 1 on each global batch alone (solve_pack "wlb", variable length, no outlier queue)
    rows.append(dict(row="WLB no queue", **pooled_rows(batches, pool_cost, bins, max_tokens, "wlb", 1, show)))
    hand = {1: [W // 2], 2: [W // 2, 3 * W // 4], 3: [W // 2, 2 * W // 3, 5 * W // 6]}
    for nq, th in hand.items():
        name = f"WLB {nq} queue" + ("s" if nq > 1 else "")
        rows.append(dict(row=name, **wlb_row(batches, cost, N, dp, max_tokens, th, None, args.seed, show, name)))
    name = "WLB 2 queues, balance"  # the paper's 2-queue thresholds [W/2, 3W/4], release="balance"
    rows.append(dict(row=name, **wlb_row(batches, cost, N, dp, max_tokens, hand[2], None, args.seed, show, name,
                                         release="balance")))
    # release="group": one outlier pool (outliers from W/4), groups of similar outliers leave
    # when the step stays within tolerance 1.3 of fwd+bwd load; chosen on streams seed+10..12
    name = "WLB group"
    rows.append(dict(row=name, **wlb_row(batches, cost, N, dp, max_tokens, [W // 4, 9 * W // 16], 16, args.seed,
                                         show, name, release="group", balance_tolerance=1.3)))
    rows.append(dict(row="WLB calibrated", **wlb_row(batches, cost, N, dp, max_tokens, "auto", args.max_delay,
                                                     args.seed, show, "WLB calibrated", calibration_sample=sample,
                                                     release="balance")))
    rows.append(dict(row="WLB auto", **wlb_row(batches, cost, N, dp, max_tokens, "auto", args.max_delay,
                                               args.seed, show, "WLB auto", release="balance")))
    for k in (0, 1, 2, 4):  # what a user gets with nothing tuned, and with lookahead
        name = "WLB default" + (f", lookahead {k}" if k else "")
        rows.append(dict(row=name, **wlb_row(batches, cost, N, dp, max_tokens, None, None, args.seed, show, name,
                                             packer=WLBPacker(N, max_tokens, cost, dp=dp, seed=args.seed,
                                                              config=PackerConfig(lookahead=k)))))
    print_table(rows)
    for r in rows:
        if "thresholds" in r:
            print(f"  {r['row']}: thresholds {r['thresholds']}, max_delay {r['max_delay']}, lookahead {r['lookahead']}, "
                  f"delay per doc {r['delay_mean_per_doc']:.3f}, max {r['delay_max']}, release {r['release']}, "
                  f"late tokens {r['delayed_token_share']:.1%}, early tokens {r['early_token_share']:.1%}"
                  + (f", calibration {r['calibration_s']:.2f} s" if r.get("calibration_s") else ""))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(source=source, steps=len(batches), window=W, n_micro=N, dp=dp, max_tokens=max_tokens,
                exact_steps=args.exact_steps, exact_time_limit=args.exact_time_limit, cost=cost.to_dict(), paper=PAPER)
    (out / "table2.json").write_text(json.dumps(dict(provenance=provenance("table2", argv), meta=meta, rows=rows), indent=2, default=str))
    msg = f"wrote {out / 'table2.json'}"
    if plot(rows, out / "table2.png", f"Table 2 ({source}, {len(batches)} steps)"):
        msg += f" and {out / 'table2.png'}"
    print(msg)
    return 0
