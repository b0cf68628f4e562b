"""`wlb-opt bench pipeline-replay`: the ratios per placement and the CP-SAT bound's contract."""
from __future__ import annotations

import pytest

from wlb_opt.bench.pipeline_replay import draws, placement_bound, replay_ratios


def test_replay_ratios_are_at_least_one_for_every_placement_and_channels_reach_the_ideal():
    samples = draws(2, 4, 2, 1.0, 2.0, 3, 0.3, 0)
    ratios = replay_ratios(2, 4, 2, samples)
    assert set(ratios) == {"groups", "before", "nominal", "channels"}
    for values in ratios.values():
        assert len(values) == 3 and min(values) >= 1.0 - 1e-12
    assert ratios["channels"] == pytest.approx([1.0] * 3, rel=1e-12)
    assert max(ratios["groups"]) > 1.0 + 1e-6  # what the channels remove
    assert set(replay_ratios(2, 4, 1, draws(2, 4, 1, 1.0, 2.0, 2, 0.3, 0))) == {"groups"}


def test_the_bound_is_below_the_searched_groups_on_the_same_draws():
    pytest.importorskip("ortools")
    samples = draws(2, 4, 2, 1.0, 2.0, 2, 0.3, 0)
    fresh = draws(2, 4, 2, 1.0, 2.0, 2, 0.3, 1)
    got = placement_bound(2, 4, 2, samples, 60.0, fresh_samples=fresh)
    assert got["status"] in ("OPTIMAL", "FEASIBLE")
    assert 1.0 <= got["lower_bound"] <= got["best_placement"]
    # every group schedule is a placement, the searched one too (up to the rounding of op times)
    assert got["lower_bound"] <= max(replay_ratios(2, 4, 2, samples)["groups"]) + 1e-3
    assert got["best_placement_fresh"] >= 1.0 - 1e-12


def test_a_bound_on_one_draw_is_below_the_joint_bound_and_the_cap_leaves_it_unchanged():
    pytest.importorskip("ortools")
    samples = draws(2, 4, 2, 1.0, 2.0, 3, 0.3, 0)
    after = replay_ratios(2, 4, 2, samples)["groups"]
    joint = placement_bound(2, 4, 2, samples, 60.0)
    for d, sample in enumerate(samples):
        free = placement_bound(2, 4, 2, [sample], 30.0)
        capped = placement_bound(2, 4, 2, [sample], 30.0, ratio_cap=after[d])
        assert free["status"] == capped["status"] == "OPTIMAL"
        assert capped["lower_bound"] == pytest.approx(free["lower_bound"])
        assert 1.0 <= capped["lower_bound"] <= min(joint["lower_bound"], after[d] + 1e-3)


def test_per_draw_mode_records_the_best_draw(tmp_path):
    pytest.importorskip("ortools")
    import json

    from wlb_opt.bench.pipeline_replay import main

    assert main(["--max-pp", "2", "--max-micro", "4", "--draws", "2", "--bound-per-draw", "2,4,2",
                 "--bound-draws", "2", "--bound-joint", "2", "--bound-draw-time", "20", "--out", str(tmp_path)]) == 0
    (entry,) = json.loads((tmp_path / "pipeline_replay.json").read_text())["bounds"]
    assert (entry["pp"], entry["n_micro"], entry["v"]) == (2, 4, 2)
    # the two draws together, then each alone; together bounds at least as high as either
    tried = {tuple(d): (bound, status) for d, bound, status in entry["tried"]}
    assert sorted(tried) == [(0,), (0, 1), (1,)] or sorted(tried) == [(0,), (1,), (1, 0)]
    both = next(b for d, (b, _) in tried.items() if len(d) == 2)
    assert both >= max(b for d, (b, _) in tried.items() if len(d) == 1) - 2e-3  # op times rounded per model
    assert entry["lower_bound"] == max(b for b, _ in tried.values()) and entry["draws"] == len(entry["draw"].split())
    assert 1.0 <= entry["lower_bound"] <= entry["groups_on_draw"] + 1e-3 <= entry["groups_max"] + 1e-3


@pytest.mark.parametrize("args, message", [
    (["--bound-draw-time", "0"], "--bound-draw-time: expected a number of seconds > 0, got '0'"),
    (["--bound-draws", "30", "--bound-per-draw", "2,2,1"], "--bound-draws 30 must be at most --draws (20)"),
    (["--bound-joint", "21", "--bound-per-draw", "2,2,1"], "--bound-joint 21 must be at most --draws (20)"),
    (["--bound-per-draw", "2,3,2"], "a multiple of pp"),
])
def test_bad_per_draw_arguments_name_the_value(args, message, capsys):
    from wlb_opt.bench.pipeline_replay import main

    with pytest.raises(SystemExit):
        main(args)
    assert message in capsys.readouterr().err
