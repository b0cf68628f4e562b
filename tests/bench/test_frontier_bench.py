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
    for b in out["brackets"]:
        # each heuristic meets an offline schedule of at most its displacement; the bound is below both
        assert b["offline_displacement"] <= b["displacement_per_token"] + 1e-12
        assert b["gap_lower_aggregate"] >= b["gap_achievable_aggregate"] - 1e-6
    assert "achievable" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        frontier.main(["--offline", "--dists", "nope", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        frontier.main(["--dists", "real", "--out", str(tmp_path)])
