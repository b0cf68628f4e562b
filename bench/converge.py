"""`wlb-opt bench converge`: does reordering documents hurt training? The paper's Fig. 16, measured.

The paper (§5.5, Fig. 16, a 550M model) reports that fixed-length packing over 8 global
batches raises the training loss by 1.6% on average, while WLB-LLM, which delays only outlier
documents (0.5 iterations per token), tracks the curve of packing within one global batch;
it shows training loss only. This benchmark trains a small Llama-style model
(`wlb_opt.executor.TinyLM`, document-masked attention, bytes as tokens) from scratch on real
text, the running interpreter's standard library (`wlb_opt.bench.corpus`), once per ordering
("single", "fixed-8", "wlb", "original"; see `_converge_plans`) and seed, and reports per
ordering, over the seeds:

- `mean_train_loss_rel`: mean training loss over the first `steps` steps relative to
  "single" of the same seed (the paper's statistic; 0.016 = +1.6%), mean and spread;
- `final_heldout_rel`: the held-out loss at the end relative to "single" (the paper has none);
  "at the end" is the mean over the evaluations after each of the last 8 steps, so that
  fixed-8's pool phase (long documents first in a pool, short ones last) does not decide it;
  `last_heldout_rel` is the one evaluation after the last step. Each ordering ends when it
  has trained every token: one with drain steps (wlb) is evaluated after them, one or more
  optimizer steps later than "single" (its `steps` says how many it took);
- displacement and delay per token (steps between a token's global batch and its step);
- the PP imbalance of the plans (max / mean of modelled micro-batch cost per step) under the
  cost model of the trained model at its window: informative only for a model that small.

Every ordering of a seed starts from the same weights and sees the same documents; the
(ordering, seed) runs are independent processes (`--workers`, one torch thread each).

    wlb-opt bench converge --quick --out results/converge     about 3 minutes on 2 cores
    wlb-opt bench converge --out results/converge             about 15 minutes on 2 idle cores

Writes converge.json (every curve: one row per ordering and seed, one summary row per
ordering) and converge.png (training and held-out curves, mean and band over seeds).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from ._converge_plans import ORDERINGS
from ._converge_train import ConvergeConfig, load_corpus, run_job
from ..cost_args import count
from ._provenance import provenance

QUICK = dict(window=256, n_micro=8, steps=48, layers=2, eval_every=8)
"""--quick: a 256-token window, 2 layers, 48 global batches."""
PAPER = {"fixed-8": "+1.6% mean training loss (550M, Fig. 16)", "wlb": "tracks single (0.5 iterations delay per token)"}


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)  # one core per run: runs in parallel scale better than threads here


def run_all(config: ConvergeConfig, orderings, seeds, workers: int, log=print) -> list[dict]:
    """Every (ordering, seed) run; in `workers` processes (1: in this process)."""
    jobs = [(o, s) for s in seeds for o in orderings]
    rows = []
    if workers <= 1:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for o, s in jobs:
                rows.append(run_job(config, o, s))
                log(_done_line(rows[-1], len(rows), len(jobs)))
        finally:
            torch.set_num_threads(threads)
    else:
        with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"), initializer=_init_worker) as pool:
            futures = [pool.submit(run_job, config, o, s) for o, s in jobs]
            for fut in as_completed(futures):
                rows.append(fut.result())
                log(_done_line(rows[-1], len(rows), len(jobs)))
    order = {o: i for i, o in enumerate(orderings)}
    return sorted(rows, key=lambda r: (order[r["ordering"]], r["seed"]))


def _done_line(row: dict, k: int, n: int) -> str:
    return (f"  [{k}/{n}] {row['ordering']:<8} seed {row['seed']}: {row['steps']} steps, final held-out "
            f"{row['final_heldout']:.4f}, {row['wall_s']:.0f} s ({row['cpu_s']:.0f} s CPU)")


def _spread(values) -> dict:
    v = np.asarray(values, dtype=np.float64)
    return dict(mean=float(v.mean()), std=float(v.std(ddof=1)) if len(v) > 1 else 0.0,
                min=float(v.min()), max=float(v.max()))


def summarize(rows: list[dict], steps: int) -> list[dict]:
    """One row per ordering: paired (same seed) losses relative to "single", with their spread
    over seeds, and the packing facts averaged over seeds."""
    by = {(r["ordering"], r["seed"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    orderings = list(dict.fromkeys(r["ordering"] for r in rows))
    if "single" not in orderings:
        raise ValueError("the summary is relative to 'single'; include it in --orderings")
    for s in seeds:  # same initial weights for every ordering of a seed: same loss before training
        first = {o: by[(o, s)]["heldout_loss"][0] for o in orderings}
        if max(first.values()) - min(first.values()) > 1e-6:
            raise RuntimeError(f"seed {s}: orderings start from different held-out losses {first}")
    out = []
    for o in orderings:
        train_rel, held_rel, last_rel = [], [], []
        for s in seeds:
            base, run = by[("single", s)], by[(o, s)]
            train_rel.append(np.mean(run["train_loss"][:steps]) / np.mean(base["train_loss"][:steps]) - 1)
            held_rel.append(run["final_heldout"] / base["final_heldout"] - 1)
            last_rel.append(run["heldout_loss"][-1] / base["heldout_loss"][-1] - 1)
        mine = [by[(o, s)] for s in seeds]
        tr, hr, lr = _spread(train_rel), _spread(held_rel), _spread(last_rel)
        out.append(dict(
            ordering=o, seeds=len(seeds),
            mean_train_loss_rel=tr["mean"], mean_train_loss_rel_std=tr["std"],
            mean_train_loss_rel_min=tr["min"], mean_train_loss_rel_max=tr["max"],
            final_heldout_rel=hr["mean"], final_heldout_rel_std=hr["std"],
            final_heldout_rel_min=hr["min"], final_heldout_rel_max=hr["max"],
            last_heldout_rel=lr["mean"], last_heldout_rel_std=lr["std"],
            mean_train_loss=_spread([np.mean(r["train_loss"][:steps]) for r in mine]),
            final_heldout=_spread([r["final_heldout"] for r in mine]),
            **{k: float(np.mean([r[k] for r in mine])) for k in
               ("displacement_per_token", "delay_per_token", "moved_token_share", "imbalance", "imbalance_p90",
                "tokens_per_step_cv", "steps")}))
    return out


def print_table(summary: list[dict]) -> None:
    print(f"{'ordering':<9} {'steps':>6} {'train loss vs single':>21} {'held-out vs single':>20} {'held-out':>16} "
          f"{'last eval vs single':>20} {'displ/tok':>9} {'delay/tok':>9} {'PP imb':>7} {'tok/step cv':>11}")
    for r in summary:
        tr = f"{100 * r['mean_train_loss_rel']:+.2f} ± {100 * r['mean_train_loss_rel_std']:.2f}%"
        hr = f"{100 * r['final_heldout_rel']:+.2f} ± {100 * r['final_heldout_rel_std']:.2f}%"
        fh = f"{r['final_heldout']['mean']:.4f} ± {r['final_heldout']['std']:.4f}"
        lr = f"{100 * r['last_heldout_rel']:+.2f} ± {100 * r['last_heldout_rel_std']:.2f}%"
        print(f"{r['ordering']:<9} {r['steps']:>6.1f} {tr:>21} {hr:>20} {fh:>16} {lr:>20} {r['displacement_per_token']:>9.3f} "
              f"{r['delay_per_token']:>9.3f} {r['imbalance']:>7.3f} {r['tokens_per_step_cv']:>11.3f}")


def _moving_average(y: np.ndarray, k: int) -> np.ndarray:
    if len(y) < k or k <= 1:
        return y
    c = np.cumsum(np.concatenate([[0.0], y]))
    return np.concatenate([c[1:k] / np.arange(1, k), (c[k:] - c[:-k]) / k])


def plot(rows: list[dict], summary: list[dict], steps: int, path: Path, title: str, smooth: int = 8) -> bool:
    """Training loss (moving average of `smooth` steps) and held-out loss, absolute and
    relative to single of the same seed, each as the mean over seeds with a min-max band."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, grid = plt.subplots(2, 2, figsize=(12, 8))
    axes = [grid[0, 0], grid[0, 1], grid[1, 1], grid[1, 0]]
    orderings = [r["ordering"] for r in summary]
    single = {r["seed"]: r for r in rows if r["ordering"] == "single"}
    for c, o in enumerate(orderings):
        mine = [r for r in rows if r["ordering"] == o]
        color = f"C{c}"
        train = np.array([_moving_average(np.asarray(r["train_loss"][:steps]), smooth) for r in mine])
        x = np.arange(1, train.shape[1] + 1)
        axes[0].plot(x, train.mean(0), color=color, label=o)
        axes[0].fill_between(x, train.min(0), train.max(0), color=color, alpha=0.2)
        base = np.array([_moving_average(np.asarray(single[r["seed"]]["train_loss"][:steps]), smooth) for r in mine])
        train_rel = (train / base - 1) * 100
        axes[3].plot(x, train_rel.mean(0), color=color, label=o)
        axes[3].fill_between(x, train_rel.min(0), train_rel.max(0), color=color, alpha=0.2)
        # held-out curves on the eval steps of the shortest run (runs of an ordering may differ
        # by a drain step); single is interpolated onto them for the relative panel
        hx = np.asarray(min((r["heldout_steps"] for r in mine), key=len), dtype=np.float64)
        held = np.array([np.interp(hx, r["heldout_steps"], r["heldout_loss"]) for r in mine])
        axes[1].plot(hx, held.mean(0), color=color, marker=".", ms=3, label=o)
        axes[1].fill_between(hx, held.min(0), held.max(0), color=color, alpha=0.2)
        keep = (hx > 0) & (hx <= min(single[r["seed"]]["heldout_steps"][-1] for r in mine))
        rel = np.array([held[i, keep] / np.interp(hx[keep], single[r["seed"]]["heldout_steps"],
                                                  single[r["seed"]]["heldout_loss"]) - 1
                        for i, r in enumerate(mine)]) * 100
        axes[2].plot(hx[keep], rel.mean(0), color=color, marker=".", ms=3, label=o)
        axes[2].fill_between(hx[keep], rel.min(0), rel.max(0), color=color, alpha=0.2)
    axes[0].set(xlabel="step", ylabel=f"training loss (nats/byte, mean of {smooth} steps)", title="training loss")
    axes[1].set(xlabel="step", ylabel="held-out loss (nats/byte)", title="held-out loss")
    axes[2].set(xlabel="step", ylabel="held-out loss vs single of the same seed (%)", title="held-out, relative")
    axes[3].set(xlabel="step", ylabel="training loss vs single, same seed (%)",
                title="training, relative")
    for ax in (axes[2], axes[3]):
        ax.axhline(0, color="k", lw=0.5)
    # y from a quarter of the run on: the first steps fall from ln(256) = 5.5 and would flatten the rest
    quarter = max(1, steps // 4)
    train_top = [_moving_average(np.asarray(r["train_loss"][:steps]), smooth)[min(quarter, steps) - 1] for r in rows]
    held_top = [np.interp(quarter, r["heldout_steps"], r["heldout_loss"]) for r in rows]
    axes[0].set_ylim(min(min(r["train_loss"]) for r in rows) - 0.05, max(train_top) + 0.05)
    axes[1].set_ylim(min(min(r["heldout_loss"]) for r in rows) - 0.02, max(held_top) + 0.02)
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title + " (bands: min-max over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt bench converge", description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default=None, metavar="DIR",
                   help="folder of text files (default: this interpreter's standard library, *.py)")
    p.add_argument("--steps", type=count, default=None, help="global batches, a multiple of 8 (default 128; quick 48)")
    p.add_argument("--seeds", type=count, default=3, help="seeds 0..K-1 (model init and data order; default 3)")
    p.add_argument("--quick", action="store_true", help="window 256, 2 layers, 48 steps (about 3 minutes)")
    p.add_argument("--out", required=True, help="folder for converge.json and converge.png")
    p.add_argument("--orderings", default=",".join(ORDERINGS), help=f"comma-separated subset of {','.join(ORDERINGS)} "
                   "(must include single)")
    p.add_argument("--window", type=count, default=None, help="context length in bytes (default 512; quick 256)")
    p.add_argument("--n-micro", type=count, default=None, help="micro-batches per step (default 8)")
    p.add_argument("--layers", type=count, default=None, help="transformer blocks (default 4; quick 2)")
    p.add_argument("--dim", type=count, default=None, help="model width (default 64)")
    p.add_argument("--eval-every", type=count, default=None, help="steps between held-out evaluations (default 16; quick 8)")
    p.add_argument("--workers", type=count, default=min(2, os.cpu_count() or 1),
                   help="parallel runs, one torch thread each (default: min(2, CPUs))")
    args = p.parse_args(argv)
    orderings = [o.strip() for o in args.orderings.split(",") if o.strip()]
    bad = [o for o in orderings if o not in ORDERINGS]
    if bad or "single" not in orderings or len(set(orderings)) != len(orderings):
        p.error(f"--orderings {args.orderings!r}: need distinct names from {list(ORDERINGS)}, including single")
    if args.seeds < 1 or args.workers < 1:
        p.error(f"--seeds and --workers must be >= 1, got {args.seeds} and {args.workers}")
    settings = dict(QUICK) if args.quick else dict(steps=128)
    for name in ("steps", "window", "n_micro", "layers", "dim", "eval_every"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    try:
        config = ConvergeConfig(corpus=args.corpus, **settings)
        corpus = load_corpus(config)
    except ValueError as exc:
        p.error(str(exc))
    stats = corpus.stats()
    print(f"converge: {stats['train_files']} training / {stats['heldout_files']} held-out files of {stats['root']}; "
          f"window {config.window}, {stats['short_token_share']:.0%} of tokens in documents < window/2, "
          f"{stats['documents_at_least_window']} documents >= window; {config.steps} global batches of "
          f"{config.tokens_per_batch} tokens; model {config.dim}x{config.layers}; {len(orderings)} orderings x "
          f"{args.seeds} seeds on {args.workers} worker(s)")
    load_before, t0 = os.getloadavg(), time.perf_counter()
    rows = run_all(config, orderings, range(args.seeds), args.workers)
    wall = time.perf_counter() - t0
    summary = summarize(rows, config.steps)
    print_table(summary)
    print(f"total {wall:.0f} s wall, {sum(r['cpu_s'] for r in rows):.0f} s CPU over all runs; load average "
          f"{load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(command=provenance("converge", argv)["command"],
                config=config.to_dict(), corpus=stats, tokens_per_batch=config.tokens_per_batch,
                wall_s=wall, cpu_s=sum(r["cpu_s"] for r in rows), workers=args.workers, cpus=os.cpu_count(),
                load_average_before=load_before, load_average_after=os.getloadavg(), paper=PAPER,
                cost=config.cost().to_dict())
    (out / "converge.json").write_text(json.dumps(dict(provenance=provenance("converge", argv), meta=meta, runs=rows, summary=summary), indent=1))
    msg = f"wrote {out / 'converge.json'}"
    title = f"converge: {config.dim}x{config.layers} TinyLM, window {config.window}, {args.seeds} seeds"
    if plot(rows, summary, config.steps, out / "converge.png", title):
        msg += f" and {out / 'converge.png'}"
    print(msg)
    return 0
