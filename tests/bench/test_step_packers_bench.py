"""`wlb-opt bench step-packers` end to end on short streams: every step packer re-packs the
defaults' steps, CP-SAT brackets them, and the loop rows carry imbalance, displacement and
CPU time."""
import json

import pytest

from wlb_opt.bench import step_packers


def test_step_packers_quick_run_writes_a_consistent_summary(tmp_path, capsys):
    exact = step_packers._has_exact()
    argv = ["--quick", "--steps", "24", "--warmup", "4", "--exact-steps", "1" if exact else "0",
            "--time-limit", "2", "--no-progress", "--out", str(tmp_path)]
    assert step_packers.main(argv) == 0
    data = json.loads((tmp_path / "step_packers.json").read_text())
    assert data["provenance"]["command"].startswith("wlb-opt bench step-packers")
    kinds = {row["streams"] for row in data["summary"]}
    assert kinds == {"scored", "calibration"}
    for row in data["summary"]:
        for method in ("wlb", "wlb_ls", "wlb_fill", "wlb_phases"):
            assert row[f"{method}_imbalance"] >= 1.0 and row[f"{method}_packing"] >= 1.0
            assert row[f"{method}_bwd"] >= 1.0
        # the descent of wlb_ls only lowers Algorithm 1's largest load
        assert row["wlb_ls_packing"] <= row["wlb_packing"] + 1e-12
        if exact:  # proven bound <= CP-SAT's plan <= Algorithm 1 (CP-SAT starts from it)
            assert row["exact_bound_packing"] <= row["exact_cpsat_packing"] + 1e-9
            assert row["exact_cpsat_packing"] <= row["exact_wlb_packing"] + 1e-9
    assert {r["method"] for r in data["loop"]} == {"wlb", "wlb_phases", "wlb_fill"}
    assert all(r["median_ms"] > 0 and r["displacement_per_token"] >= 0 and r["imbalance_bwd"] >= 1.0
               for r in data["loop"])
    assert "wlb_fill" in capsys.readouterr().out


def test_unknown_distribution_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        step_packers.main(["--dists", "nope"])
    assert "unknown distributions ['nope']" in capsys.readouterr().err
