"""The frontier MILP (`wlb_opt.solvers.frontier`): its optimum equals brute-force enumeration on
tiny streams, its bound lies below every packer plan within the budget, and `wlb-opt bench
frontier` runs end to end on a short stream."""
import json

import numpy as np
import pytest

from conftest import unit_cost

pytest.importorskip("highspy")

from wlb_opt.packer import WLBPacker  # noqa: E402
from wlb_opt.solvers.frontier import (aggregate_imbalance, brute_force_frontier, frontier_problem,  # noqa: E402
                                      placement_of, solve_frontier)

COST = unit_cost(attn=1e-4, linear=1e-3, doc_const=1e-3)


def fwd(lengths):
    return COST.doc_cost(lengths, "fwd")


def tiny_stream(rng, n_steps, n_outliers):
    """Batches (pieces, ids, offsets) of short pieces plus `n_outliers` long ones in all."""
    where = rng.integers(0, n_steps, n_outliers)
    batches, next_id = [], 0
    for s in range(n_steps):
        lengths = list(rng.integers(1, 25, int(rng.integers(1, 5)))) + list(rng.integers(40, 95, int((where == s).sum())))
        batches.append((np.array(lengths, dtype=np.int64), np.arange(next_id, next_id + len(lengths)),
                        np.zeros(len(lengths), dtype=np.int64)))
        next_id += len(lengths)
    return batches


@pytest.mark.parametrize("seed", range(4))
def test_frontier_optimum_equals_brute_force_on_tiny_streams(seed):
    rng = np.random.default_rng(seed)
    batches = tiny_stream(rng, n_steps=3, n_outliers=3)
    problem = frontier_problem(batches, fwd, n_micro=2, max_tokens=120, outlier_min=40, early=1, late=1)
    assert len(problem.outlier_length) == 3
    for budget in (0.0, 0.15, 0.6):
        exact = solve_frontier(problem, budget, time_limit=30)
        brute = brute_force_frontier(problem, budget)
        if not np.isfinite(brute):
            assert exact.objective is None
            continue
        assert exact.status == "Optimal"
        assert exact.objective == pytest.approx(brute, rel=1e-3)
        assert exact.bound <= exact.objective * (1 + 1e-6)
        assert exact.displacement_per_token <= budget + 1e-9


def test_bound_lies_below_every_packer_plan_within_its_displacement():
    rng = np.random.default_rng(7)
    batches = tiny_stream(rng, n_steps=12, n_outliers=8)
    problem = frontier_problem(batches, fwd, n_micro=2, max_tokens=120, outlier_min=40, early=2, late=6)
    mbc = COST.mb_const("fwd")
    checked = 0
    for kw in (dict(thresholds=[40], max_delay=4), dict(thresholds=[40], max_delay=4, lookahead=2),
               dict(thresholds=[40], max_delay=4, release="group", balance_tolerance=1.2)):
        packer = WLBPacker(2, 120, COST, **kw)
        plans = [p for p in (packer.pack(*b) for b in batches) if p is not None] + packer.drain()
        disp = packer.stats()["displacement_per_token"]
        if placement_of(problem, plans) is None:
            continue  # a piece outside the model's window: the bound does not apply
        total = sum(max(COST.micro_batch_cost(p.lengths[mb], "fwd") - mbc for mb in p.micro_batches) for p in plans)
        result = solve_frontier(problem, disp + 1e-9, time_limit=5, starts=[placement_of(problem, plans)])
        assert result.bound <= total * (1 + 1e-6), kw
        assert aggregate_imbalance(result.bound, problem) <= aggregate_imbalance(total, problem) + 1e-6
        checked += 1
    assert checked >= 2


def test_bad_budget():
    problem = frontier_problem(tiny_stream(np.random.default_rng(0), 2, 1), fwd, 2, 120, outlier_min=40,
                               early=0, late=1)
    with pytest.raises(ValueError, match="budget must be"):
        solve_frontier(problem, -0.1)


def test_bench_frontier_runs_on_a_short_stream(tmp_path, capsys):
    from wlb_opt.bench import frontier

    assert frontier.main(["--steps", "24", "--budgets", "0.5", "--time-limit", "2", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "frontier.json").read_text())
    assert len(out["frontier"]) == 1 and out["heuristics"]
    for row in out["heuristics"]:
        assert -1.0 <= row["length_displacement_corr"] <= 1.0
        assert sum(row["top1_share_by_tenth"]) == pytest.approx(1.0)
        if row["gap_to_bound"] is not None:
            assert row["gap_to_bound"] >= -1e-6  # no heuristic beats the proven bound
    assert "gap" in capsys.readouterr().out
