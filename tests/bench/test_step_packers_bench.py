"""`wlb-opt bench step-packers` end to end on short streams: every step packer re-packs the
defaults' steps, CP-SAT brackets them, and the loop rows carry imbalance, displacement and
CPU time."""
import json

import pytest

from wlb_opt.bench import step_packers


def test_step_packers_quick_run_writes_a_consistent_summary(tmp_path, capsys):
    exact = step_packers._has_exact()
    argv = ["--quick", "--steps", "24", "--warmup", "4", "--exact-steps", "2" if exact else "0",
            "--time-limit", "2", "--no-progress", "--out", str(tmp_path)]
    assert step_packers.main(argv) == 0
    data = json.loads((tmp_path / "step_packers.json").read_text())
    assert data["provenance"]["command"].startswith("wlb-opt bench step-packers")
    kinds = {row["streams"] for row in data["summary"]}
    assert kinds == {"scored", "calibration"}
    for row in data["summary"]:
        for method in ("wlb", "wlb_ls", "wlb_fill", "wlb_phases", "wlb_fwd"):
            assert row[f"{method}_imbalance"] >= 1.0 and row[f"{method}_packing"] >= 1.0
            assert row[f"{method}_bwd"] >= 1.0 and row[f"{method}_sim"] > 0
        assert row["defaults_sim"] > 0
        # the descent of wlb_ls only lowers Algorithm 1's largest load
        assert row["wlb_ls_packing"] <= row["wlb_packing"] + 1e-12
        if exact:  # proven bound <= CP-SAT's plan <= Algorithm 1 (CP-SAT starts from it)
            assert row["exact_bound_packing"] <= row["exact_cpsat_packing"] + 1e-9
            assert row["exact_cpsat_packing"] <= row["exact_wlb_packing"] + 1e-9
    # full steps and the others: shares summing to one, and (one stream per kind here) the
    # share-weighted mean of their imbalance is the stream's
    for kind in kinds:
        parts = [g for g in data["regimes"] if g["streams"] == kind]
        assert [g["steps"] for g in parts] == ["full", "other"]
        assert sum(g["share"] for g in parts) == pytest.approx(1.0)
        whole = next(r for r in data["summary"] if r["streams"] == kind)["defaults_imbalance"]
        assert sum(g["share"] * g["defaults_imbalance"] for g in parts if g["share"]) == pytest.approx(whole)
        if exact:  # the CP-SAT steps are spread over the stream: both of them solved, each in its regime
            assert sum(g["exact_steps"] for g in parts) == 2
            for g in parts:
                if g["exact_steps"]:
                    assert g["exact_bound_packing"] <= g["exact_cpsat_packing"] + 1e-9 <= g["exact_wlb_packing"] + 2e-9
    assert {r["method"] for r in data["loop"]} == {"wlb", "wlb_phases", "wlb_fill"}
    assert all(r["median_ms"] > 0 and r["displacement_per_token"] >= 0 and r["imbalance_bwd"] >= 1.0
               for r in data["loop"])
    assert "wlb_fill" in capsys.readouterr().out


def test_unknown_distribution_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        step_packers.main(["--dists", "nope"])
    assert "unknown distributions ['nope']" in capsys.readouterr().err


def test_forward_cost_plans_on_the_forward_cost_alone():
    import numpy as np

    import wlb_opt as wlb

    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4),
                                  wlb.HardwareSpec.preset("h100"))
    forward = step_packers.forward_cost(cost)
    d = np.array([1, 300, 4096, 70000])
    assert np.array_equal(forward.doc_cost(d), cost.doc_cost(d, "fwd"))
    assert forward.mb_const() == cost.mb_const("fwd")
    assert np.array_equal(forward.doc_cost(d, "fwd"), cost.doc_cost(d, "fwd"))


def test_pipeline_ratio_is_one_for_equal_micro_batches_and_grows_with_a_heavy_one():
    import numpy as np

    import wlb_opt as wlb

    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4),
                                  wlb.HardwareSpec.preset("h100"))
    lengths = np.array([8192] * 8)
    even = wlb.solve_pack(lengths, 4, 16384, cost, "wlb")
    assert step_packers.pipeline_ratio(even, cost, 4) == pytest.approx(1.0, rel=1e-12)
    # the same tokens, one micro-batch holding one long document: 1F1B pays its stage times
    skewed = wlb.solve_pack(np.array([16384, 4096, 4096, 4096, 4096, 8192, 8192]), 4, 16384, cost, "wlb")
    assert step_packers.pipeline_ratio(skewed, cost, 4) > 1.0


def test_a_step_is_full_from_99_percent_of_its_token_capacity():
    import numpy as np

    import wlb_opt as wlb

    cap, n = 1000, 4
    for placed, full in ((n * cap, True), (int(0.99 * n * cap), True), (int(0.99 * n * cap) - 1, False)):
        lengths = np.array([cap] * (placed // cap) + ([placed % cap] if placed % cap else []), dtype=np.int64)
        plan = wlb.solve_pack(lengths, n, cap, method="wlb")
        assert not len(plan.deferred)
        assert step_packers.is_full(plan) is full, placed


@pytest.mark.parametrize("lookahead", [0, 2])
def test_the_loop_rows_measure_the_steps_parity_measures(lookahead, monkeypatch):
    """One step per global batch: the drain's steps past the last batch's are not counted."""
    from wlb_opt.bench import parity
    import wlb_opt as wlb
    from wlb_opt.packer import PackerConfig
    from wlb_opt.workloads import DEFAULT_SEED, global_batches

    window, n = 131072, 4
    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4),
                                  wlb.HardwareSpec.preset("h100"))
    batches = global_batches("real", window, n * window, 26, seed=DEFAULT_SEED)
    monkeypatch.setattr(step_packers, "PackerConfig", lambda **kw: PackerConfig(lookahead=lookahead, **kw))
    loop = step_packers.loop_stream(batches, cost, n, int(1.25 * window), 4, "wlb_phases")
    ref = parity.run_stream(batches, cost, n, int(1.25 * window), warmup=4, method="wlb_phases", lookahead=lookahead)
    assert loop["imbalance"] == pytest.approx(ref["imbalance"], rel=1e-12)
    assert loop["displacement_per_token"] == pytest.approx(ref["delay_per_token"], rel=1e-12)


def test_the_repacked_rows_count_the_displacement_of_the_pieces_left_in_the_queues():
    """The re-packed steps are the defaults' steps: their displacement is the defaults' own,
    drained (as `parity` and the loop rows count it), not the part trained within the stream."""
    import wlb_opt as wlb
    from wlb_opt.workloads import DEFAULT_SEED, global_batches

    window, n = 131072, 4
    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4),
                                  wlb.HardwareSpec.preset("h100"))
    batches = global_batches("prose", window, n * window, 24, seed=DEFAULT_SEED)
    repacked = step_packers.repack_stream(batches, cost, n, int(1.25 * window), 4, 0, 1.0)
    loop = step_packers.loop_stream(batches, cost, n, int(1.25 * window), 4, "wlb_phases")
    assert repacked["displacement_per_token"] == pytest.approx(loop["displacement_per_token"], rel=1e-12)
