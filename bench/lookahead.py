"""`wlb-opt bench lookahead`: the no-tuning defaults with lookahead, compared at equal displacement.

Lookahead lets outliers train early (up to K steps; with the default release, up to
`packer.defaults.MAX_LEAD` = 2, so lookahead 4 plans as lookahead 2), which is displacement
too, so a packer with lookahead that balances better at a little more displacement has not
yet shown that it is better. This runs the defaults (`parity`'s "default" and "default+K"
settings, same streams, same measures) at several delay budgets (`PackerConfig.delay_budget`,
which sets where balance_tolerance="auto" holds the displacement), so that each lookahead
draws a curve of (displacement per token, mean forward imbalance), means over the seeds, and
compares:

- "at or below": for each point of K = 0, the lowest imbalance a K point reaches at no more
  displacement (measured points only; "holds" when it is no worse than K = 0's, None when no
  K point displaces that little);
- "interpolated": each K curve read at that point's displacement (linear between the K
  curve's points, sorted by displacement; None outside them);
- "within": per K and limit of `--limits`, the lowest imbalance of the points at no more
  displacement than the limit.

Streams are those of `parity` (the built-in distributions, seeds offset from DEFAULT_SEED;
scored seeds 0-2 by default, never the calibration seeds 100-102 the constants were chosen
on). One PNG per run draws every distribution's curves.

`--balance fwd` plans with the cost model's backward coefficients set to zero
(`step_packers.forward_cost`), so that the packer balances the forward phase alone, the
measure of the imbalance columns; the default, fwd_bwd, plans with the whole cost model, as
the defaults do. `sim` (the simulated 1F1B step over that of balanced micro-batches) shows
what balancing the forward phase alone costs the pipeline, which runs both phases.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from ..solvers.greedy import warm_up_compiled
from .._optional import progress
from ..cost_args import add_cost_args, cost_from_args, count, natural
from ..workloads import DEFAULT_SEED, DISTRIBUTIONS, global_batches
from ._provenance import provenance
from .parity import run_stream
from .step_packers import forward_cost

DEFAULT_BUDGET = 0.5
"""`PackerConfig.delay_budget`'s default: the defaults' own point of each curve."""


def _numbers(text: str, name: str, kind: type = float) -> list:
    """Sorted distinct finite values >= 0 of a comma-separated option (`kind`: float or int)."""
    what = "numbers" if kind is float else "integers"
    try:
        values = sorted({kind(x) for x in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} must be comma-separated {what}, got {text!r}") from None
    if not values or values[0] < 0 or not all(math.isfinite(v) for v in values):  # nan sorts anywhere
        raise argparse.ArgumentTypeError(f"{name} must be finite {what} >= 0, got {text!r}")
    return values


def compare(points: list[dict], limits: list[float]) -> tuple[list[dict], list[dict]]:
    """(rows comparing each K > 0 with K = 0 at each K = 0 point, rows of the best point within
    each displacement limit) of one distribution's `points` (means over seeds: lookahead,
    delay_budget, imbalance, delay_per_token)."""
    by_k: dict[int, list[dict]] = {}
    for p in points:
        by_k.setdefault(p["lookahead"], []).append(p)
    curves = {k: sorted(ps, key=lambda p: p["delay_per_token"]) for k, ps in by_k.items()}
    rows = []
    for base in curves.get(0, []):
        d0, i0 = base["delay_per_token"], base["imbalance"]
        for k, curve in curves.items():
            if k == 0:
                continue
            ds = np.array([p["delay_per_token"] for p in curve])
            imbs = np.array([p["imbalance"] for p in curve])
            inside = imbs[ds <= d0]
            best = float(inside.min()) if len(inside) else None
            interp = float(np.interp(d0, ds, imbs)) if ds[0] <= d0 <= ds[-1] else None
            rows.append(dict(lookahead=k, k0_delay_budget=base["delay_budget"], k0_displacement=d0, k0_imbalance=i0,
                             at_or_below=best, at_or_below_minus_k0=None if best is None else best - i0,
                             holds=None if best is None else best <= i0,
                             interpolated=interp, interpolated_minus_k0=None if interp is None else interp - i0))
    within = []
    for k, curve in sorted(curves.items()):
        for limit in limits:
            inside = [p for p in curve if p["delay_per_token"] <= limit]
            best = min(inside, key=lambda p: p["imbalance"]) if inside else None
            within.append(dict(lookahead=k, limit=limit, imbalance=None if best is None else best["imbalance"],
                               delay_per_token=None if best is None else best["delay_per_token"],
                               delay_budget=None if best is None else best["delay_budget"]))
    return rows, within


def plot(points: list[dict], dists: list[str], path: Path) -> bool:
    """One panel per distribution: each lookahead's (displacement, imbalance) curve over the
    budgets, the defaults' own budget circled."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cols = min(3, len(dists))
    rows = -(-len(dists) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.8 * rows), squeeze=False)
    for ax in axes.flat[len(dists):]:
        ax.set_visible(False)
    for ax, dist in zip(axes.flat, dists):
        mine = [p for p in points if p["dist"] == dist]
        for i, k in enumerate(sorted({p["lookahead"] for p in mine})):
            curve = sorted((p for p in mine if p["lookahead"] == k), key=lambda p: p["delay_per_token"])
            ax.plot([p["delay_per_token"] for p in curve], [p["imbalance"] for p in curve], "-o", ms=3,
                    color=f"C{i}", label=f"K = {k}")
            own = [p for p in curve if p["delay_budget"] == DEFAULT_BUDGET]
            if own:
                ax.plot(own[0]["delay_per_token"], own[0]["imbalance"], "o", ms=9, mfc="none", color=f"C{i}")
        ax.set_title(dist)
        ax.set_xlabel("displacement per token (steps)")
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("mean forward imbalance")
    axes[0][0].legend(fontsize=8, title=f"circled: delay_budget {DEFAULT_BUDGET:g}", title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt bench lookahead", description=__doc__.splitlines()[0])
    p.add_argument("--dists", default="real,heavy,default,code,prose",
                   help="comma-separated built-in distributions (default real,heavy,default,code,prose)")
    p.add_argument("--seeds", type=lambda s: _numbers(s, "--seeds", int), default=[0, 1, 2],
                   help="comma-separated stream seeds, offsets from DEFAULT_SEED (default 0,1,2)")
    p.add_argument("--lookaheads", type=lambda s: _numbers(s, "--lookaheads", int), default=[0, 2, 4],
                   help="comma-separated lookaheads K, 0 among them (default 0,2,4)")
    p.add_argument("--budgets", type=lambda s: _numbers(s, "--budgets"), default=[0.35, 0.4, 0.45, 0.5, 0.55],
                   help="comma-separated delay budgets, steps per token (default 0.35,0.4,0.45,0.5,0.55)")
    p.add_argument("--limits", type=lambda s: _numbers(s, "--limits"), default=[0.4, 0.45],
                   help="displacement limits of the 'within' rows (default 0.4,0.45)")
    p.add_argument("--steps", type=count, default=200, help="global batches per stream (default 200)")
    p.add_argument("--window", type=count, default=131072, help="training context length (default 131072)")
    p.add_argument("--n-micro", type=count, default=4, help="micro-batches per step (default 4)")
    p.add_argument("--warmup", type=natural, default=20, help="steps left out of the mean imbalance (default 20)")
    p.add_argument("--balance", choices=("fwd_bwd", "fwd"), default="fwd_bwd",
                   help="the cost the packer balances: fwd_bwd (the whole cost model, as the defaults) or fwd "
                        "(the forward phase alone); the imbalance measured is the forward one either way "
                        "(default fwd_bwd)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", default="results/lookahead", help="folder for lookahead.json (default results/lookahead)")
    add_cost_args(p, layout=("tp", "cp", "pp"))
    args = p.parse_args(argv)
    warm_up_compiled()  # numba's compile (or cache load) is no step's planning time
    cost = cost_from_args(args, parser=p)
    plan_cost = forward_cost(cost) if args.balance == "fwd" else None
    dists = [d for d in args.dists.split(",") if d]
    unknown = [d for d in dists if d not in DISTRIBUTIONS]
    if unknown or not dists:
        p.error(f"--dists must name some of {sorted(DISTRIBUTIONS)}, got {args.dists!r}")
    if 0 not in args.lookaheads:
        p.error(f"--lookaheads must include 0 (the reference), got {args.lookaheads}")
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must be more than --warmup ({args.warmup}): the means leave out the warm-up")
    W, N = args.window, args.n_micro
    runs = [(dist, s, k, b) for dist in dists for s in args.seeds for k in args.lookaheads for b in args.budgets]
    streams: list[dict] = []
    batches_of: dict[tuple[str, int], list] = {}
    for dist, s, k, b in progress(runs, desc="runs", enable=not args.no_progress):
        if (dist, s) not in batches_of:
            batches_of = {(dist, s): global_batches(dist, W, N * W, args.steps, seed=DEFAULT_SEED + s)}
        r = run_stream(batches_of[dist, s], cost, N, int(1.25 * W), args.warmup, plan_cost=plan_cost,
                       lookahead=k, delay_budget=b)
        streams.append(dict(dist=dist, seed=s, lookahead=k, delay_budget=b, **r))
    points, equal, within = [], [], []
    for dist in dists:
        mine = []
        for k in args.lookaheads:
            for b in args.budgets:
                rows = [r for r in streams if r["dist"] == dist and r["lookahead"] == k and r["delay_budget"] == b]
                mine.append(dict(dist=dist, lookahead=k, delay_budget=b,
                                 imbalance=float(np.mean([r["imbalance"] for r in rows])),
                                 delay_per_token=float(np.mean([r["delay_per_token"] for r in rows])),
                                 sim=float(np.mean([r["sim"] for r in rows])),
                                 ms_per_batch=float(np.median([r["ms_per_batch"] for r in rows]))))
        rows, best = compare(mine, args.limits)
        points += mine
        equal += [dict(dist=dist, **r) for r in rows]
        within += [dict(dist=dist, **r) for r in best]
    print(f"{len(args.seeds)} streams x {args.steps} steps, N = {N}, planned on the {args.balance} cost; "
          "mean forward imbalance / displacement per token")
    for dist in dists:
        print(f"{dist}:")
        print(f"  {'budget':>6} " + " ".join(f"{'K=' + str(k):>13}" for k in args.lookaheads))
        for b in args.budgets:
            cells = [next(q for q in points if q["dist"] == dist and q["lookahead"] == k and q["delay_budget"] == b)
                     for k in args.lookaheads]
            print(f"  {b:>6.2f} " + " ".join(f"{q['imbalance']:.4f}/{q['delay_per_token']:.3f}".rjust(13)
                                           for q in cells))
        for r in (r for r in equal if r["dist"] == dist and r["k0_delay_budget"] == DEFAULT_BUDGET):
            best = "-" if r["at_or_below"] is None else f"{r['at_or_below']:.4f}"
            interp = "-" if r["interpolated"] is None else f"{r['interpolated']:.4f}"
            print(f"  K={r['lookahead']} at K=0's default displacement {r['k0_displacement']:.3f} "
                  f"(K=0 {r['k0_imbalance']:.4f}): best at or below {best}, interpolated {interp}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lookahead.json").write_text(json.dumps(dict(
        provenance=provenance("lookahead", argv), balance=args.balance, dists=dists, seeds=args.seeds, steps=args.steps, n_micro=N,
        lookaheads=args.lookaheads, budgets=args.budgets, points=points, equal_displacement=equal, within=within,
        streams=streams), indent=2))
    print(f"wrote {out / 'lookahead.json'}")
    if plot(points, dists, out / "lookahead.png"):
        print(f"wrote {out / 'lookahead.png'}")
    return 0
