"""wlb-opt bench frontier on a short stream."""
from __future__ import annotations

import json

import pytest


def test_bench_frontier_runs_on_a_short_stream(tmp_path, capsys):
    from wlb_opt.bench import frontier

    assert frontier.main(["--steps", "24", "--budgets", "0.5", "--time-limit", "2", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "frontier.json").read_text())
    assert out["heuristics"] and out["frontier"][0]["budget"] == 0.5
    assert [f["budget"] for f in out["frontier"]] == sorted(f["budget"] for f in out["frontier"])
    for row in out["heuristics"]:
        assert row["in_model"], row["not_in_model"]  # the window covers every heuristic
        assert -1.0 <= row["length_displacement_corr"] <= 1.0
        assert sum(row["top1_share_by_tenth"]) == pytest.approx(1.0)
        # arrivals are the stream's, whatever the method did
        assert row["top1_share_by_arrival_tenth"] == pytest.approx(out["heuristics"][0]["top1_share_by_arrival_tenth"])
        assert row["gap_to_bound"] is not None and row["gap_to_bound"] >= -1e-6  # no heuristic beats the bound
        if row["settings"].get("lookahead", 0) == 0:  # no plan without lookahead displaces less than the floor
            assert row["displacement_per_token"] >= out["meta"]["delay_floor"] - 1e-12
    assert "gap" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        frontier.main(["--steps", "4", "--budgets", "x", "--out", str(tmp_path)])


def test_a_lengths_file_shorter_than_the_steps_is_refused(tmp_path, capsys):
    """The steps past the stream's end would be empty, each scored as perfectly balanced."""
    import numpy as np
    from wlb_opt.bench import frontier
    from wlb_opt.workloads import document_stream

    short = tmp_path / "short.npy"
    np.save(short, document_stream(3 * 4 * 131072, "heavy", 1234))
    with pytest.raises(SystemExit):
        frontier.main(["--lengths", str(short), "--steps", "40", "--budgets", "0.5", "--out", str(tmp_path)])
    assert "fewer than 40 steps of 524288 (--steps 3 or fewer)" in capsys.readouterr().err


def test_bench_frontier_offline_checks_its_schedules_and_brackets_the_defaults(tmp_path, capsys):
    from wlb_opt.bench import frontier

    assert frontier.main(["--offline", "--quick", "--steps", "16", "--dists", "real", "--budgets", "0.3",
                          "--time-limit", "1", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "offline.json").read_text())
    curve = out["offline"]
    assert curve and all(c["checked"] and c["displacement_per_token"] <= c["budget"] + 1e-9 for c in curve)
    assert all(c["aggregate"] >= c["bound"] - 1e-6 for c in curve)  # no schedule beats the proven bound
    assert {b["method"] for b in out["brackets"]} == {"default (no tuning)", "default, lookahead 2",
                                                      "default, lookahead 4"}
    # the forward search ran at every budget, the forward plus backward one at the defaults' own
    budgets = {c["budget"] for c in curve}
    assert {c["budget"] for c in curve if c["objective"] == "fwd"} == budgets
    full = [c for c in curve if c["max_lead"] == out["meta"]["streams"][0]["early"]]
    assert {c["budget"] for c in full if c["objective"] == "fwd+bwd"} == \
        {b["displacement_per_token"] for b in out["brackets"]}
    assert all(c["imbalance"] >= 1.0 and c["imbalance_bwd"] >= 1.0 and c["sim"] > 0 for c in curve)
    assert all(0.0 <= r["full_share"] <= 1.0 for r in curve + out["brackets"])
    # and with each heuristic's own lead (none without lookahead, MAX_LEAD with it), at its displacement
    from wlb_opt.packer.defaults import MAX_LEAD
    early = out["meta"]["streams"][0]["early"]
    assert {b["method"]: b["max_lead"] for b in out["brackets"]} == {
        "default (no tuning)": 0, "default, lookahead 2": min(2, MAX_LEAD), "default, lookahead 4": min(4, MAX_LEAD)}
    for lead in {b["max_lead"] for b in out["brackets"]}:
        assert {c["budget"] for c in curve if c["max_lead"] == lead} == \
            {b["displacement_per_token"] for b in out["brackets"] if b["max_lead"] == lead}
        assert all(c["objective"] == "fwd+bwd" for c in curve if c["max_lead"] == lead)
    assert {c["max_lead"] for c in curve} == {early} | {b["max_lead"] for b in out["brackets"]}
    for b in out["brackets"]:
        # each heuristic meets an offline schedule of at most its displacement; the bound is below both
        assert b["offline_displacement"] <= b["displacement_per_token"] + 1e-12
        assert b["phases_offline_displacement"] <= b["displacement_per_token"] + 1e-12
        assert b["lead_offline_displacement"] <= b["displacement_per_token"] + 1e-12
        assert b["gap_achievable_lead"] == pytest.approx(b["imbalance"] - b["lead_offline_imbalance"])
        assert b["gap_lower_aggregate"] >= b["gap_achievable_aggregate"] - 1e-6
        assert b["gap_achievable_phases"] == pytest.approx(b["imbalance"] - b["phases_offline_imbalance"])
        assert b["imbalance_bwd"] >= 1.0
        # the whole stream known, every schedule of a shorter reach is one too: never worse
        assert b["phases_offline_imbalance"] <= b["lead_offline_imbalance"] + 1e-12
    assert "achievable" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        frontier.main(["--offline", "--dists", "nope", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        frontier.main(["--dists", "real", "--out", str(tmp_path)])


def test_the_forward_and_backward_search_also_meets_the_target_budgets():
    """Besides the defaults' own displacements, the search that balances both phases runs at
    `phases_budgets` (the balance targets' displacements), each schedule checked and within
    its budget, and a bound is proven there too."""
    from wlb_opt.bench._frontier_offline import PHASES_BUDGETS, run_distribution
    from wlb_opt.solvers.offline import PRICES

    import wlb_opt as wlb

    assert PHASES_BUDGETS == tuple(sorted(PHASES_BUDGETS)) and all(0 < b < 1 for b in PHASES_BUDGETS)
    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4),
                                  wlb.HardwareSpec.preset("h100"))
    out = run_distribution("real", cost, steps=16, window=131072, n_micro=4, budgets=[0.3], time_limit=1.0,
                           outlier_min=32768, seed=0, prices=PRICES[-3:], warmup=4, show=lambda m: None,
                           seeded_starts=1, phases_budgets=(0.25,))
    phases = [c for c in out["offline"] if c["objective"] == "fwd+bwd"]
    own = {b["displacement_per_token"] for b in out["brackets"]}
    assert {c["budget"] for c in phases} == own | {0.25}
    at_target = [c for c in phases if c["budget"] == 0.25]
    assert at_target[0]["bound"] is not None
    for c in at_target:
        assert c["source"] in ("none found", "none exists") or (
            c["checked"] and c["displacement_per_token"] <= 0.25 + 1e-9 and c["aggregate"] >= c["bound"] - 1e-6)
    # the forward search, which draws the frontier, stays at --budgets and the defaults' displacements
    assert {c["budget"] for c in out["offline"] if c["objective"] == "fwd"} == own | {0.3}


def test_the_schedule_checker_measures_both_phases_as_the_plans_do():
    """`check_schedule` rebuilds each step's plan from (step, micro-batch) arrays alone; on the
    defaults' own schedule it must give the plans' forward and backward imbalance."""
    import numpy as np

    from wlb_opt.bench._frontier_offline import _piece_steps, check_schedule
    from wlb_opt.bench.data import run_packer
    from wlb_opt.bench.frontier import stream_plans
    from wlb_opt.bench.step_packers import pipeline_ratio
    import wlb_opt as wlb
    from wlb_opt.packer import WLBPacker, per_step_imbalance
    from wlb_opt.solvers.offline import offline_stream
    from wlb_opt.workloads import global_batches

    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4),
                                  wlb.HardwareSpec.preset("h100"))
    W, N, steps, warmup = 32768, 4, 12, 3
    batches = global_batches("real", W, N * W, steps, seed=5)
    plans = stream_plans(run_packer(WLBPacker(N, int(1.25 * W), cost), batches))
    stream = offline_stream(batches, lambda d: cost.doc_cost(d, "fwd"))
    step, micro = _piece_steps(plans, stream)
    n_slots = int(step.max()) + 1
    check = check_schedule(batches, cost, step, micro, stream.doc_ids, stream.offsets, stream.lengths, N,
                           int(1.25 * W), n_slots, warmup, pp=4)
    for key, phase in (("imbalance", "fwd"), ("imbalance_bwd", "bwd")):
        expected = np.mean([per_step_imbalance(p, cost, phase) for p in plans[:len(batches)]][warmup:])
        assert check[key] == pytest.approx(expected, rel=1e-12)
    expected = np.mean([pipeline_ratio(p, cost, 4) for p in plans[:len(batches)]][warmup:])
    assert check["sim"] == pytest.approx(expected, rel=1e-9)
    # without lookahead nothing trains early; moving a piece of step 5 to step 2 trains it 3 steps early
    assert check["max_early"] == 0
    moved = step.copy()
    piece = int(np.flatnonzero(stream.arrival == 5)[0])
    moved[piece] = 2
    assert check_schedule(batches, cost, moved, micro, stream.doc_ids, stream.offsets, stream.lengths, N,
                          10 * W, n_slots, warmup)["max_early"] == 3
    # a step emptied counts as an empty plan does (1), here the only step measured; its pieces
    # train a step late
    two = batches[:2]
    stream2 = offline_stream(two, lambda d: cost.doc_cost(d, "fwd"))
    late = stream2.arrival.copy()
    late[late == 1] = 2
    check = check_schedule(two, cost, late, np.zeros_like(late), stream2.doc_ids, stream2.offsets, stream2.lengths,
                           N, 10 * W, 3, 1)
    assert check["imbalance"] == 1.0 and check["max_late"] == 1 and check["max_early"] == 0
    # a micro-batch over the token cap is a violation like any other
    with pytest.raises(AssertionError, match="step 0"):
        check_schedule(two, cost, stream2.arrival, np.zeros_like(late), stream2.doc_ids, stream2.offsets,
                       stream2.lengths, N, int(1.25 * W), 2, 1)


def test_bench_frontier_offline_balance_fwd_brackets_forward_planned_defaults_by_forward_searches(tmp_path):
    """--balance fwd: the defaults plan on the forward phase alone (measured on the whole cost
    model, as a packer built by hand on that cost gives), and every search balances the forward
    cost, with the whole stream known and with each default's own reach."""
    import argparse

    import numpy as np

    from wlb_opt.bench import frontier
    from wlb_opt.bench.data import run_packer
    from wlb_opt.bench.step_packers import forward_cost
    from wlb_opt.cost_args import add_cost_args, cost_from_args
    from wlb_opt.packer import PackerConfig, WLBPacker, per_step_imbalance
    from wlb_opt.workloads import DEFAULT_SEED, global_batches

    assert frontier.main(["--offline", "--quick", "--steps", "16", "--dists", "real", "--budgets", "0.3",
                          "--time-limit", "1", "--balance", "fwd", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "offline.json").read_text())
    assert out["meta"]["balance"] == "fwd" and out["meta"]["streams"][0]["balance"] == "fwd"
    curve = out["offline"]
    assert curve and {c["objective"] for c in curve} == {"fwd"}
    assert all(c["checked"] and c["displacement_per_token"] <= c["budget"] + 1e-9 for c in curve)
    early = out["meta"]["streams"][0]["early"]
    leads = {b["max_lead"] for b in out["brackets"]}
    assert {c["max_lead"] for c in curve} == {early} | leads
    for b in out["brackets"]:
        assert b["phases_offline_imbalance"] is None and b["gap_achievable_phases"] is None
        assert b["lead_offline_displacement"] <= b["displacement_per_token"] + 1e-12
        assert b["gap_achievable"] == pytest.approx(b["imbalance"] - b["offline_imbalance"])
    parser = argparse.ArgumentParser()
    add_cost_args(parser, layout=("tp", "cp", "pp"))
    cost = cost_from_args(parser.parse_args([]), parser=parser)  # the bench's default cost model
    batches = global_batches("real", 131072, 4 * 131072, 16, seed=DEFAULT_SEED)
    run = run_packer(WLBPacker(4, int(1.25 * 131072), forward_cost(cost), config=PackerConfig()), batches)
    plans = [plan for plan in run.plans if plan is not None][:16]
    by_hand = float(np.mean([per_step_imbalance(plan, cost, "fwd") for plan in plans]))
    row = next(b for b in out["brackets"] if b["method"] == "default (no tuning)")
    assert row["imbalance"] == pytest.approx(by_hand, rel=1e-12)
    with pytest.raises(SystemExit):
        frontier.main(["--balance", "fwd", "--steps", "4", "--out", str(tmp_path)])  # needs --offline


def test_offline_distributions_in_worker_processes_give_the_same_schedules(tmp_path):
    """`--jobs 2` searches each distribution in a process of its own: every draw is seeded,
    so the schedules, and the brackets read from them, are those of one process."""
    from wlb_opt.bench import frontier

    args = ["--offline", "--quick", "--steps", "8", "--dists", "real,code", "--budgets", "0.3", "--time-limit", "1"]
    runs = []
    for jobs in ("1", "2"):
        assert frontier.main(args + ["--jobs", jobs, "--out", str(tmp_path / jobs)]) == 0
        out = json.loads((tmp_path / jobs / "offline.json").read_text())
        runs.append(([{k: v for k, v in c.items() if k != "bound"} for c in out["offline"]],
                     [{k: v for k, v in b.items() if "bound" not in k and "lower" not in k} for b in out["brackets"]]))
    assert runs[0] == runs[1]
    assert {c["dist"] for c in runs[0][0]} == {"real", "code"}
