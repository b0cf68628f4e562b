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
