"""`wlb-opt bench hf-throughput` in its quick mode: both sides run, at equal tokens, with the same losses."""
from __future__ import annotations

import json


def test_hf_throughput_quick(tmp_path):
    """cp=2 on 2 gloo ranks against the --hf-packed baseline, 2 steps of 128-token windows: the
    JSON holds provenance, equal tokens per step, both clocks, the commands, and losses that
    agree step by step (the same model, seed and documents on both sides)."""
    from wlb_opt.bench import hf_throughput

    out = tmp_path / "h"
    assert hf_throughput.main(["--configs", "cp2", "--steps", "2", "--rounds", "1", "--window", "128",
                               "--out", str(out)]) == 0
    result = json.loads((out / "hf_throughput.json").read_text())
    assert result["provenance"]["command"].startswith("wlb-opt bench hf-throughput ")
    (row,) = result["rows"]
    assert row["config"] == "cp2" and row["ranks"] == 2 and row["steps"] == 1 and row["tokens_per_step"] > 0
    for clock in ("cpu", "wall"):
        assert row[f"wlb_{clock}_tokens_per_s"] > 0 and row[f"hf_{clock}_tokens_per_s"] > 0
        assert abs(row[f"ratio_{clock}"] * row[f"hf_{clock}_tokens_per_s"] - row[f"wlb_{clock}_tokens_per_s"]) \
            <= 1e-6 * row[f"wlb_{clock}_tokens_per_s"]
    assert row["max_loss_rel_diff"] < 1e-4
    assert "--nproc_per_node 2" in row["command"] and "--cp 2" in row["command"]
    assert "--hf-packed" in row["hf_command"] and "--dp 1" in row["hf_command"]


def test_hf_throughput_rejects_a_warmup_as_long_as_the_run(capsys):
    import pytest

    from wlb_opt.bench import hf_throughput

    with pytest.raises(SystemExit):
        hf_throughput.main(["--steps", "2", "--warmup", "2", "--out", "/nonexistent"])
    assert "--warmup must be in [0, --steps)" in capsys.readouterr().err
