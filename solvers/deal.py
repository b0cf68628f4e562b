"""Dealing micro-batches to data-parallel replicas: one dealer for the whole library.

A step's dp x n_micro micro-batches are given n_micro to each replica. Replicas run in
parallel and the step waits for the slowest, so the dealer minimises the largest replica
time. Three levels, each a refinement of the one before:

- heaviest first to the replica with a free slot whose modelled 1F1B time (below) is least
  once the micro-batch joins it; with pp = 1 that is the least total (LPT with equal slot
  counts; balances the sums of loads, what `solve_pack` does);
- with `pp` and `max_passes > 0`: pairwise swaps between replicas while the largest modelled
  1F1B replica time (then the sum of replica times) goes down. The 1F1B time of a replica
  whose micro-batches cost c_j (forward + backward, all stages) is about
  (sum_j c_j + (pp - 1) max_j c_j) / pp: the heaviest micro-batch crosses every stage once,
  the others pass the first stage (paper §1.3 / §2.3); p2p ignored. What `WLBPacker` does;
- `refine_replicas(replica_of, step_time)`: pairwise swaps while a caller's step-time
  callable (e.g. the simulator, in the e2e benchmark) gets shorter. `solvers/` never imports
  the simulator: the caller brings the callable.

All are deterministic (ties go to the lowest replica and micro-batch index).
"""
from __future__ import annotations

from typing import Callable

import numpy as np


def deal_to_replicas(loads, dp: int, n_micro: int, pp: int = 1, max_passes: int = 0,
                     min_gain: float = 0.0) -> np.ndarray:
    """replica_of (int64, one entry per micro-batch) giving n_micro micro-batches to each of
    dp replicas. `max_passes` = 0: heaviest-first greedy on the replicas' modelled 1F1B time
    (their totals when pp = 1); > 0: then up to
    that many rounds of 1F1B-priced pairwise swaps with `pp` stages (see the module docstring),
    ending after a round that lowers the largest replica time by less than `min_gain` of it
    (0: only a round without any swap ends them)."""
    loads = np.asarray(loads, dtype=np.float64)
    if len(loads) != dp * n_micro:
        raise ValueError(f"need dp x n_micro = {dp * n_micro} loads, got {len(loads)}")
    if dp == 1:
        return np.zeros(len(loads), dtype=np.int64)
    return _deal_by_1f1b(loads, dp, n_micro, pp, max_passes, min_gain)


def one_f_one_b_time(costs, pp: int) -> float:
    """Closed-form 1F1B step time of one replica: (sum + (pp - 1) * max) / pp of the
    micro-batches' forward+backward costs (all stages), p2p ignored."""
    costs = np.asarray(costs, dtype=np.float64)
    if costs.size == 0:
        return 0.0
    return float((costs.sum() + (pp - 1) * costs.max()) / pp)


def _greedy_start(L: list[float], dp: int, n_micro: int, pp: int) -> tuple[list[list[int]], list[float]]:
    """(micro-batches of each replica, each replica's summed loads): heaviest first (ties: the
    lower index), each to the replica of least modelled time once it joins (ties: the lower
    replica) among those with a free slot."""
    k = float(pp - 1)
    members: list[list[int]] = [[] for _ in range(dp)]
    sums = [0.0] * dp
    tops = [0.0] * dp  # largest load of each replica
    for j in np.argsort(-np.asarray(L), kind="stable").tolist():
        best, best_key = -1, None
        for r in range(dp):
            if len(members[r]) >= n_micro:
                continue
            key = ((sums[r] + L[j] + k * max(tops[r], L[j])) / pp, r)
            if best_key is None or key < best_key:
                best, best_key = r, key
        members[best].append(j)
        sums[best] += L[j]
        tops[best] = max(tops[best], L[j])
    return members, sums


def _top_two(L: list[float], ms: list[int]) -> tuple[float, float, int]:
    """(largest, second largest, position of the largest) of the loads `L` of micro-batches `ms`."""
    first, second, pos = -1.0, -1.0, -1
    for i, m in enumerate(ms):
        v = L[m]
        if v > first:
            first, second, pos = v, first, i
        elif v > second:
            second = v
    return first, second, pos


def _deal_by_1f1b(loads: np.ndarray, dp: int, n_micro: int, pp: int, max_passes: int,
                  min_gain: float = 0.0) -> np.ndarray:
    """Give n_micro micro-batches to each of dp replicas, minimising the largest modelled 1F1B
    replica time (then the sum of replica times). Greedy heaviest-first start (`_greedy_start`),
    then rounds of pairwise swaps between replicas until none improves (or one gains less than
    `min_gain`). Deterministic. Returns replica_of.

    A replica's time needs only its sum and its largest load, so a swap is priced from each
    replica's sum and two largest loads; a pair of replicas has all its swaps priced at once,
    and the first that improves, in the order (its micro-batch in the first replica, in the
    second), is made, the scan going on after it.
    """
    n = len(loads)
    L = loads.tolist()
    k = float(pp - 1)
    members, sums = _greedy_start(L, dp, n_micro, pp)
    stats = [_top_two(L, ms) for ms in members]
    times = [(sums[r] + k * stats[r][0]) / pp if members[r] else 0.0 for r in range(dp)]

    values = [np.array([L[m] for m in ms]) for ms in members]  # each replica's loads, as members
    positions = [np.arange(len(ms)) for ms in members]
    for _ in range(max_passes):
        improved = False
        slowest = max(times)
        for ra in range(dp):
            for rb in range(ra + 1, dp):
                # the other replicas' times do not change while ra and rb swap
                others = max((times[r] for r in range(dp) if r != ra and r != rb), default=0.0)
                old_max, old_sum = max(times), sum(times)
                at = 0  # the scan's position among the pair's swaps (row ra's micro-batch, then rb's)
                while True:
                    # every swap from `at` on priced at once, the floats of a scalar loop (same
                    # operations in the same order); the first that improves is made, and the
                    # scan goes on after it with the replicas as they now are
                    la, lb = values[ra], values[rb]
                    rest_a = np.where(positions[ra] == stats[ra][2], stats[ra][1], stats[ra][0])[:, None]
                    rest_b = np.where(positions[rb] == stats[rb][2], stats[rb][1], stats[rb][0])[None, :]
                    col_a, row_b = la[:, None], lb[None, :]
                    ta = (sums[ra] - col_a + row_b + k * np.maximum(rest_a, row_b)) / pp
                    tb = (sums[rb] - row_b + col_a + k * np.maximum(rest_b, col_a)) / pp
                    new_max = np.maximum(np.maximum(others, ta), tb)
                    new_sum = old_sum - times[ra] - times[rb] + ta + tb
                    bar = old_max - 1e-15
                    better = (((new_max < bar) | ((new_max == bar) & (new_sum < old_sum)))
                              | ((new_max <= old_max) & (new_sum < old_sum - 1e-15))) & (col_a != row_b)
                    hits = np.flatnonzero(better.ravel()[at:])
                    if not len(hits):
                        break
                    flat = at + int(hits[0])
                    ia, ib = divmod(flat, len(lb))
                    a, b = members[ra][ia], members[rb][ib]
                    members[ra][ia], members[rb][ib] = b, a
                    la[ia], lb[ib] = L[b], L[a]
                    sums[ra] += L[b] - L[a]
                    sums[rb] += L[a] - L[b]
                    stats[ra], stats[rb] = _top_two(L, members[ra]), _top_two(L, members[rb])
                    times[ra], times[rb] = float(ta[ia, ib]), float(tb[ia, ib])
                    old_max, old_sum = max(times), sum(times)
                    improved = True
                    at = flat + 1
        if not improved or max(times) > slowest * (1.0 - min_gain):
            break
    replica_of = np.empty(n, dtype=np.int64)
    for r, ms in enumerate(members):
        replica_of[ms] = r
    return replica_of


def refine_replicas(replica_of, step_time: Callable[[np.ndarray], float], max_rounds: int = 50) -> np.ndarray:
    """Pairwise swaps of micro-batches between replicas while `step_time(replica_of)` (seconds,
    any model the caller trusts) gets shorter; first improving swap in (a, b) order, repeated
    until a round finds none. Returns a new replica_of; the input is not modified."""
    current = np.array(replica_of, dtype=np.int64, copy=True)
    best = float(step_time(current))
    n = len(current)
    for _ in range(max_rounds):
        improved = False
        for a in range(n):
            for b in range(a + 1, n):
                if current[a] == current[b]:
                    continue
                current[[a, b]] = current[[b, a]]
                t = float(step_time(current))
                if t < best - 1e-12:
                    best, improved = t, True
                else:
                    current[[a, b]] = current[[b, a]]
        if not improved:
            break
    return current
