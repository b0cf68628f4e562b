"""Old module paths kept for one release: a module at the old path that warns once on import
and resolves every name to the object in the new module (so old imports get the same
functions and classes, `from old import *` included)."""
from __future__ import annotations

import warnings
from types import ModuleType


def deprecated_alias(namespace: dict, new: ModuleType) -> None:
    """Make the module whose globals are `namespace` an alias of `new`, with a
    DeprecationWarning naming both (call it at the top level of the old module)."""
    old = namespace["__name__"]
    warnings.warn(f"{old} is deprecated; import {new.__name__} instead", DeprecationWarning, stacklevel=3)
    namespace["__all__"] = getattr(new, "__all__", [
        name for name, value in vars(new).items()
        if not name.startswith("_") and not isinstance(value, ModuleType)
        and getattr(value, "__module__", new.__name__) == new.__name__])
    namespace["__getattr__"] = lambda name: getattr(new, name)
    namespace["__dir__"] = lambda: sorted(dir(new))
