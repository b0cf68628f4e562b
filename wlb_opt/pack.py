"""Deprecated alias, kept for one release: `wlb_opt.pack` is now `wlb_opt.step_pack`.

Every name resolves to the object in the new module, so old imports get the same functions
and classes.
"""
from ._alias import deprecated_alias
from . import step_pack as _new

deprecated_alias(globals(), _new)
