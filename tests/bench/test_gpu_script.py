"""scripts/gpu_check.sh: its CPU smoke run works from the repository root (where a plain
PYTHONPATH used to lose against the checkout's own wlb_opt/ folder), and missing
prerequisites are named in one line and their stages skipped."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env.update(extra)
    return env


def test_cpu_smoke_runs_every_stage_from_the_repo_root(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    out = tmp_path / "smoke"
    res = subprocess.run(["bash", str(SCRIPT), "--cpu-smoke", str(out)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env=_env(PYTHON=sys.executable, WLB_OPT_COMMIT="abc123"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary == {"mode": "cpu-smoke", "commit": "abc123", "missing": "", "tests_rc": 0, "bench_rc": 0,
                       "profile_rc": 0, "cp_path_rc": 0}
    # what the device machine returns: at most 8 files, none more than two folders down
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert written == ["cost_tiny.json", "cp_path.json", "gpu_check.log", "kernel_bench.json", "summary.json",
                       "tests.xml"], written
    log = (out / "gpu_check.log").read_text()
    # the package came from the script's mirror of the installed layout, not ROOT/wlb_opt
    assert "wlb_opt from" in log and f"from {ROOT}/wlb_opt/" not in log, log[:2000]
    assert "commit abc123" in log and "==== tests" in log and "==== kernel benchmark" in log
    kernel = json.loads((out / "kernel_bench.json").read_text())
    assert kernel["correctness"]["passed"] and kernel["provenance"]["code"]["commit"]  # git's here; WLB_OPT_COMMIT without
    # the profile stage saves the validation, the attention-latency table and the memory calibration
    import wlb_opt as wlb

    cost = wlb.CostModel.load(out / "cost_tiny.json")
    assert cost.meta["validation"]["n"] == 3 and cost.memory_model is not None
    assert [r["q_len"] for r in cost.meta["attention_latency"]] == [16, 32, 64, 128]
    assert "validation MAPE:" in log
    cp_path = json.loads((out / "cp_path.json").read_text())
    assert {"before_cpu_ms", "after_first_layer_cpu_ms", "after_later_layers_cpu_ms"} <= set(cp_path["host"][0])
    assert cp_path["full"][0]["backend"] == "gloo"


def test_missing_prerequisites_are_named_and_their_stages_skipped(tmp_path):
    bare = shutil.which("python3")
    probe = subprocess.run([bare, "-c", "import torch"], capture_output=True) if bare else None
    if bare is None or probe.returncode == 0:
        pytest.skip("needs a python3 without torch on PATH")
    res = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, env=_env(PYTHON=bare))
    first = res.stdout.splitlines()[0]
    assert first.startswith("gpu_check: missing:") and "torch" in first and "CUDA" in first, res.stdout
    assert "tests: skipped" in res.stdout and "profile: skipped" in res.stdout
    assert res.returncode != 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["tests_rc"] == summary["bench_rc"] == summary["profile_rc"] == summary["cp_path_rc"] == 99


def test_stages_can_be_chosen_and_a_folder_outside_out_is_warned_about(tmp_path):
    pytest.importorskip("torch")
    out, elsewhere = tmp_path / "OUT", tmp_path / "elsewhere"
    out.mkdir()
    res = subprocess.run(["bash", str(SCRIPT), "--cpu-smoke", str(elsewhere)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env=_env(PYTHON=sys.executable, OUT=str(out),
                                                          GPU_CHECK_STAGES="none"))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "outside $OUT" in res.stdout.splitlines()[0]
    for stage in ("tests", "kernel benchmark", "profile", "CP hot path"):
        assert f"{stage}: not selected (GPU_CHECK_STAGES)" in res.stdout, res.stdout
    summary = json.loads((elsewhere / "summary.json").read_text())
    assert summary["tests_rc"] == summary["bench_rc"] == summary["profile_rc"] == summary["cp_path_rc"] == 99
