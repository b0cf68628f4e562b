"""The README's training loop runs as printed (no undefined names)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_the_readme_training_loop_runs_as_printed(capsys):
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"<!-- readme-loop -->\s*```python\n(.*?)```\s*<!-- /readme-loop -->", text, re.S)
    assert block, "README.md lost its runnable loop"
    exec(compile(block.group(1), "README.md", "exec"), {"__name__": "readme"})
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert len(lines) >= 3 and all("loss" in ln for ln in lines)
