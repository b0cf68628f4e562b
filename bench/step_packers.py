"""`wlb-opt bench step-packers`: how much a stronger step packer can lower the imbalance.

The streaming packer decides two things each step: which pieces train in it (the release of
held outliers, the carry) and how those pieces are packed into micro-batches (the step
packer, `PackerConfig.method`). This benchmark separates the two.

- **Re-pack** (unchanged displacement): the no-tuning defaults (`PackerConfig()`) plan each
  stream; every step after the warm-up keeps exactly the pieces the defaults placed in it,
  and is packed again by each step packer ("wlb" = Algorithm 1, "wlb_ls", "wlb_fill",
  "wlb_phases" = the defaults' packer). With `--exact-steps K`, K steps spread evenly over
  each stream (after the warm-up) are also solved by CP-SAT (`--time-limit` seconds each;
  the `exact` extra): its best plan and its proven bound on the largest micro-batch bracket
  what ANY step packer can reach on those pieces, in the packing cost. Steps the defaults
  fill to at least `FULL_SHARE` of their token capacity ("full": a step of long outliers
  packed to the caps, its pieces leaving little choice) are reported apart from the others,
  for the defaults and for CP-SAT. One more re-packing, "wlb_fwd", is Algorithm 1
  balancing the forward cost alone (the measured one): it shows what a step packer gains on
  the forward measure by letting the backward phase go.
- **In the loop**: the packer runs with each method as its step packer ("wlb_phases" and
  "wlb" release the same way, on Algorithm 1's packings; "wlb_fill" scores candidates by its
  prediction, wlb_opt/packer/fill_trial.py): imbalance, displacement and CPU ms per step.

Imbalance is `bench parity`'s measure (max / mean forward cost per step, mean over the steps
after a 20-step warm-up), `_bwd` the same of the backward cost (a pipeline pays the heaviest
forward and the heaviest backward); "packing" is max / mean of the packing cost (forward +
backward, what Algorithm 1 balances); `_sim` is what a pipeline pays for both: the step time
of the 1F1B pipeline (`simulate.pipeline_step_time`, the cost model's pp stages, each stage a
pp-th of every micro-batch's forward and backward cost) over its step time with every
micro-batch at the step's mean forward and backward cost. Streams: the scored ones (seeds
DEFAULT_SEED + 0, 1, 2) and the calibration ones (DEFAULT_SEED + 100, 101, 102) on which the
defaults were tuned.

    wlb-opt bench step-packers                              real, default, heavy, code, prose at N = 4
    wlb-opt bench step-packers --quick                      real, 60 steps, one scored and one calibration seed
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from ..solvers.greedy import warm_up_compiled
from .._optional import progress
from ..cost import CostModel
from ..cost_args import add_cost_args, cost_from_args, count, natural, seconds
from ..packer import PackerConfig, WLBPacker, per_step_imbalance
from ..simulate import pipeline_step_time
from ..step_pack import solve_pack
from ..workloads import DEFAULT_SEED, DISTRIBUTIONS, global_batches
from ._provenance import provenance

METHODS = ("wlb", "wlb_ls", "wlb_fill", "wlb_phases")
REPACKED = METHODS + ("wlb_fwd",)
"""The re-packings: the step packers, and Algorithm 1 on the forward cost alone."""
LOOP_METHODS = ("wlb", "wlb_phases", "wlb_fill")
SCORED, CALIBRATION = (0, 1, 2), (100, 101, 102)
FULL_SHARE = 0.99
"""A step is "full" when its placed tokens reach this share of n_micro x max_tokens."""


def _has_exact() -> bool:
    try:
        import ortools  # noqa: F401
    except ImportError:
        return False
    return True


def forward_cost(cost: CostModel) -> CostModel:
    """`cost` with every backward coefficient zero: planning with it balances the forward cost
    alone (its "fwd_bwd" cost is the forward one)."""
    return dataclasses.replace(cost, coef={"fwd": dict(cost.coef["fwd"]), "bwd": dict.fromkeys(cost.coef["bwd"], 0.0)})


def pipeline_ratio(plan, cost: CostModel, pp: int) -> float:
    """Step time of `plan`'s micro-batches through a 1F1B pipeline of `pp` stages (each stage a
    pp-th of every micro-batch's forward and backward cost) over the step time of the same
    pipeline with every micro-batch at the mean forward and backward cost."""
    mbs = list(plan.micro_batches)
    fwd = np.array([cost.micro_batch_cost(plan.lengths[mb], "fwd") for mb in mbs]) / pp
    bwd = np.array([cost.micro_batch_cost(plan.lengths[mb], "bwd") for mb in mbs]) / pp
    step = pipeline_step_time(np.tile(fwd, (pp, 1)), np.tile(bwd, (pp, 1)))
    even = pipeline_step_time(np.full((pp, len(mbs)), fwd.mean()), np.full((pp, len(mbs)), bwd.mean()))
    return step / even


def repack_stream(batches, cost, n_micro: int, max_tokens: int, warmup: int, exact_steps: int,
                  time_limit: float) -> dict:
    """Re-pack each step of the defaults' plans with every method (module docstring)."""
    packer = WLBPacker(n_micro, max_tokens, cost, config=PackerConfig())
    plans = [packer.pack(*batch) for batch in batches]
    plans = [plan for plan in plans if plan is not None][warmup:]
    fwd = {m: [] for m in ("defaults", *REPACKED)}
    bwd = {m: [] for m in REPACKED}
    packing = {m: [] for m in REPACKED}
    sim = {m: [] for m in ("defaults", *REPACKED)}
    pp = cost.degree("pp")
    forward_only = forward_cost(cost)
    exact = dict(steps=0, wlb=[], cpsat=[], bound=[], full=[])
    exact_at = set(np.linspace(0, len(plans) - 1, exact_steps).round().astype(int).tolist()) \
        if exact_steps and plans else set()
    full = []  # whether each step re-packed is full (FULL_SHARE)
    for k, plan in enumerate(plans):
        placed = np.concatenate(plan.micro_batches) if plan.micro_batches else np.zeros(0, np.int64)
        if not len(placed):
            continue
        lengths = plan.lengths[placed]
        full.append(is_full(plan))
        fwd["defaults"].append(per_step_imbalance(plan, cost, "fwd"))
        sim["defaults"].append(pipeline_ratio(plan, cost, pp))
        for m in REPACKED:
            if m == "wlb_fwd":
                q = solve_pack(lengths, n_micro, max_tokens, forward_only, "wlb")
                if len(q.deferred):  # it must place what the others place: then Algorithm 1's plan
                    q = solve_pack(lengths, n_micro, max_tokens, cost, "wlb")
            else:
                q = solve_pack(lengths, n_micro, max_tokens, cost, m)
            fwd[m].append(per_step_imbalance(q, cost, "fwd"))
            bwd[m].append(per_step_imbalance(q, cost, "bwd"))
            packing[m].append(q.imbalance if m != "wlb_fwd" else per_step_imbalance(q, cost, "fwd_bwd"))
            sim[m].append(pipeline_ratio(q, cost, pp))
        if k in exact_at:
            q = solve_pack(lengths, n_micro, max_tokens, cost, "cpsat", time_limit=time_limit)
            alg1 = solve_pack(lengths, n_micro, max_tokens, cost, "wlb")
            mean = float(q.loads.mean())
            exact["steps"] += 1
            exact["full"].append(full[-1])
            exact["wlb"].append(alg1.imbalance)
            exact["cpsat"].append(q.imbalance)
            exact["bound"].append(q.info.bound / mean if q.info.bound is not None else float("nan"))
    row = {f"{m}_imbalance": float(np.mean(v)) for m, v in fwd.items()}
    row |= {f"{m}_bwd": float(np.mean(v)) for m, v in bwd.items()}
    row |= {f"{m}_packing": float(np.mean(v)) for m, v in packing.items()}
    row |= {f"{m}_sim": float(np.mean(v)) for m, v in sim.items()}
    row["steps"] = len(fwd["wlb"])
    for _ in packer.drain():  # the pieces still queued are trained, and displaced, in the drain (as `parity`)
        pass
    row["displacement_per_token"] = float(packer.stats()["displacement_per_token"])
    if exact["steps"]:
        row |= dict(exact_steps=exact["steps"], exact_wlb_packing=float(np.mean(exact["wlb"])),
                    exact_cpsat_packing=float(np.mean(exact["cpsat"])),
                    exact_bound_packing=float(np.nanmean(exact["bound"])))
    # full steps apart: the defaults' forward imbalance (the stream's mean is the share-weighted
    # mean of the two), and the packing imbalance of Algorithm 1, CP-SAT and its bound
    full = np.array(full, dtype=bool)
    defaults = np.array(fwd["defaults"])
    was_full = np.array(exact["full"], dtype=bool)
    regimes = {}
    for name, steps_in, exact_in in (("full", full, was_full), ("other", ~full, ~was_full)):
        regimes[name] = dict(steps=int(steps_in.sum()), defaults_imbalance=_mean_or_none(defaults[steps_in]),
                             exact_steps=int(exact_in.sum()),
                             **{f"exact_{key}_packing": _mean_or_none(np.array(exact[key], dtype=np.float64)[exact_in])
                                for key in ("wlb", "cpsat", "bound")})
    row["regimes"] = regimes
    return row


def is_full(plan) -> bool:
    """Whether a step's plan places at least `FULL_SHARE` of its micro-batches' token capacity."""
    placed = sum(int(np.add.reduce(plan.lengths[mb])) for mb in plan.micro_batches)
    return placed >= FULL_SHARE * len(plan.micro_batches) * plan.max_tokens


def _mean_or_none(values: np.ndarray) -> float | None:
    values = values[~np.isnan(values)]
    return float(values.mean()) if len(values) else None


def regime_summary(repack: list[dict]) -> list[dict]:
    """Per distribution, kind of stream and regime ("full": steps the defaults fill to
    `FULL_SHARE` of their token capacity; "other"), over the streams: the share of the steps,
    the defaults' mean forward imbalance on them, and on the steps CP-SAT solved, the packing
    imbalance of Algorithm 1, of CP-SAT's plan and of its bound (each step weighs one)."""
    out = []
    for dist, kind in dict.fromkeys((r["dist"], r["streams"]) for r in repack):
        rows = [r["regimes"] for r in repack if r["dist"] == dist and r["streams"] == kind]
        total = sum(g["steps"] for r in rows for g in r.values())
        for name in ("full", "other"):
            parts = [r[name] for r in rows]
            steps = sum(p["steps"] for p in parts)
            exact_steps = sum(p["exact_steps"] for p in parts)

            def weighted(key, weight):
                pairs = [(p[key], p[weight]) for p in parts if p[key] is not None and p[weight]]
                n = sum(w for _, w in pairs)
                return sum(v * w for v, w in pairs) / n if n else None

            out.append(dict(dist=dist, streams=kind, steps=name, share=steps / total if total else 0.0,
                            defaults_imbalance=weighted("defaults_imbalance", "steps"), exact_steps=exact_steps,
                            **{f"exact_{key}_packing": weighted(f"exact_{key}_packing", "exact_steps")
                               for key in ("wlb", "cpsat", "bound")}))
    return out


_DISTS = ("real", "default", "heavy", "code", "prose")


def loop_stream(batches, cost, n_micro: int, max_tokens: int, warmup: int, method: str) -> dict:
    """The packer with `method` as its step packer: imbalance (forward, backward), displacement,
    CPU ms per step."""
    packer = WLBPacker(n_micro, max_tokens, cost, config=PackerConfig(method=method))
    plans, cpu = [], []
    for batch in batches:
        t0 = time.process_time()
        plan = packer.pack(*batch)
        if plan is not None:  # with lookahead the first K calls plan nothing
            cpu.append(time.process_time() - t0)
        plans.append(plan)
    # one step per global batch, as `parity` measures: the drain's first K plans are the last
    # K batches' steps (lookahead), what it plans after them only empties the queues
    plans = [plan for plan in plans if plan is not None] + list(packer.drain())[:packer.lookahead]
    imbs = [per_step_imbalance(plan, cost, "fwd") for plan in plans]
    bwds = [per_step_imbalance(plan, cost, "bwd") for plan in plans]
    return dict(imbalance=float(np.mean(imbs[warmup:] or imbs)), imbalance_bwd=float(np.mean(bwds[warmup:] or bwds)),
                displacement_per_token=float(packer.stats()["displacement_per_token"]),
                median_ms=1e3 * float(np.median(cpu)), p99_ms=1e3 * float(np.percentile(cpu, 99)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt bench step-packers", description=__doc__.splitlines()[0])
    p.add_argument("--dists", default=None,
                   help=f"comma-separated length distributions (default {','.join(_DISTS)}; --quick real)")
    p.add_argument("--n-micro", type=count, default=4, help="micro-batches per step (default 4)")
    p.add_argument("--steps", type=count, default=None, help="global batches per stream (default 200; --quick 60)")
    p.add_argument("--window", type=count, default=131072, help="training context length (default 131072)")
    p.add_argument("--warmup", type=natural, default=20, help="steps left out of the means (default 20)")
    p.add_argument("--exact-steps", type=natural, default=None,
                   help="steps per stream also solved by CP-SAT (default 10, --quick 3; 0: none; needs the exact extra)")
    p.add_argument("--time-limit", type=seconds, default=5.0, help="CP-SAT seconds per step (default 5)")
    p.add_argument("--quick", action="store_true",
                   help="seeds 0 and 100; real, 60 steps, 3 exact steps (unless given)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", default=None, help="folder for step_packers.json (default: print only)")
    add_cost_args(p, layout=("tp", "cp", "pp"))
    args = p.parse_args(argv)
    warm_up_compiled()  # numba's compile (or cache load) is no step's planning time
    dists = args.dists.split(",") if args.dists is not None else (["real"] if args.quick else list(_DISTS))
    bad = [d for d in dists if d not in DISTRIBUTIONS]
    if bad:
        p.error(f"unknown distributions {bad}; valid: {', '.join(sorted(DISTRIBUTIONS))}")
    steps = args.steps or (60 if args.quick else 200)
    if steps <= args.warmup:
        p.error(f"--steps ({steps}) must be more than --warmup ({args.warmup}): the means leave out the warm-up")
    seeds = [(0, "scored"), (100, "calibration")] if args.quick else \
        [(s, "scored") for s in SCORED] + [(s, "calibration") for s in CALIBRATION]
    exact_steps = args.exact_steps if args.exact_steps is not None else (3 if args.quick else 10)
    if exact_steps and not _has_exact():
        exact_steps = 0
        print("ortools is not installed (the `exact` extra): no CP-SAT bracket")
    cost = cost_from_args(args, parser=p)
    N, W = args.n_micro, args.window
    max_tokens = int(1.25 * W)
    repack, loop = [], []
    jobs = [(d, s, kind) for d in dists for s, kind in seeds]
    for dist, seed, kind in progress(jobs, desc="streams", enable=not args.no_progress):
        batches = global_batches(dist, W, N * W, steps, seed=DEFAULT_SEED + seed)
        repack.append(dict(dist=dist, seed=seed, streams=kind, n_micro=N,
                           **repack_stream(batches, cost, N, max_tokens, args.warmup, exact_steps, args.time_limit)))
        for method in LOOP_METHODS:
            loop.append(dict(dist=dist, seed=seed, streams=kind, n_micro=N, method=method,
                             **loop_stream(batches, cost, N, max_tokens, args.warmup, method)))
    summary = []
    for dist in dists:
        for kind in ("scored", "calibration"):
            rows = [r for r in repack if r["dist"] == dist and r["streams"] == kind]
            if not rows:
                continue
            keys = [k for k in rows[0] if k.endswith(("_imbalance", "_bwd", "_packing", "_sim"))]
            out = dict(dist=dist, streams=kind, seeds=len(rows), n_micro=N,
                       displacement_per_token=float(np.mean([r["displacement_per_token"] for r in rows])))
            out |= {k: float(np.mean([r[k] for r in rows if k in r])) for k in keys}
            for method in LOOP_METHODS:
                lrows = [r for r in loop if r["dist"] == dist and r["streams"] == kind and r["method"] == method]
                out[f"loop_{method}"] = (f"{np.mean([r['imbalance'] for r in lrows]):.4f} "
                                         f"(bwd {np.mean([r['imbalance_bwd'] for r in lrows]):.4f}) / "
                                         f"{np.mean([r['displacement_per_token'] for r in lrows]):.3f} / "
                                         f"{np.median([r['median_ms'] for r in lrows]):.2f} ms")
            summary.append(out)
    print(f"N={N}, {steps} steps; re-pack at unchanged pieces: mean imbalance / backward (packing "
          "imbalance) sim = 1F1B step time over balanced; in the loop: imbalance (backward) / displacement / "
          "median CPU ms")
    for r in summary:
        cells = " ".join(f"{m}={r[m + '_imbalance']:.4f}/{r[m + '_bwd']:.4f}({r[m + '_packing']:.4f}) "
                         f"sim {r[m + '_sim']:.4f}" for m in REPACKED)
        exact = (f" | CP-SAT on {exact_steps}/stream: wlb {r['exact_wlb_packing']:.4f}, cpsat "
                 f"{r['exact_cpsat_packing']:.4f}, bound {r['exact_bound_packing']:.4f}"
                 if "exact_cpsat_packing" in r else "")
        print(f"{r['dist']:>7} {r['streams']:>11} disp {r['displacement_per_token']:.3f}: defaults "
              f"{r['defaults_imbalance']:.4f} sim {r['defaults_sim']:.4f} {cells}{exact}")
        print(f"{'':>20} loop " + ", ".join(f"{m} {r['loop_' + m]}" for m in LOOP_METHODS))
    print(f"steps filled to {FULL_SHARE:g} of the token capacity (full) and the others: share, defaults' imbalance; "
          "on the CP-SAT steps, packing imbalance of wlb / cpsat / bound")
    for g in regime_summary(repack):
        exact = " / ".join("-" if g[f"exact_{k}_packing"] is None else f"{g[f'exact_{k}_packing']:.4f}"
                           for k in ("wlb", "cpsat", "bound"))
        imb = "-" if g["defaults_imbalance"] is None else f"{g['defaults_imbalance']:.4f}"
        print(f"{g['dist']:>7} {g['streams']:>11} {g['steps']:>5}: share {g['share']:.3f}, defaults {imb}; "
              f"{g['exact_steps']} CP-SAT steps: {exact}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        data = dict(provenance=provenance("step_packers", argv), summary=summary, regimes=regime_summary(repack),
                    repack=repack, loop=loop)
        (out / "step_packers.json").write_text(json.dumps(data, indent=2))
        print(f"wrote {out / 'step_packers.json'}")
    return 0
