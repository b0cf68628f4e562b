"""`wlb-opt bench lookahead`: the defaults' curves over delay budgets per lookahead, compared
at equal displacement, and bad options refused by name."""
import json

import pytest

from wlb_opt.bench import lookahead


def _point(k, budget, displacement, imbalance):
    return dict(lookahead=k, delay_budget=budget, delay_per_token=displacement, imbalance=imbalance)


def test_lookahead_is_compared_at_no_more_displacement_than_k0():
    points = [_point(0, 0.4, 0.40, 1.030), _point(0, 0.5, 0.50, 1.020),
              _point(2, 0.4, 0.38, 1.025), _point(2, 0.5, 0.45, 1.010)]
    rows, within = lookahead.compare(points, [0.39, 0.5])
    at_04, at_05 = sorted(rows, key=lambda r: r["k0_displacement"])
    # at 0.40 only K=2's 0.38 point is at or below: 1.025 <= 1.030 holds
    assert at_04["at_or_below"] == 1.025 and at_04["holds"] is True
    assert at_04["at_or_below_minus_k0"] == pytest.approx(-0.005)
    assert at_04["interpolated"] == pytest.approx(1.025 + (1.010 - 1.025) * (0.02 / 0.07))
    # at 0.50 the best is 1.010, and 0.50 is past K=2's curve: no interpolation
    assert at_05["at_or_below"] == 1.010 and at_05["holds"] and at_05["interpolated"] is None
    worse = lookahead.compare([_point(0, 0.5, 0.40, 1.020), _point(2, 0.5, 0.41, 1.000),
                               _point(2, 0.4, 0.39, 1.021)], [0.4])[0]
    assert worse[0]["at_or_below"] == 1.021 and worse[0]["holds"] is False  # the better point displaces more
    none_below = lookahead.compare([_point(0, 0.5, 0.30, 1.02), _point(4, 0.5, 0.35, 1.00)], [0.2])
    assert none_below[0][0]["at_or_below"] is None and none_below[0][0]["holds"] is None  # nothing to compare
    assert none_below[1] == [dict(lookahead=0, limit=0.2, imbalance=None, delay_per_token=None, delay_budget=None),
                             dict(lookahead=4, limit=0.2, imbalance=None, delay_per_token=None, delay_budget=None)]
    best = {(w["lookahead"], w["limit"]): w["imbalance"] for w in within}
    assert best == {(0, 0.39): None, (0, 0.5): 1.020, (2, 0.39): 1.025, (2, 0.5): 1.010}


def test_lookahead_bench_writes_a_point_per_setting(tmp_path, capsys):
    argv = ["--dists", "real", "--seeds", "0", "--steps", "30", "--lookaheads", "0,2", "--budgets", "0.4,0.5",
            "--no-progress", "--out", str(tmp_path)]
    assert lookahead.main(argv) == 0
    data = json.loads((tmp_path / "lookahead.json").read_text())
    assert {(p["lookahead"], p["delay_budget"]) for p in data["points"]} == {(0, 0.4), (0, 0.5), (2, 0.4), (2, 0.5)}
    for p in data["points"]:
        assert p["imbalance"] >= 1.0 and p["delay_per_token"] >= 0 and p["dist"] == "real"
    assert len(data["equal_displacement"]) == 2 and len(data["streams"]) == 4
    assert data["provenance"]["command"].startswith("wlb-opt bench lookahead")
    assert "K=2 at K=0's default displacement" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    assert (tmp_path / "lookahead.png").stat().st_size > 0


def test_balance_fwd_plans_on_the_forward_cost_and_measures_the_whole_model(tmp_path):
    """--balance fwd: the packer plans with the backward coefficients zero; the imbalance is
    still the forward one of the whole cost model, as a packer built by hand on that cost gives."""
    import argparse

    import numpy as np

    from wlb_opt.bench.data import run_packer
    from wlb_opt.bench.step_packers import forward_cost
    from wlb_opt.cost_args import add_cost_args, cost_from_args
    from wlb_opt.packer import PackerConfig, WLBPacker, per_step_imbalance
    from wlb_opt.workloads import DEFAULT_SEED, global_batches

    common = ["--dists", "real", "--seeds", "0", "--steps", "30", "--warmup", "5", "--lookaheads", "0",
              "--budgets", "0.5", "--no-progress", "--window", "16384"]
    assert lookahead.main(common + ["--balance", "fwd", "--out", str(tmp_path / "fwd")]) == 0
    assert lookahead.main(common + ["--out", str(tmp_path / "both")]) == 0
    fwd = json.loads((tmp_path / "fwd" / "lookahead.json").read_text())
    both = json.loads((tmp_path / "both" / "lookahead.json").read_text())
    assert fwd["balance"] == "fwd" and both["balance"] == "fwd_bwd"
    parser = argparse.ArgumentParser()
    add_cost_args(parser, layout=("tp", "cp", "pp"))
    cost = cost_from_args(parser.parse_args([]), parser=parser)  # the bench's default cost model
    batches = global_batches("real", 16384, 4 * 16384, 30, seed=DEFAULT_SEED)
    packer = WLBPacker(4, int(1.25 * 16384), forward_cost(cost), config=PackerConfig(delay_budget=0.5))
    plans = [plan for plan in run_packer(packer, batches).plans if plan is not None]
    by_hand = float(np.mean([per_step_imbalance(plan, cost, "fwd") for plan in plans][5:]))
    assert fwd["points"][0]["imbalance"] == pytest.approx(by_hand, rel=1e-12)
    assert fwd["points"][0]["imbalance"] != both["points"][0]["imbalance"]


@pytest.mark.parametrize("option, value, message", [("--dists", "real,nope", "--dists must name"),
                                                    ("--lookaheads", "2,4", "must include 0"),
                                                    ("--budgets", "0.4,x", "--budgets must be comma-separated"),
                                                    ("--seeds", "-1", "--seeds must be finite integers >= 0"),
                                                    ("--limits", "0.4,nan", "--limits must be finite numbers >= 0"),
                                                    ("--budgets", "inf", "--budgets must be finite numbers >= 0"),
                                                    ("--balance", "bwd", "invalid choice")])
def test_bad_options_are_usage_errors(option, value, message, capsys):
    with pytest.raises(SystemExit):
        lookahead.main([option, value, "--steps", "2"])
    assert message in capsys.readouterr().err
