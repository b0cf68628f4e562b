"""`wlb-opt bench frontier`: the certified imbalance-displacement frontier of one stream, with
every outlier-delay heuristic on the same axes, and the order-bias check. `--offline`: the
achievable side, offline schedules checked and set beside the bound (bench/_frontier_offline.py).

Stream: 7B, (tp, cp, pp, dp) = (8, 2, 4, 1), H100, window W = 131072, N = 4, max_tokens
1.25 W, 200 global batches (`--dist` or `--lengths`; `--quick`: 100 batches, three budgets,
12 s solves). The heuristics run first; the model's window is then widened to cover every one
of them (early = the most steps an outlier trains before it arrives, at least 4; late = the
longest wait of an outlier, at least 16), so that each heuristic's plans are a point of the model: `plan_solution` maps them exactly
and `solution_violation` checks the point against every row (a violation aborts the run),
and the points are the MIP starts. For each displacement budget the MILP of
`wlb_opt.solvers.frontier_milp` (HiGHS, `--time-limit` seconds) gives a proven lower bound on the
sum over steps of the largest micro-batch's forward cost, valid for every plan within the
budget and window, including plans that move short documents (see that module).

Axes: displacement per token (mean |training step - arrival step|, token-weighted) and the
aggregate imbalance sum_t max_j cost_tj x N / total cost (the model's objective as a ratio;
it weighs each step by its cost, so it is larger than the imbalance of `bench parity`, the mean over
steps of max / mean forward cost after a 20-step warm-up, which each row also reports). A
heuristic's gap is its aggregate imbalance minus the bound at the smallest budget >= its
displacement (the bound does not increase with the budget, so that bound holds at its
displacement). Per budget, "best" is the best real plan within the budget: a heuristic's, or
the model's outlier placement realised with whole documents (the short documents of each
step by Algorithm 1, deferred pieces carried), whose true aggregate and imbalance
and displacement are printed; "model" is the model's own best solution (divisible filler).

Order bias (per method): the Pearson correlation between a piece's length and its
displacement (over placed pieces), and the share of the longest 1% of tokens (the tokens of
the pieces whose lengths are in the top 1% of the stream) trained in each tenth of the steps
(10% each is unbiased; the largest deviation is "top1%dev"), and "shift", the largest
difference between that share and the share that ARRIVES in each tenth: the stream itself
is not uniform, so "shift" is what the method's reordering moved.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from ..solvers.greedy import warm_up_compiled
from ..cost_args import add_cost_args, cost_from_args, count, natural, seconds
from ..documents import load_lengths
from ..packer import PackerConfig, WLBPacker, per_step_imbalance
from ..solvers.bounds import delay_floor
from ..solvers.frontier_milp import (aggregate_imbalance, frontier_problem, plan_solution, solution_violation,
                                     solve_frontier)
from ..step_pack import solve_pack
from ..workloads import DEFAULT_SEED, DISTRIBUTIONS, global_batches
from .data import run_packer
from ._provenance import provenance
from ._frontier_offline import OFFLINE_DISTS
from ._frontier_offline import main as offline_main

WARMUP = 20
EARLY, LATE = 4, 16  # the model's window at least; widened to what the heuristics do
STEPS, QUICK_STEPS = 200, 100
BUDGETS, QUICK_BUDGETS = "0.02,0.05,0.1,0.15,0.2,0.3,0.4,0.5", "0.05,0.1,0.3"
TIME_LIMIT, QUICK_TIME_LIMIT = 40.0, 12.0


def heuristics(window: int) -> dict[str, dict]:
    """The settings placed on the frontier (constants as in `bench table2` / `bench parity`; the
    earlier rules pack each step by Algorithm 1, the defaults by "wlb_phases")."""
    group = dict(thresholds=[window // 4, 9 * window // 16], max_delay=16, release="group", balance_tolerance=1.3,
                 method="wlb")
    return {
        "paper rule 32768/73728": dict(thresholds=[32768, 73728], max_delay=None, release="paper", method="wlb"),
        "balance W/2,3W/4": dict(thresholds=[window // 2, 3 * window // 4], max_delay=None, release="balance",
                                 method="wlb"),
        "group": group,
        "default (no tuning)": {},
        **{f"default, lookahead {k}": dict(lookahead=k) for k in (1, 2, 4)},
        **{f"group, lookahead {k}": dict(group, lookahead=k) for k in (1, 2, 4)},
        # the default's own trade-off: its feedback rule aims at a smaller displacement
        **{f"default, delay_budget {b:g}": dict(delay_budget=b) for b in (0.1, 0.2, 0.3)},
    }


def stream_plans(run) -> list:
    """Every plan of a packer run in step order (with lookahead the first K `pack` calls
    return None and the drain plans the last K steps)."""
    return [p for p in run.plans if p is not None] + list(run.drained)


def planning_seconds(run) -> list:
    """CPU seconds of the `pack` calls that planned a step (with lookahead the first K plan
    nothing)."""
    return [t for t, plan in zip(run.seconds, run.plans) if plan is not None] or run.seconds


def sum_of_max(plans, cost) -> float:
    mbc = cost.mb_const("fwd")
    return float(sum(max(cost.micro_batch_cost(p.lengths[mb], "fwd") - mbc for mb in p.micro_batches)
                     for p in plans))


def model_window(plan_lists, n_steps: int, outlier_min: int) -> tuple[int, int, int]:
    """(early, late, n_slots) of a window that covers every heuristic: early = the most steps
    an outlier trains before its arrival (>= EARLY), late = the longest wait of an outlier (>= LATE), slots up to the
    last step any heuristic uses."""
    outlier_delays = [d for plans in plan_lists for plan in plans
                      for d in plan.delays()[plan.lengths >= outlier_min].tolist()]
    early = max([EARLY] + [-d for d in outlier_delays])
    late = max([LATE] + outlier_delays)
    n_slots = max([n_steps + late] + [plan.step + 1 for plans in plan_lists for plan in plans])
    return early, late, n_slots


def order_bias(plans, n_steps: int) -> dict:
    """Correlation of length and displacement; share of the top-1% tokens trained in each
    tenth of the stream, and the same share by arrival (the stream's own order), whose
    largest difference is what the reordering did."""
    lengths, disp, steps = [], [], []
    for p in plans:
        placed = np.concatenate(p.micro_batches) if p.micro_batches else np.zeros(0, np.int64)
        lengths.append(p.lengths[placed])
        disp.append(p.delays()[placed])
        steps.append(np.full(len(placed), p.step))
    lengths, disp, steps = (np.concatenate(a) for a in (lengths, disp, steps))
    corr = float(np.corrcoef(lengths, disp)[0, 1]) if disp.std() > 0 else 0.0
    top = lengths >= np.percentile(lengths, 99)

    def share(at):
        tenth = np.clip(at * 10 // max(n_steps, 1), 0, 9)
        return np.bincount(tenth[top], weights=lengths[top], minlength=10)[:10] / max(lengths[top].sum(), 1)

    trained, arrived = share(steps), share(steps - disp)
    return dict(length_displacement_corr=corr, top1_share_by_tenth=trained.tolist(),
                top1_share_by_arrival_tenth=arrived.tolist(), top1_share_max_dev=float(np.abs(trained - 0.1).max()),
                top1_shift_max=float(np.abs(trained - arrived).max()))


def realise(problem, placement, batches, cost, n_micro: int, max_tokens: int, outlier_min: int) -> dict:
    """Whole-document plans from a model placement (the step of each outlier): each step packs
    its outliers, its own short pieces and the carry (Algorithm 1, carried first)."""
    at_step: dict[int, list] = {}
    for o, t in enumerate(placement):
        at_step.setdefault(int(t), []).append(o)
    mbc = cost.mb_const("fwd")
    carry = [np.zeros(0, np.int64)] * 4
    imbs, disp_tok, tokens, total_max, t = [], 0, 0, 0.0, 0
    while t < problem.n_slots or len(carry[0]):
        parts = [carry]
        if t < len(batches):
            lengths, ids, offsets = batches[t]
            short = lengths < outlier_min
            parts.append([lengths[short], ids[short], offsets[short], np.full(int(short.sum()), t)])
        outs = at_step.get(t, [])
        if outs:
            parts.append([problem.outlier_length[outs], np.array([problem.outlier_key[o][0] for o in outs]),
                          np.array([problem.outlier_key[o][1] for o in outs]), problem.outlier_arrival[outs]])
        lengths, ids, offsets, arrival = (np.concatenate([np.asarray(p[f], dtype=np.int64) for p in parts])
                                          for f in range(4))
        plan = solve_pack(lengths, n_micro, max_tokens, cost, "wlb", ids=ids, offsets=offsets, carried=len(carry[0]))
        placed = np.concatenate(plan.micro_batches)
        disp_tok += int((np.abs(t - arrival[placed]) * lengths[placed]).sum())
        tokens += int(lengths[placed].sum())
        total_max += max(cost.micro_batch_cost(lengths[mb], "fwd") - mbc for mb in plan.micro_batches)
        if t < len(batches):
            imbs.append(per_step_imbalance(plan, cost, "fwd"))
        d = plan.deferred
        carry = [lengths[d], ids[d], offsets[d], arrival[d]]
        t += 1
    return dict(imbalance=float(np.mean(imbs[WARMUP:] or imbs)), aggregate=aggregate_imbalance(total_max, problem),
                displacement_per_token=disp_tok / max(tokens, 1))


def parse_budgets(text: str) -> list[float]:
    """Comma-separated displacement budgets (finite, >= 0), ascending."""
    try:
        budgets = sorted(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--budgets must be comma-separated numbers, got {text!r}") from None
    if not budgets or not all(np.isfinite(b) and b >= 0 for b in budgets):
        raise ValueError(f"--budgets must be finite numbers >= 0, got {text!r}")
    return budgets


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt bench frontier", description=" ".join(__doc__.split("\n\n")[0].split()))
    src = p.add_mutually_exclusive_group()
    src.add_argument("--lengths", metavar="FILE", help="document lengths in stream order (.npy, .txt, .jsonl)")
    src.add_argument("--dist", default=None, choices=sorted(DISTRIBUTIONS),
                     help="built-in distribution (default: default; with --offline use --dists)")
    p.add_argument("--steps", type=count, default=None, help=f"global batches (default {STEPS}; --quick {QUICK_STEPS})")
    p.add_argument("--budgets", default=None, help=f"displacement-per-token budgets (default {BUDGETS}; --quick "
                                                   f"{QUICK_BUDGETS})")
    p.add_argument("--time-limit", type=seconds, default=None,
                   help=f"HiGHS seconds per budget (default {TIME_LIMIT:g}; --quick {QUICK_TIME_LIMIT:g})")
    p.add_argument("--quick", action="store_true",
                   help="fewer steps and budgets, shorter solves (about 2 minutes; with --offline under 3)")
    p.add_argument("--outlier-min", type=count, default=32768, help="pieces this long are whole (default 32768)")
    p.add_argument("--window", type=count, default=131072, help="training context length (default 131072)")
    p.add_argument("--n-micro", type=count, default=4, help="micro-batches per step (default 4)")
    p.add_argument("--seed", type=natural, default=0, help="stream seed, an offset from DEFAULT_SEED (default 0)")
    p.add_argument("--out", default="results/frontier", help="folder for frontier.json and frontier.png")
    p.add_argument("--offline", action="store_true",
                   help="the achievable side: offline schedules per budget, checked, beside the bound and the defaults "
                        "(bench/_frontier_offline.py; writes offline.json and offline_<dist>.png)")
    p.add_argument("--dists", default=None,
                   help=f"with --offline: comma-separated distributions (default {','.join(OFFLINE_DISTS)})")
    p.add_argument("--jobs", type=count, default=1,
                   help="with --offline: distributions searched in this many worker processes at once (default 1; "
                        "at most the machine's idle cores: the schedules are the same, the bounds are HiGHS's within "
                        "--time-limit)")
    p.add_argument("--balance", choices=("fwd_bwd", "fwd"), default="fwd_bwd",
                   help="with --offline: the cost the defaults plan on, fwd_bwd (the whole cost model, as the "
                        "defaults) or fwd (the forward phase alone, bracketed by forward searches only); default "
                        "fwd_bwd")
    add_cost_args(p, layout=("tp", "cp", "pp"))
    args = p.parse_args(argv)
    warm_up_compiled()  # numba's compile (or cache load) is no step's planning time
    if args.offline:
        if args.lengths:
            p.error("--offline runs the built-in distributions of --dists, not --lengths")
        if args.dist:
            p.error(f"--offline runs the distributions of --dists, not --dist (use --dists {args.dist})")
        unknown = [d for d in (args.dists or "").split(",") if d.strip() and d.strip() not in DISTRIBUTIONS]
        if unknown:
            p.error(f"--dists: unknown distribution(s) {unknown}; valid: {sorted(DISTRIBUTIONS)}")
        try:
            budgets = parse_budgets(args.budgets) if args.budgets else None
        except ValueError as exc:
            p.error(str(exc))
        if args.steps is not None and args.steps <= WARMUP:
            print(f"note: --steps {args.steps} is within the {WARMUP}-step warm-up: the means are over every step",
                  file=sys.stderr)
        return offline_main(args, argv, cost_from_args(args, parser=p), budgets)
    if args.dists:
        p.error("--dists needs --offline (use --dist for the certified frontier)")
    if args.balance != "fwd_bwd":
        p.error("--balance needs --offline")
    if args.jobs != 1:
        p.error(f"--jobs {args.jobs} needs --offline (the certified frontier is one stream)")
    steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else STEPS)
    time_limit = args.time_limit if args.time_limit is not None else (QUICK_TIME_LIMIT if args.quick else TIME_LIMIT)
    try:
        budgets = parse_budgets(args.budgets or (QUICK_BUDGETS if args.quick else BUDGETS))
    except ValueError as exc:
        p.error(str(exc))
    if steps <= WARMUP:
        p.error(f"--steps ({steps}) must be more than the {WARMUP}-step warm-up the means leave out")
    cost = cost_from_args(args, parser=p)
    W, N = args.window, args.n_micro
    max_tokens = int(1.25 * W)
    if args.lengths:
        stream = load_lengths(args.lengths)
        if int(stream.sum()) < N * W * steps:  # the steps past its end would be empty, scored as balanced
            most = int(stream.sum()) // (N * W)
            p.error(f"--lengths {args.lengths} holds {int(stream.sum())} tokens, fewer than {steps} steps of "
                    f"{N * W} " + (f"(--steps {most} or fewer)" if most else "(not even one step)"))
        batches = global_batches("default", W, N * W, steps, lengths=stream)
        source = args.lengths
    else:
        dist = args.dist or "default"
        batches = global_batches(dist, W, N * W, steps, seed=DEFAULT_SEED + args.seed)
        source = f"dist={dist}"
    t0 = time.perf_counter()
    runs = {}
    with warnings.catch_warnings():  # the paper rule warns about its thresholds on every stream; it is on purpose
        warnings.simplefilter("ignore", UserWarning)
        skipped = {}
        for name, kw in heuristics(W).items():
            try:
                run = run_packer(WLBPacker(N, max_tokens, cost, config=PackerConfig(**kw)), batches)
            except ValueError as exc:  # an overload (e.g. max_delay=None on a stream of many outliers)
                if "overload" not in str(exc):
                    raise
                skipped[name] = str(exc).split(";")[0]
                continue
            runs[name] = (kw, run, stream_plans(run))
    early, late, n_slots = model_window([plans for _, _, plans in runs.values()], len(batches), args.outlier_min)
    problem = frontier_problem(batches, lambda d: cost.doc_cost(d, "fwd"), N, max_tokens,
                               outlier_min=args.outlier_min, early=early, late=late, n_slots=n_slots)
    print(f"frontier: {len(batches)} steps ({source}), {len(problem.outlier_length)} outliers >= "
          f"{args.outlier_min} tokens, {problem.n_classes} filler classes, window [-{early}, +{late}], "
          f"{n_slots} slots, budgets {budgets}, {time_limit:g} s each")
    floor = delay_floor(batches, N, max_tokens)
    print(f"delay floor: {floor:.3f} displacement per token (no plan without lookahead needs less; "
          "solvers.bounds.delay_floor)")
    rows, starts = [], []
    for name, (kw, run, plans) in runs.items():
        imbs = [per_step_imbalance(plan, cost, "fwd") for plan in plans[:len(batches)]]
        solution, why = plan_solution(problem, plans)
        violation = None if solution is None else solution_violation(problem, solution,
                                                                      solution.displacement_per_token + 1e-9)
        if solution is not None and violation > 1e-6:
            raise AssertionError(f"{name}: its plans map onto the model with a violation of {violation:.2e}")
        starts.append(solution)
        rows.append(dict(method=name, settings=kw, imbalance=float(np.mean(imbs[WARMUP:] or imbs)),
                         aggregate=aggregate_imbalance(sum_of_max(plans, cost), problem),
                         displacement_per_token=run.stats["displacement_per_token"],
                         late_pieces=run.stats["late_pieces"], in_model=solution is not None, not_in_model=why,
                         ms_per_batch=1e3 * float(np.median(planning_seconds(run))), **order_bias(plans, len(batches))))
    widest = max((r["displacement_per_token"] for r in rows if r["in_model"]), default=0.0)
    if widest > budgets[-1]:  # one more budget, so that every heuristic has a bound at its displacement
        budgets.append(float(np.ceil(widest * 100) / 100))
    frontier, realised, previous = [], [], None
    for budget in budgets:  # ascending: a smaller budget's solution is a start for the next
        r = solve_frontier(problem, budget, time_limit, starts=starts + [previous])
        previous = r.values
        real = (realise(problem, r.placement, batches, cost, N, max_tokens, args.outlier_min)
                if r.placement is not None else None)
        realised += [real] if real is not None else []
        plans_within = [x["aggregate"] for x in rows + realised if x["displacement_per_token"] <= budget + 1e-12]
        frontier.append(dict(budget=budget, status=r.status, seconds=r.seconds, n_binaries=r.n_binaries,
                             model_best=None if r.objective is None else aggregate_imbalance(r.objective, problem),
                             bound=_finite(aggregate_imbalance(r.bound, problem)),
                             model_displacement=r.displacement_per_token,
                             realised=real, best_plan=min(plans_within, default=None)))
    for row in rows:  # the bound does not increase with the budget: the next budget up bounds this plan
        above = [f for f in frontier if f["budget"] >= row["displacement_per_token"] - 1e-12]
        row["bound_at_displacement"] = above[0]["bound"] if above and row["in_model"] else None
        row["gap_to_bound"] = None if row["bound_at_displacement"] is None else row["aggregate"] - row[
            "bound_at_displacement"]
    print(f"\n{'budget':>6} {'bound':>6} {'best':>6} {'model':>6} {'realised agg/imb/disp':>22} {'status':<19} "
          f"{'s':>4}")
    for f in frontier:
        real = f["realised"]
        cell = "-" if real is None else "{:.3f}/{:.3f}/{:.2f}".format(real["aggregate"], real["imbalance"],
                                                                   real["displacement_per_token"])
        print(f"{f['budget']:>6.2f} {f['bound']:>6.3f} {_fmt(f['best_plan'])} {_fmt(f['model_best'])} {cell:>22} "
              f"{f['status']:<19} {f['seconds']:>4.0f}")
    print(f"\n{'method':<26} {'imb':>6} {'agg':>6} {'disp':>5} {'bound':>6} {'gap':>6} {'corr':>6} "
          f"{'top1%dev':>8} {'shift':>6} {'ms':>5}")
    for r in rows:
        print(f"{r['method']:<26} {r['imbalance']:>6.3f} {r['aggregate']:>6.3f} {r['displacement_per_token']:>5.2f} "
              f"{_fmt(r['bound_at_displacement'])} {_fmt(r['gap_to_bound'])} {r['length_displacement_corr']:>6.2f} "
              f"{r['top1_share_max_dev']:>8.3f} {r['top1_shift_max']:>6.3f} {r['ms_per_batch']:>5.1f}")
    for name, why in skipped.items():
        print(f"  {name}: not run ({why})")
    for r in rows:
        if not r["in_model"]:
            print(f"  {r['method']}: no bound ({r['not_in_model']})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(source=source, steps=len(batches), window=W, n_micro=N, max_tokens=max_tokens,
                outlier_min=args.outlier_min, early=early, late=late, n_slots=n_slots,
                filler_classes=problem.class_edges.tolist(), time_limit=time_limit, delay_floor=floor,
                seconds=time.perf_counter() - t0)
    (out / "frontier.json").write_text(json.dumps(dict(provenance=provenance("frontier", argv), meta=meta, frontier=frontier, heuristics=rows, skipped=skipped), indent=2))
    msg = f"wrote {out / 'frontier.json'}"
    if plot(frontier, rows, out / "frontier.png", f"frontier ({source}, {len(batches)} steps)"):
        msg += f" and {out / 'frontier.png'}"
    print(msg + f" ({meta['seconds']:.0f} s)")
    return 0


def _fmt(x) -> str:
    return f"{'-':>6}" if x is None else f"{x:>6.3f}"



def _finite(bound: float) -> float | None:
    """A bound as JSON writes it: None for an infeasible budget's infinite one (JSON has no
    Infinity)."""
    return bound if math.isfinite(bound) else None

def plot(frontier, rows, path: Path, title: str, offline=None) -> bool:
    """The bound, the best plans and each heuristic on (displacement, aggregate imbalance);
    `offline`: (displacement, aggregate) points of offline schedules, drawn as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(9, 5.5))
    bounded = sorted((f["budget"], f["bound"]) for f in frontier if f["bound"] is not None)
    ax.step([b for b, _ in bounded], [v for _, v in bounded], "k--", where="pre",
            label="proven bound (a budget's bound holds from the budget below it)")
    best = [(f["budget"], f["best_plan"]) for f in frontier if f["best_plan"] is not None]
    if best:
        ax.plot(*zip(*best), "k-o", ms=3, label="best plan found within the budget")
    real = [(f["realised"]["displacement_per_token"], f["realised"]["aggregate"]) for f in frontier
            if f["realised"] is not None]
    if real:
        ax.plot(*zip(*real), "kx", label="model's placements, realised whole")
    if offline:
        ax.plot(*zip(*sorted(offline)), "-s", color="0.45", ms=4,
                label="offline schedule (full knowledge of the stream, checked)")
    markers = "osD^v<>p*hXdP"
    for i, r in enumerate(rows):
        ax.plot(r["displacement_per_token"], r["aggregate"], markers[i % len(markers)], color=f"C{i % 10}",
                label=r["method"])
    ax.set_xlabel("displacement per token (iterations)")
    ax.set_ylabel("aggregate imbalance (sum of max x N / total)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
