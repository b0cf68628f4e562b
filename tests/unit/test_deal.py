"""The dealer of micro-batches to data-parallel replicas (`solvers.deal`): its swaps priced in
numpy give exactly what a scalar loop over every swap gives, on random loads with ties, and at
production sizes (dp x n_micro of several hundred micro-batches)."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from wlb_opt.solvers.deal import deal_to_replicas


def greedy_start(L: list[float], dp: int, n_micro: int, pp: int) -> tuple[list[list[int]], list[float]]:
    """The dealer's start, written out: micro-batches heaviest first (ties: the lower index),
    each to the replica whose modelled 1F1B time, (sum + (pp - 1) x largest) / pp, is least
    once it joins (ties: the lower replica), among replicas with a free slot."""
    members: list[list[int]] = [[] for _ in range(dp)]
    for j in sorted(range(len(L)), key=lambda i: (-L[i], i)):
        def time_with(r):
            joined = [L[m] for m in members[r]] + [L[j]]
            return (sum(joined) + (pp - 1) * max(joined)) / pp
        free = [r for r in range(dp) if len(members[r]) < n_micro]
        members[min(free, key=lambda r: (time_with(r), r))].append(j)
    sums = [0.0] * dp
    for r, ms in enumerate(members):
        for m in ms:  # summed in the order they joined, as the dealer sums them
            sums[r] += L[m]
    return members, sums


def top_two(L: list[float], ms: list[int]) -> tuple[float, float, int]:
    """(largest, second largest, position of the first largest) of the loads of `ms`; -1.0 for
    a missing one."""
    values = [L[m] for m in ms]
    if not values:
        return -1.0, -1.0, -1
    pos = max(range(len(values)), key=lambda i: (values[i], -i))
    rest = values[:pos] + values[pos + 1:]
    return values[pos], max(rest, default=-1.0), pos


def deal_reference(loads: np.ndarray, dp: int, n_micro: int, pp: int, max_passes: int) -> np.ndarray:
    """The dealer's swap rounds as a plain scalar loop, one swap priced at a time, from the
    same greedy start: the twin that `solvers.deal` must agree with exactly (same swaps, same
    floats)."""
    L = loads.tolist()
    k = float(pp - 1)
    members, sums = greedy_start(L, dp, n_micro, pp)
    stats = [top_two(L, ms) for ms in members]
    times = [(sums[r] + k * stats[r][0]) / pp if members[r] else 0.0 for r in range(dp)]

    def top_after_swap(r, i, incoming):
        first, second, pos = stats[r]
        return max(second if i == pos else first, incoming)

    for _ in range(max_passes):
        improved = False
        for ra in range(dp):
            for rb in range(ra + 1, dp):
                others = max((times[r] for r in range(dp) if r != ra and r != rb), default=0.0)
                old_max, old_sum = max(times), sum(times)
                for ia in range(len(members[ra])):
                    for ib in range(len(members[rb])):
                        a, b = members[ra][ia], members[rb][ib]
                        la, lb = L[a], L[b]
                        if la == lb:
                            continue
                        ta = (sums[ra] - la + lb + k * top_after_swap(ra, ia, lb)) / pp
                        tb = (sums[rb] - lb + la + k * top_after_swap(rb, ib, la)) / pp
                        new_max = max(others, ta, tb)
                        new_sum = old_sum - times[ra] - times[rb] + ta + tb
                        if (new_max, new_sum) < (old_max - 1e-15, old_sum) or (
                                new_max <= old_max and new_sum < old_sum - 1e-15):
                            members[ra][ia], members[rb][ib] = b, a
                            sums[ra] += lb - la
                            sums[rb] += la - lb
                            stats[ra], stats[rb] = top_two(L, members[ra]), top_two(L, members[rb])
                            times[ra], times[rb] = ta, tb
                            old_max, old_sum = max(times), sum(times)
                            improved = True
        if not improved:
            break
    replica_of = np.empty(len(L), dtype=np.int64)
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
