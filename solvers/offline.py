"""Offline schedules of a whole stream: with every arrival known in advance, the most balanced
assignment of each piece to a training step and a micro-batch that a local search finds within
a displacement budget.

`wlb-opt bench frontier --offline` sets these beside the proven lower bound of `frontier_milp`:
a heuristic's distance to the best schedule lies between (heuristic - bound) and (heuristic -
offline schedule). Pure numpy and Python; piece costs come in as an array (seconds).

The schedule (what is searched):
- pieces of at least `outlier_min` tokens ("outliers") each have a training step in their
  window [arrival - early, arrival + late], within steps 0 .. n_slots - 1 (n_slots >= n_steps:
  steps past the stream's last batch drain what is left, as a streaming packer's drain does);
- the shorter pieces train in arrival order: step t trains positions [P_t, P_{t+1}) of the
  short pieces sorted by arrival. For given per-step amounts this order has the least total
  |step - arrival| (a transport on a line with cost |.|), so only the boundaries P are searched.

The search (per budget; budgets ascending, each warm-started from the schedule of the one below;
and, from each start given, a second search seeded there, see below):
- a step is ranked by `offline_step.step_model` (outliers by LPT on cost, short pieces poured
  as a fluid up to a common level), memoised on the step's content;
- moves: one outlier to another step of its window (when the step would overflow, the short
  pieces at its end or start go to the neighbouring step), a swap of two outliers between
  steps, a shift of a boundary P_t by a few thousand to a hundred thousand tokens; from the
  worst-ranked steps also the best split of two steps' outliers between them and ejection
  chains (one outlier into a step, one of that step's outliers out to a third);
- splits and chains are branch and bound: `_Search.floor` (the overflow of a step's
  tokens, else its costliest outlier or its mean cost over its mean; the search evaluates it
  for many steps at once, `_floors` and `_floors_with`) is a lower bound on the model that
  needs no packing, so a candidate whose floor cannot beat the best move found is
  never modelled; the moves taken are those of the full enumeration;
- a move is taken when it lowers sum_t weight_t x model_t + price x displacement (token-steps
  divided by the mean tokens per step) and keeps the displacement within the budget. The price
  descends over `prices` (a Lagrangian sweep): early phases spend displacement only on moves
  that buy much balance, the last ones spend what is left;
- the result is packed exactly per step (`offline_step.pack_step`; pieces a step cannot hold
  pass to the next step) and measured from the assignment: per-step max / mean of micro-batch
  cost (the per-micro-batch constant included), and displacement per token.

Seeded searches: a streaming planner's schedule packs its steps to the token cap or nearly,
and its short pieces are not in arrival order, so the path from the arrivals never
comes near it, and the model finds it over capacity as given. From each start given, the
search's own form of it (`start_state`) is made feasible for the model (`_Search.feasible`:
short pieces at the edges of a step over capacity move to a neighbour, the least displacement
first), then searched at each budget from its displacement less `SEED_REACH` up
(`_Search.seeded`: below its displacement, displacement is first shed at rising prices). On
heavy-tailed streams these seeded schedules are far better than the path's at the budgets near
the planner's.

The returned schedule is the best exactly-measured one within the budget and window among the
starts, the warm start, the search's result and the seeded searches' results, so it is never
worse than a start it was given.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .offline_step import OVERFLOW, pack_step, step_model

PRICES = (2.0, 1.0, 0.5, 0.25, 0.12, 0.06, 0.03, 0.015, 0.0)
"""Price of one step's worth of tokens displaced by one step, per phase, in units of the
objective (a step's imbalance)."""
SWEEPS = 6
"""Passes over every outlier and every boundary per price at most (a pass that takes no move ends the phase)."""
BOUNDARY_TOKENS = (4096, 16384, 65536)
"""Short-piece tokens a boundary move shifts (each way)."""
PARTITION_MAX = 8
"""Outliers (the costliest) whose side a two-step repartition enumerates; the rest stay put."""
CHAIN_FROM = 0.03
"""Ejection chains start from the outliers of steps whose weighted model exceeds 1 by this much."""
SHED_PRICES = (0.12, 0.25, 0.5, 1.0, 2.0, 4.0)
"""Prices, in turn, at which a search seeded from a start sheds displacement down to a budget
below the start's (each phase from where the one before stopped, until the budget is met)."""
SEED_REACH = 0.05
"""A start seeds searches at budgets down to its own displacement per token less this much."""


@dataclass(frozen=True, slots=True)
class OfflineStream:
    """Every piece of a stream, flat: piece i is tokens [offsets[i], offsets[i] + lengths[i])
    of document doc_ids[i], arrived at step arrival[i], costing cost[i] seconds."""

    lengths: np.ndarray
    doc_ids: np.ndarray
    offsets: np.ndarray
    arrival: np.ndarray
    cost: np.ndarray
    n_steps: int

    def __post_init__(self) -> None:
        n = len(self.lengths)
        for name in ("lengths", "doc_ids", "offsets", "arrival", "cost"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"OfflineStream.{name} needs one entry per piece ({n}), got {len(getattr(self, name))}")
        if n and (self.lengths.min() < 1 or self.arrival.min() < 0 or self.arrival.max() >= self.n_steps):
            raise ValueError(f"OfflineStream needs lengths >= 1 and arrivals in [0, {self.n_steps}), got lengths "
                             f"down to {self.lengths.min()} and arrivals in [{self.arrival.min()}, {self.arrival.max()}]")
        if n and not (np.isfinite(self.cost).all() and self.cost.min() >= 0):
            raise ValueError("OfflineStream.cost must be finite seconds >= 0")

    @property
    def total_tokens(self) -> int:
        return int(self.lengths.sum())


def offline_stream(batches: Sequence, piece_cost: Callable[[np.ndarray], np.ndarray]) -> OfflineStream:
    """The stream of `batches` (per step (lengths, ids, offsets), as `workloads.global_batches`
    gives them), each piece arriving at its batch's index and costing piece_cost(lengths)."""
    if not batches:
        raise ValueError("offline_stream needs at least one global batch, got none")
    parts = [[np.asarray(b[f], dtype=np.int64) for f in range(3)] for b in batches]
    lengths, ids, offsets = (np.concatenate([p[f] for p in parts]) for f in range(3))
    arrival = np.concatenate([np.full(len(p[0]), t, dtype=np.int64) for t, p in enumerate(parts)])
    cost = np.asarray(piece_cost(lengths), dtype=np.float64).reshape(-1)
    return OfflineStream(lengths=lengths, doc_ids=ids, offsets=offsets, arrival=arrival, cost=cost,
                         n_steps=len(batches))


@dataclass(frozen=True, slots=True)
class OfflineSchedule:
    """Training step and micro-batch of every piece of an `OfflineStream`, measured."""

    step: np.ndarray
    """Training step of each piece (0 .. n_slots - 1)."""
    micro_batch: np.ndarray
    """Micro-batch of each piece within its step (0 .. n_micro - 1)."""
    budget: float
    """Displacement per token the schedule was searched within."""
    displacement_per_token: float
    """Token-weighted mean |step - arrival|."""
    step_imbalance: np.ndarray
    """Per step 0 .. n_slots - 1, max / mean of its micro-batch costs (the per-micro-batch constant
    included; 1.0 for an empty step)."""
    objective: float
    """sum_t weight_t x step_imbalance_t, what the search lowers."""
    source: str
    """Which candidate won: "search" (from the arrivals), "search from start k" (seeded from start
    k), "warm" (the schedule of the budget below) or "start k"."""
    info: dict = field(default_factory=dict)
    """Counters of the search (moves taken, model evaluations, seconds are left to the caller)."""


def _check_args(stream, n_micro, max_tokens, mb_const, budgets, early, late, outlier_min, weights, prices, sweeps,
                n_slots, seeded_starts=None):
    for name, value, low in (("n_micro", n_micro, 1), ("max_tokens", max_tokens, 1), ("early", early, 0),
                             ("late", late, 0), ("outlier_min", outlier_min, 1), ("sweeps", sweeps, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if len(stream.lengths) and stream.lengths.max() > max_tokens:
        raise ValueError(f"a piece of {int(stream.lengths.max())} tokens cannot fit max_tokens={max_tokens}")
    if not (isinstance(mb_const, (int, float)) and math.isfinite(mb_const) and mb_const >= 0):
        raise ValueError(f"mb_const must be finite seconds >= 0, got {mb_const!r}")
    if not len(budgets):
        raise ValueError("budgets must hold at least one displacement budget, got none")
    for b in budgets:
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b < 0:
            raise ValueError(f"a displacement budget must be a finite number >= 0 (tokens' mean |step - arrival|), "
                             f"got {b!r}")
    if isinstance(n_slots, bool) or not isinstance(n_slots, (int, np.integer)) or n_slots < stream.n_steps:
        raise ValueError(f"n_slots must be an integer >= the stream's {stream.n_steps} steps, got {n_slots!r}")
    if len(weights) != n_slots or not np.all(np.isfinite(weights)) or (len(weights) and np.min(weights) < 0):
        raise ValueError(f"step_weights must be {n_slots} finite numbers >= 0 (one per slot), got {len(weights)}")
    if not prices or any(not math.isfinite(p) or p < 0 for p in prices):
        raise ValueError(f"prices must be finite numbers >= 0 (at least one), got {prices!r}")
    if seeded_starts is not None and (isinstance(seeded_starts, bool) or not isinstance(seeded_starts, (int, np.integer))
                                      or seeded_starts < 0):
        raise ValueError(f"seeded_starts must be an integer >= 0 or None, got {seeded_starts!r}")


_BITS = [((np.arange(1 << n)[:, None] >> np.arange(n)) & 1).astype(np.int64) for n in range(PARTITION_MAX + 1)]
"""Per n, every subset of n items as a row of 0/1 (item i in bit i)."""
_FIRST_IN = [np.array([(m & -m).bit_length() - 1 if m else n for m in range(1 << n)]) for n in range(PARTITION_MAX + 1)]
"""Per n, the lowest item of each subset (n for the empty one)."""


class _Search:
    """The search state: outlier steps, short-piece boundaries, per-step model and displacement."""

    def __init__(self, stream: OfflineStream, n_micro: int, max_tokens: int, mb_const: float, early: int, late: int,
                 outlier_min: int, weights: np.ndarray):
        self.T, self.N, self.cap, self.mbc = len(weights), n_micro, max_tokens, mb_const
        self.early, self.late, self.w, self.w_np = early, late, weights.tolist(), np.asarray(weights, dtype=np.float64)
        L, A, C = stream.lengths, stream.arrival, stream.cost
        big = np.flatnonzero(L >= outlier_min)
        self.big = big[np.argsort(-C[big], kind="stable")]  # rank k = k-th costliest: sorted tuples are LPT order
        self.blen, self.bcost, self.barr = (L[self.big].tolist(), C[self.big].tolist(), A[self.big].tolist())
        self.blen_np, self.bcost_np = L[self.big].astype(np.int64), C[self.big]  # the same as arrays
        self.barr_np = A[self.big].astype(np.int64)
        short = np.flatnonzero(L < outlier_min)
        self.short = short[np.lexsort((short, A[short]))]
        sl, sa = L[self.short], A[self.short]
        self.sarr = sa.tolist()
        self.SL = np.concatenate([[0], np.cumsum(sl)]).tolist()
        self.SLA = np.concatenate([[0], np.cumsum(sl * sa)]).tolist()
        self.SC = np.concatenate([[0.0], np.cumsum(C[self.short])]).tolist()
        self._table = [sl.astype(np.int64)]  # sparse table of range maxima of short lengths
        while len(self._table[-1]) > 1 and (1 << len(self._table)) <= len(sl):
            prev, half = self._table[-1], 1 << (len(self._table) - 1)
            self._table.append(np.maximum(prev[:-half], prev[half:]))
        self._table = [t.tolist() for t in self._table]
        self._ctable = [C[self.short]]
        while len(self._ctable) < len(self._table):
            prev, half = self._ctable[-1], 1 << (len(self._ctable) - 1)
            self._ctable.append(np.maximum(prev[:-half], prev[half:]))
        self._ctable = [t.tolist() for t in self._ctable]
        steps = np.arange(self.T + 1)
        # boundary P_t: pieces that must train before t, and pieces that may
        self.lowP = np.searchsorted(sa + late, steps, side="left").tolist()
        self.highP = np.searchsorted(sa - early, steps, side="left").tolist()
        self.tokens_per_step = max(stream.total_tokens / max(stream.n_steps, 1), 1.0)
        self.total_tokens = max(stream.total_tokens, 1)
        self.memo: dict = {}
        self.evaluations = 0

    # -- one step ---------------------------------------------------------------------------
    def _largest(self, p: int, q: int, table=None):
        """The longest short piece in positions [p, q) (with `table=self._ctable`: the costliest)."""
        if q <= p:
            return 0
        k = (q - p).bit_length() - 1
        row = (table or self._table)[k]
        return max(row[p], row[q - (1 << k)])

    def model(self, bigs: tuple, p: int, q: int) -> float:
        key = (bigs, p, q)
        v = self.memo.get(key)
        if v is None:
            self.evaluations += 1
            v = step_model([self.blen[k] for k in bigs], [self.bcost[k] for k in bigs], self.SL[q] - self.SL[p],
                           self.SC[q] - self.SC[p], self._largest(p, q), self._largest(p, q, self._ctable), self.N,
                           self.cap, self.mbc)
            self.memo[key] = v
        return v

    def seg_disp(self, t: int, p: int, q: int) -> int:
        """Token-steps of |t - arrival| over short positions [p, q) trained at step t."""
        if q <= p:
            return 0
        r = bisect.bisect_right(self.sarr, t, p, q)
        SL, SLA = self.SL, self.SLA
        return t * (SL[r] - SL[p]) - (SLA[r] - SLA[p]) + (SLA[q] - SLA[r]) - t * (SL[q] - SL[r])

    def big_disp(self, k: int, t: int) -> int:
        return self.blen[k] * abs(t - self.barr[k])

    # -- state ------------------------------------------------------------------------------
    def load(self, big_step: list[int], P: list[int]) -> None:
        self.bstep = list(big_step)
        self.P = list(P)
        members: list[list[int]] = [[] for _ in range(self.T)]
        for k, t in enumerate(self.bstep):
            members[t].append(k)
        self.bigs = [tuple(m) for m in members]  # ranks ascending = cost descending
        self.f = [self.model(self.bigs[t], P[t], P[t + 1]) for t in range(self.T)]
        # per step, what `floor` reads: outliers' cost, tokens and costliest; short tokens, cost, longest
        self.bsum, self.btok, self.btop = np.zeros(self.T), np.zeros(self.T, dtype=np.int64), np.zeros(self.T)
        self.stok, self.scost, self.slong = np.zeros(self.T, dtype=np.int64), np.zeros(self.T), \
            np.zeros(self.T, dtype=np.int64)
        self.fv = np.array(self.f)
        for t in range(self.T):
            self._refresh(t)
        self.stamp, self.freed, self.changed, self.blocked = 1, 1, [1] * self.T, False
        self.D = sum(self.big_disp(k, t) for k, t in enumerate(self.bstep)) + sum(
            self.seg_disp(t, P[t], P[t + 1]) for t in range(self.T))

    def objective(self) -> float:
        return sum(w * f for w, f in zip(self.w, self.f))

    def start_state(self, piece_step: np.ndarray) -> tuple[list[int], list[int]]:
        """Outlier steps as given; boundaries that give each step the short tokens it had,
        to the nearest piece, clamped to the window."""
        big_step = piece_step[self.big].tolist()
        per_step = np.bincount(piece_step[self.short], weights=np.asarray(self.SL[1:]) - np.asarray(self.SL[:-1]),
                               minlength=self.T) if len(self.short) else np.zeros(self.T)
        target = np.concatenate([[0], np.cumsum(per_step)])
        SL = np.asarray(self.SL, dtype=np.float64)
        pos = np.clip(np.searchsorted(SL, target), 0, len(SL) - 1)
        lower = np.maximum(pos - 1, 0)
        P = np.where(np.abs(SL[lower] - target) <= np.abs(SL[pos] - target), lower, pos)
        P = np.minimum(np.maximum(P, self.lowP), self.highP)
        P[0], P[-1] = 0, len(self.short)
        return big_step, np.maximum.accumulate(P).tolist()

    def feasible(self, big_step: list[int], P: list[int]) -> tuple[list[int], list[int]]:
        """`(big_step, P)` with the short pieces at the edges of each step the model finds over
        capacity moved to a neighbouring step, one at a time: a move to a step that stays
        within capacity first, then the move of least displacement (to the step before only
        where that one stays within capacity), until none is over or no move is left. A streaming planner's schedule packs its steps to the token
        cap or nearly, which `start_state`'s boundaries, rounded to whole pieces, and the
        model's slack of one short piece often pass."""
        self.load(big_step, P)
        P = list(P)

        def fits(t: int, p: int, q: int) -> bool:
            return self.model(self.bigs[t], p, q) < OVERFLOW

        for _ in range(self.T):
            over = [t for t in range(self.T) if not fits(t, P[t], P[t + 1])]
            if not over:
                break
            for t in over:
                while P[t + 1] > P[t] and not fits(t, P[t], P[t + 1]):
                    options = []
                    if t > 0 and P[t] + 1 <= self.highP[t] and fits(t - 1, P[t - 1], P[t] + 1):  # first piece back
                        options.append((self.seg_disp(t - 1, P[t - 1], P[t] + 1) + self.seg_disp(t, P[t] + 1, P[t + 1])
                                        - self.seg_disp(t - 1, P[t - 1], P[t]) - self.seg_disp(t, P[t], P[t + 1]),
                                        0, t))
                    if t + 1 < self.T and P[t + 1] - 1 >= self.lowP[t + 1]:  # last piece on
                        q = P[t + 1] - 1
                        options.append((self.seg_disp(t, P[t], q) + self.seg_disp(t + 1, q, P[t + 2])
                                        - self.seg_disp(t, P[t], P[t + 1]) - self.seg_disp(t + 1, P[t + 1], P[t + 2]),
                                        0 if fits(t + 1, q, P[t + 2]) else 1, t + 1))
                    if not options:
                        break
                    _, _, at = min(options, key=lambda o: (o[1], o[0]))
                    if at == t:
                        P[t] += 1
                    else:
                        P[t + 1] -= 1
        return list(big_step), P

    def seeded(self, state: tuple[list[int], list[int]], d_caps: list[int], sweeps: int,
               rng: np.random.Generator) -> dict[int, tuple[list[int], list[int]]]:
        """Per index of `d_caps` (token-steps): a state within that cap searched from `state`
        (made `feasible` first). Caps at or above its displacement: the search at price 0 within
        the cap. Below: the displacement is shed at `SHED_PRICES` in turn (each phase within the
        displacement it starts from) until under the cap, then the search at price 0 within the
        cap; each lower cap continues from the state shed for the one above."""
        self.load(*self.feasible(*state))
        out = {}
        for i in sorted(range(len(d_caps)), key=lambda i: -d_caps[i]):
            d_max = d_caps[i]
            for price in SHED_PRICES:
                if self.D <= d_max:
                    break
                self.run([price], sweeps, self.D, rng)
            if self.D > d_max:
                break
            shed = (list(self.bstep), list(self.P))
            self.run([0.0], sweeps, d_max, rng)
            out[i] = (list(self.bstep), list(self.P))
            self.load(*shed)
        return out

    # -- moves ------------------------------------------------------------------------------
    def _delta(self, changes: dict, dd: int, price: float, d_max: int):
        """(objective change, displacement change) of replacing steps by `changes`
        {t: (bigs, p, q)} whose outliers' displacement changes by `dd` token-steps; None
        when a short piece leaves its window or the budget is exceeded."""
        df = 0.0
        P = self.P
        for t, (bigs, p, q) in changes.items():
            if p != P[t] or q != P[t + 1]:
                if q > p and not (self.lowP[t] <= p and q <= self.highP[t + 1]):
                    return None
                dd += self.seg_disp(t, p, q) - self.seg_disp(t, P[t], P[t + 1])
            df += self.w[t] * (self.model(bigs, p, q) - self.f[t])
        if self.D + dd > d_max:
            self.blocked = True
            return None
        return df + price * dd / self.tokens_per_step, dd

    def _apply(self, changes: dict, dd: int) -> None:
        self.stamp += 1
        if dd < 0:
            self.freed = self.stamp  # a move rejected for the budget may fit now
        for t in changes:
            self.changed[t] = self.stamp
        for t, (bigs, p, q) in changes.items():
            for k in bigs:
                self.bstep[k] = t
            self.bigs[t] = bigs
            self.P[t], self.P[t + 1] = p, q
        for t, (bigs, p, q) in changes.items():
            self.f[t] = self.model(bigs, p, q)
            self._refresh(t)
        self.D += dd

    def _refresh(self, t: int) -> None:
        """The per-step arrays of step t from its outliers, boundaries and model."""
        bigs, p, q = self.bigs[t], self.P[t], self.P[t + 1]
        self.bsum[t] = sum(self.bcost[k] for k in bigs)
        self.btok[t] = sum(self.blen[k] for k in bigs)
        self.btop[t] = self.bcost[bigs[0]] if bigs else 0.0
        self.stok[t], self.scost[t], self.slong[t] = self.SL[q] - self.SL[p], self.SC[q] - self.SC[p], \
            self._largest(p, q)
        self.fv[t] = self.f[t]

    def _window(self, k: int) -> range:
        a = self.barr[k]
        return range(max(0, a - self.early), min(self.T - 1, a + self.late) + 1)

    def _push(self, changes: dict, b: int) -> list[dict]:
        """`changes` with short pieces moved out of step b to b + 1 or b - 1 so that b fits."""
        bigs, p, q = changes[b]
        used = sum(self.blen[k] for k in bigs) + self.SL[q] - self.SL[p]
        over = used - self.N * self.cap + self._largest(p, q)
        out = []
        if over <= 0:
            return out
        if b + 1 < self.T:  # the last pieces of b go first into b + 1
            q2 = max(bisect.bisect_right(self.SL, self.SL[q] - over, p, q + 1) - 1, p)
            if q2 < q:
                nb = changes.get(b + 1, (self.bigs[b + 1], self.P[b + 1], self.P[b + 2]))
                out.append({**changes, b: (bigs, p, q2), b + 1: (nb[0], q2, nb[2])})
        if b > 0:  # the first pieces of b go to the end of b - 1
            p2 = min(bisect.bisect_left(self.SL, self.SL[p] + over, p, q + 1), q)
            if p2 > p:
                nb = changes.get(b - 1, (self.bigs[b - 1], self.P[b - 1], self.P[b]))
                out.append({**changes, b: (bigs, p2, q), b - 1: (nb[0], nb[1], p2)})
        return out

    def _gain(self, t: int, bigs: tuple) -> float:
        """Weighted model change of step t holding outliers `bigs` (its short pieces unchanged)."""
        return self.w[t] * (self.model(bigs, self.P[t], self.P[t + 1]) - self.f[t])

    def _leaving(self, k: int, d_max: int) -> tuple:
        """Outlier k leaving its step a: (a, a's outliers without k, k's displacement at a, the
        weighted model change of a without k, the displacement budget left, the most a's
        model can fall)."""
        a = self.bstep[k]
        without = tuple(x for x in self.bigs[a] if x != k)
        return (a, without, self.big_disp(k, a), self._gain(a, without), d_max - self.D,
                self.w[a] * (1.0 - self.f[a]))

    def improve_outlier(self, k: int, price: float, d_max: int) -> bool:
        """The best move of outlier k to another step, or swap with an outlier there."""
        a, without, here, leave, room, floor_a = self._leaving(k, d_max)
        P, bd, unit = self.P, self.big_disp, price / self.tokens_per_step
        # a swap brings back at most what an outlier of the window gives when it leaves (bound below)
        swap_relief = max(0.0, unit * max((bd(k2, self.bstep[k2]) for t in self._window(k) for k2 in self.bigs[t]),
                                          default=0))
        best = (-1e-12, None, 0)
        for b in self._window(k):
            if b == a:
                continue
            dd = bd(k, b) - here
            floor_b = self.w[b] * (1.0 - self.f[b])  # no step's model is below 1
            if leave + floor_b + unit * dd >= best[0] and floor_a + floor_b + unit * dd >= best[0] - swap_relief:
                continue
            at_b = tuple(sorted(self.bigs[b] + (k,)))
            fb = self.model(at_b, P[b], P[b + 1])
            if fb >= OVERFLOW:
                for ch in self._push({a: (without, P[a], P[a + 1]), b: (at_b, P[b], P[b + 1])}, b):
                    r = self._delta(ch, dd, price, d_max)
                    if r is not None and r[0] < best[0]:
                        best = (r[0], ch, r[1])
            if dd > room:
                self.blocked = True
            else:
                v = leave + self.w[b] * (fb - self.f[b]) + unit * dd
                if v < best[0]:
                    best = (v, {a: (without, P[a], P[a + 1]), b: (at_b, P[b], P[b + 1])}, dd)
            for k2 in self.bigs[b]:
                if not self.barr[k2] - self.early <= a <= self.barr[k2] + self.late:
                    continue
                d2 = dd + bd(k2, a) - bd(k2, b)
                if d2 > room:
                    self.blocked = True
                    continue
                if floor_a + floor_b + unit * d2 >= best[0]:
                    continue
                new_a = tuple(sorted(without + (k2,)))
                new_b = tuple(sorted(tuple(x for x in self.bigs[b] if x != k2) + (k,)))
                v = self._gain(a, new_a) + self._gain(b, new_b) + unit * d2
                if v < best[0]:
                    best = (v, {a: (new_a, P[a], P[a + 1]), b: (new_b, P[b], P[b + 1])}, d2)
        if best[1] is None:
            return False
        self._apply(best[1], best[2])
        return True

    def chain_outlier(self, k: int, price: float, d_max: int) -> bool:
        """Ejection chain: k from a to b and an outlier k2 of b from b to c (c may be a), branch
        and bound: every (b, k2, c) is ranked by `floor` of c at once, and the model evaluated
        in that order until the floor reaches the best chain found."""
        a, without, here, leave, room, _ = self._leaving(k, d_max)
        P, bd, unit = self.P, self.big_disp, price / self.tokens_per_step
        pairs = []  # (b, k2, b's outliers with k for k2, weighted model change of b, k's displacement change)
        for b in self._window(k):
            if b == a:
                continue
            dk = bd(k, b) - here
            for k2 in self.bigs[b]:
                at_b = tuple(sorted(tuple(x for x in self.bigs[b] if x != k2) + (k,)))
                pairs.append((b, k2, at_b, self._gain(b, at_b), dk - bd(k2, b)))
        if not pairs:
            return False
        pb = np.array([x[0] for x in pairs])
        k2s = np.array([x[1] for x in pairs])
        arr = self.barr_np[k2s]
        lo, hi = np.maximum(arr - self.early, 0), np.minimum(arr + self.late, self.T - 1)
        size = hi - lo + 1
        pi = np.repeat(np.arange(len(pairs)), size)  # one row per (b, k2, c)
        c = lo[pi] + np.arange(len(pi)) - np.repeat(np.cumsum(size) - size, size)
        length, cost = self.blen_np[k2s][pi], self.bcost_np[k2s][pi]
        dd = np.array([x[4] for x in pairs])[pi] + length * np.abs(c - arr[pi])
        within = dd <= room
        self.blocked |= not within.all()
        keep = (c != pb[pi]) & within
        pi, c, length, cost, dd = pi[keep], c[keep], length[keep], cost[keep], dd[keep]
        at_a = c == a  # k2 takes k's place: a without k, plus k2
        top_without = self.bcost[without[0]] if without else 0.0
        floor = self._floors_with(c, cost - np.where(at_a, self.bcost[k], 0.0),
                                  np.maximum(np.where(at_a, top_without, self.btop[c]), cost),
                                  length - np.where(at_a, self.blen[k], 0))
        vb = np.array([x[3] for x in pairs])
        bound = (np.where(at_a, 0.0, leave) + vb[pi] + unit * dd + self.w_np[c] * (floor - self.fv[c]) - 1e-9)
        best = (-1e-12, None, 0)
        for i in np.flatnonzero(bound < best[0])[np.argsort(bound[bound < best[0]], kind="stable")].tolist():
            if bound[i] >= best[0]:
                break
            b, k2, at_b, gb, _ = pairs[pi[i]]
            ci, di = int(c[i]), int(dd[i])
            if ci == a:
                new_a = tuple(sorted(without + (k2,)))
                v = self._gain(a, new_a) + gb + unit * di
                if v < best[0]:
                    best = (v, {a: (new_a, P[a], P[a + 1]), b: (at_b, P[b], P[b + 1])}, di)
                continue
            at_c = tuple(sorted(self.bigs[ci] + (k2,)))
            v = leave + gb + self._gain(ci, at_c) + unit * di
            if v < best[0]:
                best = (v, {a: (without, P[a], P[a + 1]), b: (at_b, P[b], P[b + 1]), ci: (at_c, P[ci], P[ci + 1])}, di)
        if best[1] is None:
            return False
        self._apply(best[1], best[2])
        return True

    def floor(self, big_cost: float, big_max: float, big_tokens: int, p: int, q: int) -> float:
        """A lower bound on `model` of a step whose outliers cost `big_cost` in all (the costliest
        `big_max`) over `big_tokens` tokens, with short positions [p, q): the overflow value of
        the tokens beyond the step's room, else max / mean with the max at least the costliest
        outlier and the mean (no packing, so it prunes moves before the model is evaluated)."""
        fluid = self.SL[q] - self.SL[p]
        excess = big_tokens + fluid - self.N * self.cap + (self._largest(p, q) if fluid else 0)
        if excess > 0:
            return OVERFLOW * (1.0 + excess / self.cap)
        mean = (big_cost + self.SC[q] - self.SC[p]) / self.N + self.mbc
        return max(1.0, (big_max + self.mbc) / mean) if mean > 0 else 1.0

    def _floors_with(self, c: np.ndarray, cost: np.ndarray, top: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """`floor` of steps c (an array) with outliers of `cost`, `top` (their costliest) and
        `tokens` added to theirs (negative cost and tokens remove them; `top`: the costliest
        outlier of the result, at least the step's own when none is removed)."""
        stok = self.stok[c]
        excess = self.btok[c] + tokens + stok - self.N * self.cap + np.where(stok > 0, self.slong[c], 0)
        mean = (self.bsum[c] + cost + self.scost[c]) / self.N + self.mbc
        ratio = np.maximum(1.0, (top + self.mbc) / np.where(mean > 0, mean, 1.0))
        return np.where(excess > 0, OVERFLOW * (1.0 + np.maximum(excess, 0) / self.cap),
                        np.where(mean > 0, ratio, 1.0))

    def _floors(self, cost: np.ndarray, top: np.ndarray, tokens: np.ndarray, p: int, q: int) -> np.ndarray:
        """`floor` of many outlier sets at once (arrays of their total cost, costliest, tokens)."""
        fluid = self.SL[q] - self.SL[p]
        excess = tokens + fluid - self.N * self.cap + (self._largest(p, q) if fluid else 0)
        mean = (cost + self.SC[q] - self.SC[p]) / self.N + self.mbc
        ratio = np.maximum(1.0, (top + self.mbc) / np.where(mean > 0, mean, 1.0))
        return np.where(excess > 0, OVERFLOW * (1.0 + np.maximum(excess, 0) / self.cap),
                        np.where(mean > 0, ratio, 1.0))

    def repartition(self, a: int, b: int, price: float, d_max: int) -> bool:
        """The best split of the outliers of steps a and b between the two (every split of the
        PARTITION_MAX costliest that keeps each in its window), branch and bound: splits in
        ascending order of `floor`, the model evaluated until the floor reaches the best found."""
        P, bd, unit = self.P, self.big_disp, price / self.tokens_per_step
        lo, hi = min(a, b), max(a, b)
        flexible = [k for k in sorted(self.bigs[a] + self.bigs[b])
                    if self.barr[k] - self.early <= lo and hi <= self.barr[k] + self.late][:PARTITION_MAX]
        if not flexible:
            return False
        fixed_a = tuple(k for k in self.bigs[a] if k not in flexible)
        fixed_b = tuple(k for k in self.bigs[b] if k not in flexible)
        n = len(flexible)
        bits = _BITS[n]  # (2^n, n): bit i of each split = flexible[i] in a
        cost = np.array([self.bcost[k] for k in flexible])
        tokens = np.array([self.blen[k] for k in flexible], dtype=np.int64)
        to_a = np.array([bd(k, a) for k in flexible], dtype=np.int64)
        to_b = np.array([bd(k, b) for k in flexible], dtype=np.int64)
        dd = bits @ (to_a - to_b) + int(to_b.sum()) - sum(bd(k, self.bstep[k]) for k in flexible)
        ok = np.flatnonzero(dd <= d_max - self.D)
        self.blocked |= len(ok) < len(dd)
        if not len(ok):
            return False
        bits, dd = bits[ok], dd[ok]
        # flexible is in rank order (costliest first): a side's costliest is its first member
        cost_or_0 = np.append(cost, 0.0)
        fa_top = self.bcost[fixed_a[0]] if fixed_a else 0.0
        fb_top = self.bcost[fixed_b[0]] if fixed_b else 0.0
        top_a = np.maximum(fa_top, cost_or_0[_FIRST_IN[n][ok]])
        top_b = np.maximum(fb_top, cost_or_0[_FIRST_IN[n][(1 << n) - 1 - ok]])
        cost_a, tokens_a = bits @ cost, bits @ tokens  # the flexible outliers' share of a; b has the rest
        floor = (self.w[a] * (self._floors(sum(self.bcost[k] for k in fixed_a) + cost_a,
                                           top_a, self._tokens_of(fixed_a) + tokens_a, P[a], P[a + 1]) - self.f[a])
                 + self.w[b] * (self._floors(sum(self.bcost[k] for k in fixed_b) + float(cost.sum()) - cost_a, top_b,
                                             self._tokens_of(fixed_b) + int(tokens.sum()) - tokens_a, P[b], P[b + 1])
                                - self.f[b])
                 + unit * dd - 1e-9)
        if floor.min() >= -1e-12:
            return False
        in_a = bits.astype(bool)
        best = (-1e-12, None, 0)
        for i in np.argsort(floor, kind="stable").tolist():
            if floor[i] >= best[0]:
                break
            row = in_a[i]
            new_a = tuple(sorted(fixed_a + tuple(k for k, x in zip(flexible, row) if x)))
            new_b = tuple(sorted(fixed_b + tuple(k for k, x in zip(flexible, row) if not x)))
            v = self._gain(a, new_a) + self._gain(b, new_b) + unit * int(dd[i])
            if v < best[0]:
                best = (v, {a: (new_a, P[a], P[a + 1]), b: (new_b, P[b], P[b + 1])}, int(dd[i]))
        if best[1] is None:
            return False
        self._apply(best[1], best[2])
        return True

    def _tokens_of(self, bigs: tuple) -> int:
        return sum(self.blen[k] for k in bigs)

    def _fresh(self, seen: dict, key, lo: int, hi: int, also: int | None = None) -> bool:
        """Whether anything in steps lo .. hi (and step `also`) changed since `key` was last
        searched without a move, or the budget freed since and that search left out a move for
        the budget (without one, more room gives the same search)."""
        entry = seen.get(key)
        if entry is None:
            return True
        last, blocked = entry
        return (blocked and last < self.freed) or last < max(self.changed[max(lo, 0):hi + 1]) or \
            (also is not None and last < self.changed[also])

    def _try(self, seen: dict, key, move, *args) -> bool:
        """Run a move search; on failure remember when, and whether the budget left a move out."""
        self.blocked = False
        if move(*args):
            return True
        seen[key] = (self.stamp, self.blocked)
        return False

    def improve_boundary(self, t: int, price: float, d_max: int) -> bool:
        """Shift P_t (between steps t - 1 and t)."""
        P, SL = self.P, self.SL
        lo, hi = max(self.lowP[t], P[t - 1]), min(self.highP[t], P[t + 1])
        best = (-1e-12, None, 0)
        for tokens in BOUNDARY_TOKENS:
            for target in (bisect.bisect_left(SL, SL[P[t]] + tokens), bisect.bisect_right(SL, SL[P[t]] - tokens) - 1):
                pt = min(max(target, lo), hi)
                if pt == P[t]:
                    continue
                ch = {t - 1: (self.bigs[t - 1], P[t - 1], pt), t: (self.bigs[t], pt, P[t + 1])}
                r = self._delta(ch, 0, price, d_max)
                if r is not None and r[0] < best[0]:
                    best = (r[0], ch, r[1])
        if best[1] is None:
            return False
        self._apply(best[1], best[2])
        return True

    def run(self, prices: Sequence[float], sweeps: int, d_max: int, rng: np.random.Generator) -> int:
        """Descent at each price in turn; a move is searched again only when a step it reads
        has changed since it was last searched without success."""
        moves = 0
        span = self.early + self.late
        for price in prices:
            seen: dict = {}
            for _ in range(sweeps):
                taken = 0
                for k in rng.permutation(len(self.bstep)).tolist():
                    if self._fresh(seen, ("move", k), self.barr[k] - self.early, self.barr[k] + self.late):
                        taken += self._try(seen, ("move", k), self.improve_outlier, k, price, d_max)
                # repartitions and chains only from the steps the model ranks worst: they cost a window squared
                for t in range(self.T):
                    if self.w[t] * (self.f[t] - 1.0) <= CHAIN_FROM:
                        continue
                    for b in range(max(0, t - span), min(self.T, t + span + 1)):
                        # a split reads steps t and b only (and the budget), not the steps between
                        if b != t and self._fresh(seen, ("part", t, b), t, t, also=b):
                            taken += self._try(seen, ("part", t, b), self.repartition, t, b, price, d_max)
                    for k in self.bigs[t]:
                        if self.bstep[k] == t and self._fresh(seen, ("chain", k), t - 2 * span, t + 2 * span):
                            taken += self._try(seen, ("chain", k), self.chain_outlier, k, price, d_max)
                for t in rng.permutation(np.arange(1, self.T)).tolist():
                    if self._fresh(seen, ("boundary", t), t - 1, t):
                        taken += self._try(seen, ("boundary", t), self.improve_boundary, t, price, d_max)
                moves += taken
                if not taken:
                    break
        return moves

    def piece_steps(self) -> np.ndarray:
        step = np.empty(len(self.big) + len(self.short), dtype=np.int64)
        step[self.big] = self.bstep
        for t in range(self.T):
            step[self.short[self.P[t]:self.P[t + 1]]] = t
        return step


def realise(stream: OfflineStream, piece_step: np.ndarray, n_micro: int, max_tokens: int, mb_const: float,
            outlier_min: int, n_slots: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(step, micro-batch) of every piece: each step packed by `pack_step`; pieces a step
    cannot hold are added to the next step. None when the last step cannot hold its pieces."""
    step = np.asarray(piece_step, dtype=np.int64).copy()
    micro = np.full(len(step), -1, dtype=np.int64)
    order = np.argsort(step, kind="stable")
    bounds = np.searchsorted(step[order], np.arange(n_slots + 1))
    carry = np.zeros(0, dtype=np.int64)
    for t in range(n_slots):
        members = np.concatenate([carry, order[bounds[t]:bounds[t + 1]]])
        assign = pack_step(stream.lengths[members], stream.cost[members], n_micro, max_tokens, mb_const, outlier_min)
        micro[members] = assign
        step[members] = t
        carry = members[assign < 0]
    return None if len(carry) else (step, micro)


def measure(stream: OfflineStream, step: np.ndarray, micro: np.ndarray, n_micro: int, mb_const: float,
            n_slots: int) -> tuple[np.ndarray, float]:
    """(per-step max / mean micro-batch cost with `mb_const`, displacement per token)."""
    loads = np.zeros((n_slots, n_micro))
    np.add.at(loads, (step, micro), stream.cost)
    loads += mb_const
    mean = loads.mean(axis=1)
    imbalance = np.where(mean > 0, loads.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0)
    disp = float((np.abs(step - stream.arrival) * stream.lengths).sum()) / max(stream.total_tokens, 1)
    return imbalance, disp


def offline_frontier(stream: OfflineStream, n_micro: int, max_tokens: int, mb_const: float, budgets: Sequence[float],
                     *, early: int, late: int, outlier_min: int = 32768, starts: Sequence[np.ndarray] = (),
                     n_slots: int | None = None, step_weights: np.ndarray | None = None,
                     measure_weights: np.ndarray | None = None, prices: Sequence[float] = PRICES, sweeps: int = SWEEPS,
                     seed: int = 0, on_budget: Callable[[OfflineSchedule], None] | None = None,
                     skip_infeasible: bool = False, seeded_starts: int | None = None) -> list[OfflineSchedule]:
    """One `OfflineSchedule` per budget (displacement per token), in ascending budget order.

    `starts`: schedules to start from and never do worse than: a training step per piece (each
    within the window), or a (step, micro-batch) pair of arrays, then also measured as given;
    the schedule that trains every piece at its arrival is always one.
    `step_weights`: weight of each step in the objective (default 1 each). `measure_weights`
    (default `step_weights`): the weights of the measure the schedules are read on; of the
    schedules found within a budget (each start as given among them) the one of least
    measure is kept, so that no start does better on it than the schedule returned. `on_budget` is
    called with each schedule as it is found (progress). When no schedule is found within a
    budget (a budget of 0 on a stream whose arrivals overflow a step), raises ValueError, or
    with `skip_infeasible` leaves that budget out of the list. `seeded_starts`: at most this
    many starts seed a search of their own (module docstring), those of least exactly measured
    objective first; None: every start."""
    if not isinstance(stream, OfflineStream):
        raise TypeError(f"stream must be an OfflineStream (see offline_stream), got {type(stream).__name__}")
    budgets = sorted(budgets)
    n_slots = stream.n_steps if n_slots is None else n_slots
    weights = np.ones(n_slots if isinstance(n_slots, (int, np.integer)) else 0) if step_weights is None else \
        np.asarray(step_weights, dtype=np.float64).reshape(-1)
    measured = weights if measure_weights is None else np.asarray(measure_weights, dtype=np.float64).reshape(-1)
    if len(measured) != len(weights) or not np.all(np.isfinite(measured)) or (len(measured) and measured.min() < 0):
        raise ValueError(f"measure_weights must be {len(weights)} finite numbers >= 0 (one per slot), got "
                         f"{len(measured)}")
    _check_args(stream, n_micro, max_tokens, mb_const, budgets, early, late, outlier_min, weights, tuple(prices), sweeps,
                n_slots, seeded_starts)
    arrival = stream.arrival
    candidates = [(np.asarray(arrival, dtype=np.int64), None)]
    for i, s in enumerate(starts):
        s, micro = (s if isinstance(s, tuple) else (s, None))
        s = np.asarray(s, dtype=np.int64)
        if s.shape != arrival.shape or (s < np.maximum(arrival - early, 0)).any() or \
                (s > np.minimum(arrival + late, n_slots - 1)).any():
            raise ValueError(f"start {i} must give each of the {len(arrival)} pieces a step within "
                             f"[arrival - {early}, arrival + {late}] and [0, {n_slots - 1}]")
        if micro is not None:
            micro = np.asarray(micro, dtype=np.int64)
            tokens = np.zeros((n_slots, n_micro), dtype=np.int64)
            if micro.shape != arrival.shape or micro.min(initial=0) < 0 or micro.max(initial=0) >= n_micro:
                raise ValueError(f"start {i}: micro-batches must be one per piece in [0, {n_micro})")
            np.add.at(tokens, (s, micro), stream.lengths)
            if tokens.max(initial=0) > max_tokens:
                raise ValueError(f"start {i} puts {int(tokens.max())} tokens in a micro-batch > max_tokens={max_tokens}")
        candidates.append((s, micro))

    def in_window(step):
        return bool(((step >= arrival - early) & (step <= arrival + late)).all())

    # Exact measure of every start: as given when it comes with micro-batches, else packed the
    # way the search's results are (a piece that a full step passes on may leave its window:
    # such a schedule is no candidate).
    exact = []
    for i, (s, micro) in enumerate(candidates):
        name = f"start {i}" if i else "arrival"
        if micro is not None:
            imb, disp = measure(stream, s, micro, n_micro, mb_const, n_slots)
            exact.append((name, (s, micro), imb, disp))
        r = realise(stream, s, n_micro, max_tokens, mb_const, outlier_min, n_slots)
        if r is not None and in_window(r[0]):
            imb, disp = measure(stream, *r, n_micro, mb_const, n_slots)
            exact.append((name, r, imb, disp))
    search = _Search(stream, n_micro, max_tokens, mb_const, early, late, outlier_min, weights)
    rng = np.random.default_rng(seed)
    d_cap = [int(math.floor(b * stream.total_tokens + 1e-9)) for b in budgets]
    starts_at = [(e[3], search.start_state(e[1][0])) for e in exact] or [(0.0, search.start_state(arrival))]
    # One descent path for every budget: the price falls phase by phase, displacement grows up
    # to the largest budget, and the state after each phase is kept.
    search.load(*min(starts_at, key=lambda s: s[0])[1])
    path = []
    for price in prices:
        moves = search.run([price], sweeps, d_cap[-1], rng)
        path.append((price, search.D, search.objective(), (list(search.bstep), list(search.P)), moves))
    # Searches seeded from each given start (made feasible for the model), at the budgets from
    # its displacement less SEED_REACH up: a streaming planner's schedule lies in a region the
    # path from the arrivals does not reach.
    seeded, seed_rng = {}, np.random.default_rng([seed, 1])  # its own draws: the path's are unchanged
    best_of = {}  # start index: its least exactly measured objective
    for name, _, imb, _ in exact:
        if name.startswith("start "):
            k = int(name.split()[1])
            best_of[k] = min(best_of.get(k, math.inf), float(np.dot(weights, imb)))
    seeds = sorted(range(1, len(candidates)), key=lambda k: (best_of.get(k, math.inf), k))
    if seeded_starts is not None:
        seeds = seeds[:seeded_starts]
    for k in sorted(seeds):
        s = candidates[k][0]
        own = float((np.abs(s - arrival) * stream.lengths).sum()) / max(stream.total_tokens, 1)
        at = [i for i, b in enumerate(budgets) if b >= own - SEED_REACH]
        if at:
            for i, state in search.seeded(search.start_state(s), [d_cap[i] for i in at], sweeps, seed_rng).items():
                seeded.setdefault(at[i], []).append((f"search from start {k}", state))
    out, warm = [], None
    for j, (budget, d_max) in enumerate(zip(budgets, d_cap)):
        within = [e for e in exact if e[3] <= budget + 1e-12] + ([warm] if warm is not None else [])
        for name, state in seeded.get(j, []):
            search.load(*state)
            r = realise(stream, search.piece_steps(), n_micro, max_tokens, mb_const, outlier_min, n_slots)
            if r is not None and in_window(r[0]):
                imb, disp = measure(stream, *r, n_micro, mb_const, n_slots)
                within.append((name, r, imb, disp))
        # finish from the best state of the path within the budget, at the price where the
        # path left the budget (its Lagrange multiplier), the budget now a hard cap
        inside = [i for i, p in enumerate(path) if p[1] <= d_max]
        options = [(p[2], p[3]) for p in (path[i] for i in inside)]
        for _, state in starts_at:
            search.load(*state)
            if search.D <= d_max:
                options.append((search.objective(), state))
        if not options:  # every start displaces more: repair the arrivals' overflow within the budget
            state = search.start_state(arrival)
            search.load(*state)
            if search.D <= d_max:
                options.append((search.objective(), state))
        moves = 0
        if options:
            search.load(*min(options, key=lambda o: o[0])[1])
            beyond = [p[0] for p in path if p[1] > d_max]
            if beyond:
                moves = search.run([beyond[0], 0.0] if beyond[0] > 0 else [0.0], sweeps, d_max, rng)
            r = realise(stream, search.piece_steps(), n_micro, max_tokens, mb_const, outlier_min, n_slots)
            if r is not None and in_window(r[0]):
                imb, disp = measure(stream, *r, n_micro, mb_const, n_slots)
                within.append(("search", r, imb, disp))
        if not any(e[3] <= budget + 1e-12 for e in within):
            if skip_infeasible:
                continue
            raise ValueError(f"no schedule found within the displacement budget {budget}: the arrivals overflow a "
                             f"step and the search found no way out within the budget and window")
        source, (step, micro), imb, disp = min((e for e in within if e[3] <= budget + 1e-12),
                                               key=lambda e: (float(np.dot(measured, e[2])), float(np.dot(weights, e[2]))))
        warm = ("warm", (step, micro), imb, disp)
        sched = OfflineSchedule(step=step, micro_batch=micro, budget=float(budget), displacement_per_token=disp,
                                step_imbalance=imb, objective=float(np.dot(weights, imb)), source=source,
                                info=dict(path_moves=sum(p[4] for p in path), finish_moves=moves,
                                          model_evaluations=search.evaluations, model_objective=search.objective()))
        out.append(sched)
        if on_budget is not None:
            on_budget(sched)
    return out


def offline_schedule(stream: OfflineStream, n_micro: int, max_tokens: int, mb_const: float, budget: float,
                     **kw) -> OfflineSchedule:
    """The schedule of `offline_frontier` at one budget (same keywords)."""
    return offline_frontier(stream, n_micro, max_tokens, mb_const, [budget], **kw)[0]
