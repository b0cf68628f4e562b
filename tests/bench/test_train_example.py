"""examples/train.py under torchrun: its reference check, the recorded losses and gradients to the
bit, and the loss-memory benchmark."""
from __future__ import annotations

import pytest

from test_training import _RECORDED


def test_example_matches_its_single_process_reference():
    """examples/train.py with an interleaved pipeline, checked against its own one-process rerun."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(root / "examples" / "train.py"), "--cp", "1", "--pp", "2", "--virtual-stages", "2", "--steps", "2",
           "--check-reference"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=root)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    last = [ln for ln in res.stdout.splitlines() if ln.strip()][-1]
    assert last.startswith("reference check: max abs diff ") and float(last.split()[-1]) <= 1e-4, last


def test_loss_memory_bench_runs_small(tmp_path):
    from wlb_opt.bench import loss_memory

    assert loss_memory.main(["--tokens", "64", "--dim", "8", "--vocab", "100", "--out", str(tmp_path)]) == 0
    rows = __import__("json").loads((tmp_path / "loss_memory.json").read_text())
    assert [r["method"] for r in rows] == ["full logits", "chunked", "chunked", "chunked"]
    assert all(r["peak_mb"] > 0 for r in rows)


@pytest.mark.parametrize("layout", [pytest.param(name, marks=() if name == "pp2v2" else pytest.mark.slow)
                                    for name in _RECORDED])
def test_example_losses_and_gradients_are_the_recorded_ones_to_the_bit(layout, tmp_path):
    """examples/train.py --check-reference: every rank's loss (float.hex) and gradient bits of
    every step equal the recorded ones (tests/data/train_reference_losses.json)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    want = _RECORDED[layout]
    out = tmp_path / "losses.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(want["nproc"]),
           str(root / "tests" / "data" / "record_train_losses.py"), str(out), "--", *want["args"]]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "default",
                              "MKL_CBWR": "COMPATIBLE"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    for rank, records in want["ranks"].items():
        # the --steps steps, recorded; the drain's steps after them are held to the reference check
        assert json.loads(Path(f"{out}.rank{rank}").read_text())[:len(records)] == records, f"rank {rank}"
