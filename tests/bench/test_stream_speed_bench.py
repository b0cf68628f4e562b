"""`wlb-opt bench stream-speed` on a short stream: a row per (N, stream, method, lookahead,
loop), CPU-time percentiles in order, and bad options refused by name."""
import argparse
import json

import pytest

from wlb_opt.bench import stream_speed
from wlb_opt.cost_args import add_cost_args, cost_from_args
from wlb_opt.workloads import global_batches


def test_stream_speed_writes_a_row_per_setting(tmp_path, capsys):
    argv = ["--n-micro", "2", "--steps", "8", "--seeds", "1", "--dists", "real", "--lookaheads", "0,1",
            "--methods", "wlb_phases,wlb_fill", "--loops", "python", "--window", "8192", "--out", str(tmp_path)]
    assert stream_speed.main(argv) == 0
    data = json.loads((tmp_path / "stream_speed.json").read_text())
    rows = data["rows"]
    assert {(r["method"], r["lookahead"]) for r in rows} == {("wlb_phases", 0), ("wlb_phases", 1), ("wlb_fill", 0),
                                                             ("wlb_fill", 1)}
    for r in rows:
        assert r["clock"] == "cpu" and r["loop"] == "python"
        assert 0 <= r["median_ms"] <= r["p99_ms"] <= r["worst_ms"]
    # sharding is timed once, on the first setting: all micro-batches at once, and one at a time
    assert sorted((r["call"], r["strategy"]) for r in data["shard"]) == [("solve_shard", "adaptive"),
                                                                         ("solve_shards", "adaptive")]
    assert {r["steps"] for r in data["shard"]} == {rows[0]["steps"]}
    # the machine reference, timed before the streams and after them
    assert [r["when"] for r in data["reference"]] == ["before", "after"]
    assert all(r["reference_ms"] > 0 for r in data["reference"])
    assert "wlb_fill" in capsys.readouterr().out


def test_the_machine_reference_is_the_least_cpu_time_of_its_runs(monkeypatch):
    clock = iter([0.0, 0.5, 1.0, 1.2, 2.0, 2.9])  # runs of 0.5, 0.2 and 0.9 s of CPU time
    ran = []
    monkeypatch.setattr(stream_speed.time, "process_time", lambda: next(clock))
    monkeypatch.setattr(stream_speed, "_reference_workload", lambda: ran.append(1))
    assert stream_speed.reference_ms(3) == pytest.approx(200.0)
    assert len(ran) == 3


def test_repeated_passes_count_each_steps_least_time(tmp_path, monkeypatch):
    # the passes of one stream are timed apart and each step keeps its least time
    passes = iter([[3.0, 1.0, 5.0], [2.0, 4.0, 6.0], [9.0, 0.5, 7.0]])
    monkeypatch.setattr(stream_speed, "time_stream", lambda *args: (next(passes), {}))
    argv = ["--n-micro", "2", "--steps", "3", "--seeds", "1", "--dists", "real", "--lookaheads", "0",
            "--loops", "python", "--window", "8192", "--repeats", "3", "--no-shard", "--out", str(tmp_path)]
    assert stream_speed.main(argv) == 0
    (row,) = json.loads((tmp_path / "stream_speed.json").read_text())["rows"]
    assert row["repeats"] == 3
    assert row["median_ms"] == 2000.0 and row["worst_ms"] == 5000.0  # of the minima 2, 0.5, 5 seconds
    assert row["median_of_runs_ms"] == 4000.0  # the passes' medians: 3, 4, 7 seconds


@pytest.mark.parametrize("option, value, message", [("--methods", "wlb,nope", "--methods must name"),
                                                    ("--loops", "python,fortran", "unknown loops"),
                                                    ("--lookaheads", "0,-1", "--lookaheads must be >= 0"),
                                                    ("--repeats", "0", "--repeats"),
                                                    ("--shard-strategies", "adaptive,cpsat", "--shard-strategies")])
def test_bad_options_are_usage_errors(option, value, message, capsys):
    with pytest.raises(SystemExit):
        stream_speed.main([option, value, "--steps", "2", "--seeds", "1"])
    assert message in capsys.readouterr().err


def test_worker_processes_fill_the_same_rows(tmp_path):
    # --jobs 2 times each stream in a worker process: the same rows, steps and shard timings
    argv = ["--n-micro", "2", "--steps", "6", "--seeds", "2", "--dists", "real", "--lookaheads", "0,1",
            "--loops", "python", "--window", "8192"]
    assert stream_speed.main(argv + ["--out", str(tmp_path / "one")]) == 0
    assert stream_speed.main(argv + ["--jobs", "2", "--out", str(tmp_path / "two")]) == 0
    one, two = (json.loads((tmp_path / name / "stream_speed.json").read_text()) for name in ("one", "two"))
    keys = ("dist", "method", "lookahead", "n_micro", "loop", "steps", "seeds", "repeats")
    assert [tuple(r[k] for k in keys) for r in two["rows"]] == [tuple(r[k] for k in keys) for r in one["rows"]]
    assert [(r["call"], r["steps"]) for r in two["shard"]] == [(r["call"], r["steps"]) for r in one["shard"]]
    for r in two["rows"]:
        assert 0 < r["median_ms"] <= r["p99_ms"] <= r["worst_ms"]


def test_with_replicas_each_step_packs_dp_times_the_tokens_and_deals_them(tmp_path, monkeypatch):
    # --dp 2: global batches of 2 x n_micro x window tokens, packed into 2 x n_micro micro-batches
    # dealt n_micro to each replica
    seen = []
    time_stream = stream_speed.time_stream

    def recording(batches, *args, **kwargs):
        seen.append(sum(int(sum(batch[0])) for batch in batches) / len(batches))
        return time_stream(batches, *args, **kwargs)

    monkeypatch.setattr(stream_speed, "time_stream", recording)
    argv = ["--n-micro", "2", "--dp", "2", "--steps", "6", "--seeds", "1", "--dists", "real", "--lookaheads", "0",
            "--loops", "python", "--window", "8192", "--no-shard", "--out", str(tmp_path)]
    assert stream_speed.main(argv) == 0
    (row,) = json.loads((tmp_path / "stream_speed.json").read_text())["rows"]
    assert row["dp"] == 2 and row["n_micro"] == 2
    assert seen and seen[0] >= 0.9 * 2 * 2 * 8192  # dp x n_micro x window tokens per step
    p = argparse.ArgumentParser()
    add_cost_args(p, layout=("tp", "cp", "pp", "dp"))
    cost = cost_from_args(p.parse_args(["--dp", "2"]))
    plans = [plan for plan in (stream_speed.WLBPacker(2, 10240, cost).pack(*b)
                               for b in global_batches("real", 8192, 2 * 2 * 8192, 3, seed=1)) if plan is not None]
    assert all(sorted(plan.replica_of.tolist()) == [0, 0, 1, 1] for plan in plans)


def test_quick_sets_only_what_is_not_given(tmp_path):
    argv = ["--quick", "--n-micro", "2", "--steps", "5", "--dists", "real", "--lookaheads", "0", "--methods",
            "wlb_phases", "--loops", "python", "--window", "8192", "--no-shard", "--out", str(tmp_path)]
    assert stream_speed.main(argv) == 0
    data = json.loads((tmp_path / "stream_speed.json").read_text())
    assert [r["steps"] for r in data["rows"]] == [5]  # --steps given: not --quick's 200


@pytest.mark.parametrize("lookahead", [0, 2])
def test_only_the_calls_that_plan_a_step_are_timed(lookahead):
    import wlb_opt as wlb

    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4),
                                  wlb.HardwareSpec.preset("h100"))
    batches = global_batches("real", 8192, 2 * 8192, 9, seed=0)
    pack_s, _ = stream_speed.time_stream(batches, 2, 10240, cost, lookahead, None)
    assert len(pack_s) == 9 - lookahead  # with lookahead K the first K calls plan nothing
