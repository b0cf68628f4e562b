"""Command-line options shared by `wlb-opt` and the benchmarks: the flags that build a
CostModel, and the argparse value types of every numeric option.

Value types: a bad number on the command line is a usage error (exit status 2, the option
named), never a traceback from deep inside a run. `count` is an integer >= 1 (steps, sizes,
repeats), `natural` an integer >= 0 (seeds, optional counts), `seconds` a finite number > 0
(time limits), `fraction` a number in [0, 1) (relative gaps); argparse turns their
ArgumentTypeError into "argument --steps: ..." with the usage line.

One place owns the flags (`--cost`, `--model`, `--hardware` and the layout degrees) and how
they become a cost model, so every command reads them the same way. The cost model carries
the layout it was built for (`cost.parallel`); the planners check their `dp`/`pp`/`cp`
against it, so a command builds its cost model for the layout it packs:
`cost_from_args(args, dp=1)` overrides a degree for one use.

A saved model (`--cost JSON`) keeps its own coefficients and with them its TP and CP
degrees (they change the coefficients). Its DP and PP degrees are set to the command's, as
they do not change the coefficients (`CostModel.analytic` splits work over tp x cp only).
A saved model without a layout accepts any degree and is returned as it is.
"""
from __future__ import annotations

import argparse
import dataclasses
import math

from .cost import LAYOUT_DIMS, CostModel
from .specs import HardwareSpec, ModelSpec, ParallelSpec

_LAYOUT_HELP = {
    "tp": "tensor-parallel degree",
    "cp": "context-parallel degree",
    "pp": "pipeline stages",
    "dp": "data-parallel replicas",
}
_COEFFICIENT_FREE = ("dp", "pp")  # degrees that do not change the analytic coefficients


def add_cost_args(p: argparse.ArgumentParser, *, tp: int = 8, cp: int = 2, pp: int = 4, dp: int = 1,
                  layout: tuple[str, ...] = LAYOUT_DIMS) -> None:
    """Add the cost-model options to `p`, with these default degrees.

    `layout` names the degrees the command lets the user set (a benchmark that sweeps CP
    itself leaves "cp" out); the others keep their default and still reach `cost_from_args`.
    """
    unknown = sorted(set(layout) - set(LAYOUT_DIMS))
    if unknown:
        raise ValueError(f"add_cost_args: unknown layout degrees {unknown}; valid: {LAYOUT_DIMS}")
    defaults = dict(tp=tp, cp=cp, pp=pp, dp=dp)
    g = p.add_argument_group("cost model")
    g.add_argument("--cost", metavar="JSON", help="a saved CostModel (its coefficients override the options below)")
    g.add_argument("--model", default="7b", help="ModelSpec preset: tiny, 550m, 7b, 30b, 70b (default 7b)")
    g.add_argument("--hardware", default="h100", help="HardwareSpec preset: h100, h200, cpu (default h100)")
    for dim in LAYOUT_DIMS:
        if dim in layout:
            g.add_argument(f"--{dim}", type=count, default=defaults[dim],
                           help=f"{_LAYOUT_HELP[dim]} (default {defaults[dim]})")
        else:
            p.set_defaults(**{dim: defaults[dim]})


def layout_from_args(args: argparse.Namespace, **overrides: int) -> ParallelSpec:
    """The ParallelSpec of the options, with `overrides` (tp, cp, pp, dp) applied."""
    unknown = sorted(set(overrides) - set(LAYOUT_DIMS))
    if unknown:
        raise ValueError(f"unknown layout degrees {unknown}; valid: {LAYOUT_DIMS}")
    return ParallelSpec(**{dim: overrides.get(dim, getattr(args, dim)) for dim in LAYOUT_DIMS})  # it checks each


def cost_from_args(args: argparse.Namespace, *, parser: argparse.ArgumentParser | None = None,
                   **overrides: int) -> CostModel:
    """The CostModel the options describe, for the layout `layout_from_args(args, **overrides)`.

    Raises ValueError for an unknown preset or degree (OSError for a missing `--cost` file);
    a saved model whose TP or CP degree disagrees with an explicit override raises too (its
    coefficients are for its own). With `parser`, such an error goes to `parser.error`
    (usage and message on stderr, exit status 2) instead.
    """
    try:
        return _cost(args, overrides)
    except (ValueError, TypeError, KeyError, OSError) as exc:
        if parser is None:
            raise
        parser.error(f"cost model: {exc}")
        raise  # unreachable: parser.error exits


def _cost(args: argparse.Namespace, overrides: dict) -> CostModel:
    parallel = layout_from_args(args, **overrides)
    if getattr(args, "cost", None):
        cost = CostModel.load(args.cost)
        if cost.parallel is None:
            return cost
        for dim in ("tp", "cp"):
            if dim in overrides:
                cost.degree(dim, overrides[dim])  # raises on disagreement, naming both
        kept = {dim: getattr(parallel, dim) for dim in _COEFFICIENT_FREE}
        return dataclasses.replace(cost, parallel=dataclasses.replace(cost.parallel, **kept))
    return CostModel.analytic(ModelSpec.preset(args.model), parallel, HardwareSpec.preset(args.hardware))


# ------------------------------------------------------------------ value types
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


def nonnegative(text: str) -> float:
    """A finite number >= 0 (spreads, noise levels)."""
    value = _real(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1) (relative gaps)."""
    value = _real(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value
