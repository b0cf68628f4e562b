"""Packaging: every subpackage of the source tree is listed in pyproject.toml, so that a
non-editable install (a wheel) contains it; and a wheel built from the tree holds them all."""
from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _source_packages() -> set[str]:
    """Dotted names of every folder with an __init__.py, through pyproject's package-dir map."""
    roots = {"wlb_opt": ROOT / "wlb_opt"}
    roots.update({name: ROOT / folder for name, folder in _config().get("package-dir", {}).items()})
    found = set()
    for name, folder in roots.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder)
            if "__pycache__" in rel.parts:
                continue
            found.add(".".join((name, *rel.parts)) if rel.parts else name)
    return found


def test_every_subpackage_is_listed_in_pyproject():
    listed = set(_config()["packages"])
    missing = _source_packages() - listed
    assert not missing, f"add {sorted(missing)} to [tool.setuptools] packages in pyproject.toml"
    assert "wlb_opt.packer" in listed


@pytest.mark.slow
def test_a_wheel_holds_every_subpackage(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                    str(ROOT)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("wlb_opt-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in _source_packages():
        assert f"{package.replace('.', '/')}/__init__.py" in names, package
