"""`wlb-opt bench e2e`: simulated end-to-end step time of paper Table 1's eight configurations.

For every configuration (model, window, TP, CP, PP, DP) the same stream of global batches
(dp x pp sequences of `window` tokens each, paper §7.1) is planned by four methods and each
step is simulated (`wlb_opt.simulate.simulate_step`, interleaved 1F1B with 2 chunks per stage):

- plain: Plain-4D. Data-order fixed-length packing ("original"), per-sequence CP.
- fixed: Fixed-4D. Fixed-length greedy on cost ("fixed"), and the better of static per-seq
  and per-doc CP over the run (paper §7.2 reports the better one too).
- wlb:   WLB-LLM. `WLBPacker` (three calibrated outlier queues, release "balance", max_delay 8,
         S_max = 1.25 x window; each step packed by the default step packer, `wlb_phases`:
         Algorithm 1's rule with the forward and backward balanced apart), adaptive CP per
         micro-batch.
- best:  everything else this library has, on top of the wlb packer's stream: the improved
         packing heuristic (re-packs each step's placed documents, kept only if its largest
         load is lower), hybrid CP (never predicted worse than adaptive), micro-batches
         dealt to DP replicas by the simulated step, and the micro-batch order the simulator
         finds fastest.

Throughput is tokens placed / simulated seconds over all steps (the wlb packer's drain
steps included, so no queued outlier escapes the bill); speedup is a throughput ratio.
`--quick` runs all 8 x 4 with few steps; the full run adds the 7B-128K breakdown and the 7B
context sweep. Paper figures (§7.3) are printed beside ours.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .._optional import progress
from ..cost import CostModel
from ..documents import load_lengths, split_documents
from ..plan import PackPlan
from ..simulate import simulate_step
from ..solvers.deal import refine_replicas
from ..specs import HardwareSpec, ModelSpec, ParallelSpec
from ..step_pack import PACK_METHODS, solve_pack
from ..workloads import DEFAULT_SEED, DISTRIBUTIONS, document_stream, global_batches
from .data import carried_plans, run_packer
from ..cost_args import count, natural
from ._provenance import provenance

METHODS = ("plain", "fixed", "wlb", "best")
IMPROVED_METHOD = "wlb_ls"  # the library's improved packing heuristic (the "best" row re-packs with it)
PAPER = dict(avg=1.23, avg_64k=1.15, avg_128k=1.30, b7_128k=1.33, b7_160k=1.40,
             breakdown={"per_doc_cp": 1.02, "adaptive_cp": 1.05, "pp_packing": 1.28, "all": 1.33})
SCHEDULE, VIRTUAL_STAGES = "interleaved", 2


@dataclass(frozen=True)
class Config:
    model: str
    context: int
    tp: int
    cp: int
    pp: int
    dp: int

    @property
    def label(self) -> str:
        return f"{self.model.upper()}-{self.context // 1024}K"

    @property
    def parallel(self) -> ParallelSpec:
        return ParallelSpec(tp=self.tp, cp=self.cp, pp=self.pp, dp=self.dp)


# Paper Table 1 (§7.1).
CONFIGS = (
    Config("550m", 65536, 2, 2, 4, 2), Config("550m", 131072, 2, 4, 4, 1),
    Config("7b", 65536, 4, 2, 4, 1), Config("7b", 131072, 8, 2, 4, 1),
    Config("30b", 65536, 8, 2, 4, 1), Config("30b", 131072, 8, 4, 4, 1),
    Config("70b", 65536, 16, 4, 4, 1), Config("70b", 131072, 16, 4, 4, 1),
)
SWEEP_CONTEXTS = (32768, 65536, 98304, 131072, 163840)


# ---------------------------------------------------------------------- CP shards
def _shards(plan: PackPlan, cfg: Config, cost: CostModel, strategies: tuple[str, ...]) -> list | None:
    """Per micro-batch, the ShardPlan of the strategy with the smallest max over ranks (None
    for an empty micro-batch: it costs its constant); None for cp = 1 (each micro-batch its
    own cost)."""
    from ..shard import solve_shard

    if cfg.cp == 1:
        return None
    out = []
    for mb in plan.micro_batches:
        if not len(mb):
            out.append(None)
            continue
        lengths, offsets = plan.lengths[mb], plan.offsets[mb]
        cands = [solve_shard(lengths, cfg.cp, s, cost, offsets=offsets) for s in strategies]
        out.append(min(cands, key=lambda shard: float(np.max(shard.loads))))
    return out


# ---------------------------------------------------------------------- packing streams
def _fixed_length_plans(batches, cfg: Config, cost: CostModel, method: str) -> list[PackPlan]:
    """Plain-4D / Fixed-4D: one plan per batch, deferred pieces carried to the next one."""
    return [plan for plan, _ in carried_plans(batches, cfg.pp, cfg.context, cost, method, dp=cfg.dp)]


def calibration_sample(cfg: Config, dist: str, seed: int, lengths=None, batches: int = 16) -> np.ndarray:
    """Pieces of an independent draw (other seed) of `batches` global batches from the same
    source: the "small sample of training documents" the paper tunes its thresholds on (§3.2)."""
    tokens = batches * cfg.dp * cfg.pp * cfg.context
    rng_seed = DEFAULT_SEED + 10_000 + seed
    if lengths is not None:
        rng = np.random.default_rng(rng_seed)
        draw = rng.choice(np.asarray(lengths, dtype=np.int64), size=max(16, int(tokens / np.mean(lengths)) + 16))
    else:
        draw = document_stream(tokens, dist, rng_seed)
    return split_documents(draw, cfg.context)[0]


def _wlb_plans(batches, cfg: Config, cost: CostModel, seed: int, sample=None) -> tuple[list[PackPlan], dict]:
    from ..packer import PackerConfig, WLBPacker

    config = PackerConfig(thresholds="auto", n_queues=3, max_delay=8, release="balance", delay_budget=0.75,
                          balance_tolerance=1.02)
    packer = WLBPacker(cfg.pp, int(1.25 * cfg.context), cost, dp=cfg.dp, seed=seed, config=config)
    if sample is not None:
        packer.calibrate(sample, tokens_per_batch=cfg.dp * cfg.pp * cfg.context, n_batches=32)
    run = run_packer(packer, batches)
    return run.plans + run.drained, run.streamed_stats  # stats before the drain: the steady stream's delay


def _repack(plan: PackPlan, cfg: Config, cost: CostModel, method: str | None) -> PackPlan:
    """Re-pack the documents `plan` placed with the improved heuristic; keep the better plan.

    Only placed pieces are re-packed, so the packer's queues and carry stay valid. The new
    plan covers those pieces only (deferred ones are the packer's business)."""
    if method is None or not plan.micro_batches:
        return plan
    placed = np.concatenate(plan.micro_batches)
    new = solve_pack(plan.lengths[placed], cfg.pp, plan.max_tokens, cost, method, ids=plan.doc_ids[placed],
                     offsets=plan.offsets[placed], dp=cfg.dp)
    if len(new.deferred) or new.loads.max() >= plan.loads.max():
        return plan
    return new


def _deal_by_simulation(plan: PackPlan, shards, cfg: Config, cost: CostModel) -> PackPlan:
    """DP refinement: a copy of `plan` whose micro-batches are swapped between replicas while
    the simulated step (no order search) gets shorter (`solvers.deal.refine_replicas`; the
    solvers never import the simulator, so the step-time callable is built here)."""
    if cfg.dp == 1:
        return plan

    def step_time(replica_of: np.ndarray) -> float:
        return simulate_step(plan.replace(replica_of=replica_of), shards, cost, cfg.parallel).step_time_s

    return plan.replace(replica_of=refine_replicas(plan.replica_of, step_time))


# ---------------------------------------------------------------------- evaluation
def _summarise(cfg: Config, method: str, results, extra: dict | None = None, steady: int | None = None,
               plans=None) -> dict:
    """Throughput over every step (drain steps included); imbalances and bubbles over the first
    `steady` steps: the end-of-data drain of a short benchmark stream (a step or two emptying
    the outlier queues, paid once per training run) would otherwise dominate the means."""
    times = np.array([r.step_time_s for r in results])
    tokens = np.array([r.tokens for r in results])
    all_results, results = results, results[:steady] if steady else results
    row = dict(model=cfg.model, context=cfg.context, config=cfg.label, tp=cfg.tp, cp=cfg.cp, pp=cfg.pp,
               dp=cfg.dp, method=method, steps=len(all_results), drain_steps=len(all_results) - len(results),
               step_time_s=float(times.mean()),
               tokens_per_s=float(tokens.sum() / times.sum()),
               imbalance_pp=float(np.mean([r.imbalance_pp for r in results])),
               imbalance_cp=float(np.mean([r.imbalance_cp for r in results])),
               bubble_fraction=float(np.mean([np.mean([p.bubble_fraction for p in r.pipelines]) for r in results])))
    if plans is not None:  # the packer's own view: max / mean of plan.loads (CP assumed even)
        row["imbalance_pp_plan"] = float(np.mean([p.imbalance for p in plans[: len(results)]]))
    row.update(extra or {})
    return row


def _simulate(plans, cfg, cost, strategies, *, search_order=False, refine_dp=False, improve=None):
    results = []
    for plan in plans:
        plan = _repack(plan, cfg, cost, improve) if improve else plan
        shards = _shards(plan, cfg, cost, strategies)
        if refine_dp:
            plan = _deal_by_simulation(plan, shards, cfg, cost)
        results.append(simulate_step(plan, shards, cost, cfg.parallel, schedule=SCHEDULE,
                                     virtual_stages=VIRTUAL_STAGES, search_order=search_order, use_dag=True))
    return results


def run_config(cfg: Config, batches, hardware: str = "h100", methods=METHODS, seed: int = 0,
               cost: CostModel | None = None, tick=None, sample=None) -> tuple[list[dict], dict]:
    """All methods on one configuration. Returns (rows, {method: (plans, results)})."""
    cost = cost or CostModel.analytic(ModelSpec.preset(cfg.model), cfg.parallel, HardwareSpec.preset(hardware))
    rows, detail = [], {}
    wlb_plans = stats = None
    for method in methods:
        extra = {}
        if method == "plain":
            plans = _fixed_length_plans(batches, cfg, cost, "original")
            results = _simulate(plans, cfg, cost, ("per_seq",))
            extra["cp_strategy"] = "per_seq"
        elif method == "fixed":
            plans = _fixed_length_plans(batches, cfg, cost, "fixed")
            options = {s: _simulate(plans, cfg, cost, (s,)) for s in ("per_seq", "per_doc")}
            best_s = min(options, key=lambda s: sum(r.step_time_s for r in options[s]) /
                         max(1, sum(r.tokens for r in options[s])))
            results = options[best_s]
            extra["cp_strategy"] = best_s
        elif method in ("wlb", "best"):
            if wlb_plans is None:
                wlb_plans, stats = _wlb_plans(batches, cfg, cost, seed, sample)
            plans = wlb_plans
            extra.update(delay_per_token=stats["delay_per_token"], thresholds=stats["thresholds"])
            if method == "wlb":
                results = _simulate(plans, cfg, cost, ("adaptive",))
                extra["cp_strategy"] = "adaptive"
            else:  # plans are frozen: the refinements below make new plans, wlb's stay as they are
                improve = IMPROVED_METHOD if IMPROVED_METHOD in PACK_METHODS else None
                results = _simulate(plans, cfg, cost, ("hybrid",), search_order=True,
                                    refine_dp=True, improve=improve)
                extra.update(cp_strategy="hybrid", pack=improve or "wlb",
                             extras="order search" + (", dp refinement" if cfg.dp > 1 else ""))
        else:
            raise ValueError(f"unknown e2e method {method!r}; valid: {METHODS}")
        rows.append(_summarise(cfg, method, results, extra, steady=len(batches),
                               plans=None if method == "best" else plans))
        detail[method] = (plans, results)
        if tick:
            tick()
    base = next((r["tokens_per_s"] for r in rows if r["method"] == "plain"), None)
    for r in rows:
        r["speedup_vs_plain"] = r["tokens_per_s"] / base if base else None
    return rows, detail


def make_batches(cfg: Config, steps: int, dist: str, seed: int, lengths=None):
    """`steps` global batches of dp x pp x window tokens: from `lengths` (a user's file, in a
    seeded random order, repeated as needed) or sampled from the distribution `dist`."""
    tokens = cfg.dp * cfg.pp * cfg.context
    stream = None
    if lengths is not None:
        rng = np.random.default_rng(seed)
        lengths = np.asarray(lengths, dtype=np.int64)
        reps = -(-(tokens * steps + cfg.context) // int(lengths.sum()))
        stream = np.concatenate([rng.permutation(lengths) for _ in range(max(1, reps))])
    return global_batches(dist, cfg.context, tokens, steps, seed=DEFAULT_SEED + seed, lengths=stream)


# ---------------------------------------------------------------------- breakdown and sweep
def breakdown(steps: int, dist: str, seed: int, lengths=None, hardware: str = "h100") -> list[dict]:
    """7B-128K: per-doc CP alone, adaptive CP alone, PP packing alone, all together."""
    cfg = CONFIGS[3]
    cost = CostModel.analytic(ModelSpec.preset(cfg.model), cfg.parallel, HardwareSpec.preset(hardware))
    batches = make_batches(cfg, steps, dist, seed, lengths)
    plain = _fixed_length_plans(batches, cfg, cost, "original")
    wlb_plans, _ = _wlb_plans(batches, cfg, cost, seed, calibration_sample(cfg, dist, seed, lengths))
    cases = {"plain": (plain, "per_seq"), "per_doc_cp": (plain, "per_doc"), "adaptive_cp": (plain, "adaptive"),
             "pp_packing": (wlb_plans, "per_seq"), "all": (wlb_plans, "adaptive")}
    rows = [_summarise(cfg, name, _simulate(plans, cfg, cost, (s,)), steady=len(batches), plans=plans)
            for name, (plans, s) in cases.items()]
    for r in rows:
        r["speedup_vs_plain"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
        r["paper"] = PAPER["breakdown"].get(r["method"])
    return rows


def sweep(steps: int, dist: str, seed: int, lengths=None, hardware: str = "h100") -> list[dict]:
    """7B, (8, 2, 4, 1), windows 32K..160K: plain, wlb, best."""
    rows = []
    for ctx in SWEEP_CONTEXTS:
        cfg = Config("7b", ctx, 8, 2, 4, 1)
        r, _ = run_config(cfg, make_batches(cfg, steps, dist, seed, lengths), hardware, ("plain", "wlb", "best"),
                          seed, sample=calibration_sample(cfg, dist, seed, lengths))
        rows.extend(r)
    return rows


# ---------------------------------------------------------------------- output
def print_table(rows: list[dict]) -> None:
    print(f"{'config':>9} {'(tp,cp,pp,dp)':>13} {'method':>6} {'step s':>7} {'tok/s':>9} {'speedup':>7} "
          f"{'PP imb':>6} {'CP imb':>6} {'bubble':>6}  CP")
    for r in rows:
        print(f"{r['config']:>9} {str((r['tp'], r['cp'], r['pp'], r['dp'])):>13} {r['method']:>6} "
              f"{r['step_time_s']:>7.3f} {r['tokens_per_s']:>9.0f} {r['speedup_vs_plain']:>6.2f}x "
              f"{r['imbalance_pp']:>6.3f} {r['imbalance_cp']:>6.3f} {r['bubble_fraction']:>6.1%}  "
              f"{r.get('cp_strategy', '')}")


def paper_comparison(rows: list[dict]) -> list[str]:
    def avg(method, ctx=None):
        xs = [r["speedup_vs_plain"] for r in rows if r["method"] == method and (ctx is None or r["context"] == ctx)]
        return float(np.mean(xs)) if xs else float("nan")

    b7 = [r for r in rows if r["config"] == "7B-128K"]
    get = lambda m: next((r["speedup_vs_plain"] for r in b7 if r["method"] == m), float("nan"))  # noqa: E731
    n_configs = len({r["config"] for r in rows})  # the paper's averages are over its eight
    lines = [f"wlb over plain, average of {n_configs}: ours {avg('wlb'):.2f}x (paper 1.23x, of 8); best "
             f"{avg('best'):.2f}x; fixed {avg('fixed'):.2f}x (paper ~1.03x)"]
    by_context = [f"{label}: ours {avg('wlb', ctx):.2f}x (paper {paper})"
                  for label, ctx, paper in (("64K", 65536, "1.15x"), ("128K", 131072, "1.30x"))
                  if any(r["context"] == ctx for r in rows)]
    if by_context:
        lines.append("  " + "   ".join(by_context))
    if b7:
        lines.append(f"7B-128K: wlb {get('wlb'):.2f}x (paper 1.33x), best {get('best'):.2f}x")
    return lines


def plot_speedups(rows: list[dict], path: Path, title: str) -> None:
    from .._optional import require

    matplotlib = require("matplotlib", "the e2e plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows))
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    colours = {"plain": "#9e9e9e", "fixed": "#64b5f6", "wlb": "#ef6c00", "best": "#2e7d32"}
    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.8 / len(methods)
    x = np.arange(len(configs))
    for k, m in enumerate(methods):
        ys = [next(r["speedup_vs_plain"] for r in rows if r["config"] == c and r["method"] == m) for c in configs]
        bars = ax.bar(x + (k - (len(methods) - 1) / 2) * width, ys, width, label=m, color=colours.get(m))
        if m in ("wlb", "best"):
            ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(x, configs)
    ax.set_ylabel("throughput speedup over Plain-4D (x)")
    ax.set_xlabel("model - context window (paper Table 1 layouts)")
    lo = min(r["speedup_vs_plain"] for r in rows)
    ax.set_ylim(min(0.9, lo - 0.05), max(r["speedup_vs_plain"] for r in rows) * 1.1)
    ax.set_title(title)
    ax.legend(ncol=len(methods), loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_gantt(panels: list[tuple[str, object]], path: Path, title: str) -> None:
    """panels: (label, StepResult); one row per stage, replica 0's pipeline."""
    from .._optional import require

    matplotlib = require("matplotlib", "the e2e plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10")
    t_max = max(res.step_time_s for _, res in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 1.0 + 1.1 * len(panels) * 2), sharex=True)
    axes = np.atleast_1d(axes)
    for ax, (label, res) in zip(axes, panels):
        sim = res.pipelines[0]
        pp = len(sim.stage_busy_s)
        order = res.orders[0]
        for r in sim.timeline:
            mb = order[r["micro_batch"]]
            colour = cmap(mb % 10)
            hatch = "" if r["phase"] == "F" else "//"
            ax.barh(r["stage"], r["end_s"] - r["start_s"], left=r["start_s"], height=0.8, color=colour,
                    alpha=0.55 if r["phase"] == "F" else 0.9, hatch=hatch, edgecolor="black", linewidth=0.4)
            if r["end_s"] - r["start_s"] > 0.025 * t_max:
                ax.text((r["start_s"] + r["end_s"]) / 2, r["stage"], f"{r['phase']}{mb}", ha="center",
                        va="center", fontsize=7)
        ax.set_yticks(range(pp), [f"stage {s}" for s in range(pp)])
        ax.invert_yaxis()
        ax.axvline(res.step_time_s, color="red", lw=1)
        ax.set_title(f"{label}: {res.step_time_s:.2f} s for {res.tokens / 1e3:.0f}K tokens "
                     f"({res.tokens / res.step_time_s / 1e3:.0f}K tokens/s), bubble {sim.bubble_fraction:.0%}, "
                     f"PP imbalance {res.imbalance_pp:.2f}", fontsize=9, loc="left")
    axes[-1].set_xlabel("time (s); F = forward (light), B = backward (hatched); label = micro-batch")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def gantt_step(detail: dict, tokens: int, tolerance: float = 0.10) -> int:
    """The one steady step every method's panel shows: among the steps at which WLB-LLM places
    the global batch's `tokens` within `tolerance` (Plain-4D places a full batch every step;
    if no WLB step is that close, those nearest to it), the one at which every method's
    throughput is closest to its own throughput over the whole run (the sum of relative
    deviations; ties: the earlier step). A representative step at (near) equal tokens, not
    the fastest or the slowest of either method."""
    steady = len(detail["plain"][1])
    methods = ("plain", "wlb")
    rate = {m: sum(r.tokens for r in detail[m][1]) / sum(r.step_time_s for r in detail[m][1]) for m in methods}
    res = detail["wlb"][1][:steady]
    gap = [abs(r.tokens - tokens) / tokens for r in res]
    near = [i for i in range(steady) if gap[i] <= tolerance] or [i for i in range(steady) if gap[i] == min(gap)]

    def deviation(i: int) -> float:
        return sum(abs(detail[m][1][i].tokens / detail[m][1][i].step_time_s / rate[m] - 1.0) for m in methods)

    return min(near, key=lambda i: (deviation(i), i))


def _gantt_panels(detail: dict, tokens: int) -> list:
    """(label, StepResult) per method, all at the step `gantt_step` chooses."""
    k = gantt_step(detail, tokens)
    return [(f"{label}, step {k} ({detail[method][1][k].tokens / 1e3:.0f}K tokens)", detail[method][1][k])
            for label, method in (("Plain-4D", "plain"), ("WLB-LLM", "wlb"))]


def parse_configs(text: str | None) -> tuple[Config, ...]:
    """Comma-separated Table 1 labels ("7B-128K") or custom "MODEL-CTXK@tp,cp,pp,dp"."""
    if not text:
        return CONFIGS
    known = {c.label: c for c in CONFIGS}
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()) if "@" not in text else _split_custom(text):
        label, _, layout = item.partition("@")
        label = label.strip().upper()
        if not layout:
            if label not in known:
                raise ValueError(f"unknown configuration {label!r}; valid: {sorted(known)} or MODEL-CTXK@tp,cp,pp,dp")
            out.append(known[label])
            continue
        try:
            model, ctx = label.rsplit("-", 1)
            context = int(ctx.rstrip("K")) * 1024
            tp, cp, pp, dp = (int(x) for x in layout.split(","))
        except ValueError:
            raise ValueError(f"bad configuration {item!r}; expected e.g. 7B-128K or TINY-4K@1,2,2,1") from None
        ModelSpec.preset(model.lower())  # validates the model name
        out.append(Config(model.lower(), context, tp, cp, pp, dp))
    return tuple(out)


def _split_custom(text: str) -> list[str]:
    """Split "A@1,2,2,1,B,C@1,1,2,2" into items: a layout takes the four numbers after '@'."""
    parts, items, k = text.split(","), [], 0
    while k < len(parts):
        if "@" in parts[k]:
            items.append(",".join(parts[k:k + 4]))
            k += 4
        else:
            items.append(parts[k])
            k += 1
    return items


# ---------------------------------------------------------------------- main
def run(steps: int, dist: str = "default", seed: int = 0, lengths=None, hardware: str = "h100",
        configs=CONFIGS, show_progress: bool = True):
    """The 8 x 4 table. Returns (rows, gantt_panels)."""
    rows, gantt = [], None
    bar = progress(range(len(configs) * len(METHODS)), desc="e2e", enable=show_progress)
    it = iter(bar)
    for cfg in configs:
        r, detail = run_config(cfg, make_batches(cfg, steps, dist, seed, lengths), hardware, METHODS, seed,
                               tick=lambda: next(it, None), sample=calibration_sample(cfg, dist, seed, lengths))
        rows.extend(r)
        if cfg.label == "7B-128K" or gantt is None or gantt[0] != "7B-128K":
            gantt = (cfg.label, _gantt_panels(detail, cfg.dp * cfg.pp * cfg.context))
    for _ in it:  # a tqdm bar counts an item when the next is asked for: the last one too
        pass
    if hasattr(bar, "close"):
        bar.close()
    return rows, gantt


def main(argv: list[str] | None = None, prog: str = "wlb-opt bench e2e") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="8 configurations x 4 methods, few steps (< 2 min)")
    p.add_argument("--steps", type=count, default=None, help="global batches per configuration (default 24 quick, 120 full)")
    p.add_argument("--lengths", metavar="FILE", help="document lengths (.npy/.txt/.jsonl) instead of the default distribution")
    p.add_argument("--dist", default="default", choices=sorted(DISTRIBUTIONS),
                   help="built-in length distribution (default: default)")
    p.add_argument("--hardware", default="h100", help="HardwareSpec preset: h100, h200, cpu (default h100)")
    p.add_argument("--configs", default=None,
                   help="comma-separated Table 1 labels, e.g. 7B-128K, or custom MODEL-CTXK@tp,cp,pp,dp (default: all 8)")
    p.add_argument("--seed", type=natural, default=0, help="stream and packer seed (default 0)")
    p.add_argument("--out", default="results/e2e", help="folder for e2e.json and the PNGs")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    steps = args.steps if args.steps is not None else (24 if args.quick else 120)
    if steps < 1:
        p.error(f"--steps must be >= 1, got {steps}")
    try:
        lengths = load_lengths(args.lengths) if args.lengths else None
        configs = parse_configs(args.configs)
        HardwareSpec.preset(args.hardware)
    except ValueError as exc:
        p.error(str(exc))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    source = args.lengths or f"distribution '{args.dist}'"
    print(f"e2e: {len(configs)} configurations x {len(METHODS)} methods, {steps} global batches each, {source}, "
          f"{SCHEDULE} 1F1B (v={VIRTUAL_STAGES}), {args.hardware}")
    t0 = time.perf_counter()
    rows, gantt = run(steps, args.dist, args.seed, lengths, args.hardware, configs, not args.no_progress)
    print_table(rows)
    for line in paper_comparison(rows):
        print(line)
    payload = dict(provenance=provenance("e2e", argv), rows=rows, steps=steps, source=source, schedule=SCHEDULE, virtual_stages=VIRTUAL_STAGES,
                   hardware=args.hardware, paper=PAPER)
    if not args.quick:
        print("\nbreakdown at 7B-128K (speedup over plain; paper in brackets)")
        bd = breakdown(steps, args.dist, args.seed, lengths, args.hardware)
        for r in bd:
            paper = f"[{r['paper']:.2f}x]" if r["paper"] else ""
            print(f"  {r['method']:>12}: {r['speedup_vs_plain']:.2f}x {paper}  PP imb {r['imbalance_pp']:.3f}  "
                  f"CP imb {r['imbalance_cp']:.3f}")
        print("\ncontext sweep, 7B (8,2,4,1) (paper: 1.40x at 160K)")
        sw = sweep(max(8, steps // 2), args.dist, args.seed, lengths, args.hardware)
        for ctx in SWEEP_CONTEXTS:
            part = {r["method"]: r for r in sw if r["context"] == ctx}
            print(f"  {ctx // 1024:>4}K: wlb {part['wlb']['speedup_vs_plain']:.2f}x  best "
                  f"{part['best']['speedup_vs_plain']:.2f}x")
        payload.update(breakdown=bd, sweep=sw)
    (out / "e2e.json").write_text(json.dumps(rows, indent=2))
    (out / "e2e_meta.json").write_text(json.dumps(payload, indent=2))
    pngs = []
    try:
        plot_speedups(rows, out / "speedup.png", f"Simulated speedup over Plain-4D ({source}, {steps} steps)")
        pngs.append(out / "speedup.png")
        if gantt:
            label, panels = gantt
            cfg = next(c for c in configs if c.label == label)
            name = f"gantt_{label.lower().replace('-', '_')}.png"
            plot_gantt(panels, out / name, f"{label}: one representative step at near-equal tokens "
                       f"({cfg.dp * cfg.pp * cfg.context / 1e3:.0f}K per step; TP{cfg.tp} CP{cfg.cp} PP{cfg.pp} "
                       f"DP{cfg.dp}, interleaved 1F1B v={VIRTUAL_STAGES}), replica 0")
            pngs.append(out / name)
    except ImportError as exc:
        print(f"(no PNGs: {exc})")
    print(f"wrote {out / 'e2e.json'} (rows), {out / 'e2e_meta.json'}" + "".join(f", {p}" for p in pngs))
    print(f"e2e wall time {time.perf_counter() - t0:.1f} s")
    return 0
