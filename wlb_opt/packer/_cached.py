"""`cached_property` without the lock that Python 3.11's takes on every first read.

The release policies make several candidate packings per step and read a dozen cached
attributes of each once: functools.cached_property (3.8 to 3.11) acquires an RLock for each
first read, a few percent of a step's planning time at 4 micro-batches. The planner is not
shared between threads, so a plain descriptor does: the first read computes the value and
stores it in the instance's __dict__, which later reads find before the descriptor (as with
functools.cached_property, a non-data descriptor)."""
from __future__ import annotations


class cached_property:  # noqa: N801 (named as the functools descriptor it replaces)
    """A method computed on first read, then an instance attribute (no lock: not thread-safe
    on first read)."""

    def __init__(self, func):
        self.func = func
        self.attrname = func.__name__
        self.__doc__ = func.__doc__

    def __set_name__(self, owner, name):
        self.attrname = name

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        value = instance.__dict__[self.attrname] = self.func(instance)
        return value
