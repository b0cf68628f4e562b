"""The no-tuning defaults of WLBPacker (`wlb_opt.packer.defaults`): what they are, the
displacement feedback of balance_tolerance="auto", and bad input."""
import numpy as np
import pytest

from conftest import unit_cost

import wlb_opt as wlb
from wlb_opt import workloads
from wlb_opt.packer import PackerConfig, WLBPacker
from wlb_opt.packer import defaults as d
from wlb_opt.packer.state import HeldPiece

COST = unit_cost(1e-6, 1e-3, backward=True)


def test_the_defaults_are_one_pool_marginal_release_and_the_feedback_tolerance():
    packer = WLBPacker(4, 163840, COST)
    assert packer.thresholds == [int(163840 * d.DEFAULT_CUTOFF_SHARE)] == [49152]
    assert packer.release == "marginal" and packer.max_delay == d.DEFAULT_MAX_DELAY == 32
    assert packer._release.price == d.MARGINAL_PRICE and packer._release.capacity_tokens == 4 * 163840
    # with lookahead too (defaults.py); "group" by name
    assert WLBPacker(4, 163840, COST, config=PackerConfig(lookahead=2)).release == "marginal"
    assert WLBPacker(4, 163840, COST, config=PackerConfig(lookahead=2, release="group")).release == "group"
    assert packer.balance_tolerance == "auto" and packer.lookahead == 0 and packer.calibration is None
    assert WLBPacker(4, 163840, COST, config=PackerConfig(n_queues=1)).thresholds == [49152]


def test_adaptive_tolerance_rises_with_displacement_between_its_bounds():
    budget = 0.5
    target = d.TARGET_SHARE * budget
    xs = np.linspace(0, 2 * target, 41)
    tol = [d.adaptive_tolerance(x, budget) for x in xs]
    assert tol[0] == d.TOLERANCE_LOW and tol[-1] == d.TOLERANCE_HIGH
    assert all(b >= a for a, b in zip(tol, tol[1:]))
    middle = target * (d.RISE_FROM + d.RISE_TO) / 2
    assert d.adaptive_tolerance(middle, budget) == pytest.approx((d.TOLERANCE_LOW + d.TOLERANCE_HIGH) / 2)
    assert d.adaptive_tolerance(d.RISE_FROM * target, budget) == pytest.approx(d.TOLERANCE_LOW)
    assert d.adaptive_tolerance(d.RISE_TO * target, budget) == pytest.approx(d.TOLERANCE_HIGH)
    assert d.adaptive_tolerance(0.3, 0.0) == d.TOLERANCE_HIGH
    # release="marginal" ramps to its own ceiling
    assert d.adaptive_tolerance(0.0, budget, d.MARGINAL_TOLERANCE_HIGH) == d.TOLERANCE_LOW
    assert d.adaptive_tolerance(d.RISE_TO * target, budget, d.MARGINAL_TOLERANCE_HIGH) == pytest.approx(
        d.MARGINAL_TOLERANCE_HIGH)


def test_running_displacement_counts_the_wait_of_held_pieces():
    totals = dict(displacement_token_sum=0, tokens=0)
    # nothing placed, nothing held: the prior (the target) alone
    assert d.running_displacement(totals, [], 0, 1000, 0.4) == pytest.approx(0.4)
    held = [HeldPiece(1, 0, 500, 0)]  # waited 10 steps
    got = d.running_displacement(totals, held, 10, 1000, 0.4)
    assert got == pytest.approx((10 * 500 + 0.4 * 2000) / (500 + 2000))
    # a piece seen ahead (lookahead) has neither waited nor arrived: left out, not counted as
    # tokens without displacement
    assert d.running_displacement(totals, [HeldPiece(2, 0, 500, 12)], 10, 1000, 0.4) == pytest.approx(0.4)
    assert d.running_displacement(totals, held + [HeldPiece(2, 0, 500, 12)], 10, 1000, 0.4) == pytest.approx(got)


def _stream(rng, n_batches, cap=200):
    out, next_id = [], 0
    for _ in range(n_batches):
        n = int(rng.integers(4, 14))
        lengths = np.where(rng.random(n) < 0.15, rng.integers(cap // 3, cap + 1, n), rng.integers(1, cap // 10, n))
        out.append((lengths, np.arange(next_id, next_id + n)))
        next_id += n
    return out


def test_a_fixed_tolerance_is_used_as_given():
    batches = _stream(np.random.default_rng(4), 20)
    packer = WLBPacker(2, 200, COST, config=PackerConfig(thresholds=[60], balance_tolerance=1.3))
    assert {packer.pack(*b).info.extra["balance_tolerance"] for b in batches} == {1.3}


@pytest.mark.parametrize("kwargs, match", [
    (dict(balance_tolerance="fixed"), "balance_tolerance must be 'auto' or"),
    (dict(balance_tolerance=0.9), "balance_tolerance must be 'auto' or"),
    (dict(balance_tolerance=True), "balance_tolerance must be 'auto' or"),
    (dict(n_queues=2), "does not match thresholds=None"),
])
def test_bad_default_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WLBPacker(2, 200, COST, config=PackerConfig(**kwargs))


def test_default_packer_trains_every_document_once_on_the_default_distribution():
    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4, dp=1),
                                  wlb.HardwareSpec.preset("h100"))
    batches = workloads.global_batches("default", 131072, 4 * 131072, 12, seed=workloads.DEFAULT_SEED + 100)
    packer = WLBPacker(4, 163840, cost)
    plans = [packer.pack(*b) for b in batches] + packer.drain()
    placed = sorted((int(p.doc_ids[i]), int(p.offsets[i])) for p in plans for mb in p.micro_batches for i in mb)
    sent = sorted((int(i), int(o)) for b in batches for i, o in zip(b[1], b[2]))
    assert placed == sent


def _sent_and_placed(batches, plans):
    placed = sorted((int(p.doc_ids[i]), int(p.offsets[i])) for p in plans for mb in p.micro_batches for i in mb)
    sent = sorted((int(i), int(o)) for b in batches for i, o in zip(b[1], b[2]))
    return sent, placed


def test_a_long_document_arriving_whole_passes_the_default_backlog_limit_only():
    # 15 pieces of 100 tokens arrive together: 1300 tokens stay held after the first step,
    # above the default limit (2 + 1) x 2 x 100 = 600 by less than the batch's excess (1300).
    long_doc = wlb.split_documents([1500], 100, ids=[0])
    batches = [long_doc] + [(np.full(3, 10), np.arange(k * 3 + 1, k * 3 + 4), np.zeros(3, np.int64))
                            for k in range(8)]
    packer = WLBPacker(2, 100, COST)
    assert packer.max_backlog_tokens == 600
    plans = [packer.pack(*b) for b in batches] + packer.drain()
    sent, placed = _sent_and_placed(batches, plans)
    assert placed == sent
    strict = WLBPacker(2, 100, COST, max_backlog_tokens=600)  # an explicit limit is strict
    with pytest.raises(ValueError, match=r"overload at step 0.*max_backlog_tokens=600;"):
        strict.pack(*long_doc)


def test_the_default_backlog_limit_still_catches_a_stream_above_capacity():
    packer = WLBPacker(2, 100, COST)  # capacity 200 tokens a step
    with pytest.raises(ValueError, match=r"overload at step \d+.*\+ 40 \(the batch's tokens beyond"):
        for k in range(40):  # 240 tokens a step: the backlog grows by ~40 a step
            packer.pack(np.full(24, 10), np.arange(24 * k, 24 * k + 24))
    assert packer.held_tokens <= 600 + 40


@pytest.mark.parametrize("release", ["group", "marginal"])
def test_group_release_never_carries_an_outlier_it_released_early(release):
    # An outlier that the packing defers is carried, and a carried piece is placed first in
    # the next step, often alone; "group" only lets a group leave if the step places all of it.
    rng = np.random.default_rng(7)
    batches = [(b[0], b[1], np.zeros(len(b[0]), np.int64)) for b in _stream(rng, 120)]
    packer = WLBPacker(2, 200, COST, config=PackerConfig(thresholds=[60], max_delay=6, release=release))
    plans = [packer.pack(*b) for b in batches] + packer.drain()
    for plan in plans[:len(batches)]:
        for i in plan.deferred.tolist():
            if plan.lengths[i] >= 60:  # only an outlier at its deadline may be carried
                assert plan.step - plan.arrival_step[i] >= 6
    sent, placed = _sent_and_placed(batches, plans)
    assert placed == sent


def test_marginal_holds_what_would_unbalance_a_step_that_group_takes():
    # attention-only cost d(d+1)/2, 2 micro-batches of 200 tokens; the step brings 20 x 5
    # tokens (15 each) and outliers of 60 (1830) and 100 (5050). Tolerance 2.0:
    # - "group" (most tokens first): 100 alone (5050 | 300: 1.89 <= 2.0), then 60 joins the
    #   shorts (5050 | 2130: 1.41);
    # - "marginal" (price 0.5 x (2.0 - 1) per 400 tokens): 100 scores 0.89 - 0.125, 60 scores
    #   0.72 - 0.075, both together 0.41 - 0.2: all > 0, so both wait and the step stays 1.0.
    cost = unit_cost(attn=1.0, linear=0.0)
    batch = ([100, 60] + [5] * 20, list(range(22)))
    got = {}
    for release in ("group", "marginal"):
        packer = WLBPacker(2, 200, cost,
                           config=PackerConfig(thresholds=[50], max_delay=None, release=release, balance_tolerance=2.0))
        got[release] = (packer.pack(*batch), sorted(packer.queued_ids().tolist()), packer)
    plan, queued, _ = got["group"]
    assert sorted(plan.placed_ids().tolist()) == list(range(22)) and queued == []
    assert plan.imbalance == pytest.approx(5050 / ((5050 + 1830 + 300) / 2))
    plan, queued, packer = got["marginal"]
    assert sorted(plan.placed_ids().tolist()) == list(range(2, 22)) and queued == [0, 1]
    assert plan.imbalance == pytest.approx(1.0)
    # a step that would train nothing takes its most balanced group: both, one per micro-batch
    idle = packer.pack([], [])
    assert sorted(idle.placed_ids().tolist()) == [0, 1] and idle.imbalance == pytest.approx(5050 / ((5050 + 1830) / 2))


def test_marginal_defers_a_short_document_that_outweighs_the_rest_of_a_starved_step():
    # attention-only cost d(d+1)/2, 4 micro-batches of 200 tokens, pool cutoff 50: the step
    # brings one short piece of 40 (820) and ten of 4 (10 each), and the pool holds nothing.
    # Packed whole, the 40 sits alone: 820 / ((820 + 100) / 4) = 3.57. Deferred, the ten 4s
    # spread 3/3/2/2: 30 / 25 = 1.2. Price 0.5 x (2.0 - 1) per 800 tokens: 40 tokens cost
    # 0.025 < 2.37, so the 40 waits one step (carried) and trains with the next batch.
    cost = unit_cost(attn=1.0, linear=0.0)
    batch = ([40] + [4] * 10, list(range(11)))
    packer = WLBPacker(4, 200, cost, config=PackerConfig(thresholds=[50], release="marginal", balance_tolerance=2.0))
    plan = packer.pack(*batch)
    assert plan.deferred_ids().tolist() == [0] and packer.carried_ids().tolist() == [0]
    assert plan.imbalance == pytest.approx(30 / 25)
    nxt = packer.pack([40, 40, 40], [11, 12, 13])  # with three like it, all four balance
    assert sorted(nxt.placed_ids().tolist()) == [0, 11, 12, 13] and nxt.imbalance == pytest.approx(1.0)
    assert packer.stats()["displacement_per_token"] == pytest.approx(40 / (80 + 120))
    # "group" (no trim) trains it at once
    group = WLBPacker(4, 200, cost,
                      config=PackerConfig(thresholds=[50], release="group", balance_tolerance=2.0)).pack(*batch)
    assert group.deferred_ids().tolist() == [] and group.imbalance == pytest.approx(820 / 230)


def test_marginal_does_not_defer_a_piece_at_its_deadline():
    cost = unit_cost(attn=1.0, linear=0.0)
    packer = WLBPacker(4, 200, cost,
                       config=PackerConfig(thresholds=[50], release="marginal", balance_tolerance=2.0, max_delay=1))
    packer.pack([40] + [4] * 10, list(range(11)))  # the 40 is deferred (above)
    plan = packer.pack([4] * 10, list(range(11, 21)))  # one step late: at max_delay, placed first
    assert 0 in plan.placed_ids().tolist() and plan.deferred_ids().tolist() == []


def test_marginal_without_max_delay_defers_a_piece_once_only():
    cost = unit_cost(attn=1.0, linear=0.0)
    packer = WLBPacker(4, 200, cost,
                       config=PackerConfig(thresholds=[50], release="marginal", balance_tolerance=2.0, max_delay=None))
    assert packer.pack([40] + [4] * 10, list(range(11))).deferred_ids().tolist() == [0]
    # the same starved step again: the carried 40 is not deferred a second time
    plan = packer.pack([4] * 10, list(range(11, 21)))
    assert 0 in plan.placed_ids().tolist() and plan.deferred_ids().tolist() == []


def test_marginal_trims_only_within_the_carry_limit():
    # the trim would defer the 40 (above), but half the backlog limit is 15 tokens: it stays
    cost = unit_cost(attn=1.0, linear=0.0)
    packer = WLBPacker(4, 200, cost, max_backlog_tokens=30,
                       config=PackerConfig(thresholds=[50], release="marginal", balance_tolerance=2.0))
    plan = packer.pack([40] + [4] * 10, list(range(11)))
    assert plan.deferred_ids().tolist() == [] and sorted(plan.placed_ids().tolist()) == list(range(11))


# ---------------------------------------------------------------- calibration's work budget
def _timed_case_a():
    """The packer and first batch whose calibration took 10.7 s of CPU before it had a budget."""
    tiny = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"), None, wlb.HardwareSpec.preset("cpu")).without_layout()
    packer = WLBPacker(3, 33, cost=tiny, dp=2,
                       config=PackerConfig(thresholds="auto", n_queues=2, lookahead=3, release="marginal", max_delay=2))
    return packer, np.random.default_rng(0).integers(1, 34, 12)


def _every_candidate(packer, sample, n_batches):
    """The reference: every candidate set run to the end on the bootstrap stream, one by one
    (what calibration did before it grouped candidates and had a budget)."""
    from itertools import combinations

    from wlb_opt.packer.calibrate import _choose, bootstrap_batches

    tokens = min(int(np.sum(sample)), int(packer.capacity_tokens / 1.25))
    batches = bootstrap_batches(np.asarray(sample), tokens, n_batches, packer.seed)
    grid = packer.candidate_thresholds(np.asarray(sample), tokens)
    results = []
    for thresholds in combinations(grid, min(packer.n_queues, len(grid))):
        trial = packer._trial(list(thresholds))
        try:
            plans = [trial.pack(batch) for batch in batches]
        except ValueError:
            continue
        late = trial.drain()[:sum(plan is None for plan in plans)]
        results.append(dict(thresholds=list(thresholds), imbalance=float(np.mean(
            [p.imbalance for p in plans if p is not None] + [p.imbalance for p in late])),
            delay_per_token=trial.stats()["displacement_per_token"]))  # |delay|: early pieces count too
    return _choose(results, packer.delay_budget)["thresholds"], results


def test_a_small_budget_bounds_the_work_and_stays_deterministic():
    from wlb_opt.packer.calibrate import calibrate_thresholds

    packer, batch = _timed_case_a()
    first = calibrate_thresholds(packer, batch, None, 32, budget=200)
    again = calibrate_thresholds(packer, batch, None, 32, budget=200)
    assert first["thresholds"] == again["thresholds"] and first["candidates"] == again["candidates"]
    assert first["work"] <= 300 and first["budget"] == 200
    assert min(r["batches"] for r in first["candidates"]) < 32  # the race dropped or stopped some runs
    # a budget every run fits in changes nothing
    rng = np.random.default_rng(3)
    sample = np.concatenate([rng.integers(1, 30, 60), rng.integers(40, 100, 10)])
    small = WLBPacker(2, 100, COST, config=PackerConfig(thresholds="auto", n_queues=2, release="paper", max_delay=3))
    bounded, free = calibrate_thresholds(small, sample, None, 8), calibrate_thresholds(small, sample, None, 8, None)
    assert bounded["candidates"] == free["candidates"] and bounded["thresholds"] == free["thresholds"]
    assert all(r["batches"] == 8 for r in bounded["candidates"])


def _brute_force_packings(items, n_bins, cap=None):
    """Every assignment of `items` ((tokens, cost) pairs) to n_bins bins or to none (-1)."""
    from itertools import product
    for bins in product(range(-1, n_bins), repeat=len(items)):
        tokens = [0] * n_bins
        costs = [0.0] * n_bins
        for (t, c), b in zip(items, bins):
            if b >= 0:
                tokens[b] += t
                costs[b] += c
        if cap is None or max(tokens) <= cap:
            yield bins, costs


@pytest.mark.parametrize("seed", range(6))
def test_the_token_room_bounds_what_any_packing_places(seed):
    # `_Room`: a candidate placing all of its group places at most `placed_at_most` cost
    # and defers at least `deferred_at_least` tokens, whatever the packing (brute force).
    from wlb_opt.packer.release import _DensestPieces, _Room
    rng = np.random.default_rng(seed)
    cap, n_bins = 10, 2
    base = [(int(t), float(t) ** 2 / 10 + t) for t in rng.integers(1, 9, int(rng.integers(2, 5)))]
    group = [(int(t), float(t) ** 2 / 10 + t) for t in rng.integers(3, 10, int(rng.integers(1, 3)))]
    base_len = np.array([t for t, _ in base], dtype=np.int64)
    base_cost = np.array([c for _, c in base])
    # the round's pieces: the step's own and, with seed >= 3, a released held one
    released = [HeldPiece(99, 0, 4, 0)] if seed >= 3 else []
    costs = {piece.key: 4.0 ** 2 / 10 + 4 for piece in released}
    room = _Room.of(_DensestPieces(base_len, base_cost), released, costs, n_bins * cap)
    base += [(4, 4.0 ** 2 / 10 + 4)] * len(released)
    g_tokens, g_cost = sum(t for t, _ in group), sum(c for _, c in group)
    items = group + base
    feasible = [(bins, loads) for bins, loads in _brute_force_packings(items, n_bins, cap)
                if min(bins[:len(group)]) >= 0]  # the group placed whole
    total = sum(t for t, _ in items)
    for bins, loads in feasible:
        placed_cost = sum(loads)
        deferred = sum(t for (t, _), b in zip(items, bins) if b < 0)
        assert placed_cost <= room.placed_at_most(g_tokens, g_cost) + 1e-9
        assert deferred >= room.deferred_at_least(g_tokens)
    assert room.deferred_at_least(g_tokens) == total - n_bins * cap
    assert room.overflows(g_tokens) == (total > n_bins * cap)
    if feasible and total > n_bins * cap:  # the bound is below the cost of everything held
        assert room.placed_at_most(g_tokens, g_cost) < sum(c for _, c in base) + g_cost
