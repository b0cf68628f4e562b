"""The README: its training loop runs as printed, it stays a front door, its links resolve."""
from __future__ import annotations

import re
from pathlib import Path

import pytest


def test_the_readme_training_loop_runs_as_printed(capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"<!-- readme-loop -->\s*```python\n(.*?)```\s*<!-- /readme-loop -->", text, re.S)
    assert block, "README.md lost its runnable loop"
    exec(compile(block.group(1), "README.md", "exec"), {"__name__": "readme"})
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert len(lines) >= 3 and all("loss" in ln for ln in lines)


README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_code_block_runs_as_printed(capsys):
    block = re.search(r"<!-- readme-code -->\s*```python\n(.*?)```\s*<!-- /readme-code -->", README.read_text(), re.S)
    assert block, "README.md lost its code block"
    exec(compile(block.group(1), "README.md", "exec"), {"__name__": "readme"})
    assert capsys.readouterr().out.startswith("imbalance ")


def test_the_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.encode()) <= 15_000, f"README.md is {len(text.encode())} bytes; detail belongs in docs/"
    for pattern in (r"\bissue \d", r"\bround\b", r"\b20\d\d-\d\d-\d\d\b", r"this session", r"\bre-run\b"):
        assert not re.search(pattern, text, re.I), f"README.md holds a process word: {pattern}"


def test_the_readme_links_resolve():
    root = README.parent
    for target in re.findall(r"\]\(([^)#\s]+)\)", README.read_text()):
        if "://" not in target:
            assert (root / target).exists(), f"README.md links to {target}, which does not exist"


def _titan_snippet() -> str:
    block = re.search(r"<!-- readme-titan -->\s*```python\n(.*?)```\s*<!-- /readme-titan -->", README.read_text(), re.S)
    assert block, "README.md lost its torchtitan snippet"
    return block.group(1)


def test_the_torchtitan_snippet_is_at_most_15_lines():
    lines = [ln for ln in _titan_snippet().splitlines() if ln.strip()]
    assert len(lines) <= 15, f"{len(lines)} non-blank lines"
    compile(_titan_snippet(), "README.md", "exec")


@pytest.mark.slow
def test_the_torchtitan_snippet_trains_as_printed(tmp_path):
    """The snippet under torchrun on one gloo process (torchtitan's debugmodel on CPU)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("torchtitan")
    script = tmp_path / "train.py"
    script.write_text(_titan_snippet())
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                          str(script)], capture_output=True, text=True, timeout=900, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert re.search(r"^step 2: loss \d", res.stdout, re.M), res.stdout[-2000:]
