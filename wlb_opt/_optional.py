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
