"""solvers.offline: offline schedules of a whole stream, checked against their definition and,
on tiny streams, against every schedule enumerated."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wlb_opt.solvers.offline import OfflineStream, _Search, offline_frontier, offline_schedule, offline_stream
from wlb_opt.solvers.offline_step import OVERFLOW
from wlb_opt.solvers.offline_step import pack_step, step_model, water_level


def _cost(d):
    d = np.asarray(d, dtype=np.float64)
    return 1e-4 * d * d + 1e-2 * d


def _stream(steps):
    batches = [(np.asarray(s, dtype=np.int64), 100 * t + np.arange(len(s)), np.zeros(len(s), dtype=np.int64))
               for t, s in enumerate(steps)]
    return batches, offline_stream(batches, _cost)


def _measure(stream, step, micro, n_micro, mb_const, n_slots):
    """Per-step max/mean and displacement per token, written out loop by loop."""
    imbs = []
    for t in range(n_slots):
        loads = [mb_const + sum(float(stream.cost[i]) for i in range(len(step)) if step[i] == t and micro[i] == j)
                 for j in range(n_micro)]
        mean = sum(loads) / n_micro
        imbs.append(max(loads) / mean if mean > 0 else 1.0)
    disp = sum(int(stream.lengths[i]) * abs(int(step[i]) - int(stream.arrival[i])) for i in range(len(step)))
    return imbs, disp / int(stream.lengths.sum())


def _check(stream, sched, n_micro, max_tokens, early, late, n_slots):
    assert len(sched.step) == len(stream.lengths) == len(sched.micro_batch)
    assert ((sched.step >= 0) & (sched.step < n_slots)).all()
    assert ((sched.step >= stream.arrival - early) & (sched.step <= stream.arrival + late)).all()
    assert ((sched.micro_batch >= 0) & (sched.micro_batch < n_micro)).all()
    for t in range(n_slots):
        for j in range(n_micro):
            assert stream.lengths[(sched.step == t) & (sched.micro_batch == j)].sum() <= max_tokens
    imbs, disp = _measure(stream, sched.step, sched.micro_batch, n_micro, 0.5, n_slots)
    assert disp == pytest.approx(sched.displacement_per_token)
    assert disp <= sched.budget + 1e-12
    assert imbs == pytest.approx(sched.step_imbalance.tolist())


def _brute_force(stream, n_micro, max_tokens, mb_const, budget, early, late, n_slots):
    """Least sum of per-step imbalance over every (step, micro-batch) of every piece."""
    choices = [[(t, j) for t in range(max(0, a - early), min(n_slots - 1, a + late) + 1) for j in range(n_micro)]
               for a in stream.arrival.tolist()]
    best = np.inf
    for pick in itertools.product(*choices):
        step = np.array([p[0] for p in pick])
        micro = np.array([p[1] for p in pick])
        tokens = np.zeros((n_slots, n_micro), dtype=np.int64)
        np.add.at(tokens, (step, micro), stream.lengths)
        if tokens.max() > max_tokens:
            continue
        if (np.abs(step - stream.arrival) * stream.lengths).sum() > budget * stream.lengths.sum() + 1e-9:
            continue
        loads = np.zeros((n_slots, n_micro)) + mb_const
        np.add.at(loads, (step, micro), stream.cost)
        best = min(best, float((loads.max(axis=1) / loads.mean(axis=1)).sum()))
    return best


@pytest.mark.parametrize("budget", [0.0, 0.2, 0.6])
def test_a_tiny_stream_reaches_the_enumerated_optimum(budget):
    batches, stream = _stream([[40, 12], [30], [28, 6]])
    kw = dict(early=1, late=1, outlier_min=1)
    sched = offline_schedule(stream, 2, 60, 0.5, budget, **kw)
    _check(stream, sched, 2, 60, 1, 1, 3)
    assert sched.objective == pytest.approx(_brute_force(stream, 2, 60, 0.5, budget, 1, 1, 3), abs=1e-9)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.lists(st.integers(1, 60), min_size=0, max_size=5), min_size=2, max_size=5),
       st.floats(0.0, 1.0), st.integers(1, 3), st.integers(0, 2), st.integers(1, 3))
def test_a_schedule_is_valid_within_its_budget_and_never_worse_than_its_start(steps, budget, n_micro, early, late):
    if not any(steps):
        steps[0] = [5]
    batches, stream = _stream(steps)
    n_slots = len(steps) + late
    # a start that delays everything it can by one step (inside the window)
    start = np.minimum(stream.arrival + 1, np.minimum(stream.arrival + late, n_slots - 1))
    d_start = float((np.abs(start - stream.arrival) * stream.lengths).sum() / stream.lengths.sum())
    budgets = sorted({budget, d_start})
    # every step's arrivals fit one micro-batch (5 pieces of at most 60 tokens): the arrival schedule is valid
    out = offline_frontier(stream, n_micro, 300, 0.5, budgets, early=early, late=late, outlier_min=20,
                           starts=[start], n_slots=n_slots)
    assert [s.budget for s in out] == budgets
    for s in out:
        _check(stream, s, n_micro, 300, early, late, n_slots)
    # never worse than the start packed the same way, nor than a smaller budget's schedule
    at_start = offline_frontier(stream, n_micro, 300, 0.5, [d_start], early=early, late=late, outlier_min=20,
                                starts=[start], n_slots=n_slots, prices=(0.0,), sweeps=0)[0]
    assert out[budgets.index(d_start)].objective <= at_start.objective + 1e-12
    if len(out) == 2:
        assert out[1].objective <= out[0].objective + 1e-12


def test_a_start_packed_to_the_cap_is_made_feasible_for_the_model_by_moving_edge_pieces():
    # step 0's short pieces fill its one micro-batch to the token: the model wants one short
    # piece of slack, so the last one goes on to step 1, which has room for it
    batches, stream = _stream([[30, 30, 40], [10]])
    search = _Search(stream, 1, 100, 0.5, 1, 1, 50, np.ones(3))
    state = search.start_state(stream.arrival)
    search.load(*state)
    assert search.f[0] >= OVERFLOW
    big_step, P = search.feasible(*state)
    search.load(big_step, P)
    assert max(search.f) < OVERFLOW
    assert P == [0, 2, 4, 4]  # 30, 30 at step 0; 40, 10 at step 1
    assert all(search.lowP[t] <= P[t] <= search.highP[t] for t in range(4))


@settings(max_examples=15, deadline=None)
@given(st.lists(st.lists(st.integers(1, 60), min_size=1, max_size=4), min_size=2, max_size=5), st.integers(1, 3))
def test_a_seeded_search_keeps_each_state_within_its_cap(steps, n_micro):
    # at most 240 tokens a step: the model finds every step within capacity, so the start is
    # kept as given and the caps from its own displacement up are met
    batches, stream = _stream(steps)
    n_slots = len(steps) + 1
    start = np.minimum(stream.arrival + 1, n_slots - 1)  # everything one step late
    search = _Search(stream, n_micro, 300, 0.5, 1, 1, 20, np.ones(n_slots))
    d_start = int((np.abs(start - stream.arrival) * stream.lengths).sum())
    caps = [0, d_start // 2, d_start, 2 * d_start]
    out = search.seeded(search.start_state(start), caps, 2, np.random.default_rng(0))
    assert {2, 3} <= set(out)
    for i, state in out.items():
        search.load(*state)
        assert search.D <= caps[i]
        assert all(search.lowP[t] <= state[1][t] <= search.highP[t] for t in range(n_slots + 1))


def test_the_stream_is_flat_in_batch_order():
    batches, stream = _stream([[5, 6], [], [7]])
    assert stream.lengths.tolist() == [5, 6, 7] and stream.arrival.tolist() == [0, 0, 2] and stream.n_steps == 3
    assert stream.cost.tolist() == pytest.approx(_cost([5, 6, 7]).tolist())


def test_water_level_matches_bisection():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 6))
        loads = rng.choice([0.0, 1.0], n) * rng.random(n)
        rooms = rng.integers(0, 100, n)
        fluid = int(rng.integers(0, rooms.sum() + 1))
        density = float(rng.random() * 0.05 + 1e-3)
        lo, hi = 0.0, float((loads + density * rooms).max()) + 1
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if np.minimum(np.maximum((mid - loads) / density, 0), rooms).sum() >= fluid else (mid, hi)
        want = float((loads + density * np.minimum(np.maximum((hi - loads) / density, 0), rooms)).max()) if fluid \
            else float(loads.max())
        assert water_level(loads.tolist(), rooms.tolist(), fluid, density) == pytest.approx(want, rel=1e-6, abs=1e-9)


def test_the_step_model_flags_overflow_and_levels_a_fluid():
    assert step_model([], [], 100, 1.0, 10, 0.1, 4, 50, 0.0) == 1.0
    assert step_model([], [], 300, 1.0, 10, 0.1, 4, 50, 0.0) >= 1000.0  # 300 tokens > 4 x 50 - 10
    assert step_model([60], [1.0], 0, 0.0, 0, 0.0, 2, 50, 0.0) >= 1000.0  # an outlier longer than the cap
    # one outlier of cost 2, fluid of cost 2 poured beside it: 2 / mean 2
    assert step_model([40], [2.0], 40, 2.0, 1, 0.05, 2, 50, 0.0) == pytest.approx(1.0)


def test_pack_step_places_every_piece_within_the_cap():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 400, 40)
    assign = pack_step(lengths, _cost(lengths), 4, int(lengths.sum() // 4 + 400), 0.1, outlier_min=200)
    assert (assign >= 0).all()
    for j in range(4):
        assert lengths[assign == j].sum() <= lengths.sum() // 4 + 400


@pytest.mark.parametrize("kw, message", [
    (dict(budget=-0.1), "budget must be a finite number >= 0"),
    (dict(budget=float("nan")), "budget must be a finite number >= 0"),
    (dict(n_micro=0), "n_micro must be an integer >= 1"),
    (dict(max_tokens=30), "cannot fit max_tokens=30"),
    (dict(early=-1), "early must be an integer >= 0"),
    (dict(mb_const=-1.0), "mb_const must be finite seconds >= 0"),
    (dict(n_slots=1), "n_slots must be an integer >= the stream's 3 steps"),
    (dict(step_weights=np.ones(2)), "step_weights must be 3 finite numbers"),
    (dict(prices=()), "prices must be finite numbers >= 0"),
    (dict(starts=[np.array([2, 0, 0, 0, 0])]), "start 0 must give each of the 5 pieces a step within"),
    (dict(seeded_starts=-1), "seeded_starts must be an integer >= 0 or None, got -1"),
    (dict(seeded_starts=1.5), "seeded_starts must be an integer >= 0 or None, got 1.5"),
])
def test_bad_input_is_refused_by_name(kw, message):
    batches, stream = _stream([[40, 12], [30], [28, 6]])
    args = dict(n_micro=2, max_tokens=60, mb_const=0.5, budget=0.2)
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    window = dict(early=1, late=1)
    window.update({k: kw.pop(k) for k in list(kw) if k in window})
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        offline_schedule(stream, args["n_micro"], args["max_tokens"], args["mb_const"], args["budget"], **window, **kw)
    with pytest.raises(TypeError, match="OfflineStream"):
        offline_schedule(batches, 2, 60, 0.5, 0.2, early=1, late=1)
    with pytest.raises(ValueError, match="budgets must hold at least one displacement budget"):
        offline_frontier(stream, 2, 60, 0.5, [], early=1, late=1)
    with pytest.raises(ValueError, match="one entry per piece"):
        OfflineStream(lengths=np.ones(2, dtype=np.int64), doc_ids=np.zeros(1, dtype=np.int64),
                      offsets=np.zeros(2, dtype=np.int64), arrival=np.zeros(2, dtype=np.int64), cost=np.ones(2),
                      n_steps=1)


def test_the_search_floor_never_exceeds_the_step_model():
    """The branch and bound of splits and chains prunes by `floor`: it must be a lower bound of
    the model, and its array forms (`_floors`, `_floors_with`) must agree with it."""
    from wlb_opt.solvers.offline import _Search

    rng = np.random.default_rng(1)
    for trial in range(60):
        steps = [np.where(rng.random(m) < 0.4, rng.integers(30, 160, m), rng.integers(1, 30, m))
                 for m in rng.integers(1, 12, 6)]
        _, stream = _stream(steps)
        search = _Search(stream, int(rng.integers(1, 5)), 170, float(rng.choice([0.0, 0.5])), 1, 1, 30, np.ones(6))
        search.load(stream.arrival[search.big].tolist(), search.start_state(stream.arrival)[1])
        n_big, n_short = len(search.blen), len(search.short)
        for _ in range(40):
            bigs = tuple(sorted(rng.choice(n_big, size=rng.integers(0, min(n_big, 6) + 1), replace=False).tolist()))
            p = int(rng.integers(0, n_short + 1))
            q = int(rng.integers(p, n_short + 1))
            cost, top = sum(search.bcost[k] for k in bigs), search.bcost[bigs[0]] if bigs else 0.0
            tokens = sum(search.blen[k] for k in bigs)
            floor = search.floor(cost, top, tokens, p, q)
            assert floor <= search.model(bigs, p, q) + 1e-9
            assert search._floors(np.array([cost]), np.array([top]), np.array([tokens]), p, q)[0] == \
                pytest.approx(floor, rel=1e-12)
        for c in range(6):
            for k in range(n_big):
                bc, (p, q) = search.bigs[c], (search.P[c], search.P[c + 1])
                expect = search.floor(search.bsum[c] + search.bcost[k], max([search.bcost[x] for x in bc + (k,)]),
                                      search.btok[c] + search.blen[k], p, q)
                got = search._floors_with(np.array([c]), np.array([search.bcost[k]]),
                                          np.array([max([search.bcost[x] for x in bc + (k,)])]),
                                          np.array([search.blen[k]]))[0]
                assert got == pytest.approx(expect, rel=1e-12)


def test_a_budget_without_a_schedule_raises_or_is_left_out():
    # step 0's arrivals (3 x 50 tokens) overflow its 2 x 60 tokens: a budget of 0 has no schedule
    batches, stream = _stream([[50, 50, 50], [10], [10]])
    kw = dict(early=1, late=1, outlier_min=20)
    with pytest.raises(ValueError, match="no schedule found within the displacement budget 0"):
        offline_frontier(stream, 2, 60, 0.5, [0.0, 1.0], **kw)
    out = offline_frontier(stream, 2, 60, 0.5, [0.0, 1.0], skip_infeasible=True, **kw)
    assert [s.budget for s in out] == [1.0]
    _check(stream, out[0], 2, 60, 1, 1, 3)



def test_the_schedule_kept_is_the_best_on_the_measure_read():
    """The search may weigh steps otherwise than the measure the schedules are read on; of the
    schedules within a budget (each start as given among them) the one kept is the best on
    `measure_weights`. Here the start moves a short piece out of an edge step into a measured
    one: better on the search's weights, worse on the measure, so the arrival schedule is kept."""
    batches, stream = _stream([[60, 60, 10], [60, 60], [60, 60]])
    start = stream.arrival.copy()
    start[2] = 1  # the short piece of step 0, a step late
    d_start = float((np.abs(start - stream.arrival) * stream.lengths).sum() / stream.lengths.sum())
    weights, measured = np.array([10.0, 1.0, 1.0, 10.0]), np.array([0.0, 1.0, 1.0, 0.0])
    kw = dict(early=0, late=1, outlier_min=20, starts=[start], n_slots=4, step_weights=weights, prices=(0.0,),
              sweeps=0)
    searched = offline_frontier(stream, 2, 300, 0.5, [d_start], **kw)[0]
    assert searched.step[2] == 1  # the search's own weights prefer the start
    read = offline_frontier(stream, 2, 300, 0.5, [d_start], measure_weights=measured, **kw)[0]
    assert read.step[2] == 0 and read.displacement_per_token == 0.0
    assert np.dot(measured, read.step_imbalance) < np.dot(measured, searched.step_imbalance)
