"""Algorithm 1 (`wlb_greedy`) against a plain twin: the same plans on random batches,
overloaded ones included (items that fit nowhere are deferred, most of the short ones fall
back to the bin of fewest tokens), through the Python loop and through the compiled one (the
`fast` extra, skipped without numba); the sorting and grouping helpers against numpy's."""
from __future__ import annotations


import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from wlb_opt.solvers.greedy import (AssignStop, SharedPlacements, Unshared, argsort_descending, bin_tokens,
                                    compiled_available, insert_sorted, placement_order, split_by_bin, use_compiled,
                                    warm_up_compiled, wlb_assign_lists, wlb_assign_python, wlb_greedy)
from wlb_opt.solvers.problem import PackProblem


def reference_wlb_greedy(problem: PackProblem) -> tuple[list[np.ndarray], np.ndarray]:
    """Algorithm 1 as written in the paper: least load first (ties: lowest bin), else the
    bin of fewest tokens (a scan), else defer. Returns (bins, deferred) in placement order."""
    n, cap = problem.n_bins, int(problem.max_tokens)
    lengths, weights = problem.lengths.tolist(), problem.weights.tolist()
    order = placement_order(problem, problem.lengths).tolist()
    toks, loads = [0] * n, [0.0] * n
    bins, deferred = [[] for _ in range(n)], []
    for i in order:
        d = lengths[i]
        b = min(range(n), key=lambda j: (loads[j], j))
        if toks[b] + d > cap:
            b = min(range(n), key=lambda j: (toks[j], j))
            if toks[b] + d > cap:
                deferred.append(i)
                continue
        toks[b] += d
        loads[b] += weights[i]
        bins[b].append(i)
    return [np.asarray(b, dtype=np.int64) for b in bins], np.asarray(deferred, dtype=np.int64)


@st.composite
def problems(draw):
    n_bins = draw(st.integers(1, 9))
    cap = draw(st.integers(4, 60))
    # up to ~3x the capacity: overloaded batches defer and fall back often
    n = draw(st.integers(0, 3 * n_bins * cap // 8 + 2))
    lengths = np.asarray(draw(st.lists(st.integers(1, cap), min_size=n, max_size=n)), dtype=np.int64)
    quadratic = draw(st.sampled_from([0.0, 0.5, 1.0]))
    # coarse weights make equal loads (ties) common
    weights = np.round(quadratic * lengths.astype(float) ** 2 / 7.0 + lengths) if draw(st.booleans()) else (
        quadratic * lengths.astype(float) ** 2 + 0.37 * lengths)
    if draw(st.booleans()):  # items that cost nothing: a bin at load 0.0 takes the next item again
        weights = np.where(lengths % 3 == 0, 0.0, weights)
    return PackProblem(lengths=lengths, weights=weights.astype(np.float64), n_bins=n_bins, max_tokens=cap,
                       carried=draw(st.integers(0, n)))


needs_numba = pytest.mark.skipif(not compiled_available(), reason="numba (the `fast` extra) is not installed")
BOTH_LOOPS = pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_numba)],
                                     ids=["python", "compiled"])


@BOTH_LOOPS
@settings(max_examples=300, deadline=None)
@given(problem=problems())
def test_algorithm_1_places_like_its_plain_twin(compiled, problem):
    with use_compiled(compiled):
        result = wlb_greedy(problem)
    bins, deferred = reference_wlb_greedy(problem)
    assert len(result.bins) == len(bins)
    for got, want in zip(result.bins, bins):
        assert np.array_equal(got, want)
    assert np.array_equal(result.deferred, deferred)


@settings(max_examples=200, deadline=None)
@given(problem=problems(), data=st.data())
def test_the_python_loop_stops_exactly_when_the_packing_passes_a_limit(problem, data):
    # AssignStop: a load stop that falls by slope x each deferred item's cost and never
    # exceeds load_cap, a limit on the deferred tokens, positions that must not be deferred;
    # the loop returns None at the first item that passes one of them (a deferred item passes
    # the load stop when it lowers the stop below a bin's load), else the full placement
    n, cap = problem.n_bins, int(problem.max_tokens)
    order = placement_order(problem, problem.lengths)
    full = wlb_assign_python(order, problem.lengths, problem.weights, n, cap)
    loads = [0.0] * n
    running = []  # (load after each placed item, or the weight of a deferred one), in order
    for i, b in zip(order.tolist(), full.tolist()):
        if b >= 0:
            loads[b] += problem.weights[i]
            running.append(("placed", loads[b], 0))
        else:
            running.append(("deferred", problem.weights[i], int(problem.lengths[i])))
    top = max([value for kind, value, _ in running if kind == "placed"], default=0.0)
    stop = AssignStop(load=data.draw(st.floats(-1.0, 1.2 * top + 1.0)),
                      slope=data.draw(st.sampled_from([0.0, 0.1, 1.0])),
                      load_cap=data.draw(st.one_of(st.just(float("inf")), st.floats(-1.0, 1.2 * top + 1.0))),
                      deferred_tokens=data.draw(st.sampled_from([float("inf"), 1, 5, 20])),
                      keep=frozenset(data.draw(st.lists(st.integers(0, max(len(order) - 1, 0)), max_size=3))))
    at, tokens, want, high = stop.load, 0, full, None
    for k, (kind, value, length) in enumerate(running):
        if kind == "deferred":
            tokens += length
            at -= stop.slope * value
            if k in stop.keep or tokens >= stop.deferred_tokens:
                want = None
                break
            value = high  # the heaviest bin so far, checked against the lowered stop
            if value is None:
                continue
        else:
            high = value if high is None else max(high, value)
        # the loop lowers the stop by runs of deferred items at once: its floats may differ
        # from these in the last bits
        limit = min(at, stop.load_cap)  # the falling stop, never above the cap
        assume(abs(value - limit) > 1e-9 * max(1.0, abs(value)))
        if value > limit:
            want = None
            break
    got = wlb_assign_python(order, problem.lengths, problem.weights, n, cap, stop=stop)
    assert (got is None) == (want is None)
    if got is not None:
        assert np.array_equal(got, full)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_shared_placements_place_each_candidate_as_the_whole_loop(data):
    # candidates first + group + rest, one SharedPlacements for all of them (groups of equal
    # size share its runs), each with a stop drawn at random: the same bins, or None, as
    # Algorithm 1's loop on the candidate's whole list
    n_bins, cap = data.draw(st.integers(1, 9)), data.draw(st.integers(4, 60))
    quadratic = data.draw(st.sampled_from([0.0, 0.5, 1.0]))
    coarse = data.draw(st.booleans())  # costs rounded: equal loads (ties) are common

    def items(max_size):
        sizes = data.draw(st.lists(st.integers(1, cap), max_size=max_size))
        if data.draw(st.booleans()):  # longest first, as a step places its pieces
            sizes.sort(reverse=True)
        costs = [round(quadratic * d * d / 7 + d) if coarse else quadratic * d * d + 0.37 * d for d in sizes]
        return sizes, [float(c) * (d % 5 != 0 or not coarse) for d, c in zip(sizes, costs)]  # some cost 0

    first, rest = items(4), items(3 * n_bins * cap // 8 + 2)
    shared = SharedPlacements(*first, *rest, n_bins, cap)
    for _ in range(data.draw(st.integers(1, 6))):
        group = items(4)
        sizes, costs = first[0] + group[0] + rest[0], first[1] + group[1] + rest[1]
        full = wlb_assign_lists(sizes, costs, n_bins, cap)
        top = max(costs, default=0.0) * (len(sizes) + 1)
        stop = data.draw(st.one_of(st.none(), st.builds(
            AssignStop, load=st.floats(-1.0, top), slope=st.sampled_from([0.0, 0.1, 1.0]),
            load_cap=st.one_of(st.just(float("inf")), st.floats(-1.0, top)),
            deferred_tokens=st.sampled_from([float("inf"), 1, 5, 20]),
            keep=st.frozensets(st.integers(0, max(len(sizes) - 1, 0)), max_size=3))))
        want = full if stop is None else wlb_assign_lists(sizes, costs, n_bins, cap, stop=stop)
        try:
            got = shared.assign(*group, stop=stop)
        except Unshared:  # only where an item placed first or of the group does not fit the least-loaded bin
            loads, toks = [0.0] * n_bins, [0] * n_bins
            for d, w in zip(first[0] + group[0], first[1] + group[1]):
                b = min(range(n_bins), key=lambda j: (loads[j], j))
                if toks[b] + d > cap:
                    break
                loads[b], toks[b] = loads[b] + w, toks[b] + d
            else:
                raise AssertionError("Unshared, though every item placed first and of the group fits")
            continue
        assert (got is None) == (want is None)
        if got is not None:
            assert got == want.tolist()


def test_shared_placements_share_the_run_of_groups_that_fill_the_same_bins():
    # two groups of one item, each to bin 0: the rest's placements on bins 1-2 are found once,
    # as far as the heavier group needs them, and the lighter one reuses a prefix of them
    rest = [1] * 12
    shared = SharedPlacements([], [], rest, [1.0] * 12, 3, 100)
    assert shared.assign([1], [5.0]) == wlb_assign_lists([1] + rest, [5.0] + [1.0] * 12, 3, 100).tolist()
    (run,) = shared._runs.values()
    assert len(run.chosen) == 10  # bins 1 and 2 up to load 5 each; the 11th item would go to bin 0
    assert shared.assign([1], [2.0]) == wlb_assign_lists([1] + rest, [2.0] + [1.0] * 12, 3, 100).tolist()
    assert len(shared._runs) == 1 and len(run.chosen) == 10


def test_the_python_loop_stops_when_a_deferred_item_lowers_the_stop_below_a_bin():
    # bin 0 holds the 10-token item (load 10); the last item fits nowhere and is deferred,
    # which lowers the stop from 10.5 to 9.5: bin 0 is then past it, although no item placed
    # after the deferral reaches it
    lengths, weights = np.array([10, 6, 6]), np.array([10.0, 1.0, 1.0])
    order = np.arange(3)
    assert wlb_assign_python(order, lengths, weights, 2, 10).tolist() == [0, 1, -1]
    assert wlb_assign_python(order, lengths, weights, 2, 10, stop=AssignStop(load=10.5, slope=1.0)) is None
    assert wlb_assign_python(order, lengths, weights, 2, 10, stop=AssignStop(load=10.5, slope=0.4)).tolist() == [0, 1, -1]


@BOTH_LOOPS
def test_an_overloaded_batch_falls_back_to_the_bin_of_fewest_tokens(compiled):
    # 9 -> bin 0, 8 -> bin 1; 3 is due to bin 0 (least load, lowest index) but fits neither
    # bin 0 nor bin 1 (fewest tokens): deferred; 2 does not fit bin 0 and falls back to bin 1
    problem = PackProblem(lengths=np.array([9, 8, 3, 2], dtype=np.int64), weights=np.array([0.1, 0.1, 0.1, 5.0]),
                          n_bins=2, max_tokens=10)
    with use_compiled(compiled):
        result = wlb_greedy(problem)
    assert [b.tolist() for b in result.bins] == [[0], [1, 3]] and result.deferred.tolist() == [2]
    bins, deferred = reference_wlb_greedy(problem)
    assert [b.tolist() for b in bins] == [[0], [1, 3]] and deferred.tolist() == [2]



@BOTH_LOOPS
def test_a_full_least_loaded_bin_is_passed_over_only_while_it_stays_the_least_loaded(compiled):
    # placed first, in this order (not longest first): the 3-token piece finds the least-loaded
    # bin (the 9-token piece's) without room and falls back to bin 1; the 1-token piece then
    # fits that bin, which stops being the least loaded, so the 2-token piece goes by load
    # (bin 0), not to the fewest-token bin as a bin still passed over would send it
    problem = PackProblem(lengths=np.array([6, 2, 9, 3, 1, 2, 1], dtype=np.int64),
                          weights=np.array([27.0, 29.0, 10.0, 13.0, 26.0, 3.0, 20.0]), n_bins=3, max_tokens=10,
                          carried=7)
    with use_compiled(compiled):
        result = wlb_greedy(problem)
    bins, deferred = reference_wlb_greedy(problem)
    assert [b.tolist() for b in result.bins] == [b.tolist() for b in bins] == [[0, 5, 6], [1, 3], [2, 4]]
    assert result.deferred.tolist() == deferred.tolist() == []

@needs_numba
def test_the_compiled_loop_places_a_large_batch_as_the_python_loop():
    # many bins (a tree of several levels, padded: 37 -> 64 leaves), float loads with ties
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 5000, 6000).astype(np.int64)
    weights = np.round(lengths.astype(float) ** 2 / 1e4 + lengths, 0)
    problem = PackProblem(lengths=lengths, weights=weights, n_bins=37, max_tokens=600_000, carried=50)
    with use_compiled(False):
        python = wlb_greedy(problem)
    with use_compiled(True):
        compiled = wlb_greedy(problem)
    assert all(np.array_equal(a, b) for a, b in zip(python.bins, compiled.bins))
    assert np.array_equal(python.deferred, compiled.deferred)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**33), max_size=300), st.sampled_from([3, 200, 70_000, 2**31, 2**33]))
def test_argsort_descending_is_numpys_stable_sort(values, modulus):
    key = np.asarray(values, dtype=np.int64) % modulus
    assert np.array_equal(argsort_descending(key), np.argsort(-key, kind="stable"))
    floats = key.astype(np.float64) / 7
    assert np.array_equal(argsort_descending(floats), np.argsort(-floats, kind="stable"))
    unsigned = key.astype(np.uint64)  # the same order: no key wraps around when negated
    assert np.array_equal(argsort_descending(unsigned), np.argsort(-key, kind="stable"))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 10**6), max_size=60), st.data())
def test_insert_sorted_is_numpys_insert(values, data):
    values = np.asarray(values, dtype=np.int64)
    k = data.draw(st.integers(0, 20))
    at = np.sort(np.asarray(data.draw(st.lists(st.integers(0, len(values)), min_size=k, max_size=k)), dtype=np.int64))
    items = np.asarray(data.draw(st.lists(st.integers(0, 10**6), min_size=k, max_size=k)), dtype=np.int64)
    got = insert_sorted(values, at, items)
    assert got.dtype == values.dtype and np.array_equal(got, np.insert(values, at, items))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.lists(st.integers(0, 39), max_size=200))
def test_split_by_bin_and_bin_tokens_match_a_stable_sort(n_bins, bins):
    bins_of = np.asarray(bins, dtype=np.int64) % n_bins
    items = np.arange(len(bins_of), dtype=np.int64)[::-1].copy()
    want = [items[bins_of == b] for b in range(n_bins)]
    got = split_by_bin(items, bins_of, n_bins)
    assert len(got) == n_bins and all(np.array_equal(g, w) for g, w in zip(got, want))
    lengths = (items * 7 + 3)[::-1].copy()
    groups = [np.flatnonzero(bins_of == b) for b in range(n_bins)]
    assert bin_tokens(lengths, groups).tolist() == [int(lengths[g].sum()) for g in groups]


def test_warm_up_compiles_the_loops_where_they_can_run():
    with use_compiled(False):
        assert warm_up_compiled() is False  # switched off: nothing to compile
    with use_compiled(True):
        assert warm_up_compiled() == compiled_available()


@pytest.mark.skipif(not compiled_available(), reason="numba (the `fast` extra) is not installed")
def test_warm_up_makes_every_signature_a_stream_uses():
    """After `warm_up_compiled`, a 32-micro-batch stream (lookahead 0 and 4, lumped
    candidates, the balanced placement) compiles nothing more: no step pays for numba."""
    import wlb_opt as wlb
    from wlb_opt.packer import PackerConfig, WLBPacker
    from wlb_opt.solvers import greedy_compiled
    from wlb_opt.workloads import global_batches

    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4, dp=1),
                                  wlb.HardwareSpec.preset("h100"))
    loops = [greedy_compiled.wlb_assign_compiled, greedy_compiled.phases_assign_compiled,
             greedy_compiled.lumped_assign_compiled]
    window = 131072
    with use_compiled(True):
        assert warm_up_compiled()
        before = [len(f.signatures) for f in loops]
        for dist in ("real", "heavy"):
            for k in (0, 4):
                packer = WLBPacker(32, int(1.25 * window), cost, config=PackerConfig(lookahead=k))
                for batch in global_batches(dist, window, 32 * window, 12, seed=7):
                    packer.pack(*batch)
                packer.drain()
    assert [len(f.signatures) for f in loops] == before
