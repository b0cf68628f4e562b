"""`wlb-opt bench cost-check`: the analytic cost model against a measured one.

    wlb-opt bench cost-check --measured docs/results/profile_7b/cost_7b.json --hardware h200

The planner weighs every document by its cost model. `CostModel.analytic` derives one from
FLOPs, bytes and a hardware preset; `wlb-opt profile` fits one to timings on the machine.
This benchmark compares the two for the measured model's own architecture and layout (one
GPU, as `wlb-opt profile` measures): 

- `coefficients`: each term per phase (seconds per causal pair, per token, per document,
  per micro-batch), analytic over measured;
- `mixes`: the cost of a micro-batch of `--window` tokens split into equal documents, from
  one document to documents of 128 tokens, under each model, forward and backward;
- `planning`: the default streaming packer run twice on the same stream, planning once with
  each model, both plans' mean per-step imbalance scored with the measured model (forward
  and backward, after a 20-step warm-up) beside each run's displacement per token: what
  planning with the analytic model costs when the measured one is the truth.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from ..cost import CostModel
from ..cost_args import count
from ..packer import PackerConfig, WLBPacker, per_step_imbalance
from ..specs import HardwareSpec, ParallelSpec
from ..workloads import DEFAULT_SEED, DISTRIBUTIONS, global_batches
from ._provenance import provenance
from .data import run_packer

TERMS = ("attn", "linear", "doc_const", "mb_const")
"""The coefficients compared (communication is zero on one GPU)."""


def analytic_twin(measured: CostModel, hardware: str) -> CostModel:
    """The analytic model of `measured`'s architecture and layout on the `hardware` preset."""
    if measured.model is None:
        raise ValueError("the measured cost model names no ModelSpec (its JSON has no 'model'); "
                         "profile with `wlb-opt profile --model ...` or `--hf-config ...`")
    return CostModel.analytic(measured.model, measured.parallel or ParallelSpec(), HardwareSpec.preset(hardware))


def coefficient_rows(analytic: CostModel, measured: CostModel) -> list[dict]:
    rows = []
    for phase in ("fwd", "bwd"):
        for term in TERMS:
            a, m = float(analytic.coef[phase][term]), float(measured.coef[phase][term])
            rows.append(dict(phase=phase, term=term, analytic=a, measured=m, analytic_over_measured=a / m if m else None))
    return rows


def mix_rows(analytic: CostModel, measured: CostModel, window: int) -> list[dict]:
    rows = []
    doc = window
    while doc >= 128:
        lengths = np.full(window // doc, doc, dtype=np.int64)
        row = dict(tokens=int(lengths.sum()), documents=len(lengths), document_tokens=doc)
        for phase in ("fwd", "bwd"):
            a, m = analytic.micro_batch_cost(lengths, phase), measured.micro_batch_cost(lengths, phase)
            row.update({f"{phase}_analytic_s": a, f"{phase}_measured_s": m, f"{phase}_analytic_over_measured": a / m})
        rows.append(row)
        doc //= 2
    return rows


def planning_rows(analytic: CostModel, measured: CostModel, dist: str, window: int, n_micro: int, steps: int,
                  seeds: list[int], warmup: int = 20) -> list[dict]:
    """Per planning model: the means over the streams `seeds` (DEFAULT_SEED + each)."""
    rows = []
    for name, planner in (("analytic", analytic), ("measured", measured)):
        per_seed = []
        for seed in seeds:
            batches = global_batches(dist, window, n_micro * window, steps, seed=DEFAULT_SEED + seed)
            run = run_packer(WLBPacker(n_micro, int(1.25 * window), planner, config=PackerConfig()), batches)
            plans = [plan for plan in run.plans if plan is not None]
            imbs = {phase: [per_step_imbalance(plan, measured, phase) for plan in plans] for phase in ("fwd", "bwd")}
            per_seed.append(dict(displacement_per_token=float(run.stats["displacement_per_token"]),
                                 **{f"{ph}_imbalance": float(np.mean(v[warmup:] or v)) for ph, v in imbs.items()}))
        rows.append(dict(dist=dist, planned_with=name, scored_with="measured", seeds=len(seeds), steps=steps,
                         n_micro=n_micro, window=window,
                         **{key: float(np.mean([r[key] for r in per_seed])) for key in per_seed[0]}))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt bench cost-check", description=__doc__.splitlines()[0])
    p.add_argument("--measured", type=Path, required=True, help="a CostModel JSON written by `wlb-opt profile`")
    p.add_argument("--hardware", default="h200", help="HardwareSpec preset of the analytic model (default h200)")
    p.add_argument("--window", type=count, default=131072,
                   help="training context: the mixes' micro-batch and the planning stream's window (default 131072, "
                        "as the other benchmarks)")
    p.add_argument("--dist", default="real", choices=sorted(DISTRIBUTIONS), help="planning stream (default real)")
    p.add_argument("--n-micro", type=count, default=4, help="micro-batches per step (default 4)")
    p.add_argument("--steps", type=count, default=200, help="planning steps per stream (default 200)")
    p.add_argument("--seeds", default="300,301,302",
                   help="comma-separated planning streams, offsets from DEFAULT_SEED (default 300,301,302: not the "
                        "calibration seeds)")
    p.add_argument("--out", type=Path, default=Path("results/cost_check"), help="folder for cost_check.json")
    args = p.parse_args(argv)
    if args.steps <= 20:  # the planning rows' means leave out a 20-step warm-up
        p.error(f"--steps ({args.steps}) must be more than the 20-step warm-up the imbalance leaves out")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        p.error(f"--seeds must be a comma list of integers, got {args.seeds!r}")
    if not seeds or min(seeds) < 0:
        p.error(f"--seeds must name at least one stream, each >= 0, got {args.seeds!r}")
    try:
        measured = CostModel.load(args.measured)
        analytic = analytic_twin(measured, args.hardware)
    except (OSError, ValueError, KeyError) as exc:
        p.error(str(exc))
    window = args.window
    result = dict(provenance=provenance("cost_check", argv), measured=str(args.measured), hardware=args.hardware,
                  model=measured.model.name, measured_on=measured.meta.get("device"),
                  coefficients=coefficient_rows(analytic, measured), mixes=mix_rows(analytic, measured, window),
                  planning=planning_rows(analytic, measured, args.dist, window, args.n_micro, args.steps, seeds))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cost_check.json").write_text(json.dumps(result, indent=1))
    print(f"{measured.model.name}: analytic ({args.hardware}) over measured ({args.measured})")
    for r in result["coefficients"]:
        ratio = "-" if r["analytic_over_measured"] is None else f"{r['analytic_over_measured']:.3f}"
        print(f"  {r['phase']:>3} {r['term']:<9} {r['analytic']:.3g} / {r['measured']:.3g} = {ratio}")
    for r in result["mixes"]:
        print(f"  {r['documents']:>4} x {r['document_tokens']:>6} tokens: fwd {r['fwd_analytic_over_measured']:.3f}, "
              f"bwd {r['bwd_analytic_over_measured']:.3f}")
    for r in result["planning"]:
        print(f"  planned with {r['planned_with']:<8}: imbalance fwd {r['fwd_imbalance']:.4f}, bwd "
              f"{r['bwd_imbalance']:.4f} (measured model), displacement {r['displacement_per_token']:.4f} "
              f"({r['seeds']} streams of {r['steps']} steps)")
    print(f"wrote {args.out / 'cost_check.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
