"""Packaging: every subpackage of the source tree is listed in pyproject.toml, so that a
non-editable install (a wheel) contains it; and a wheel built from the tree holds them all."""
from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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


RENAMED_MODULES = {
    "wlb_opt.docs": "wlb_opt.documents",
    "wlb_opt.data": "wlb_opt.workloads",
    "wlb_opt.pack": "wlb_opt.step_pack",
    "wlb_opt.solvers.shard": "wlb_opt.solvers.chunk_rules",
    "wlb_opt.solvers.frontier": "wlb_opt.solvers.frontier_milp",
}


@pytest.mark.parametrize("old", sorted(RENAMED_MODULES))
def test_an_old_module_path_warns_and_gives_the_same_objects(old):
    new = RENAMED_MODULES[old]
    code = ("import importlib, warnings\n"
            f"new = importlib.import_module({new!r})\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            f"    old = importlib.import_module({old!r})\n"
            "deprecations = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]\n"
            f"assert any({new!r} in m for m in deprecations), deprecations\n"
            "names = [n for n in dir(new) if not n.startswith('__')]\n"
            "assert names and all(getattr(old, n) is getattr(new, n) for n in names)\n"
            "assert set(old.__all__) <= set(dir(new))\n"
            "namespace = {}\n"
            f"exec('from {old} import *', namespace)\n"
            "assert all(namespace[n] is getattr(new, n) for n in old.__all__)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_package_and_its_subpackages_import_without_a_deprecation_warning():
    """`import wlb_opt` and every top-level name warn about nothing; the torch subpackages (where
    torch is installed) import none of the old module paths."""
    code = ("import importlib.util, warnings\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    import wlb_opt, wlb_opt.solvers, wlb_opt.packer\n"
            "    for name in wlb_opt.__all__:\n"
            "        getattr(wlb_opt, name)\n"
            "core = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]\n"
            "assert not core, core\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    if importlib.util.find_spec('torch') is not None:\n"
            "        import wlb_opt.kernels, wlb_opt.executor\n"
            "ours = [str(w.message) for w in caught if 'import wlb_opt' in str(w.message)]\n"
            "assert not ours, ours\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


def test_kernels_doc_attention_is_the_function_not_a_module():
    torch = pytest.importorskip("torch")  # noqa: F841
    import wlb_opt.kernels as kernels
    from wlb_opt.kernels import attention_ops

    assert callable(kernels.doc_attention) and kernels.doc_attention is attention_ops.doc_attention
    assert "wlb_opt.kernels.doc_attention" not in sys.modules
