"""The packing problem as the solvers see it: plain numpy arrays, no cost model, no torch.

Items are documents (or window-sized pieces of documents) with a token length and a weight
(their modelled cost in seconds). A solution puts every item in one of `n_bins` bins of at
most `max_tokens` tokens, or defers it. The load of a bin is the sum of its weights plus
`bin_const`; every solver minimises (or greedily balances) the largest load.

This module owns the two forms a solution takes and the order in which solutions are ranked,
so that every solver converts and compares them the same way:
- bins: per bin, the int64 positions of its items, plus the deferred positions (`PackResult`);
- assignment: one int64 per item, its bin index or -1 when deferred (what the exact models
  read back from their 0/1 variables); `bins_to_assignment` and `assignment_to_bins` convert;
- `PackProblem.lex_key`: (-placed tokens, largest load), smaller is better. With deferral
  allowed the paper's objective is lexicographic (place the most tokens, then balance), and
  without deferral every plan places the same tokens, so the key reduces to the makespan.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class PackProblem:
    lengths: np.ndarray
    """int64 token counts of the items."""
    weights: np.ndarray
    """float64 cost of each item (seconds)."""
    n_bins: int
    """Micro-batches to fill (dp * n_micro)."""
    max_tokens: int
    """Token cap of one bin, inclusive."""
    carried: int = 0
    """The first `carried` items come from an earlier step and are placed first."""
    bin_const: float = 0.0
    """Cost of an empty bin (per-micro-batch constant)."""
    time_limit: float = 10.0
    """Seconds an exact method may spend (wall clock; deterministic time for CP-SAT with
    deterministic=True). The heuristics ignore it."""
    seed: int = 0
    """Random seed handed to the exact solvers. The heuristics are deterministic."""
    backend: str | None = None
    """Solver backend of a method that has several ("milp": "cbc" or "highs")."""
    options: dict = field(default_factory=dict)
    """Method-specific options, validated by the method (e.g. allow_defer, max_iter)."""
    phase_weights: tuple[np.ndarray, np.ndarray] | None = None
    """float64 (forward, backward) cost of each item (seconds), for a method that balances the
    two phases apart ("wlb_phases"); None: not given (`weights` stands for both)."""
    phase_consts: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) cost of an empty bin (seconds), with `phase_weights`."""

    @property
    def n_items(self) -> int:
        return int(len(self.lengths))

    def loads(self, bins) -> np.ndarray:
        """Per bin, the sum of its items' weights plus bin_const (seconds)."""
        return np.array([self.weights[b].sum() + self.bin_const for b in bins], dtype=np.float64)

    def placed_tokens(self, deferred) -> int:
        """Tokens of every item that is not deferred."""
        return int(self.lengths.sum()) - int(self.lengths[np.asarray(deferred, dtype=np.int64)].sum())

    def lex_key(self, bins, deferred) -> tuple[int, float]:
        """(-placed tokens, largest load): the rank of a plan, smaller is better."""
        loads = self.loads(bins)
        return -self.placed_tokens(deferred), float(loads.max()) if len(loads) else 0.0


@dataclass
class PackResult:
    bins: list
    """Per bin, int64 positions of its items (into `pieces` when given, else into the items)."""
    deferred: np.ndarray
    """int64 positions not placed."""
    pieces: tuple | None = None
    """(source item, length, offset inside the item) when the solver cut items ("original")."""
    status: str = "heuristic"
    """How the plan was found: "heuristic", or an exact method's solver status and bound source."""
    objective: float | None = None
    """Largest load (seconds), when the solver reports it; the facade recomputes it."""
    bound: float | None = None
    """A lower bound on the optimal largest load (seconds), from an exact method."""
    scale: float | None = None
    """Solver cost units per second of an exact model (integer or normalised costs)."""
    build_s: float = 0.0
    """Seconds spent building models (and the heuristic start)."""
    solve_s: float = 0.0
    """Seconds spent inside the solver."""
    extra: dict = field(default_factory=dict)
    """Method-specific details (solver statuses per phase, start, counters)."""


def bins_to_assignment(bins, n_items: int) -> np.ndarray:
    """Per bin item positions -> bin index per item (-1 = deferred)."""
    assign = np.full(n_items, -1, dtype=np.int64)
    for b, items in enumerate(bins):
        assign[np.asarray(items, dtype=np.int64)] = b
    return assign


def assignment_to_bins(assign: np.ndarray, n_bins: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Bin index per item (-1 = deferred) -> (per bin item positions, deferred positions)."""
    bins = [np.flatnonzero(assign == b).astype(np.int64) for b in range(n_bins)]
    return bins, np.flatnonzero(assign < 0).astype(np.int64)
