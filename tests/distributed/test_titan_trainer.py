"""WLBTrainer, torchtitan's Trainer with WLB's step, under torchrun on gloo (examples/train_titan.py):
every layout equals torchtitan's own one-process path (--check-reference, fp32, relative
1e-5), and a run resumed from torchtitan's checkpoint (DCP, the loader's stream state inside)
continues exactly as the uninterrupted run. One 2-rank layout and the resume run by default;
the other layouts are `slow`."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchtitan")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_titan.py"


def _run(nproc: int, *args: str, timeout: int = 600) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(EXAMPLE), *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def _check(out: str) -> None:
    last = out.strip().splitlines()[-1]
    match = re.fullmatch(r"reference check: max abs diff (\S+)", last)
    assert match, out[-2000:]
    assert float(match.group(1)) <= 1e-5, last


def _losses(out: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step (\d+): loss (\S+)$", out, re.M)}


LAYOUTS = {
    "cp2": ["--cp", "2"],
    "pp2": ["--pp", "2"],
    "dp2_fsdp": ["--dp", "2", "--fsdp"],
    "dp2_replicate": ["--dp", "2"],
    "tp2_qwen3": ["--tp", "2", "--family", "qwen3"],
    "qwen3_separate_qkv_pp2_interleaved": ["--pp", "2", "--virtual-stages", "2", "--family", "qwen3",
                                           "--separate-qkv"],
}


@pytest.mark.parametrize("layout", [pytest.param(name, marks=() if name == "cp2" else pytest.mark.slow)
                                    for name in LAYOUTS])
def test_every_layout_equals_torchtitans_own_path(layout):
    _check(_run(2, *LAYOUTS[layout], "--steps", "3", "--check-reference"))


@pytest.mark.slow
def test_four_ranks_cp2_pp2_equal_torchtitans_own_path():
    _check(_run(4, "--cp", "2", "--pp", "2", "--steps", "3", "--check-reference"))


def test_a_run_resumed_from_torchtitans_checkpoint_continues_as_the_uninterrupted_run(tmp_path):
    common = ["--steps", "3", "--schedule-steps", "3", "--checkpoint-every", "2"]
    straight = _losses(_run(1, *common, "--dump-folder", str(tmp_path / "straight")))
    assert sorted(straight) == [1, 2, 3]
    resumed_dir = tmp_path / "resumed" / "checkpoint"
    resumed_dir.mkdir(parents=True)
    shutil.copytree(tmp_path / "straight" / "checkpoint" / "step-2", resumed_dir / "step-2")
    resumed = _losses(_run(1, *common, "--dump-folder", str(tmp_path / "resumed")))
    assert sorted(resumed) == [3]  # the checkpoint of step 2 resumes at step 3 ...
    assert resumed == {3: straight[3]}  # ... on the same documents, weights and optimizer state
