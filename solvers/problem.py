"""The packing problem as the solvers see it: plain numpy arrays, no cost model, no torch.

Items are documents (or window-sized pieces of documents) with a token length and a weight
(their modelled cost in seconds). A solution puts every item in one of `n_bins` bins of at
most `max_tokens` tokens, or defers it. The load of a bin is the sum of its weights plus
`bin_const`; every solver minimises (or greedily balances) the largest load.
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
    seed: int = 0
    backend: str | None = None
    options: dict = field(default_factory=dict)

    @property
    def n_items(self) -> int:
        return int(len(self.lengths))

    def loads(self, bins) -> np.ndarray:
        return np.array([self.weights[b].sum() + self.bin_const for b in bins], dtype=np.float64)


@dataclass
class PackResult:
    bins: list
    """Per bin, int64 positions of its items (into `pieces` when given, else into the items)."""
    deferred: np.ndarray
    """int64 positions not placed."""
    pieces: tuple | None = None
    """(source item, length, offset inside the item) when the solver cut items ("original")."""
    status: str = "heuristic"
    objective: float | None = None
    bound: float | None = None
    scale: float | None = None
    build_s: float = 0.0
    solve_s: float = 0.0
    extra: dict = field(default_factory=dict)
