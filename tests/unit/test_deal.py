"""The dealer of micro-batches to data-parallel replicas (`solvers.deal`): its swaps priced in
numpy give exactly what a scalar loop over every swap gives, on random loads with ties, and it
stays fast at production sizes (dp x n_micro of several hundred micro-batches)."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from wlb_opt.solvers.deal import deal_to_replicas


def deal_reference(loads: np.ndarray, dp: int, n_micro: int, pp: int, max_passes: int) -> np.ndarray:
    """The dealer as a plain scalar loop, one swap priced at a time: the twin that
    `solvers.deal` must agree with exactly (same swaps, same floats)."""
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


@settings(max_examples=150, deadline=None)
@given(dp=st.integers(2, 6), n_micro=st.integers(1, 12), pp=st.integers(1, 16), passes=st.integers(1, 50),
       seed=st.integers(0, 2**31), ties=st.booleans())
def test_the_dealer_makes_the_swaps_of_the_scalar_loop(dp, n_micro, pp, passes, seed, ties):
    loads = np.random.default_rng(seed).gamma(2.0, 1.0, dp * n_micro)
    if ties:  # equal loads, equal replica times: the loops' tie rules decide
        loads = np.round(loads)
    got = deal_to_replicas(loads, dp, n_micro, pp, max_passes=passes)
    assert np.array_equal(got, deal_reference(loads, dp, n_micro, pp, passes))


def test_the_dealer_matches_the_scalar_loop_on_a_large_step():
    loads = np.random.default_rng(7).gamma(2.0, 1.0, 4 * 32)
    assert np.array_equal(deal_to_replicas(loads, 4, 32, 16, max_passes=50), deal_reference(loads, 4, 32, 16, 50))
