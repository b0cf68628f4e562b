"""Import optional dependencies with an error that names the extra to install."""
from __future__ import annotations

import importlib
from types import ModuleType

_EXTRA_OF = {
    "ortools": "exact",
    "pulp": "exact",
    "highspy": "exact",
    "torch": "torch",
    "triton": "torch",
    "matplotlib": "plot",
    "tqdm": "plot",
    "transformers": "hf",
    "torchtitan": "titan",
}


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` or raise ImportError naming the wlb-opt extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        extra = _EXTRA_OF.get(module.split(".")[0], "dev")
        raise ImportError(
            f"{feature} needs the optional dependency {module!r}; install it with "
            f"`pip install 'wlb-opt[{extra}]'`"
        ) from exc


def progress(iterable, total=None, desc=None, enable=True):
    """tqdm progress bar when available and enabled, else the iterable unchanged."""
    if not enable:
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True)


def unshadow_kernels() -> None:
    """In a source checkout, the repository's `kernels/` folder (installed as `wlb_opt.kernels`)
    sits on sys.path as a top-level `kernels` package when Python runs from the repo root.
    transformers probes for the unrelated Hugging Face `kernels` package and, finding ours,
    imports a second copy of our kernel modules (and re-registers their torch ops). Alias the
    name to the one real copy so that nothing is imported twice; transformers then sees a
    package without a version and treats HF kernels as unavailable, which they are."""
    import importlib.util
    import sys
    from pathlib import Path

    if "kernels" in sys.modules:
        return
    try:
        spec = importlib.util.find_spec("kernels")
    except (ImportError, ValueError):
        return
    if spec is None or not spec.origin:
        return
    ours = importlib.util.find_spec("wlb_opt.kernels")
    if ours is not None and ours.origin and Path(spec.origin).resolve() == Path(ours.origin).resolve():
        sys.modules["kernels"] = importlib.import_module("wlb_opt.kernels")
