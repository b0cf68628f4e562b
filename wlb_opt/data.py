"""Deprecated alias, kept for one release: `wlb_opt.data` is now `wlb_opt.workloads`.

Every name resolves to the object in the new module, so old imports get the same functions
and classes.
"""
from __future__ import annotations

import warnings
from types import ModuleType

from . import workloads as _new

warnings.warn("wlb_opt.data is deprecated; import wlb_opt.workloads instead", DeprecationWarning, stacklevel=2)

__all__ = getattr(_new, "__all__", [name for name, value in vars(_new).items() if not name.startswith("_")
                                    and not isinstance(value, ModuleType)
                                    and getattr(value, "__module__", _new.__name__) == _new.__name__])


def __getattr__(name: str):
    return getattr(_new, name)


def __dir__() -> list[str]:
    return sorted(dir(_new))
