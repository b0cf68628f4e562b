"""`wlb-opt bench frontier --offline`: the achievable side of the frontier. With the whole
stream known, `wlb_opt.solvers.offline` finds a schedule at each displacement budget; each
one is checked here, independently of the search, and set beside the proven bound of
`frontier_milp` and the streaming planner's points, so that each heuristic's distance to the
best schedule is bracketed: at least (heuristic - offline schedule) is achievable, at most
(heuristic - bound) is possible.

Streams: per distribution (`--dists`, default default, real, code, heavy, prose), the
frontier's settings: 7B, (tp, cp, pp, dp) = (8, 2, 4, 1), H100, window W = 131072, N = 4,
max_tokens 1.25 W, 200 global batches (`--quick`: 100, two budgets, a shorter price path).
Heuristics: the no-tuning defaults (`PackerConfig()`, whatever step method they use when
this runs) and the same with lookahead 2 and 4.

Measures (as `bench parity`): imbalance = mean over steps 20 .. T - 1 of the step's max /
mean forward micro-batch cost (the "Table 2" imbalance; steps after the stream's last batch
only drain and are not counted, for the heuristics as for the offline schedules); aggregate =
sum over all steps of the largest forward cost x N / total (the MILP's objective as a ratio,
`frontier_milp.aggregate_imbalance`); displacement per token = token-weighted mean |training
step - arrival step|. The offline search weights steps 20 .. T - 1 by 1 and the warm-up and
drain steps by `EDGE_WEIGHT`. Window: every piece within [arrival - w, arrival + w], w the
larger of the frontier's early and late (`frontier.model_window`: at least 16, widened to cover
the heuristics), as far ahead as behind since the whole stream is known; the bound's model
uses the same window, so the bound holds for every offline schedule and every heuristic.

Two searches per stream (`OBJECTIVES`): one balances the forward cost, the measure above and
the one the bound is proven on; the other balances the forward plus the backward cost, as
Algorithm 1 and the defaults do. A schedule searched on the forward cost alone reaches a lower
forward imbalance by letting the backward one rise (the two phases weigh a document
differently, `solvers/phases.py`), and a pipeline pays both: every schedule and heuristic is
therefore also measured on the backward cost (`imbalance_bwd`, the same mean of the step's
max / mean backward cost) and on what a 1F1B pipeline of the layout's pp stages takes for the
step (`sim`, `step_packers.pipeline_ratio`: its simulated step time over that of the same step
with every micro-batch at the mean), and each heuristic is bracketed against both searches
(`gap_achievable` against the forward one, `gap_achievable_phases` against the other, which
searches at the heuristics' own displacements only).

The search that balances both phases runs again with each heuristic's own reach
(`heuristic_lead`: no piece trained more than 0 steps before it arrives without lookahead, more
than `defaults.MAX_LEAD` with it; late as before), at the displacements of the heuristics of
that reach and the targets' budgets, seeded from their schedules: what a planner that may use
as much of the future as the heuristic does could reach (`lead_offline_*`,
`gap_achievable_lead`). The heuristic knows the arrivals of the next K batches at most, the
search every arrival; the lead bounds what either may do with them. The checker measures how
far ahead each schedule trains (`max_early`), and a schedule beyond its search's lead fails.

Budgets: `--budgets` plus each heuristic's own displacement, so that each heuristic meets an
offline schedule of at most its displacement. A budget at which the search finds no schedule
(a stream whose arrivals overflow their steps by more than the budget moves) is a row without
figures: source "none found", or "none exists" when the bound's model is infeasible there. Bracket per heuristic: "lower" = its aggregate
minus the bound at the smallest budget >= its displacement (aggregate measure: the bound is
on the aggregate); "achievable" = its imbalance minus that of the best offline schedule whose
displacement is at most its own (and the same on the aggregate).

The checker (`check_schedule`) reads the global batches and the cost model, not the search:
every piece of every batch trained exactly once (by (document id, offset, length)), each step
a `PackPlan` that `wlb_opt.plan.check_pack` accepts (token caps, loads = the cost model's),
and the imbalance and displacement recomputed from those plans.

`--balance fwd` plans the heuristics on the forward phase alone (`step_packers.forward_cost`:
the cost model's backward coefficients zero; measured as above) and brackets them against
forward searches only: with the whole stream known (`offline_*`) and with each heuristic's own
reach (`lead_*`, the search that balances both phases replaced by the forward one; no
`phases_*`). The forward imbalance is then what both the heuristics and the searches balance.

`--jobs J` searches J distributions at once, each in a worker process: every draw of the
search is seeded, so the schedules are those of one process (the bounds are what HiGHS proves
within `--time-limit`, which a loaded machine may lower).
"""
from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import numpy as np

from ..packer import PackerConfig, WLBPacker, per_step_imbalance
from ..packer.defaults import MAX_LEAD
from ..plan import PackPlan, SolveInfo, check_pack
from ..solvers.frontier_milp import aggregate_imbalance, frontier_problem, plan_solution, solve_frontier
from ..solvers.offline import PRICES, offline_frontier, offline_stream
from ..workloads import DEFAULT_SEED, global_batches
from .data import run_packer
from .step_packers import forward_cost, is_full, pipeline_ratio
from ._provenance import provenance

OFFLINE_DISTS = ("default", "real", "code", "heavy", "prose")
BRACKETED = {"default (no tuning)": {}, "default, lookahead 2": dict(lookahead=2),
             "default, lookahead 4": dict(lookahead=4)}
BUDGETS, QUICK_BUDGETS = "0.1,0.2,0.3,0.44", "0.2,0.44"
TIME_LIMIT, QUICK_TIME_LIMIT = 4.0, 1.0  # HiGHS seconds per budget: the bound is what HiGHS proves by then
QUICK_PRICES = (1.0, 0.25, 0.06, 0.0)
QUICK_SEEDED_STARTS = 1
"""With `--quick`, only the best default's schedule seeds a search of its own (all of them otherwise)."""
EDGE_WEIGHT = 0.1
"""Objective weight of a warm-up or drain step in the offline search (the measured steps weigh 1)."""
OBJECTIVES = {"fwd": "fwd", "fwd+bwd": "fwd_bwd"}
"""What each offline search balances (the cost model's phase): "fwd", the measured forward cost,
on which the bound is proven; "fwd+bwd", the forward plus backward cost, as Algorithm 1 and the
defaults balance it. Both are measured in each phase (module docstring)."""
PHASES_BUDGETS = (0.4, 0.45)
"""Budgets the forward + backward search meets besides the heuristics' displacements: the
streaming planner's balance targets (the defaults at <= 0.45 displacement per token, lookahead
at <= 0.40), so that what a schedule balancing both phases reaches there is known."""


def heuristic_lead(settings: dict) -> int:
    """The most steps the packer of `settings` (`PackerConfig` keywords, release "marginal")
    trains a piece before it arrives: none without lookahead, else up to its lookahead and at
    most `defaults.MAX_LEAD`. The offline search given the same reach knows what the heuristic
    may use of the future: any piece's arrival, but no piece trained further ahead."""
    return min(int(settings.get("lookahead", 0)), MAX_LEAD)


def check_schedule(batches, cost, step, micro, ids, offsets, lengths, n_micro: int, max_tokens: int, n_slots: int,
                   warmup: int, pp: int = 1) -> dict:
    """Check a schedule of the pieces (ids, offsets, lengths) against `batches` and measure it;
    raise AssertionError on any violation (a micro-batch over `max_tokens` included). Returns
    imbalance (forward), imbalance_bwd (the same of the backward cost), sim (the same mean of
    `step_packers.pipeline_ratio`, a 1F1B pipeline of `pp` stages), each over the stream's
    steps from `warmup` on, an empty step counted as the packers' empty plans are (1), the
    aggregate sum of maxima, displacement per token, `full_share`, the share of the measured
    steps filled to 99% of their token capacity (`step_packers.is_full`: the steps whose
    imbalance the pieces they hold set), and `max_early` / `max_late`, the most steps any
    piece trains before / after its arrival (0 when none does)."""
    arrival = {}
    for t, (lb, ib, ob) in enumerate(batches):
        for key in zip(ib.tolist(), ob.tolist(), lb.tolist()):
            if key in arrival:
                raise AssertionError(f"piece {key} is twice in the stream")
            arrival[key] = t
    keys = list(zip(np.asarray(ids).tolist(), np.asarray(offsets).tolist(), np.asarray(lengths).tolist()))
    if len(keys) != len(arrival) or set(keys) != set(arrival) or len(set(keys)) != len(keys):
        raise AssertionError(f"the schedule trains {len(set(keys))} distinct pieces of {len(keys)}, the stream has "
                             f"{len(arrival)}: a piece is missing, repeated or not the stream's")
    step, micro, lengths = (np.asarray(a, dtype=np.int64) for a in (step, micro, lengths))
    if step.min() < 0 or step.max() >= n_slots or micro.min() < 0 or micro.max() >= n_micro:
        raise AssertionError(f"steps must lie in [0, {n_slots}) and micro-batches in [0, {n_micro})")
    ids, offsets = np.asarray(ids, dtype=np.int64), np.asarray(offsets, dtype=np.int64)
    mbc = cost.mb_const("fwd")
    imbs, bwds, sims, fulls, sum_max, disp, max_early, max_late = [], [], [], [], 0.0, 0, 0, 0
    for t in range(n_slots):
        here = np.flatnonzero(step == t)
        if not len(here) and t >= len(batches):
            continue
        mbs = [np.flatnonzero(micro[here] == j) for j in range(n_micro)]
        L = lengths[here]
        plan = PackPlan(doc_ids=ids[here], lengths=L, offsets=offsets[here], micro_batches=mbs,
                        replica_of=np.zeros(n_micro, dtype=np.int64), deferred=np.zeros(0, dtype=np.int64),
                        loads=np.array([cost.micro_batch_cost(L[mb]) for mb in mbs]),
                        tokens=np.array([int(L[mb].sum()) for mb in mbs]), n_micro=n_micro, max_tokens=max_tokens,
                        info=SolveInfo(method="offline"), step=t)
        try:
            check_pack(plan, L, max_tokens, ids=ids[here], offsets=offsets[here], cost=cost)
        except ValueError as exc:
            raise AssertionError(f"step {t}: {exc}") from None
        if t < len(batches):
            imbs.append((t, per_step_imbalance(plan, cost, "fwd")))
            bwds.append((t, per_step_imbalance(plan, cost, "bwd")))
            sims.append((t, pipeline_ratio(plan, cost, pp)))
            fulls.append((t, float(is_full(plan))))
        sum_max += max(cost.micro_batch_cost(L[mb], "fwd") - mbc for mb in mbs)
        arrived = [arrival[k] for k in zip(ids[here].tolist(), offsets[here].tolist(), L.tolist())]
        disp += sum(n * abs(t - a) for a, n in zip(arrived, L.tolist()))
        max_early = max([max_early] + [a - t for a in arrived])
        max_late = max([max_late] + [t - a for a in arrived])

    def measured(values):
        return float(np.mean([x for t, x in values if t >= warmup] or [x for _, x in values]))

    return dict(imbalance=measured(imbs), imbalance_bwd=measured(bwds), sim=measured(sims), sum_of_max=sum_max,
                displacement_per_token=disp / max(int(lengths.sum()), 1), full_share=measured(fulls),
                max_early=max_early, max_late=max_late)


def _piece_steps(plans, stream) -> tuple[np.ndarray, np.ndarray]:
    """Training step and micro-batch of each stream piece in a heuristic's plans."""
    where = {}
    for plan in plans:
        for j, mb in enumerate(plan.micro_batches):
            for i in mb.tolist():
                where[(int(plan.doc_ids[i]), int(plan.offsets[i]))] = (plan.step, j)
    at = [where[k] for k in zip(stream.doc_ids.tolist(), stream.offsets.tolist())]
    return np.array([a[0] for a in at], dtype=np.int64), np.array([a[1] for a in at], dtype=np.int64)


def run_distribution(dist: str, cost, *, steps: int, window: int, n_micro: int, budgets: list[float],
                     time_limit: float, outlier_min: int, seed: int, prices, warmup: int, show,
                     seeded_starts: int | None = None, phases_budgets=PHASES_BUDGETS, balance: str = "fwd_bwd") -> dict:
    """Heuristics, bounds and offline schedules of one distribution's stream; see the module
    docstring. `phases_budgets`: budgets the forward + backward search meets besides the
    heuristics' displacements. `balance`: "fwd_bwd" (the heuristics plan on the whole cost
    model) or "fwd" (on the forward phase alone, bracketed by forward searches only)."""
    if balance not in ("fwd_bwd", "fwd"):
        raise ValueError(f"balance must be 'fwd_bwd' or 'fwd', got {balance!r}")
    from .frontier import _finite, model_window, stream_plans, sum_of_max

    t0 = time.perf_counter()
    W, N = window, n_micro
    max_tokens = int(1.25 * W)
    batches = global_batches(dist, W, N * W, steps, seed=DEFAULT_SEED + seed)
    runs, displacement = {}, {}
    pp = cost.degree("pp")
    for name, kw in BRACKETED.items():
        plan_cost = forward_cost(cost) if balance == "fwd" else cost
        run = run_packer(WLBPacker(N, max_tokens, plan_cost, config=PackerConfig(**kw)), batches)
        runs[name] = stream_plans(run)
        displacement[name] = float(run.stats["displacement_per_token"])
    early, late, n_slots = model_window(list(runs.values()), len(batches), outlier_min)
    early = late = max(early, late)  # full knowledge of the stream: as far ahead as behind
    problem = frontier_problem(batches, lambda d: cost.doc_cost(d, "fwd"), N, max_tokens, outlier_min=outlier_min,
                               early=early, late=late, n_slots=n_slots)
    rows, starts = [], []
    stream = offline_stream(batches, lambda d: cost.doc_cost(d, "fwd"))
    for name, plans in runs.items():
        imbs = [per_step_imbalance(plan, cost, "fwd") for plan in plans[:len(batches)]]
        bwds = [per_step_imbalance(plan, cost, "bwd") for plan in plans[:len(batches)]]
        sims = [pipeline_ratio(plan, cost, pp) for plan in plans[:len(batches)]]
        fulls = [float(is_full(plan)) for plan in plans[:len(batches)]]
        rows.append(dict(dist=dist, method=name, settings=BRACKETED[name],
                         imbalance=float(np.mean(imbs[warmup:] or imbs)),
                         imbalance_bwd=float(np.mean(bwds[warmup:] or bwds)), sim=float(np.mean(sims[warmup:] or sims)),
                         full_share=float(np.mean(fulls[warmup:] or fulls)),
                         aggregate=aggregate_imbalance(sum_of_max(plans, cost), problem),
                         displacement_per_token=displacement[name], max_lead=heuristic_lead(BRACKETED[name])))
        starts.append(_piece_steps(plans, stream))
        trained_early = int((stream.arrival - starts[-1][0]).max(initial=0))
        if trained_early > rows[-1]["max_lead"]:
            raise AssertionError(f"{dist}: {name} trains a piece {trained_early} steps early, beyond its reach of "
                                 f"{rows[-1]['max_lead']}")
    in_window = [s for s in starts if ((s[0] >= stream.arrival - early) & (s[0] <= stream.arrival + late)
                                       & (s[0] < n_slots)).all()]
    all_budgets = sorted(set(budgets) | {r["displacement_per_token"] for r in rows})
    show(f"{dist}: {len(batches)} steps, window [-{early}, +{late}], {n_slots} slots; bounds ({time_limit:g} s each)")
    bounds, previous = {}, None
    mip_starts = [plan_solution(problem, plans)[0] for plans in runs.values()]
    for b in sorted(set(all_budgets) | set(phases_budgets)):
        r = solve_frontier(problem, b, time_limit, starts=mip_starts + [previous])
        previous = r.values
        bounds[b] = aggregate_imbalance(r.bound, problem)
    weights = np.full(n_slots, EDGE_WEIGHT)
    weights[warmup:len(batches)] = 1.0
    measured = np.zeros(n_slots)  # the reported imbalance: steps warmup .. T - 1 (every step of a shorter stream)
    measured[warmup if warmup < len(batches) else 0:len(batches)] = 1.0
    curve, search_s, streams = [], {}, {"fwd": stream}
    own = {r["displacement_per_token"] for r in rows}
    # the forward search draws the frontier; the other one the heuristics' budgets and the targets'
    # (with balance "fwd" the heuristics balance the forward cost: no search of both phases)
    lead_objective = "fwd" if balance == "fwd" else "fwd+bwd"
    searches = [("fwd", early, all_budgets)]
    if balance == "fwd_bwd":
        searches.append(("fwd+bwd", early, sorted(own | set(phases_budgets))))
    # and with each heuristic's own reach: its displacements and the targets'
    for lead in sorted({r["max_lead"] for r in rows}):
        searches.append((lead_objective, lead, sorted({r["displacement_per_token"] for r in rows
                                                       if r["max_lead"] == lead} | set(phases_budgets))))
    for objective, lead, at in searches:
        phase = OBJECTIVES[objective]
        label = objective if lead == early else f"{objective}, lead <= {lead}"
        found = []

        def progress(s, label=label):
            show(f"  {dist}: budget {s.budget:.3f} ({label}): offline schedule found "
                 f"({time.perf_counter() - t0:.0f} s)")
            found.append(s)

        t1 = time.perf_counter()
        if phase not in streams:  # one stream per phase, whatever the lead of its searches
            streams[phase] = offline_stream(batches, lambda d, phase=phase: cost.doc_cost(d, phase))
        searched = streams[phase]
        seeds = [s for s in in_window if (s[0] >= stream.arrival - lead).all()]
        offline_frontier(searched, N, max_tokens, cost.mb_const(phase), at, early=lead, late=late,
                         outlier_min=outlier_min, starts=seeds, n_slots=n_slots, step_weights=weights,
                         measure_weights=measured,
                         prices=prices, on_budget=progress, skip_infeasible=True, seeded_starts=seeded_starts)
        search_s[label] = time.perf_counter() - t1
        names = [n for n, s in zip(runs, starts) if any(s is w for w in seeds)]
        for b in sorted(set(at) - {s.budget for s in found}):
            show(f"  {dist}: budget {b:.3f} ({label}): no offline schedule found")
            # an infeasible bound model proves that no schedule exists within the budget and window
            proven = not np.isfinite(bounds[b])
            curve.append(dict(dist=dist, objective=objective, max_lead=lead, budget=b, imbalance=None,
                              imbalance_bwd=None, sim=None, full_share=None, aggregate=None,
                              displacement_per_token=None, bound=None if proven else bounds[b],
                              source="none exists" if proven else "none found", checked=False))
        for s in found:
            check = check_schedule(batches, cost, s.step, s.micro_batch, stream.doc_ids, stream.offsets,
                                   stream.lengths, N, max_tokens, n_slots, warmup, pp)
            if check["displacement_per_token"] > s.budget + 1e-9:
                raise AssertionError(f"{dist}: the offline schedule at budget {s.budget} ({label}) displaces "
                                     f"{check['displacement_per_token']:.6f} per token")
            if check["max_early"] > lead or check["max_late"] > late:
                raise AssertionError(f"{dist}: the offline schedule at budget {s.budget} ({label}) trains a piece "
                                     f"{check['max_early']} steps before or {check['max_late']} after it arrives, "
                                     f"outside its window [-{lead}, +{late}]")
            agg = aggregate_imbalance(check["sum_of_max"], problem)
            if agg < bounds[s.budget] - 1e-6:
                raise AssertionError(f"{dist}: the offline schedule at budget {s.budget} ({objective}, {agg:.6f}) "
                                     f"beats the proven bound {bounds[s.budget]:.6f}: the window or the check is wrong")
            source = s.source
            if source.startswith("start "):
                source = names[int(source.split()[1]) - 1]
            elif source.startswith("search from start "):
                source = "search from " + names[int(source.split()[3]) - 1]
            curve.append(dict(dist=dist, objective=objective, max_lead=lead, budget=s.budget,
                              imbalance=check["imbalance"],
                              imbalance_bwd=check["imbalance_bwd"], sim=check["sim"], full_share=check["full_share"],
                              aggregate=agg,
                              displacement_per_token=check["displacement_per_token"], bound=_finite(bounds[s.budget]),
                              source=source, checked=True))
    curve.sort(key=lambda c: (list(OBJECTIVES).index(c["objective"]), -c["max_lead"], c["budget"]))
    for r in rows:
        d = r["displacement_per_token"]
        above = [b for b in all_budgets if b >= d - 1e-12]
        r["bound"] = _finite(bounds[above[0]]) if above else None
        r["gap_lower_aggregate"] = None if r["bound"] is None else r["aggregate"] - r["bound"]
        for objective, lead, prefix in (("fwd", early, ""), ("fwd+bwd", early, "phases_"),
                                        (lead_objective, r["max_lead"], "lead_")):
            # a schedule of a shorter reach is one of this reach too (and every one is a whole-stream one)
            within = [c for c in curve if c["checked"] and c["objective"] == objective and c["max_lead"] <= lead
                      and c["displacement_per_token"] <= d + 1e-12]
            best = min(within, key=lambda c: c["imbalance"]) if within else None
            r[f"{prefix}offline_imbalance"] = None if best is None else best["imbalance"]
            r[f"{prefix}offline_imbalance_bwd"] = None if best is None else best["imbalance_bwd"]
            r[f"{prefix}offline_sim"] = None if best is None else best["sim"]
            r[f"{prefix}offline_displacement"] = None if best is None else best["displacement_per_token"]
            gap = None if best is None else r["imbalance"] - best["imbalance"]
            r[f"gap_achievable_{prefix[:-1]}" if prefix else "gap_achievable"] = gap
            if not prefix:
                best_agg = min((c["aggregate"] for c in within), default=None)
                r["gap_achievable_aggregate"] = None if best_agg is None else r["aggregate"] - best_agg
    meta = dict(dist=dist, balance=balance, steps=len(batches), early=early, late=late, n_slots=n_slots,
                search_seconds=search_s, seconds=time.perf_counter() - t0)
    return dict(meta=meta, offline=curve, brackets=rows)


def _fmt(x, width=6, digits=3) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}.{digits}f}"


def _show(message: str) -> None:
    print(message, flush=True)


def _quiet_run(dist: str, cost, kw: dict) -> dict:
    """`run_distribution` of one distribution, HiGHS's user warnings silenced (a worker
    process's entry point)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return run_distribution(dist, cost, **kw)


def main(args, argv, cost, budgets: list[float] | None) -> int:
    """The `--offline` run of `wlb-opt bench frontier` (arguments parsed there)."""
    from .frontier import QUICK_STEPS, STEPS, plot

    dists = [d.strip() for d in (args.dists or ",".join(OFFLINE_DISTS)).split(",") if d.strip()]
    steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else STEPS)
    time_limit = args.time_limit if args.time_limit is not None else (QUICK_TIME_LIMIT if args.quick else TIME_LIMIT)
    budgets = budgets if budgets is not None else [float(x) for x in (QUICK_BUDGETS if args.quick else BUDGETS).split(",")]
    prices = QUICK_PRICES if args.quick else PRICES
    t0 = time.perf_counter()
    kw = dict(steps=steps, window=args.window, n_micro=args.n_micro, budgets=budgets, time_limit=time_limit,
              outlier_min=args.outlier_min, seed=args.seed, prices=prices, warmup=20,
              seeded_starts=QUICK_SEEDED_STARTS if args.quick else None,
              phases_budgets=() if args.quick else PHASES_BUDGETS, show=_show, balance=args.balance)
    jobs = min(args.jobs, len(dists))
    if jobs <= 1:
        results = [_quiet_run(dist, cost, kw) for dist in dists]
    else:  # each distribution's searches in a process of its own (the same schedules: every draw is seeded)
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(_quiet_run, dists, [cost] * len(dists), [kw] * len(dists)))
    print("\noffline schedules (checked): objective = what the search balances; imbalance = mean max/mean "
          "forward cost per step after 20 steps (bwd: the same of the backward cost); agg = aggregate "
          "imbalance; bound = proven lower bound on agg")
    print(f"{'dist':<8} {'objective':<9} {'lead':>4} {'budget':>6} {'disp':>6} {'imb':>6} {'bwd':>6} {'sim':>6} "
          f"{'agg':>6} {'bound':>6} {'from':<8}")
    for res in results:
        for c in res["offline"]:
            print(f"{c['dist']:<8} {c['objective']:<9} {c['max_lead']:>4} {c['budget']:>6.3f} "
                  f"{_fmt(c['displacement_per_token'])} "
                  f"{_fmt(c['imbalance'])} {_fmt(c['imbalance_bwd'])} {_fmt(c['sim'])} {_fmt(c['aggregate'])} "
                  f"{_fmt(c['bound'])} {c['source']:<8}")
    print("\nbrackets: achievable = heuristic - best offline schedule of at most its displacement (imbalance, "
          "searched on fwd; on fwd+bwd; on fwd+bwd with the heuristic's lead; agg); lower = heuristic agg - bound")
    print(f"{'dist':<8} {'method':<22} {'imb':>6} {'bwd':>6} {'sim':>6} {'disp':>6} {'offline':>7} {'bwd':>6} "
          f"{'sim':>6} {'achievable':>10} {'off.fb':>7} {'bwd':>6} {'sim':>6} {'ach.fb':>7} {'lead':>4} {'off.ld':>7} "
          f"{'ach.ld':>7} {'agg':>6} {'ach.agg':>7} {'lower':>6}")
    for res in results:
        for r in res["brackets"]:
            print(f"{r['dist']:<8} {r['method']:<22} {r['imbalance']:>6.3f} {r['imbalance_bwd']:>6.3f} "
                  f"{r['sim']:>6.3f} {r['displacement_per_token']:>6.3f} {_fmt(r['offline_imbalance'], 7)} "
                  f"{_fmt(r['offline_imbalance_bwd'])} {_fmt(r['offline_sim'])} {_fmt(r['gap_achievable'], 10)} "
                  f"{_fmt(r['phases_offline_imbalance'], 7)} {_fmt(r['phases_offline_imbalance_bwd'])} "
                  f"{_fmt(r['phases_offline_sim'])} {_fmt(r['gap_achievable_phases'], 7)} {r['max_lead']:>4} "
                  f"{_fmt(r['lead_offline_imbalance'], 7)} {_fmt(r['gap_achievable_lead'], 7)} {r['aggregate']:>6.3f} "
                  f"{_fmt(r['gap_achievable_aggregate'], 7)} {_fmt(r['gap_lower_aggregate'])}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seconds = time.perf_counter() - t0
    meta = dict(balance=args.balance, steps=steps, window=args.window, n_micro=args.n_micro, max_tokens=int(1.25 * args.window),
                outlier_min=args.outlier_min, time_limit=time_limit, budgets=budgets, prices=list(prices),
                edge_weight=EDGE_WEIGHT, seconds=seconds, streams=[r["meta"] for r in results])
    (out / "offline.json").write_text(json.dumps(dict(
        provenance=provenance("frontier", argv), meta=meta, offline=[c for r in results for c in r["offline"]],
        brackets=[b for r in results for b in r["brackets"]]), indent=2))
    for res in results:
        dist = res["meta"]["dist"]
        frontier = [dict(budget=c["budget"], bound=c["bound"], best_plan=None, realised=None) for c in res["offline"]
                    if c["bound"] is not None]
        searched = [(c["displacement_per_token"], c["aggregate"]) for c in res["offline"]
                    if c["checked"] and c["objective"] == "fwd"]  # the schedules searched on the bound's measure
        plot(frontier, res["brackets"], out / f"offline_{dist}.png", f"offline frontier (dist={dist}, "
             f"{res['meta']['steps']} steps)", offline=searched)
    print(f"wrote {out / 'offline.json'} ({seconds:.0f} s)")
    return 0
