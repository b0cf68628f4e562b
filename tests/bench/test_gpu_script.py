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
                         text=True, timeout=300, env=_env(PYTHON=sys.executable))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary == {"mode": "cpu-smoke", "missing": "", "tests_rc": 0, "bench_rc": 0, "profile_rc": 0,
                       "cp_path_rc": 0}
    env_txt = (out / "env.txt").read_text()
    # the package came from the script's mirror of the installed layout, not ROOT/wlb_opt
    assert "wlb_opt from" in env_txt and f"from {ROOT}/wlb_opt/" not in env_txt, env_txt
    assert json.loads((out / "kernel" / "kernel_bench.json").read_text())["correctness"]["passed"]
    assert (out / "cost_tiny.json").exists() and (out / "tests.xml").exists()
    # the profile stage saves the validation, the attention-latency table and the memory calibration
    import wlb_opt as wlb

    cost = wlb.CostModel.load(out / "cost_tiny.json")
    assert cost.meta["validation"]["n"] == 3 and cost.memory_model is not None
    assert [r["q_len"] for r in cost.meta["attention_latency"]] == [16, 32, 64, 128]
    assert "validation MAPE:" in (out / "profile.log").read_text()
    cp_path = json.loads((out / "cp_path" / "cp_path.json").read_text())
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
