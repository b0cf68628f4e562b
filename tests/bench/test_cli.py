"""The command line and the package boundary: `import wlb_opt` pulls no optional dependency."""
import json
import subprocess
import sys

import numpy as np
import pytest

from wlb_opt.cli import main
from wlb_opt.solvers.greedy import compiled_available


def test_import_pulls_no_optional_dependency():
    code = ("import sys, wlb_opt as wlb; "
            "plan = wlb.solve_pack([5, 9, 3], 2, 10, method='wlb'); "
            "wlb.check_pack(plan, [5, 9, 3], 10); "
            "bad = [m for m in ('torch', 'triton', 'ortools', 'pulp', 'highspy', 'matplotlib') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_solver_stack_imports_together():
    # ortools and highspy in one process (versions pinned in constraints-cpu.txt), plus pulp's CBC.
    for module in ("ortools", "highspy", "pulp"):
        pytest.importorskip(module)
    code = "import ortools, highspy, pulp; from ortools.sat.python import cp_model; print(pulp.listSolvers(onlyAvailable=True))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "PULP_CBC_CMD" in res.stdout


def test_pack_command_prints_rows_and_imbalance(capsys):
    assert main(["pack", "--dist", "default", "--n-micro", "4", "--method", "wlb"]) == 0
    out = capsys.readouterr().out
    assert "imbalance" in out and out.count("%") >= 4


def test_pack_command_json_is_a_valid_plan(tmp_path, capsys):
    lengths = np.array([300, 5000, 20, 7000, 900, 64])
    np.save(tmp_path / "l.npy", lengths)
    assert main(["pack", "--lengths", str(tmp_path / "l.npy"), "--n-micro", "2", "--max-tokens", "8000",
                 "--window", "8000", "--method", "fixed", "--json"]) == 0
    import wlb_opt as wlb

    plan = wlb.PackPlan.from_dict(json.loads(capsys.readouterr().out))
    wlb.check_pack(plan, lengths, 8000)


def test_pack_command_reports_bad_input(tmp_path, capsys):
    np.save(tmp_path / "l.npy", np.array([300, 9000]))
    assert main(["pack", "--lengths", str(tmp_path / "l.npy"), "--n-micro", "2", "--max-tokens", "8000",
                 "--window", "10000", "--method", "wlb"]) == 2
    assert "max_tokens" in capsys.readouterr().err


def test_unknown_command_and_benchmark(capsys):
    assert main(["frobnicate"]) == 2
    assert main(["bench", "nope"]) == 2
    assert "pack-speed" in capsys.readouterr().err


def test_pack_speed_benchmark_runs(tmp_path, capsys):
    assert main(["bench", "pack-speed", "--n-micro", "4", "--repeats", "2", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "pack_speed.json").read_text())
    assert saved["provenance"]["command"].startswith("wlb-opt bench pack-speed --n-micro 4")
    assert saved["provenance"]["machine"]["cpu_count"] >= 1
    rows = saved["rows"]
    assert {r["method"] for r in rows} == {"wlb", "wlb_phases", "original", "fixed"}
    assert all(r["median_ms"] > 0 for r in rows)
    loops = {(r["method"], r["loop"]) for r in rows}  # both loops of each method built on Algorithm 1
    want = {"python", "compiled"} if compiled_available() else {"python"}
    assert {loop for method, loop in loops if method in ("wlb", "wlb_phases")} == want


def test_pack_command_reports_bad_options_without_a_traceback(tmp_path, capsys):
    assert main(["pack", "--lengths", str(tmp_path / "missing.txt"), "--method", "wlb"]) == 2
    assert main(["pack", "--dist", "default", "--model", "13b"]) == 2
    assert main(["pack", "--dist", "default", "--max-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("wlb-opt pack: error:") == 3


def test_parity_benchmark_runs(tmp_path, capsys):
    assert main(["bench", "parity", "--seeds", "0", "--steps", "6", "--warmup", "2", "--no-progress",
                 "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "parity.json").read_text())
    assert set(data["summary"]) == {"paper", "group", "default"}
    assert main(["bench", "parity", "--seeds", "0", "--steps", "6", "--warmup", "2", "--no-progress",
                 "--settings", "default+2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "parity.json").read_text())
    assert set(data["summary"]) == {"default+2"} and data["streams"]["default+2"][0]["early_token_share"] >= 0
    assert all(0 <= v["delay_per_token"] and v["imbalance"] >= 1.0 for v in data["summary"].values())
    # no plan without lookahead displaces less than the stream's delay floor
    assert len(data["delay_floor"]) == 1 and 0 <= data["delay_floor"][0]
    assert main(["bench", "parity", "--dist", "prose", "--seeds", "4", "--steps", "30", "--warmup", "4",
                 "--no-progress", "--settings", "default", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "parity.json").read_text())
    assert 0 < data["delay_floor"][0] <= data["streams"]["default"][0]["delay_per_token"]
    assert "floor" in capsys.readouterr().out


def _imports_of(path) -> set[str]:
    """Absolute names of the wlb_opt modules a source file imports (relative imports resolved)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    rel = path.relative_to(root)
    pkg = {"solvers": "wlb_opt.solvers", "kernels": "wlb_opt.kernels", "bench": "wlb_opt.bench"}.get(
        rel.parts[0], ".".join(rel.parts[:-1]))
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("wlb_opt")}


def test_imports_point_one_way():
    # no module outside bench and cli imports wlb_opt.bench or wlb_opt.cli; bench never imports cli
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for folder in ("wlb_opt", "solvers", "kernels", "bench", "examples"):
        for path in sorted((root / folder).rglob("*.py")):
            mods = _imports_of(path)
            if path.name == "cli.py" and folder == "wlb_opt":
                continue
            bad = {m for m in mods if m == "wlb_opt.cli" or m.startswith("wlb_opt.cli.")}
            if folder != "bench":
                bad |= {m for m in mods if m == "wlb_opt.bench" or m.startswith("wlb_opt.bench.")}
            assert not bad, f"{path.relative_to(root)} imports {sorted(bad)}"
    assert "wlb_opt.workloads" in _imports_of(root / "wlb_opt" / "cli.py")


def test_benchmarks_are_discovered_by_name(capsys):
    from wlb_opt.cli import _bench_names

    names = _bench_names()
    assert {"e2e", "table2", "parity", "pack-speed", "shard", "exact", "kernel", "validate-sim"} <= set(names)
    assert "data" not in names and "demo" not in names
    assert main(["bench", "--help"]) == 0
    assert "pack-speed" in capsys.readouterr().out


def test_profile_writes_an_ignored_path_by_default():
    import shutil
    import subprocess
    from pathlib import Path

    from wlb_opt.profile import DEFAULT_OUT

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = Path(__file__).resolve().parents[2]
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", DEFAULT_OUT], cwd=root, capture_output=True)
    assert tracked.returncode != 0, f"{DEFAULT_OUT} is tracked: a default profile run would overwrite it"
    ignored = subprocess.run(["git", "check-ignore", "-q", DEFAULT_OUT], cwd=root, capture_output=True)
    assert ignored.returncode in (0, 128), f"{DEFAULT_OUT} is not ignored by .gitignore"


def test_the_version_is_written_once():
    import re
    from importlib import metadata
    from pathlib import Path

    import wlb_opt

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert not re.search(r"^version\s*=\s*\"", pyproject, re.M), "pyproject.toml writes the version a second time"
    assert metadata.version("wlb-opt") == wlb_opt.__version__


def test_the_demo_leaves_out_the_notice_about_its_own_thresholds(caplog):
    import logging
    import warnings

    from wlb_opt.bench import demo

    def run(argv):
        logging.getLogger("wlb_opt").warning("step 3: 62% of the batch's tokens are in outliers; use thresholds='auto'")
        warnings.warn("step 3: 62% of the batch's tokens are in outliers; use thresholds='auto'", UserWarning)
        logging.getLogger("wlb_opt").warning("another notice")
        return 0

    before = list(logging.getLogger("wlb_opt").filters)
    with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.INFO, logger="wlb_opt"):
        warnings.simplefilter("always")
        assert demo._quiet_about_own_settings(run, []) == 0
    assert not seen
    assert [r.getMessage() for r in caplog.records] == ["another notice"]
    assert logging.getLogger("wlb_opt").filters == before  # the filter is gone after the run
