"""argparse value types shared by `wlb-opt` and every benchmark: a bad number on the
command line is a usage error (exit status 2, the option named), never a traceback from
deep inside a run.

    p.add_argument("--steps", type=count)          # an integer >= 1
    p.add_argument("--seed", type=natural)         # an integer >= 0
    p.add_argument("--time-limit", type=seconds)   # a finite number > 0
    p.add_argument("--gap-limit", type=fraction)   # a number in [0, 1)

argparse turns the ArgumentTypeError into "argument --steps: ..." with the usage line.
"""
from __future__ import annotations

import argparse
import math


def _integer(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
    return value


def count(text: str) -> int:
    """An integer >= 1 (steps, micro-batches, tokens, repeats, sizes)."""
    return _integer(text, 1)


def natural(text: str) -> int:
    """An integer >= 0 (seeds, optional counts where 0 means none)."""
    return _integer(text, 0)


def _real(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def seconds(text: str) -> float:
    """A finite number of seconds > 0 (time limits, budgets)."""
    value = _real(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1) (relative gaps)."""
    value = _real(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value
