"""`wlb-opt bench pipeline-replay`: the ratios per placement and the CP-SAT bound's contract."""
from __future__ import annotations

import pytest

from wlb_opt.bench.pipeline_replay import draws, placement_bound, replay_ratios


def test_replay_ratios_are_at_least_one_for_every_placement():
    samples = draws(2, 4, 2, 1.0, 2.0, 3, 0.3, 0)
    ratios = replay_ratios(2, 4, 2, samples)
    assert set(ratios) == {"after", "before", "nominal"}
    for values in ratios.values():
        assert len(values) == 3 and min(values) >= 1.0 - 1e-12
    assert set(replay_ratios(2, 4, 1, draws(2, 4, 1, 1.0, 2.0, 2, 0.3, 0))) == {"after"}


def test_the_bound_is_below_the_executors_groups_on_the_same_draws():
    pytest.importorskip("ortools")
    samples = draws(2, 4, 2, 1.0, 2.0, 2, 0.3, 0)
    fresh = draws(2, 4, 2, 1.0, 2.0, 2, 0.3, 1)
    got = placement_bound(2, 4, 2, samples, 60.0, fresh_samples=fresh)
    assert got["status"] in ("OPTIMAL", "FEASIBLE")
    assert 1.0 <= got["lower_bound"] <= got["best_placement"]
    # every group schedule is a placement, the executor's too (up to the rounding of op times)
    assert got["lower_bound"] <= max(replay_ratios(2, 4, 2, samples)["after"]) + 1e-3
    assert got["best_placement_fresh"] >= 1.0 - 1e-12
