"""Dealing micro-batches to data-parallel replicas: one dealer for the whole library.

A step's dp x n_micro micro-batches are given n_micro to each replica. Replicas run in
parallel and the step waits for the slowest, so the dealer minimises the largest replica
time. Three levels, each a refinement of the one before:

- heaviest first to the replica with the least total that still has a free slot (LPT with
  equal slot counts; balances the sums of loads, what `solve_pack` does);
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


def deal_to_replicas(loads, dp: int, n_micro: int, pp: int = 1, max_passes: int = 0) -> np.ndarray:
    """replica_of (int64, one entry per micro-batch) giving n_micro micro-batches to each of
    dp replicas. `max_passes` = 0: heaviest-first greedy on replica totals; > 0: then up to
    that many rounds of 1F1B-priced pairwise swaps with `pp` stages (see the module docstring)."""
    loads = np.asarray(loads, dtype=np.float64)
    if len(loads) != dp * n_micro:
        raise ValueError(f"need dp x n_micro = {dp * n_micro} loads, got {len(loads)}")
    if dp == 1:
        return np.zeros(len(loads), dtype=np.int64)
    return _deal_by_1f1b(loads, dp, n_micro, pp, max_passes)


def one_f_one_b_time(costs, pp: int) -> float:
    """Closed-form 1F1B step time of one replica: (sum + (pp - 1) * max) / pp of the
    micro-batches' forward+backward costs (all stages), p2p ignored."""
    costs = np.asarray(costs, dtype=np.float64)
    if costs.size == 0:
        return 0.0
    return float((costs.sum() + (pp - 1) * costs.max()) / pp)


def _deal_by_1f1b(loads: np.ndarray, dp: int, n_micro: int, pp: int, max_passes: int) -> np.ndarray:
    """Give n_micro micro-batches to each of dp replicas, minimising the largest modelled 1F1B
    replica time (then the sum of replica times). Greedy heaviest-first start, then pairwise
    swaps between replicas until none improves. Deterministic. Returns replica_of.

    A replica's time needs only its sum and its largest load, so a candidate swap is priced
    in O(1) from each replica's sum and two largest loads, and the largest time among the
    other replicas from the three largest replica times.
    """
    n = len(loads)
    L = loads.tolist()
    k = float(pp - 1)
    members: list[list[int]] = [[] for _ in range(dp)]
    sums = [0.0] * dp
    tops = [0.0] * dp  # largest load of each replica

    def time_of(total: float, top: float) -> float:
        return (total + k * top) / pp

    for j in np.argsort(-loads, kind="stable").tolist():
        best, best_key = -1, None
        for r in range(dp):
            if len(members[r]) >= n_micro:
                continue
            key = (time_of(sums[r] + L[j], max(tops[r], L[j])), r)
            if best_key is None or key < best_key:
                best, best_key = r, key
        members[best].append(j)
        sums[best] += L[j]
        tops[best] = max(tops[best], L[j])

    def top_two(ms: list[int]) -> tuple[float, float, int]:
        """(largest, second largest, position of the largest) of a replica's loads."""
        first, second, pos = -1.0, -1.0, -1
        for i, m in enumerate(ms):
            v = L[m]
            if v > first:
                first, second, pos = v, first, i
            elif v > second:
                second = v
        return first, second, pos

    stats = [top_two(ms) for ms in members]
    times = [time_of(sums[r], stats[r][0]) if members[r] else 0.0 for r in range(dp)]

    def top_after_swap(r: int, i: int, incoming: float) -> float:
        """Largest load of replica r once its i-th micro-batch is replaced by `incoming`."""
        first, second, pos = stats[r]
        rest = second if i == pos else first
        return max(rest, incoming)

    for _ in range(max_passes):
        improved = False
        for ra in range(dp):
            for rb in range(ra + 1, dp):
                # the other replicas' times do not change while ra and rb swap
                others = max((times[r] for r in range(dp) if r != ra and r != rb), default=0.0)
                old_max, old_sum = max(times), sum(times)
                for ia in range(len(members[ra])):
                    for ib in range(len(members[rb])):
                        a, b = members[ra][ia], members[rb][ib]
                        la, lb = L[a], L[b]
                        if la == lb:
                            continue
                        ta = time_of(sums[ra] - la + lb, top_after_swap(ra, ia, lb))
                        tb = time_of(sums[rb] - lb + la, top_after_swap(rb, ib, la))
                        new_max = max(others, ta, tb)
                        new_sum = old_sum - times[ra] - times[rb] + ta + tb
                        if (new_max, new_sum) < (old_max - 1e-15, old_sum) or (
                                new_max <= old_max and new_sum < old_sum - 1e-15):
                            members[ra][ia], members[rb][ib] = b, a
                            sums[ra] += lb - la
                            sums[rb] += la - lb
                            stats[ra], stats[rb] = top_two(members[ra]), top_two(members[rb])
                            times[ra], times[rb] = ta, tb
                            old_max, old_sum = max(times), sum(times)
                            improved = True
        if not improved:
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
