"""`PackerConfig`: the policy of a `WLBPacker`, validated once.

A packer's behaviour splits in two. The layout (`n_micro`, `max_tokens`, `dp`, `pp`, the cost
model, `memory_bytes`) and the job's limits (`seed`, `max_backlog_tokens`) are arguments of
`WLBPacker`; the policy (which documents wait, in which queues, when they leave, how each
step is packed) is a `PackerConfig`. A config checks itself in `__post_init__`; the rules
that join it to a layout (thresholds no longer than `max_tokens`, the default pool's cutoff)
are checked in one place, `queue_thresholds`, when the packer is built.

The defaults are the no-tuning defaults (defaults.py says what they are; docs/tuning.md what
was tried). Two presets name the other configurations a user may want to reproduce:
`PackerConfig.paper(thresholds)`, the paper's rule, and `PackerConfig.legacy()`, the
packer's earlier defaults.
"""
from __future__ import annotations

import dataclasses
from collections import abc
import math
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from .._validate import check_choice, check_int
from ..step_pack import get_method
from .defaults import DEFAULT_CUTOFF_SHARE, DEFAULT_MAX_DELAY
from .release import RELEASE_POLICIES, ReleaseName
from .state import check_thresholds

PackerMethod = Literal["wlb_phases", "wlb", "wlb_fill", "wlb_ls", "fixed", "cpsat", "milp"]
"""`solve_pack` methods that keep pieces whole (the packer tracks pieces across steps)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackerConfig:
    """How a `WLBPacker` holds and releases outliers and packs each step (paper §3.2;
    `wlb_opt.packer` lists the rules and the module that owns each)."""

    thresholds: tuple[int, ...] | Literal["auto"] | None = None
    """Outlier queues by length in tokens: None (one queue of the pieces >= 0.3 x max_tokens,
    `DEFAULT_CUTOFF_SHARE`), "auto" (calibrated on the first global batch, calibrate.py), or
    strictly increasing positive lengths [L1, L2, ...], one queue each (queue i holds
    L_i <= length < L_{i+1}); an empty sequence disables the queues. Stored as a tuple."""
    n_queues: int | None = None
    """Number of queues "auto" calibrates (None: 2); with explicit thresholds None or their
    count, with thresholds=None None or 1."""
    release: ReleaseName | None = None
    """When held outliers leave (release.py): "paper", "balance", "group" or "marginal"; None:
    the default, "marginal" (`resolved_release`)."""
    max_delay: int | None = DEFAULT_MAX_DELAY
    """The most steps a piece may wait in a queue (>= 1), or None: the paper's rule, a queue
    waits until it holds dp x n_micro outliers."""
    balance_tolerance: float | Literal["auto"] = "auto"
    """Predicted max / mean load a "balance", "group" or "marginal" step may reach by taking
    outliers early (>= 1.0), or "auto": set each step from the stream's displacement so far
    against `delay_budget` (defaults.py)."""
    delay_budget: float = 0.5
    """Displacement per token (mean |training step - arrival step|, token-weighted; without
    lookahead the mean delay), in steps, that calibration and balance_tolerance="auto" aim
    to stay within (>= 0; paper §3.2)."""
    method: PackerMethod = "wlb_phases"
    """The `solve_pack` method that packs each step: "wlb_phases" (Algorithm 1 with each
    micro-batch's forward and backward time balanced apart; the release policies decide on
    Algorithm 1's packings: from the same state a step takes the groups "wlb" takes, and
    only the short pieces it sheds from its heaviest micro-batch, read on the plan kept,
    may differ), "wlb" (Algorithm 1), "wlb_fill" (large pieces balanced first, short ones
    into the gaps; release candidates scored without packing their short pieces,
    docs/tuning.md says when it helps) or another method that keeps pieces whole and honours
    `carried`."""
    lookahead: int = 0
    """Global batches the packer sees ahead (>= 0). With K > 0, `pack(batch s)` returns the
    plan of step s - K and outliers may train up to K steps early (lookahead.py); with
    release="marginal" (the default), up to `defaults.MAX_LEAD` = 2 steps early, so K > 2
    makes the plans of K = 2."""

    def __post_init__(self):
        object.__setattr__(self, "thresholds", _check_thresholds(self.thresholds))
        _check_n_queues(self.thresholds, self.n_queues)
        if self.n_queues is not None:  # numpy integers as Python ints: a state_dict is JSON
            object.__setattr__(self, "n_queues", int(self.n_queues))
        if self.release is not None:
            check_choice("release", self.release, RELEASE_POLICIES)
        if self.max_delay is not None:
            object.__setattr__(self, "max_delay", check_int("max_delay", self.max_delay, 1))
        object.__setattr__(self, "balance_tolerance", _check_tolerance(self.balance_tolerance))
        if not (_is_number(self.delay_budget) and self.delay_budget >= 0):
            raise ValueError(f"delay_budget must be a finite number of steps >= 0, got {self.delay_budget!r}")
        object.__setattr__(self, "delay_budget", float(self.delay_budget))
        _check_method(self.method)
        object.__setattr__(self, "lookahead", check_int("lookahead", self.lookahead, 0))

    @classmethod
    def paper(cls, thresholds: Sequence[int], **overrides) -> PackerConfig:
        """The paper's rule (§3.2, Algorithm 1): a queue per threshold, released when it holds
        dp x n_micro outliers, with no deadline, each step packed by Algorithm 1."""
        return cls(**{**dict(thresholds=thresholds, max_delay=None, release="paper", method="wlb"), **overrides})

    @classmethod
    def legacy(cls, **overrides) -> PackerConfig:
        """The packer's earlier defaults: two calibrated queues, the paper's release with a
        deadline of 8 steps, tolerance 1.02, Algorithm 1."""
        # two calibrated queues unless the caller chooses the thresholds (then their count)
        chosen = overrides.get("thresholds", "auto")
        queues = dict(n_queues=2) if isinstance(chosen, str) and chosen == "auto" else {}
        return cls(**{**dict(thresholds="auto", max_delay=8, release="paper", balance_tolerance=1.02,
                             delay_budget=0.5, method="wlb", **queues), **overrides})

    @property
    def resolved_release(self) -> str:
        """The release policy a packer runs: `release`, or the default, "marginal", with or
        without lookahead (docs/tuning.md)."""
        return self.release if self.release is not None else "marginal"

    def replace(self, **changes) -> PackerConfig:
        """A copy with `changes` (validated like a new config)."""
        return dataclasses.replace(self, **changes)


def queue_thresholds(config: PackerConfig, max_tokens: int) -> tuple[list[int] | None, int]:
    """The rules that join a config to a layout: (thresholds, n_queues) for a packer of
    `max_tokens`; thresholds None while "auto" waits for calibration. Raises ValueError if a
    threshold exceeds max_tokens (pieces are at most max_tokens long, so its queue would stay
    empty)."""
    if config.thresholds is None:  # the default pool (defaults.py)
        return [max(1, int(DEFAULT_CUTOFF_SHARE * max_tokens))], 1
    if config.thresholds == "auto":
        return None, 2 if config.n_queues is None else config.n_queues
    thresholds = list(config.thresholds)
    if thresholds and thresholds[-1] > max_tokens:
        raise ValueError(f"thresholds {thresholds} must be <= max_tokens={max_tokens} (pieces are at most "
                         f"max_tokens long, so a queue above it stays empty)")
    return thresholds, len(thresholds)


def _is_number(value) -> bool:
    """A finite int or float, not a bool."""
    return (isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
            and math.isfinite(value))


def _check_thresholds(thresholds):
    """None, "auto", or a tuple of strictly increasing positive ints. No upper bound here: the
    packer bounds them by max_tokens (`queue_thresholds`)."""
    if thresholds is None:
        return None
    if isinstance(thresholds, str):
        if thresholds != "auto":
            raise ValueError(f"thresholds must be None, 'auto' or an increasing list of positive lengths, "
                             f"got {thresholds!r}")
        return thresholds
    # a list, tuple or 1-D array; a dict (its keys), a set (no order) or bytes (their values) are no list of lengths
    if not ((isinstance(thresholds, abc.Sequence) and not isinstance(thresholds, (bytes, bytearray)))
            or (isinstance(thresholds, np.ndarray) and thresholds.ndim == 1)):
        raise ValueError(f"thresholds must be None, 'auto' or an increasing list of positive lengths, "
                         f"got {type(thresholds).__name__} {thresholds!r:.80}")
    return tuple(check_thresholds(list(thresholds), high=None))


def _check_n_queues(thresholds, n_queues) -> None:
    if n_queues is None:
        return
    if thresholds == "auto":
        check_int("n_queues", n_queues, 1)
        return
    if isinstance(n_queues, bool) or not isinstance(n_queues, (int, np.integer)):
        raise ValueError(f"n_queues must be None or an integer, got {n_queues!r}")
    if thresholds is None and n_queues != 1:
        raise ValueError(f"n_queues={n_queues!r} does not match thresholds=None (one queue of pieces >= "
                         f"{DEFAULT_CUTOFF_SHARE} x max_tokens); pass n_queues=None or 1")
    if thresholds is not None and n_queues != len(thresholds):
        raise ValueError(f"n_queues={n_queues!r} does not match the {len(thresholds)} thresholds "
                         f"{list(thresholds)}; pass n_queues=None or {len(thresholds)}")


def _check_tolerance(tolerance):
    if isinstance(tolerance, str) and tolerance == "auto":
        return "auto"
    if not (_is_number(tolerance) and tolerance >= 1.0):
        raise ValueError(f"balance_tolerance must be 'auto' or a finite imbalance >= 1.0 (max / mean), "
                         f"got {tolerance!r}")
    return float(tolerance)


def _check_method(method) -> None:
    if not isinstance(method, str):
        raise ValueError(f"method must be a solve_pack method name, got {method!r}")
    get_method(method)  # ValueError naming the valid methods
    if method == "original":
        # Plain-4D cuts documents at sequence boundaries; the packer tracks whole pieces
        # (queues, carry, arrival steps), so it only runs methods that keep pieces whole.
        raise ValueError("WLBPacker cannot run method='original' (it cuts documents at sequence "
                         "boundaries); use solve_pack(..., method='original') per global batch, or a "
                         "method that keeps pieces whole: 'wlb_phases', 'wlb', 'wlb_fill', 'wlb_ls', 'fixed', 'cpsat', 'milp'")
