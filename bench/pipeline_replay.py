"""`wlb-opt bench pipeline-replay`: the executor's pipeline under rendezvous semantics against
the ideal pipeline, on random operation times.

    wlb-opt bench pipeline-replay --out docs/results/pipeline_replay          (CPU, under a minute)
    wlb-opt bench pipeline-replay --bound 2,4,2 --bound 2,2,2 --out ...     (+ CP-SAT lower bounds)
    wlb-opt bench pipeline-replay --bound-per-draw 4,8,2 --out ...          (+ bounds on single draws)

For every shape (pp 2-8, every n_micro that is a multiple of pp up to --max-micro, v 1, 2, 4)
it draws --draws sets of operation times: each forward and backward of each (stage, chunk,
micro-batch) is the cost model's per-micro-batch time split over pp x v chunks, times a
log-normal factor (median 1, --sigma). The ideal pipeline (`simulate_pipeline`: an op starts
once its device is free and its input exists; a send never waits) and the replays of the
executor's p2p run on the same times; the statistic is the largest replay / ideal over the
draws. `executor` is what `train_step` runs: for v > 1 its channels (`simulate_channels`:
one process group per ordered pair of ranks, sends never waited on before the end of the
step, the next receive posted ahead), for 1F1B its groups (`simulate_rendezvous`: a group
is posted and waited on whole, a send completes only when its receive is posted). Beside
it, for v > 1, schedules of blocking groups: `groups` the searched meetings of
wlb_opt/p2p_meetings.json (found on other draws: `wlb_opt.p2p_search`), `before` Megatron's
pairing (each op's sends with the next op's receives), `nominal` each message placed where
both ranks are idle at once in the nominal ideal timeline (the placement the search starts
from).

`--bound pp,n_micro,v` adds, for that shape and the same draws, a lower bound on that
statistic over every schedule of blocking groups (CP-SAT, `--bound-time` seconds, the search
limited to ratios up to the searched groups' own): each message is handed over at one moment
when both its ranks are between operations, after the op that makes it and before the op
that needs it, with one placement of every message on its two ranks shared by all draws and
every op time rounded down. Any group schedule is such a placement (deadlock-freedom and
message order only remove placements), so no schedule of blocking groups does better than
the bound on these draws: what channels, whose sends do not block, are for. The placement
CP-SAT finds is fitted to these draws; `best_placement_fresh` replays it on --draws other
draws (seed --seed + 1), beside the searched groups on the same ones (`groups_fresh`).

`--bound-per-draw pp,n_micro,v` solves the same model on a few draws, for shapes too large for
all draws at once: the --bound-joint draws on which the searched groups are slowest
together, then --bound-draws single draws in that order, --bound-draw-time seconds for the
shape. A bound on some of the draws bounds the statistic too: for any schedule, the largest
replay / ideal over the draws is at least its largest on those, which is at least the least
of that over every schedule. The entry keeps the try with the highest bound (`draw`: the
indices of its draws among the shape's; `groups_on_draw`: the searched groups on them).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from ..cost_args import count, natural, nonnegative, seconds
from ._provenance import provenance


def draws(pp: int, n_micro: int, v: int, fwd_s: float, bwd_s: float, n: int, sigma: float, seed: int):
    """`n` pairs of [pp, v, n_micro] forward and backward seconds (seeded by the shape)."""
    rng = np.random.default_rng([seed, pp, n_micro, v])
    out = []
    for _ in range(n):
        f = fwd_s / (pp * v) * rng.lognormal(0.0, sigma, (pp, v, n_micro))
        b = bwd_s / (pp * v) * rng.lognormal(0.0, sigma, (pp, v, n_micro))
        out.append((f, b))
    return out


def replay_ratios(pp: int, n_micro: int, v: int, samples) -> dict:
    """Per draw replay / ideal: `groups`, the groups of `p2p_schedule` (for v > 1 the searched
    meetings), and for v > 1 `channels` (the executor's), Megatron's pairing (`before`) and the
    nominal placement."""
    from ..rendezvous import _replay, _replay_channels
    from ..schedule import _plans
    from ..simulate import pipeline_step_time

    placements = {"groups": "auto", "before": "next_op", "nominal": "nominal"} if v > 1 else {"groups": "auto"}
    ratios: dict[str, list[float]] = {k: [] for k in placements}
    if v > 1:
        ratios["channels"] = []
    for f, b in samples:
        ideal = pipeline_step_time(f, b, "interleaved" if v > 1 else "1f1b", v)
        for name, placement in placements.items():
            plans = [[(list(g), op) for g, op in rank] for rank in _plans(pp, n_micro, v, placement)]
            ratios[name].append(_replay(f, b, plans, 0.0).step_time_s / ideal)
        if v > 1:
            ratios["channels"].append(_replay_channels(f, b, 0.0).step_time_s / ideal)
    return ratios


def executor_ratios(ratios: dict) -> list[float]:
    """The executor's replay / ideal: channels for v > 1, groups for 1F1B."""
    return ratios.get("channels", ratios["groups"])


def placement_bound(pp: int, n_micro: int, v: int, samples, time_limit: float, scale: float = 1000.0,
                    fresh_samples=(), ratio_cap: float | None = None) -> dict:
    """CP-SAT lower bound on max over `samples` of (best replay / ideal) for one placement of
    every message shared by all samples (see the module docstring). Times in 1/scale units of
    the median op, rounded down; the ideal rounded up, the ratio in permille rounded up and so
    the bound one permille below what CP-SAT proves, so the bound stays a bound. With
    `fresh_samples`, also the max replay / ideal of the placement it found on those.

    `ratio_cap`: a ratio some placement is known to reach on these samples (the executor's
    groups' replay / ideal): the search is limited to ratios up to it, which leaves the optimum
    unchanged (the rounding only lowers a placement's ratio) and makes large shapes solvable;
    should the model still be infeasible, every placement lies above the cap, and the cap is
    the bound."""
    from ortools.sat.python import cp_model

    from ..schedule import _makes, stage_order
    from ..simulate import pipeline_step_time

    orders = [stage_order(r, pp, n_micro, v) for r in range(pp)]
    index = [{op: i for i, op in enumerate(o)} for o in orders]
    unit = float(np.median([np.median(f) for f, _ in samples]))
    model = cp_model.CpModel()
    messages = []  # (sender, receiver, {boundary: literal}, {boundary: literal})
    for r in range(pp):
        for i, op in enumerate(orders[r]):
            _, micro, vs = op
            for direction, _, peer in _makes(op, pp, pp * v):
                need = index[peer][("F", micro, vs + 1) if direction == "fwd" else ("B", micro, vs - 1)]
                at_sender = {k: model.NewBoolVar("") for k in range(i + 1, len(orders[r]) + 1)}
                at_receiver = {k: model.NewBoolVar("") for k in range(need + 1)}
                model.AddExactlyOne(at_sender.values())
                model.AddExactlyOne(at_receiver.values())
                messages.append((r, peer, at_sender, at_receiver))
    cap = 100000 if ratio_cap is None else max(1000, int(math.ceil(1000 * ratio_cap)) + 1)
    ratio = model.NewIntVar(1000, cap, "ratio_permille")
    for f, b in samples:
        dur = [[int(math.floor((f if ph == "F" else b)[vs % pp, vs // pp, mb] / unit * scale)) for ph, mb, vs in o]
               for o in orders]
        ideal = int(math.ceil(pipeline_step_time(f, b, "interleaved" if v > 1 else "1f1b", v) / unit * scale))
        horizon = min(sum(map(sum, dur)), ideal * cap // 1000) + 1
        start = [[model.NewIntVar(0, horizon, "") for _ in o] for o in orders]
        span = model.NewIntVar(0, horizon, "")
        for r in range(pp):
            for k in range(1, len(orders[r])):
                model.Add(start[r][k] >= start[r][k - 1] + dur[r][k - 1])
            model.Add(span >= start[r][-1] + dur[r][-1])
        model.Add(1000 * span <= ratio * ideal)

        def between_ops(r, k, t, lit):  # t lies in the gap before op k of rank r
            if k > 0:
                model.Add(t >= start[r][k - 1] + dur[r][k - 1]).OnlyEnforceIf(lit)
            if k < len(orders[r]):
                model.Add(t <= start[r][k]).OnlyEnforceIf(lit)

        for sender, receiver, at_sender, at_receiver in messages:
            t = model.NewIntVar(0, horizon, "")
            for k, lit in at_sender.items():
                between_ops(sender, k, t, lit)
            for k, lit in at_receiver.items():
                between_ops(receiver, k, t, lit)
    model.Minimize(ratio)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = 1
    started = time.process_time()
    status = solver.Solve(model)
    found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    fresh = None
    if found and fresh_samples:  # the fitted placement's groups, replayed on other draws
        from ..rendezvous import _replay
        from ..schedule import _grouped

        at_sender = [next(k for k, lit in sent.items() if solver.Value(lit)) for _, _, sent, _ in messages]
        at_receiver = [next(k for k, lit in r.items() if solver.Value(lit)) for _, _, _, r in messages]
        plans = _grouped(pp, n_micro, v, at_sender, at_receiver)
        fresh = round(max(_replay(f, b, plans, 0.0).step_time_s / pipeline_step_time(f, b, "interleaved" if v > 1
                                                                                      else "1f1b", v)
                          for f, b in fresh_samples), 4)
    # the model's ratio is the permille ceiling of span / ideal, so a placement's ratio exceeds the
    # bound on it less one permille; every ratio is >= 1 (the ideal pipeline relaxes them all)
    least = cap + 1 if status == cp_model.INFEASIBLE else solver.BestObjectiveBound()
    bound = max(1.0, (least - 1) / 1000)
    return dict(pp=pp, n_micro=n_micro, v=v, draws=len(samples), lower_bound=bound,
                best_placement=solver.ObjectiveValue() / 1000 if found else None, status=solver.StatusName(status),
                cpu_s=round(time.process_time() - started, 1), best_placement_fresh=fresh)


def per_draw_bound(pp: int, n_micro: int, v: int, samples, time_limit: float, n_draws: int,
                   joint: int = 3) -> dict:
    """The highest `placement_bound` over a few of `samples`, in `time_limit` seconds of wall time
    for the shape, model building included: first the `joint` draws on which the executor's
    groups have the highest replay / ideal, together (one placement for them all: a stronger
    bound than any one of them alone, when CP-SAT solves it), with half the time; then up to
    `n_draws` single draws in the same order, each solve with half of what is left (the last
    with all of it; none starts with under a second left). Returns the entry of the best try
    (`draw`: the indices in `samples` of its draws, space-separated; `groups_on_draw`: the
    searched groups' largest replay / ideal on them) with every try as [indices, lower bound,
    status] in `tried`."""
    after = replay_ratios(pp, n_micro, v, samples)["groups"]
    slowest = [int(d) for d in np.argsort(-np.asarray(after), kind="stable")]
    tries = ([slowest[:joint]] if joint > 1 else []) + [[d] for d in slowest[:n_draws]]
    best, tried, cpu_s = None, [], 0.0
    deadline = time.monotonic() + time_limit
    for i, chosen in enumerate(tries):
        left = deadline - time.monotonic()
        if tried and left < 1.0:
            break
        share = max(left, 0.1) if i == len(tries) - 1 else max(left / 2, 0.1)
        worst = max(after[d] for d in chosen)
        res = placement_bound(pp, n_micro, v, [samples[d] for d in chosen], share, ratio_cap=worst)
        cpu_s += res["cpu_s"]
        tried.append([chosen, res["lower_bound"], res["status"]])
        if best is None or res["lower_bound"] > best["lower_bound"]:
            best = dict(res, draw=" ".join(map(str, chosen)), groups_on_draw=round(worst, 4))
    best.update(cpu_s=round(cpu_s, 1), tried=tried)
    return best


def _shape(text: str) -> tuple[int, int, int]:
    try:
        pp, n_micro, v = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is pp,n_micro,v (three integers), got {text!r}") from None
    if pp < 2 or v < 1 or n_micro < 1 or (v > 1 and n_micro % pp):
        raise argparse.ArgumentTypeError(f"shape {text!r}: pp >= 2, n_micro >= 1 (a multiple of pp when v > 1)")
    return pp, n_micro, v


def main(argv: list[str] | None = None) -> int:
    import wlb_opt as wlb

    p = argparse.ArgumentParser(prog="wlb-opt bench pipeline-replay", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--model", default="7b", help="ModelSpec preset of the cost model (default 7b)")
    p.add_argument("--hardware", default="h100", help="HardwareSpec preset (default h100)")
    p.add_argument("--tokens", type=count, default=16384, help="tokens per micro-batch (default 16384)")
    p.add_argument("--docs", type=count, default=4, help="equal documents per micro-batch (default 4)")
    p.add_argument("--draws", type=count, default=20, help="random op-time draws per shape (default 20)")
    p.add_argument("--sigma", type=nonnegative, default=0.3, help="log-normal sigma of each op's time (default 0.3)")
    p.add_argument("--max-pp", type=count, default=8, help="largest pp (default 8)")
    p.add_argument("--max-micro", type=count, default=16, help="largest n_micro (default 16)")
    p.add_argument("--seed", type=natural, default=0, help="seed of the draws (default 0)")
    p.add_argument("--bound", type=_shape, action="append", default=[],
                   help="pp,n_micro,v: add the CP-SAT lower bound for this shape (repeatable; needs ortools)")
    p.add_argument("--bound-time", type=seconds, default=120.0, help="CP-SAT seconds per bound (default 120)")
    p.add_argument("--bound-per-draw", type=_shape, action="append", default=[],
                   help="pp,n_micro,v: the CP-SAT lower bound for this shape on single draws (repeatable)")
    p.add_argument("--bound-draws", type=count, default=2,
                   help="single draws tried per --bound-per-draw shape, the executor's slowest first (default 2)")
    p.add_argument("--bound-joint", type=count, default=3,
                   help="draws solved together first per --bound-per-draw shape, the executor's slowest "
                        "(default 3; 1: none)")
    p.add_argument("--bound-draw-time", type=seconds, default=60.0,
                   help="CP-SAT seconds per --bound-per-draw shape, shared by its draws (default 60)")
    p.add_argument("--out", default="results/pipeline_replay", help="folder for pipeline_replay.json")
    args = p.parse_args(argv)
    for name in ("bound_time", "bound_draw_time"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            p.error(f"--{name.replace('_', '-')} must be seconds > 0, got {value}")
    for name in ("bound_draws", "bound_joint"):  # read only by --bound-per-draw
        if args.bound_per_draw and getattr(args, name) > args.draws:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be at most --draws ({args.draws})")
    for name in ("max_pp", "max_micro"):  # the smallest shape replayed is pp = n_micro = 2
        if getattr(args, name) < 2:
            p.error(f"--{name.replace('_', '-')} must be an integer >= 2 (a pipeline of 2 stages and 2 micro-batches "
                    f"at least), got {getattr(args, name)}")
    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset(args.model), hardware=wlb.HardwareSpec.preset(args.hardware))
    lengths = [args.tokens // args.docs] * args.docs
    fwd_s, bwd_s = cost.micro_batch_cost(lengths, "fwd"), cost.micro_batch_cost(lengths, "bwd")
    rows = []
    print(f"{'v':>2} {'pp':>3} {'n_micro':>7} {'before max':>10} {'nominal max':>11} {'groups max':>10} "
          f"{'executor max':>12} {'executor mean':>13}")
    for v in (1, 2, 4):
        for pp in range(2, args.max_pp + 1):
            for n_micro in range(pp, args.max_micro + 1, pp):
                ratios = replay_ratios(pp, n_micro, v, draws(pp, n_micro, v, fwd_s, bwd_s, args.draws, args.sigma,
                                                             args.seed))
                executor = executor_ratios(ratios)
                row = dict(v=v, pp=pp, n_micro=n_micro, draws=args.draws,
                           p2p="channels" if v > 1 else "groups",
                           executor_max=round(max(executor), 4), executor_mean=round(float(np.mean(executor)), 4),
                           groups_max=round(max(ratios["groups"]), 4),
                           before_max=round(max(ratios.get("before", ratios["groups"])), 4),
                           nominal_max=round(max(ratios.get("nominal", ratios["groups"])), 4))
                rows.append(row)
                print(f"{v:>2} {pp:>3} {n_micro:>7} {row['before_max']:>10.3f} {row['nominal_max']:>11.3f} "
                      f"{row['groups_max']:>10.3f} {row['executor_max']:>12.3f} {row['executor_mean']:>13.3f}",
                      flush=True)
    bounds = []
    for pp, n_micro, v in args.bound:
        samples = draws(pp, n_micro, v, fwd_s, bwd_s, args.draws, args.sigma, args.seed)
        fresh = draws(pp, n_micro, v, fwd_s, bwd_s, args.draws, args.sigma, args.seed + 1)
        groups = next((r["groups_max"] for r in rows if (r["pp"], r["n_micro"], r["v"]) == (pp, n_micro, v)), None)
        bounds.append(placement_bound(pp, n_micro, v, samples, args.bound_time, fresh_samples=fresh,
                                      ratio_cap=groups))
        bounds[-1]["groups_max"] = groups
        bounds[-1]["groups_fresh"] = round(max(replay_ratios(pp, n_micro, v, fresh)["groups"]), 4)
        print(f"bound pp={pp} n_micro={n_micro} v={v}: every schedule of blocking groups >= "
              f"{bounds[-1]['lower_bound']:.3f} x ideal on these draws ({bounds[-1]['status']}); the searched "
              f"groups {groups}; on other draws the fitted placement {bounds[-1]['best_placement_fresh']}, the "
              f"searched groups {bounds[-1]['groups_fresh']}")
    for pp, n_micro, v in args.bound_per_draw:
        samples = draws(pp, n_micro, v, fwd_s, bwd_s, args.draws, args.sigma, args.seed)
        entry = per_draw_bound(pp, n_micro, v, samples, args.bound_draw_time, args.bound_draws, args.bound_joint)
        entry["groups_max"] = next((r["groups_max"] for r in rows
                                    if (r["pp"], r["n_micro"], r["v"]) == (pp, n_micro, v)), None)
        bounds.append(entry)
        print(f"bound pp={pp} n_micro={n_micro} v={v} on draws {entry['draw']}: every schedule of blocking groups >= "
              f"{entry['lower_bound']:.3f} x ideal there ({entry['status']}; draws tried {entry['tried']}); "
              f"the searched groups {entry['groups_on_draw']} there, {entry['groups_max']} at worst", flush=True)
    summary = [dict(v=v, shapes=sum(r["v"] == v for r in rows), p2p="channels" if v > 1 else "groups",
                    executor_worst=max(r["executor_max"] for r in rows if r["v"] == v),
                    shapes_within_1_05=sum(r["v"] == v and r["executor_max"] <= 1.05 for r in rows),
                    groups_worst=max(r["groups_max"] for r in rows if r["v"] == v),
                    before_worst=max(r["before_max"] for r in rows if r["v"] == v),
                    nominal_worst=max(r["nominal_max"] for r in rows if r["v"] == v)) for v in (1, 2, 4)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(provenance=provenance("pipeline_replay", argv),
                  config=dict(model=args.model, hardware=args.hardware, tokens=args.tokens, docs=args.docs,
                              fwd_s=fwd_s, bwd_s=bwd_s, draws=args.draws, sigma=args.sigma, seed=args.seed),
                  summary=summary, rows=rows, bounds=bounds)
    (out / "pipeline_replay.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'pipeline_replay.json'}")
    return 0
