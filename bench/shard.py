"""`wlb-opt bench shard`: CP sharding strategies on packed micro-batches (paper §4, Fig. 15).

For CP = 2, 4, 8 and two length sources (the default distribution and a real length file),
global batches of n_micro x window tokens are packed with solve_pack(method="wlb",
max_tokens = 1.25 x window, 7B, tp=8, cp=CP; `--pack-method original` for Plain-4D sequences) and every micro-batch is sharded with each
strategy. Reported per (source, CP, strategy): mean CP imbalance (max/mean of rank loads),
mean predicted max-rank time (the micro-batch's time under synchronous CP), its change
against static per-sequence and against the better static choice, and the share of
segments shorter than one kernel tile, and a lower bound on every cut-or-whole plan
(`wlb_opt.shard.cut_or_whole_lower_bound`), which caps what hybrid can gain. Also: solve_shard wall time on a 131072-token
micro-batch of 60 documents, and hybrid against the exact CP-SAT decision on 48-document
micro-batches.

All times are predictions of the cost model (`CostModel.attention_latency`), whose
shape-dependent efficiency table is a documented placeholder (paper Fig. 10 shape) until
`wlb_opt.profile` measures it on a device. The paper's one-layer 7B CP=4 measurement:
adaptive beats static per-sequence by 7.5% and static per-document by 3.4%; our loads cover
all layers, which scales every strategy alike, so the percentages compare directly.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from .._optional import progress
from ..cost_args import add_cost_args, cost_from_args, count, natural, seconds
from ..documents import load_lengths, split_documents
from ..shard import SHARD_STRATEGIES, cut_or_whole_lower_bound, solve_shard
from ..step_pack import PACK_METHODS, solve_pack
from ..workloads import DEFAULT_SEED, REAL_FILE, document_stream, global_batches, sample_documents
from ._provenance import provenance

NOTE = ("predictions of the cost model; its attention-efficiency table is a placeholder "
        "(paper Fig. 10 shape, not measured) until wlb_opt.profile measures it")
PAPER = {"adaptive_vs_per_seq": 0.075, "adaptive_vs_per_doc": 0.034}


def micro_batches(source: str, cost, args, stream=None) -> list[tuple[np.ndarray, np.ndarray]]:
    """(lengths, offsets) of every micro-batch packed from `args.steps` global batches."""
    window = args.window
    batches = global_batches(source if stream is None else "real", window, args.n_micro * window, args.steps,
                             seed=DEFAULT_SEED + args.seed, lengths=stream)
    out = []
    for pieces, ids, offsets in batches:
        max_tokens = int(1.25 * window) if args.pack_method not in ("original", "fixed") else window
        plan = solve_pack(pieces, args.n_micro, max_tokens, cost, args.pack_method, ids=ids, offsets=offsets)
        out.extend((plan.lengths[mb], plan.offsets[mb]) for mb in plan.micro_batches if len(mb))
    return out


def shard_rows(mbs, cp: int, cost, strategies, source: str, show: bool) -> list[dict]:
    rows = []
    for j, (lengths, offsets) in enumerate(progress(mbs, desc=f"{source} cp={cp}", enable=show)):
        bound_ms = 1e3 * cut_or_whole_lower_bound(lengths, cp, cost)
        for strategy in strategies:
            t0 = time.perf_counter()
            shard = solve_shard(lengths, cp, strategy, cost, offsets=offsets)
            wall = time.perf_counter() - t0
            rows.append(dict(source=source, cp=cp, micro_batch=j, strategy=strategy, taken=shard.strategy,
                             documents=int(len(lengths)), tokens=int(lengths.sum()), max_ms=1e3 * shard.max_load,
                             imbalance=shard.imbalance, short_share=shard.short_segment_share(cost.tile),
                             max_rank_tokens=int(shard.tokens.max()), solve_ms=1e3 * wall,
                             cut_or_whole_bound_ms=bound_ms))
    return rows


def summarise(rows: list[dict], strategies) -> list[dict]:
    out = []
    keys = sorted({(r["source"], r["cp"]) for r in rows}, key=lambda k: (k[0] != "default", k[1]))
    for source, cp in keys:
        sel = {s: [r for r in rows if r["source"] == source and r["cp"] == cp and r["strategy"] == s]
               for s in strategies}
        mean_ms = {s: float(np.mean([r["max_ms"] for r in sel[s]])) for s in strategies if sel[s]}
        best_static = min(mean_ms.get("per_seq", np.inf), mean_ms.get("per_doc", np.inf))
        for s in strategies:
            if not sel[s]:
                continue
            taken = {}
            for r in sel[s]:
                taken[r["taken"]] = taken.get(r["taken"], 0) + 1
            out.append(dict(
                source=source, cp=cp, strategy=s, micro_batches=len(sel[s]),
                imbalance=float(np.mean([r["imbalance"] for r in sel[s]])),
                max_imbalance=float(np.max([r["imbalance"] for r in sel[s]])),
                max_ms=mean_ms[s],
                vs_per_seq=mean_ms[s] / mean_ms["per_seq"] - 1 if "per_seq" in mean_ms else None,
                vs_best_static=mean_ms[s] / best_static - 1 if np.isfinite(best_static) else None,
                short_share=float(np.mean([r["short_share"] for r in sel[s]])),
                solve_ms_median=float(np.median([r["solve_ms"] for r in sel[s]])),
                cut_or_whole_bound_ms=float(np.mean([r["cut_or_whole_bound_ms"] for r in sel[s]])),
                taken={k: v / len(sel[s]) for k, v in sorted(taken.items())}))
    return out


def synthetic_micro_batch(n_docs: int = 60, tokens: int = 131072, seed: int = 0) -> np.ndarray:
    """`n_docs` default-distribution lengths rescaled to exactly `tokens` tokens."""
    raw = sample_documents(n_docs, "default", DEFAULT_SEED + seed).astype(np.float64)
    raw = np.minimum(raw, tokens / 4)  # keep the rescaled micro-batch a mix, not one giant document
    lengths = np.maximum(1, np.floor(raw / raw.sum() * tokens)).astype(np.int64)
    lengths[np.argmax(lengths)] += tokens - int(lengths.sum())
    return lengths


def timing(cost, cp: int, strategies, repeats: int) -> list[dict]:
    lengths = synthetic_micro_batch()
    out = []
    for s in strategies:
        solve_shard(lengths, cp, s, cost)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            shard = solve_shard(lengths, cp, s, cost)
            times.append(time.perf_counter() - t0)
        t = 1e3 * np.array(times)
        out.append(dict(strategy=s, cp=cp, documents=int(len(lengths)), tokens=int(lengths.sum()),
                        median_ms=float(np.median(t)), p10_ms=float(np.percentile(t, 10)),
                        p90_ms=float(np.percentile(t, 90)), taken=shard.strategy, repeats=repeats))
    return out


def cpsat_reference(cost, cp: int, n_inst: int, time_limit: float, window: int, seed: int, show: bool) -> dict:
    """hybrid vs the exact cut-or-whole decision on 48-document micro-batches cut from the stream."""
    from ..shard import CPSAT_MAX_DOCS

    stream = document_stream(n_inst * CPSAT_MAX_DOCS * 4000, "default", DEFAULT_SEED + 17 + seed)
    pieces = split_documents(stream, window)[0]
    rows = []
    for i in progress(range(n_inst), desc=f"cpsat cp={cp}", enable=show):
        lengths = pieces[i * CPSAT_MAX_DOCS:(i + 1) * CPSAT_MAX_DOCS]
        if len(lengths) < CPSAT_MAX_DOCS:
            break
        exact = solve_shard(lengths, cp, "cpsat", cost, time_limit=time_limit)
        hyb = solve_shard(lengths, cp, "hybrid", cost)
        rows.append(dict(hybrid_ms=1e3 * hyb.max_load, cpsat_ms=1e3 * exact.max_load,
                         bound_ms=None if exact.info.bound is None else 1e3 * exact.info.bound,
                         status=exact.info.status, ratio=hyb.max_load / exact.max_load))
    ratios = np.array([r["ratio"] for r in rows])
    gaps = [r["cpsat_ms"] / r["bound_ms"] - 1 for r in rows if r["bound_ms"]]
    return dict(cp=cp, instances=len(rows), documents=CPSAT_MAX_DOCS, time_limit_s=time_limit,
                mean_cpsat_gap=float(np.mean(gaps)) if gaps else None,
                mean_ratio=float(ratios.mean()) if len(rows) else None,
                max_ratio=float(ratios.max()) if len(rows) else None,
                optimal=sum(r["status"] == "optimal" for r in rows), rows=rows)


def plot(summary: list[dict], path: Path, strategies) -> bool:
    """Bars of each strategy's predicted max-rank time against per_seq, the baseline (drawn
    as the zero line, not as a series of zero-height bars). False without per_seq."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [s for s in strategies if s != "per_seq"]
    if "per_seq" not in strategies or not shown:
        return False
    sources = sorted({r["source"] for r in summary}, key=lambda s: s != "default")
    fig, axes = plt.subplots(1, len(sources), figsize=(5.5 * len(sources), 3.8), squeeze=False)
    for ax, source in zip(axes[0], sources):
        cps = sorted({r["cp"] for r in summary if r["source"] == source})
        width = 0.8 / len(shown)
        for k, s in enumerate(shown):
            ys = [next((100 * r["vs_per_seq"] for r in summary if r["source"] == source and r["cp"] == cp
                        and r["strategy"] == s), 0.0) for cp in cps]
            ax.bar(np.arange(len(cps)) + (k - (len(shown) - 1) / 2) * width, ys, width, label=s, color=f"C{k + 1}")
        ax.axhline(0, color="black", lw=0.8, label="per_seq (baseline)")
        ax.set_xticks(np.arange(len(cps)), [f"CP={c}" for c in cps])
        ax.set_ylabel("predicted max-rank time vs per_seq (%)")
        ax.set_title(f"{source} micro-batches")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)  # below the bars, not on them
    fig.suptitle("CP sharding (cost-model predictions; efficiency table is a placeholder)", fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _pct(x: float | None, spec: str) -> str:
    return "-" if x is None else format(100 * x, spec) + "%"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt bench shard", description=__doc__.splitlines()[0])
    p.add_argument("--lengths", metavar="FILE", default=None,
                   help=f"real document lengths (.npy/.txt/.jsonl), used as the stream in file order "
                        f"(default {REAL_FILE.name})")
    p.add_argument("--cps", default="2,4,8", help="comma-separated CP degrees (default 2,4,8)")
    p.add_argument("--steps", type=count, default=16, help="global batches per source (default 16)")
    p.add_argument("--n-micro", type=count, default=4, help="micro-batches per global batch (default 4)")
    p.add_argument("--window", type=count, default=131072, help="training context length (default 131072)")
    p.add_argument("--pack-method", default="wlb", choices=sorted(PACK_METHODS),
                   help="solve_pack method that forms the micro-batches (default wlb, max_tokens 1.25 x window; "
                        "original/fixed use the window)")
    p.add_argument("--strategies", default="per_seq,per_doc,adaptive,hybrid",
                   help=f"comma-separated, of {','.join(SHARD_STRATEGIES)} (default per_seq,per_doc,adaptive,hybrid)")
    p.add_argument("--repeats", type=count, default=200, help="timing repeats (median reported; default 200)")
    p.add_argument("--cpsat-instances", type=natural, default=6, help="48-document instances for hybrid vs cpsat "
                                                                   "at CP=4 (0: skip; default 6)")
    p.add_argument("--cpsat-time-limit", type=seconds, default=5.0, help="seconds per cpsat solve (default 5)")
    p.add_argument("--seed", type=natural, default=0, help="stream seed, an offset from DEFAULT_SEED (default 0)")
    p.add_argument("--out", default="results/shard", help="folder for shard.json (summary), shard_rows.json (per micro-batch) and shard.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_cost_args(p, layout=("tp",))  # CP comes from --cps; one replica, so dp and pp do not matter
    args = p.parse_args(argv)
    strategies = args.strategies.split(",")
    bad = [s for s in strategies if s not in SHARD_STRATEGIES]
    if bad:
        p.error(f"unknown strategies {bad}; valid: {', '.join(SHARD_STRATEGIES)}")
    try:
        cps = [int(c) for c in args.cps.split(",")]
    except ValueError:
        p.error(f"--cps must be comma-separated integers, got {args.cps!r}")
    for name, values in (("--strategies", strategies), ("--cps", cps)):
        if len(set(values)) < len(values):  # a repeated one would be counted twice in every summary
            p.error(f"{name} must not repeat a value, got {getattr(args, name[2:])!r}")
    show = not args.no_progress
    real = load_lengths(args.lengths) if args.lengths else load_lengths(REAL_FILE)
    real_name = Path(args.lengths).name if args.lengths else "real"

    rows, timings, ref = [], [], None
    for cp in cps:
        cost = cost_from_args(args, parser=p, cp=cp)
        for source, stream in (("default", None), (real_name, real)):
            rows += shard_rows(micro_batches(source, cost, args, stream), cp, cost, strategies, source, show)
        timings += timing(cost, cp, strategies, args.repeats)
        if cp == 4 and args.cpsat_instances > 0:
            ref = cpsat_reference(cost, cp, args.cpsat_instances, args.cpsat_time_limit, args.window, args.seed, show)
    summary = summarise(rows, strategies)

    print(f"CP sharding of {args.pack_method}-packed micro-batches ({args.steps} global batches x {args.n_micro} per source, "
          f"window {args.window}, max_tokens {int(1.25 * args.window)}, {args.model} tp={args.tp})")
    print(f"note: {NOTE}")
    print(f"{'source':>8} {'CP':>3} {'strategy':>9} {'imbal':>6} {'max':>6} {'max ms':>8} {'vs seq':>7} "
          f"{'vs best':>8} {'<tile':>6} {'taken'}")
    for r in summary:
        taken = ", ".join(f"{k} {v:.0%}" for k, v in r["taken"].items())
        print(f"{r['source']:>8} {r['cp']:>3} {r['strategy']:>9} {r['imbalance']:>6.3f} {r['max_imbalance']:>6.3f} "
              f"{r['max_ms']:>8.1f} {_pct(r['vs_per_seq'], '+6.1f'):>7} {_pct(r['vs_best_static'], '+7.1f'):>8} "
              f"{r['short_share']:>6.1%} {taken}")
    paper = {}
    statics = {"per_seq", "per_doc"} <= set(strategies)  # the paper's comparison needs both
    for r4 in [r for r in summary if r["cp"] == 4 and r["strategy"] == "adaptive" and statics]:
        ms = {r["strategy"]: r["max_ms"] for r in summary if r["cp"] == 4 and r["source"] == r4["source"]}
        paper[r4["source"]] = dict(adaptive_vs_per_seq=1 - ms["adaptive"] / ms["per_seq"],
                                   adaptive_vs_per_doc=1 - ms["adaptive"] / ms["per_doc"],
                                   hybrid_vs_best_static=(1 - ms["hybrid"] / min(ms["per_seq"], ms["per_doc"]))
                                   if "hybrid" in ms else None,
                                   bound_vs_best_static=1 - r4["cut_or_whole_bound_ms"] / min(ms["per_seq"],
                                                                                              ms["per_doc"]))
        print(f"CP=4 {r4['source']}: adaptive saves {paper[r4['source']]['adaptive_vs_per_seq']:.1%} vs per_seq "
              f"(paper 7.5%) and {paper[r4['source']]['adaptive_vs_per_doc']:.1%} vs per_doc (paper 3.4%)"
              + (f"; hybrid saves {paper[r4['source']]['hybrid_vs_best_static']:.1%} vs the better static"
                 if "hybrid" in ms else "")
              + f" (no cut-or-whole plan can save more than {paper[r4['source']]['bound_vs_best_static']:.1%})")
    print(f"\nsolve_shard wall time, 131072-token micro-batch of 60 documents ({args.repeats} repeats, median)")
    print(f"{'CP':>3} {'strategy':>9} {'median ms':>10} {'p10':>7} {'p90':>7}")
    for t in timings:
        print(f"{t['cp']:>3} {t['strategy']:>9} {t['median_ms']:>10.3f} {t['p10_ms']:>7.3f} {t['p90_ms']:>7.3f}")
    if ref is not None and ref["instances"]:
        print(f"\nhybrid vs cpsat (CP=4, {ref['instances']} micro-batches of {ref['documents']} documents, "
              f"{ref['time_limit_s']:.0f} s limit, {ref['optimal']} proven optimal): hybrid / cpsat max-rank time "
              f"mean {ref['mean_ratio']:.4f}, max {ref['max_ratio']:.4f}; cpsat's own mean gap to its bound "
              f"{ref['mean_cpsat_gap']:.2%}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = dict(provenance=provenance("shard", argv), note=NOTE, paper=PAPER, paper_comparison_cp4=paper, summary=summary, timing=timings,
                   cpsat_reference=ref,
                   config=dict(steps=args.steps, n_micro=args.n_micro, window=args.window, cps=cps,
                               pack_method=args.pack_method, model=args.model, tp=args.tp, hardware=args.hardware, lengths=args.lengths))
    (out / "shard.json").write_text(json.dumps(payload, indent=2))
    (out / "shard_rows.json").write_text(json.dumps(rows))  # one row per micro-batch and strategy: the raw trace
    try:
        drawn = plot(summary, out / "shard.png", strategies)
        print(f"wrote {out / 'shard.json'}, {out / 'shard_rows.json'}" + (f" and {out / 'shard.png'}" if drawn else " (no per_seq: no PNG)"))
    except ImportError:
        print(f"wrote {out / 'shard.json'}, {out / 'shard_rows.json'} (matplotlib missing: no PNG)")
    return 0
