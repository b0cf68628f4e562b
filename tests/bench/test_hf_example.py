"""examples/train_hf.py equals transformers' own path on the same documents."""
from __future__ import annotations


def test_the_hf_example_matches_transformers_own_path():
    """examples/train_hf.py at cp=2 on the standard library's sources, against its rerun
    through transformers' sdpa path in one process."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(root / "examples" / "train_hf.py"), "--cp", "2", "--steps", "2", "--window", "256",
           "--check-reference"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert sum(ln.startswith("step ") and "tokens/s" in ln for ln in lines) == 2, lines
    assert lines[-1].startswith("reference check: max abs diff ") and float(lines[-1].split()[-1]) <= 1e-4, lines[-1]
