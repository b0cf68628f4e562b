"""scripts/pack_instructions.py: bad arguments are named before anything runs, and under
valgrind the count of a short stream is positive, repeats exactly, and is written where
`wlb-opt bench report` reads it."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "pack_instructions.py"


def _run(*args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args, says", [
    (["real", "--n-micro", "0"], "--n-micro and --sample must be >= 1"),
    (["real", "--lookahead", "-1"], "--lookahead >= 0, got 4, 16, -1"),
    (["real", "--steps", "30", "--sample", "16"], "--steps must be at least 20 + --sample = 36, got 30"),
    (["real,fable"], "dists must be among code, default, heavy, light, prose, real, got 'real,fable'"),
    (["real", "--n-micro", "4,x"], "--n-micro must be comma-separated ints, got '4,x'"),
])
def test_bad_arguments_are_named(args, says):
    res = _run(*args)
    assert res.returncode != 0 and says in res.stderr, res.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_the_count_is_positive_and_repeats(tmp_path):
    counts = []
    for i in range(2):
        out = tmp_path / f"count{i}"
        res = _run("real", "--n-micro", "4", "--lookahead", "2", "--steps", "24", "--sample", "2", "--out", str(out),
                   timeout=600)
        assert res.returncode == 0, res.stderr[-2000:]
        data = json.loads((out / "pack_instructions.json").read_text())
        assert "scripts/pack_instructions.py real" in data["provenance"]["command"]
        (row,) = data["rows"]
        assert row["counted_steps"] == [20, 22] and row["lookahead"] == 2 and row["counted"] == 2
        assert row["m_instructions_per_pack"] == round(row["instructions_per_pack"] / 1e6, 3)
        counts.append(row["instructions_per_pack"])
    assert counts[0] > 1e5 and counts[0] == counts[1]
