"""The packer's lock-free cached_property (wlb_opt/packer/_cached.py)."""
from dataclasses import dataclass

from wlb_opt.packer._cached import cached_property


class _Counter:
    def __init__(self):
        self.calls = 0

    @cached_property
    def value(self):
        """Computed once."""
        self.calls += 1
        return self.calls * 10


@dataclass(frozen=True)
class _Frozen:
    x: int

    @cached_property
    def double(self):
        return 2 * self.x


def test_the_value_is_computed_once_then_read_from_the_instance():
    c = _Counter()
    assert "value" not in c.__dict__
    assert c.value == 10 and c.value == 10 and c.calls == 1
    assert c.__dict__["value"] == 10
    c.__dict__["value"] = 7  # a value set by hand (TrialPack sets `_placed_bin` so) is what is read
    assert c.value == 7 and c.calls == 1
    other = _Counter()
    assert other.value == 10 and other.calls == 1  # per instance


def test_class_access_and_frozen_dataclasses():
    assert isinstance(_Counter.value, cached_property) and _Counter.value.__doc__ == "Computed once."
    f = _Frozen(3)
    assert f.double == 6 and f.__dict__["double"] == 6
