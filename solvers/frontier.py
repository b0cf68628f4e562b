"""Deprecated alias, kept for one release: `wlb_opt.solvers.frontier` is now `wlb_opt.solvers.frontier_milp`.

Every name resolves to the object in the new module, so old imports get the same functions
and classes.
"""
from .._alias import deprecated_alias
from . import frontier_milp as _new

deprecated_alias(globals(), _new)
