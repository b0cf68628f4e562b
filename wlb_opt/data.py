"""Deprecated alias, kept for one release: `wlb_opt.data` is now `wlb_opt.workloads`.

Every name resolves to the object in the new module, so old imports get the same functions
and classes.
"""
from ._alias import deprecated_alias
from . import workloads as _new

deprecated_alias(globals(), _new)
