"""`wlb-opt bench report`: docs/results.md is what the committed JSON gives, and `--check` says when not."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from wlb_opt.bench import report
from wlb_opt.cli import main

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
PAGE = ROOT / "docs" / "results.md"


def test_the_committed_results_page_matches_its_json(capsys):
    rc = main(["bench", "report", "--check", "--results", str(RESULTS), "--output", str(PAGE)])
    assert rc == 0, capsys.readouterr().err


def test_every_committed_summary_names_its_command_and_machine():
    files = sorted(RESULTS.glob("*/*.json"))
    assert files, "docs/results holds no JSON"
    where = {s.folder: s.provenance for s in report.SECTIONS}  # keys down to a section's provenance
    for folder in sorted({f.parent for f in files}):
        path = where.get(folder.name, ("provenance",))
        provenance = [report._dig(json.loads(f.read_text()), path) for f in folder.glob("*.json")]
        found = [p for p in provenance if p]
        assert found, f"{folder.name}: no JSON file carries {'.'.join(path)}"
        command = found[0]["command"].split()
        if command[0] == "python":  # a script of the repository (scripts/NAME.py writes folder NAME)
            assert (ROOT / command[1]).is_file() and command[1] == f"scripts/{folder.name}.py", (folder.name, command)
        else:
            assert command[:2] in (["wlb-opt", "bench"], ["wlb-opt", "profile"]), command
            name = command[2] if command[1] == "bench" else "profile"
            assert folder.name.replace("_", "-").startswith(name), (folder.name, command)
        assert {"platform", "cpu_count", "torch"} <= set(found[0]["machine"])


def test_check_fails_in_one_line_when_the_json_changes(tmp_path, capsys):
    results = tmp_path / "docs" / "results"
    shutil.copytree(RESULTS / "pack_speed", results / "pack_speed")
    page = tmp_path / "docs" / "results.md"
    assert main(["bench", "report", "--results", str(results), "--output", str(page)]) == 0
    assert main(["bench", "report", "--check", "--results", str(results), "--output", str(page)]) == 0
    saved = json.loads((results / "pack_speed" / "pack_speed.json").read_text())
    saved["rows"][0]["median_ms"] += 1.0
    (results / "pack_speed" / "pack_speed.json").write_text(json.dumps(saved))
    capsys.readouterr()
    assert main(["bench", "report", "--check", "--results", str(results), "--output", str(page)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "differs from what the JSON gives" in err
    page.unlink()
    assert main(["bench", "report", "--check", "--results", str(results), "--output", str(page)]) == 1
    assert "is missing" in capsys.readouterr().err


def test_a_page_names_the_command_and_links_the_pictures(tmp_path):
    folder = tmp_path / "results" / "demo_bench"
    folder.mkdir(parents=True)
    provenance = dict(command="wlb-opt bench demo-bench --out x", machine=dict(platform="p", cpu_count=3, torch=None))
    (folder / "demo_bench.json").write_text(json.dumps(dict(provenance=provenance, rows=[
        dict(method="a", ms=1.23456, ok=True, nested=[1]), dict(method="b", ms=None, ok=False, nested=[2])])))
    (folder / "plot.png").write_bytes(b"")
    text = report.render(tmp_path / "results", tmp_path / "results.md")
    assert "wlb-opt bench demo-bench --out x" in text and "cpu_count 3" in text
    assert "| method | ms | ok |" in text and "| a | 1.235 | yes |" in text and "| b | - | no |" in text
    assert "nested" not in text
    assert "](results/demo_bench/plot.png)" in text


def test_provenance_names_the_code_and_the_page_prints_it(tmp_path):
    import subprocess

    from wlb_opt import __version__
    from wlb_opt._provenance import provenance

    code = provenance("demo-bench", ["--out", "x"])["code"]
    assert code["version"] == __version__
    if (ROOT / ".git").exists():  # a checkout: the commit it runs, "dirty" when tracked files differ
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        assert code["commit"].split()[0] == head
    folder = tmp_path / "results" / "demo_bench"
    folder.mkdir(parents=True)
    recorded = dict(command="wlb-opt bench demo-bench", code=dict(version="9.9", commit="abc123def456"),
                    machine=dict(platform="p", cpu_count=3, torch=None))
    (folder / "demo_bench.json").write_text(json.dumps(dict(provenance=recorded, rows=[dict(a=1)])))
    text = report.render(tmp_path / "results", tmp_path / "results.md")
    assert "Machine: platform p, cpu_count 3. Code: wlb-opt 9.9, commit abc123def456." in text


def test_a_copy_inside_another_repository_records_no_commit(tmp_path):
    import shutil
    import subprocess
    import sys

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    run = dict(cwd=tmp_path, check=True, capture_output=True)
    subprocess.run(["git", "init", "-q"], **run)
    subprocess.run(["git", "-c", "user.email=a@b", "-c", "user.name=x", "commit", "-q", "--allow-empty", "-m", "x"],
                   **run)
    site = tmp_path / "venv" / "site"
    shutil.copytree(ROOT / "wlb_opt", site / "wlb_opt", ignore=shutil.ignore_patterns("__pycache__", "*.npy"))
    code = [sys.executable, "-c", "import wlb_opt._provenance as p; print(p.code()['commit'])"]
    env = {k: v for k, v in os.environ.items() if k != "WLB_OPT_COMMIT"}
    out = subprocess.run(code, cwd=site, check=True, capture_output=True, text=True, env=env).stdout.strip()
    assert out == "None"  # not the enclosing repository's commit
    # told by the environment (a device machine's copy of the tree has no .git)
    out = subprocess.run(code, cwd=site, check=True, capture_output=True, text=True,
                         env=dict(env, WLB_OPT_COMMIT="0123abcd")).stdout.strip()
    assert out == "0123abcd"


def test_a_missing_results_folder_is_a_usage_error(tmp_path, capsys):
    assert main(["bench", "report", "--results", str(tmp_path / "none"), "--output", str(tmp_path / "r.md")]) == 2
    assert "is not a folder" in capsys.readouterr().err
