"""wlb_fill: its short-piece loop against Algorithm 1, feasibility and determinism, the
polish never worse than the plan before it, brute-force optima on tiny instances, and the
fluid water level of the step predictor against a bisection."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import unit_cost

import wlb_opt as wlb
from wlb_opt.packer.fill_trial import predict_rounds, water_level
from wlb_opt.solvers.fill import fill_assign, large_mask, place_large, wlb_fill
from wlb_opt.solvers.greedy import placement_order, wlb_assign_python
from wlb_opt.solvers.problem import PackProblem


def _problem(lengths, n_bins, cap, carried=0, bin_const=0.0):
    lengths = np.asarray(lengths, dtype=np.int64)
    weights = lengths.astype(np.float64) ** 2 / 1e4 + lengths
    return PackProblem(lengths=lengths, weights=weights, n_bins=n_bins, max_tokens=cap, carried=carried,
                       bin_const=bin_const)


def _algorithm1_from(order, lengths, weights, loads, toks, cap):
    """Algorithm 1 as a plain scan from the bins' starting loads and tokens: the least-loaded
    bin (ties: lowest index) if the item fits, else the bin of fewest tokens if it fits there,
    else deferred (-1). Returns the bins and the final loads and tokens."""
    loads, toks, placed = list(loads), list(toks), []
    for i in order.tolist():
        b = min(range(len(loads)), key=lambda j: (loads[j], j))
        if toks[b] + lengths[i] > cap:
            b = min(range(len(loads)), key=lambda j: (toks[j], j))
            if toks[b] + lengths[i] > cap:
                placed.append(-1)
                continue
        toks[b] += int(lengths[i])
        loads[b] += float(weights[i])
        placed.append(b)
    return np.array(placed, dtype=np.int64), loads, toks


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=0, max_size=60), n_bins=st.integers(1, 6),
       slack=st.floats(0.4, 2.0), start=st.sampled_from(["empty", "partial"]), seed=st.integers(0, 2**16))
def test_fill_assign_is_algorithm1_from_the_bins_state(lengths, n_bins, slack, start, seed):
    """From empty bins, or bins already holding some tokens and load (the plan `fill_assign`
    continues), its placements and the bins' state it leaves equal a plain scan's."""
    lengths = np.array(lengths, dtype=np.int64)
    weights = lengths.astype(np.float64) ** 1.5
    cap = max(1, int(slack * lengths.sum() / n_bins)) if len(lengths) else 1
    order = np.argsort(-lengths, kind="stable")
    loads, toks = np.zeros(n_bins), np.zeros(n_bins, dtype=np.int64)
    if start == "partial":
        rng = np.random.default_rng(seed)
        toks = rng.integers(0, cap + 1, n_bins).astype(np.int64)
        loads = np.round(rng.uniform(0, 2, n_bins) * toks, 1)  # coarse: ties between bins are common
    want, want_loads, want_toks = _algorithm1_from(order, lengths, weights, loads, toks, cap)
    got = fill_assign(order, lengths, weights, loads, toks, cap)
    np.testing.assert_array_equal(got, want)
    assert loads.tolist() == want_loads and toks.tolist() == want_toks  # the bins' state, in place
    assert (toks <= cap).all()


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 400), min_size=0, max_size=80), n_micro=st.integers(1, 6),
       slack=st.floats(0.5, 2.0), carried_frac=st.floats(0, 1))
def test_wlb_fill_is_feasible_deterministic_and_its_polish_never_worse(lengths, n_micro, slack, carried_frac):
    lengths = np.array(lengths, dtype=np.int64)
    cap = max(int(lengths.max()) if len(lengths) else 1, int(slack * lengths.sum() / n_micro) if len(lengths) else 1)
    carried = int(carried_frac * len(lengths))
    cost = unit_cost(attn=1e-3, linear=1.0, mb_const=0.01)
    plan = wlb.solve_pack(lengths, n_micro, cap, cost, "wlb_fill", carried=carried)
    wlb.check_pack(plan, lengths, cap, cost=cost)
    assert plan.digest() == wlb.solve_pack(lengths, n_micro, cap, cost, "wlb_fill", carried=carried).digest()
    # the plan before the polish: phases 1 and 2, rebuilt from their parts
    problem = PackProblem(lengths=lengths, weights=cost.doc_cost(lengths), n_bins=n_micro, max_tokens=cap,
                          carried=carried, bin_const=cost.mb_const())
    if not len(lengths):
        return
    order = placement_order(problem, lengths)
    large = large_mask(problem.weights, n_micro, carried)
    bins, deferred = place_large(problem, order, large)
    loads = np.array([problem.weights[b].sum() if b else 0.0 for b in bins])
    toks = np.array([lengths[b].sum() if b else 0 for b in bins], dtype=np.int64)
    short = order[~large[order]]
    placed = fill_assign(short, lengths, problem.weights, loads, toks, cap)
    before_tokens = int(lengths.sum() - lengths[deferred].sum() - lengths[short[placed < 0]].sum())
    assert plan.placed_tokens >= before_tokens
    if plan.placed_tokens == before_tokens:
        assert plan.loads.max() <= (loads.max() + cost.mb_const()) * (1 + 1e-12)


def _brute_force(problem):
    """The least largest load over every assignment that places everything (None if none fits)."""
    best = None
    n = problem.n_items
    for assign in itertools.product(range(problem.n_bins), repeat=n):
        a = np.array(assign)
        if any(problem.lengths[a == b].sum() > problem.max_tokens for b in range(problem.n_bins)):
            continue
        top = max(problem.weights[a == b].sum() for b in range(problem.n_bins)) + problem.bin_const
        best = top if best is None else min(best, top)
    return best


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=7), n_bins=st.integers(2, 3))
def test_wlb_fill_against_the_brute_force_optimum(lengths, n_bins):
    problem = _problem(lengths, n_bins, cap=10**6)
    result = wlb_fill(problem)
    assert not len(result.deferred)  # no cap: everything placed
    got = max(problem.weights[b].sum() for b in result.bins) + problem.bin_const
    best = _brute_force(problem)
    assert best <= got * (1 + 1e-12)
    assert got <= best * 4 / 3 + max(problem.weights) * 1e-12  # LPT's guarantee holds after the polish


def test_wlb_fill_reaches_the_optimum_where_algorithm1_does_not():
    # LPT's classic bad case: 3, 3, 2, 2, 2 on two bins. Algorithm 1 ends at 3+2+2 | 3+2; the
    # descent on the large items swaps a 3 for a 2 (3+3 | 2+2+2), the optimum.
    problem = _problem([300, 300, 200, 200, 200], 2, cap=10**6)
    alg1 = wlb_assign_python(placement_order(problem, problem.lengths), problem.lengths, problem.weights, 2, 10**6)
    order = placement_order(problem, problem.lengths)
    alg1_max = max(problem.weights[order[alg1 == b]].sum() for b in range(2))
    result = wlb_fill(problem)
    got = max(problem.weights[b].sum() for b in result.bins)
    opt = _brute_force(problem)
    assert got == pytest.approx(opt)
    assert alg1_max > opt * 1.1


@settings(max_examples=80, deadline=None)
@given(large=st.lists(st.floats(0, 100), min_size=1, max_size=8), short=st.floats(0, 500),
       room=st.one_of(st.none(), st.lists(st.floats(0, 200), min_size=8, max_size=8)))
def test_water_level_against_a_bisection(large, short, room):
    large = np.array(large)
    room = None if room is None else np.array(room[:len(large)])
    got = water_level(large, short, room)
    cap = np.inf if room is None else room
    rise = got - large
    assert np.all(rise >= -1e-9) and np.all(rise <= cap + 1e-9)
    full = room is not None and room.sum() <= short
    if full:
        np.testing.assert_allclose(got, large + room)
        return
    assert rise.sum() == pytest.approx(short, rel=1e-9, abs=1e-9)
    lo, hi = 0.0, float(large.max() + short + 1)  # the level by bisection
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.clip(mid - large, 0, cap).sum() < short else (lo, mid)
    np.testing.assert_allclose(got, np.minimum(np.maximum(large, hi), large + cap), rtol=1e-7, atol=1e-7)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.integers(1, 400), min_size=0, max_size=40), min_size=1, max_size=5),
       n_bins=st.integers(1, 6), slack=st.floats(0.3, 2.0))
def test_predict_rounds_conserves_and_rows_are_independent(rows, n_bins, slack):
    # every item is placed under the cap or deferred, and a row's prediction does not depend
    # on the rows scored with it
    width = max(len(r) for r in rows)
    lengths = np.zeros((len(rows), width), dtype=np.int64)
    for c, r in enumerate(rows):
        lengths[c, :len(r)] = sorted(r, reverse=True)
    weights = lengths.astype(np.float64) ** 2 / 1e4 + lengths
    n_items = np.array([len(r) for r in rows])
    cap = max(1, int(slack * lengths.sum(axis=1).max(initial=0) / n_bins))
    loads, toks, deferred = predict_rounds(weights, lengths, n_items, n_bins, cap)
    assert (toks <= cap).all()
    assert not deferred[np.arange(width)[None, :] >= n_items[:, None]].any()
    np.testing.assert_allclose(loads.sum(axis=1) + np.where(deferred, weights, 0).sum(axis=1), weights.sum(axis=1))
    assert (toks.sum(axis=1) + np.where(deferred, lengths, 0).sum(axis=1) == lengths.sum(axis=1)).all()
    for c in range(len(rows)):
        one = predict_rounds(weights[c:c + 1], lengths[c:c + 1], n_items[c:c + 1], n_bins, cap)
        np.testing.assert_array_equal(one[0][0], loads[c])
        np.testing.assert_array_equal(one[2][0], deferred[c])


def test_predict_rounds_is_algorithm1_when_no_round_reorders():
    # equal items without a cap: Algorithm 1 deals them round-robin, as the rounds do
    lengths = np.full((1, 23), 50, dtype=np.int64)
    weights = lengths.astype(np.float64)
    loads, toks, deferred = predict_rounds(weights, lengths, np.array([23]), 5, 10**6)
    placed = wlb_assign_python(np.arange(23), lengths[0], weights[0], 5, 10**6)
    np.testing.assert_array_equal(loads[0], np.bincount(placed, weights=weights[0], minlength=5))
    assert not deferred.any()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), n_groups=st.integers(1, 6))
def test_candidates_scored_together_equal_each_scored_alone(seed, n_groups):
    # FillTrial.with_groups (one predict_rounds for every candidate) against FillStepSolver.solve
    # of each candidate's pieces: the same pending pieces, prediction and deferred pieces
    from wlb_opt.packer.fill_trial import FillStepSolver
    from wlb_opt.packer.state import HeldPiece
    rng = np.random.default_rng(seed)
    pieces = [HeldPiece(i, 0, int(n), int(rng.integers(0, 3))) for i, n in enumerate(rng.integers(1, 500, 40))]
    fresh, held = pieces[:25], pieces[25:]
    weights = np.array([p.length for p in pieces], dtype=np.float64) ** 2 / 1e4
    solver = FillStepSolver(held + fresh, weights[list(range(25, 40)) + list(range(25))], fresh, n_micro=4, dp=1,
                            max_tokens=int(rng.integers(300, 3000)), bin_const=0.5)
    first, base = held[:2], held[2:5]
    groups = [held[5 + i:5 + i + int(rng.integers(1, 4))] for i in range(n_groups)]
    _, base_trial, _ = solver.solve(first, base + fresh)
    for group, trial in zip(groups, base_trial.with_groups(groups)):
        pending, alone, arrival = solver.solve(first, base + group + fresh)
        assert trial.pending == pending
        np.testing.assert_array_equal(trial.arrival, arrival)
        np.testing.assert_allclose(trial.predicted_loads, alone.predicted_loads, rtol=1e-12)
        assert trial.imbalance == pytest.approx(alone.imbalance, rel=1e-12)
        assert trial.deferred_tokens == alone.deferred_tokens and trial.n_placed == alone.n_placed
        assert trial.defers_any(group) == alone.defers_any(group)


def test_calibration_meter_counts_candidates_scored_together():
    # with method wlb_fill the release scores a round's candidates without the solve callback:
    # the calibration meter is told of them (account), so its work budget still bounds the trials
    from wlb_opt.packer.calibrate import _Meter, _Metered
    from wlb_opt.workloads import global_batches
    cost = unit_cost(attn=1e-6, linear=1e-3)
    batches = global_batches("real", 4096, 4 * 4096, 12, seed=3)
    counted = {}
    for scored_together in (True, False):
        packer = wlb.WLBPacker(4, 5120, cost, config=wlb.PackerConfig(method="wlb_fill", thresholds=[1024, 2048]))
        meter = _Meter()
        metered = _Metered(packer._solve, meter)
        if not scored_together:  # a callback without `account`: the plain callable
            metered = metered.__call__
        packer._solve = metered
        for batch in batches:
            packer.pack(*batch)
        counted[scored_together] = meter.work
    assert counted[True] > counted[False] > 0
