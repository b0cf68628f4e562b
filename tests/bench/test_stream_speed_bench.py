"""`wlb-opt bench stream-speed` on a short stream: a row per (N, stream, method, lookahead,
loop), CPU-time percentiles in order, and bad options refused by name."""
import json

import pytest

from wlb_opt.bench import stream_speed


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
    assert len(data["shard"]) == 1  # sharding is timed once, on the first setting
    assert "wlb_fill" in capsys.readouterr().out


@pytest.mark.parametrize("option, value, message", [("--methods", "wlb,nope", "--methods must name"),
                                                    ("--loops", "python,fortran", "unknown loops"),
                                                    ("--lookaheads", "0,-1", "--lookaheads must be >= 0")])
def test_bad_options_are_usage_errors(option, value, message, capsys):
    with pytest.raises(SystemExit):
        stream_speed.main([option, value, "--steps", "2", "--seeds", "1"])
    assert message in capsys.readouterr().err
