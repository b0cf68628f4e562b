"""Deprecated alias, kept for one release: `wlb_opt.solvers.shard` is now `wlb_opt.solvers.chunk_rules`.

Every name resolves to the object in the new module, so old imports get the same functions
and classes.
"""
from .._alias import deprecated_alias
from . import chunk_rules as _new

deprecated_alias(globals(), _new)
