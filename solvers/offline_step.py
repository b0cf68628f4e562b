"""One step of an offline schedule: the model of its imbalance that the search ranks moves by,
and the exact packer that realises it.

`step_model` is what `solvers/offline.py` evaluates tens of thousands of times per stream, so
it is plain Python on a few floats: the step's outliers (pieces of at least `outlier_min`
tokens) go to micro-batches by LPT on cost under the token cap; the short pieces are a fluid
of the step's mean cost per token poured into the micro-batches' free tokens up to a common
level (water filling), except that the largest of them lands whole on one micro-batch; the
model is max / mean of the micro-batch costs.

`pack_step` packs real pieces, exact costs and caps: the best of (1) the outliers by LPT on
cost, the rest longest first to the least-loaded micro-batch with room, then the
move-and-swap descent of `local_search.improve`; (2) `wlb_ls` (Algorithm 1 and capped LPT,
then the same descent); (3) on steps small enough (n_micro ** pieces <= `ENUMERATE_MAX`),
every assignment. Ranked as `PackProblem.lex_key`: placed tokens, then the largest load.
"""
from __future__ import annotations

import itertools

import numpy as np

from .local_search import improve, wlb_local_search
from .problem import PackProblem

OVERFLOW = 1000.0
"""The model's value of a step whose pieces do not fit is OVERFLOW x (1 + tokens over / max_tokens):
far above any imbalance, and lower the less the step overflows, so a search can repair it."""
ENUMERATE_MAX = 4096
"""A step with n_micro ** pieces assignments at most this many is packed by enumeration."""


def water_level(loads: list[float], rooms: list[int], fluid_tokens: int, density: float) -> float:
    """Largest micro-batch cost after pouring `fluid_tokens` tokens of cost `density` per token
    into micro-batches of costs `loads` with `rooms` free tokens, lowest level first.
    Requires fluid_tokens <= sum(rooms)."""
    if fluid_tokens <= 0 or density <= 0:
        return max(loads)
    open_ = sorted(range(len(loads)), key=loads.__getitem__)
    top, fluid = 0.0, fluid_tokens * density  # fluid in cost units
    while open_:
        # the level that the open micro-batches reach together, the highest ones left dry
        k = len(open_)
        total = sum(loads[j] for j in open_) + fluid
        while k > 1 and loads[open_[k - 1]] * k >= total:
            total -= loads[open_[k - 1]]
            k -= 1
        level = total / k
        full = [j for j in open_[:k] if loads[j] + density * rooms[j] < level]
        if not full:
            return max(top, level, loads[open_[-1]])
        for j in full:  # a micro-batch out of room stops at its cap; pour again without it
            fluid -= density * rooms[j]
            top = max(top, loads[j] + density * rooms[j])
            open_.remove(j)
    return top


def step_model(big_lengths: list[int], big_costs: list[float], fluid_tokens: int, fluid_cost: float,
               fluid_largest: int, fluid_largest_cost: float, n_micro: int, max_tokens: int, mb_const: float) -> float:
    """The search's model of a step's imbalance (max / mean micro-batch cost, `mb_const`
    included); at least OVERFLOW when an outlier finds no micro-batch with room (LPT) or the
    short pieces leave less than one `fluid_largest` piece of slack. The largest short piece
    (`fluid_largest` tokens, `fluid_largest_cost` seconds) is counted whole on the least-loaded
    micro-batch that has room for it. `big_*` must be in descending cost order."""
    if not big_lengths:  # short pieces only: a fluid levels out
        if fluid_tokens > n_micro * max_tokens - fluid_largest:
            return OVERFLOW * (1.0 + (fluid_tokens - n_micro * max_tokens + fluid_largest) / max_tokens)
        return 1.0
    loads = [0.0] * n_micro
    toks = [0] * n_micro
    over = 0
    for d, c in zip(big_lengths, big_costs):
        best = -1
        for j in range(n_micro):
            if toks[j] + d <= max_tokens and (best < 0 or loads[j] < loads[best]):
                best = j
        if best < 0:
            over += d
            continue
        loads[best] += c
        toks[best] += d
    rooms = [max_tokens - t for t in toks]
    if fluid_tokens:
        over += max(fluid_tokens - (sum(rooms) - fluid_largest), 0)
    if over:
        return OVERFLOW * (1.0 + over / max_tokens)
    top = water_level(loads, rooms, fluid_tokens, fluid_cost / fluid_tokens if fluid_tokens else 0.0)
    if fluid_tokens:  # the largest short piece is not divisible: it lands whole on a micro-batch with room
        lowest = min((l for l, r in zip(loads, rooms) if r >= fluid_largest), default=None)
        if lowest is None:
            return OVERFLOW * (1.0 + fluid_largest / max_tokens)
        top = max(top, lowest + fluid_largest_cost)
    mean = (sum(loads) + fluid_cost) / n_micro + mb_const
    return (top + mb_const) / mean if mean > 0 else 1.0


def _seeded(lengths: np.ndarray, costs: np.ndarray, n_micro: int, max_tokens: int, outlier_min: int):
    """Outliers by LPT on cost, the rest longest first, each to the least-loaded micro-batch
    with room (-1: no room)."""
    assign = np.full(len(lengths), -1, dtype=np.int64)
    loads = np.zeros(n_micro)
    toks = np.zeros(n_micro, dtype=np.int64)
    big = lengths >= outlier_min
    order = np.concatenate([np.flatnonzero(big)[np.argsort(-costs[big], kind="stable")],
                            np.flatnonzero(~big)[np.argsort(-lengths[~big], kind="stable")]])
    for i in order.tolist():
        room = toks + lengths[i] <= max_tokens
        if room.any():
            j = int(np.argmin(np.where(room, loads, np.inf)))
            assign[i] = j
            loads[j] += costs[i]
            toks[j] += lengths[i]
    return assign


def _enumerate(problem: PackProblem) -> np.ndarray | None:
    """The assignment of least largest load with every piece placed (None: none fits)."""
    n, m = problem.n_items, problem.n_bins
    combos = np.array(list(itertools.product(range(m), repeat=n)), dtype=np.int64).reshape(-1, n)
    onehot = combos[:, :, None] == np.arange(m)[None, None, :]
    toks = (onehot * problem.lengths[None, :, None]).sum(axis=1)
    loads = (onehot * problem.weights[None, :, None]).sum(axis=1)
    ok = (toks <= problem.max_tokens).all(axis=1)
    if not ok.any():
        return None
    top = np.where(ok, loads.max(axis=1), np.inf)
    return combos[int(np.argmin(top))]


def _to_assign(bins, n: int) -> np.ndarray:
    assign = np.full(n, -1, dtype=np.int64)
    for j, items in enumerate(bins):
        assign[np.asarray(items, dtype=np.int64)] = j
    return assign


def pack_step(lengths, costs, n_micro: int, max_tokens: int, mb_const: float = 0.0,
              outlier_min: int = 32768) -> np.ndarray:
    """Micro-batch of each piece of one step (-1: it does not fit), the best of the packings
    named in the module docstring. `costs` in seconds, `mb_const` the per-micro-batch constant."""
    lengths = np.asarray(lengths, dtype=np.int64)
    costs = np.asarray(costs, dtype=np.float64)
    n = len(lengths)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    problem = PackProblem(lengths=lengths, weights=costs, n_bins=n_micro, max_tokens=max_tokens, bin_const=mb_const)
    if n_micro ** n <= ENUMERATE_MAX:
        best = _enumerate(problem)
        if best is not None:
            return best
    seeded = _seeded(lengths, costs, n_micro, max_tokens, outlier_min)
    bins = [np.flatnonzero(seeded == j) for j in range(n_micro)]
    first = improve(problem, bins, np.flatnonzero(seeded < 0))
    second = wlb_local_search(problem)
    best = min((first, second), key=lambda r: problem.lex_key(r.bins, r.deferred))
    return _to_assign(best.bins, n)
