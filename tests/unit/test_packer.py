"""WLBPacker: nothing lost over long streams, FIFO queues, exact release counts, max_delay,
overload, checkpoint/resume, determinism across processes, DP refinement, bad input."""
import dataclasses
import json

import numpy as np
import pytest

from conftest import unit_cost as _unit_cost

import wlb_opt as wlb
from wlb_opt.solvers.deal import deal_to_replicas, one_f_one_b_time


def unit_cost(attn=1e-6, linear=1e-3, parallel=None):
    """Attention + linear cost, the backward equal to the forward (conftest's helper)."""
    return _unit_cost(attn, linear, backward=True, parallel=parallel)


COST = unit_cost()

OLD_DEFAULTS = dict(thresholds="auto", n_queues=None, max_delay=8, release="paper", balance_tolerance=1.02)
"""The packer's earlier defaults (`PackerConfig.legacy()`, n_queues left to follow explicit
thresholds). These tests pin the paper's rule; the no-tuning defaults (release="marginal",
balance_tolerance="auto") are tested in test_defaults.py."""
_POLICY = {field.name for field in dataclasses.fields(wlb.PackerConfig)}


def PaperPacker(*args, **kw) -> wlb.WLBPacker:
    """A WLBPacker with the old defaults for every policy field the test leaves out (the
    PackerConfig fields of `kw` go in its config, the rest are WLBPacker's)."""
    policy = {**OLD_DEFAULTS, **{name: kw.pop(name) for name in list(kw) if name in _POLICY}}
    return wlb.WLBPacker(*args, **kw, config=wlb.PackerConfig(**policy))


def stream(rng, n_batches, mean_docs=12, outlier_p=0.1, cap=100):
    """Batches of (lengths, ids): short documents and some outliers near the cap."""
    out, next_id = [], 0
    for _ in range(n_batches):
        n = int(rng.integers(0, 2 * mean_docs))
        short = rng.integers(1, cap // 10, n)
        long = rng.integers(cap // 3, cap + 1, n)
        lengths = np.where(rng.random(n) < outlier_p, long, short)
        out.append((lengths, np.arange(next_id, next_id + n)))
        next_id += n
    return out


def run(packer, batches):
    plans = [packer.pack(lengths, ids) for lengths, ids in batches]
    return plans, packer.drain()


def placed_ids(plans):
    return np.concatenate([p.placed_ids() for p in plans]) if plans else np.zeros(0, np.int64)


def check_plan(plan, max_tokens):
    wlb.check_pack(plan, plan.lengths, max_tokens, ids=plan.doc_ids, offsets=plan.offsets, cost=COST)


def test_queue_is_fifo_and_releases_exactly_dp_times_n_micro():
    n_micro, dp = 2, 2
    need = dp * n_micro
    packer = PaperPacker(n_micro, 100, COST, dp=dp, thresholds=[50], max_delay=None)
    outlier_ids = []
    next_id = 0
    for step in range(7):  # 3 outliers a step: the queue reaches 4 at step 1, ...
        lengths = [60, 70, 80, 5, 5]
        ids = list(range(next_id, next_id + 5))
        next_id += 5
        outlier_ids += ids[:3]
        before = packer.queued_ids().tolist()
        plan = packer.pack(lengths, ids)
        arrived = set(ids[:3])
        released = [i for i in plan.doc_ids.tolist() if i in set(before) | arrived and plan.lengths[
            plan.doc_ids.tolist().index(i)] >= 50]
        queue_now = packer.queued_ids().tolist()
        # FIFO: the queue is always a suffix of the arrival order, the released ones a prefix
        held_then = before + ids[:3]
        n_released = len(held_then) - len(queue_now)
        assert n_released in (0, need)
        assert n_released == (need if len(held_then) >= need else 0)
        assert queue_now == held_then[n_released:]
        assert sorted(released) == sorted(held_then[:n_released])


def test_outliers_go_to_the_right_level():
    packer = PaperPacker(4, 200, COST, thresholds=[50, 100, 150], max_delay=None)
    packer.pack([49, 50, 99, 100, 149, 150, 200], [1, 2, 3, 4, 5, 6, 7])
    levels = [[piece.id for piece in q] for q in packer._queues]
    assert levels == [[2, 3], [4, 5], [6, 7]]
    assert packer.queued_ids().tolist() == [2, 3, 4, 5, 6, 7]


def test_released_outliers_go_one_per_micro_batch():
    packer = PaperPacker(4, 200, unit_cost(attn=1.0, linear=0.0), thresholds=[100], max_delay=None)
    packer.pack([150, 120, 110], [0, 1, 2])
    plan = packer.pack([105] + [3] * 20, list(range(3, 24)))
    per_mb = [int(np.sum(plan.lengths[mb] >= 100)) for mb in plan.micro_batches]
    assert per_mb == [1, 1, 1, 1]
    assert len(packer.queued_ids()) == 0


def test_max_delay_is_honoured_with_a_queue_that_never_fills():
    packer = PaperPacker(4, 100, COST, thresholds=[50], max_delay=3)
    delays = []
    for step in range(30):
        lengths = [60] if step % 5 == 0 else []  # one outlier every 5 steps: never 4 at once
        lengths += [5] * 10
        plan = packer.pack(lengths, list(range(100 * step, 100 * step + len(lengths))))
        placed = np.concatenate(plan.micro_batches)
        delays += (plan.step - plan.arrival_step[placed]).tolist()
    assert max(delays) == 3
    assert packer.stats()["delay_max"] == 3 and packer.stats()["late_pieces"] == 0
    paper = PaperPacker(4, 100, COST, thresholds=[50], max_delay=None)
    for step in range(30):
        paper.pack([60] if step % 5 == 0 else [5], [step])
    assert len(paper.queued_ids()) == 2  # paper-faithful: 6 outliers, one release of 4


def test_forced_release_tops_up_from_other_queues():
    packer = PaperPacker(2, 100, unit_cost(attn=1.0, linear=0.0), thresholds=[40, 70], max_delay=2)
    packer.pack([80], [0])
    packer.pack([50], [1])
    plan = packer.pack([3, 3], [2, 3])  # step 2: id 0 is due; id 1 joins it, one per micro-batch
    assert len(packer.queued_ids()) == 0
    assert sorted(int(np.sum(plan.lengths[mb] >= 40)) for mb in plan.micro_batches) == [1, 1]


def test_overload_raises_and_keeps_state():
    packer = PaperPacker(2, 100, COST, thresholds=[], max_delay=None, max_backlog_tokens=150)
    packer.pack([90] * 3, [0, 1, 2])  # 90 carried
    state = json.dumps(packer.state_dict())
    with pytest.raises(ValueError, match="max_backlog_tokens=150.*larger max_tokens"):
        packer.pack([90] * 3, [3, 4, 5])
    assert json.dumps(packer.state_dict()) == state
    assert sorted(p.placed_ids().tolist() for p in packer.drain()) == [[2]]


def test_drain_empties_everything_in_few_plans():
    packer = PaperPacker(4, 100, COST, thresholds=[30, 60], max_delay=None)
    packer.pack([35, 65, 95, 10], [0, 1, 2, 3])
    assert sorted(packer.queued_ids().tolist()) == [0, 1, 2]
    tail = packer.drain()
    assert 1 <= len(tail) <= 3
    assert sorted(placed_ids(tail).tolist()) == [0, 1, 2]
    assert packer.drain() == []


def test_calibration_is_deterministic_and_recorded():
    rng = np.random.default_rng(0)
    sample = np.concatenate([rng.integers(1, 10, 400), rng.integers(40, 100, 12)])
    a = PaperPacker(4, 100, COST, thresholds="auto", n_queues=2, seed=1)
    b = PaperPacker(4, 100, COST, thresholds="auto", n_queues=2, seed=1)
    ta, tb = a.calibrate(sample, n_batches=8), b.calibrate(sample, n_batches=8)
    assert ta == tb and len(ta) == 2 and ta[0] < ta[1]
    assert a.state_dict()["thresholds"] == ta and a.state_dict()["calibration"]["thresholds"] == ta
    assert all(set(r) >= {"thresholds", "imbalance", "delay_per_token"} for r in a.calibration["candidates"])


def test_delay_reduces_imbalance_on_the_default_distribution():
    from wlb_opt.workloads import global_batches
    from wlb_opt.packer import per_step_imbalance

    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4),
                                  wlb.HardwareSpec.preset("h100"))
    batches = global_batches("default", 131072, 4 * 131072, 40)
    res = {}
    for name, th in (("none", []), ("two", [65536, 98304])):
        p = PaperPacker(4, 163840, cost, thresholds=th, max_delay=8)
        res[name] = np.mean([per_step_imbalance(p.pack(*b), cost) for b in batches])
    assert res["two"] < 1.15 < res["none"]


def test_dp_refinement_by_1f1b_time():
    # pp=4: replica time = (sum + 3 max) / 4. Loads 10, 9, 1, 1: sum-balancing pairs (10, 1), (9, 1)
    # -> max(4.75+7.5, ...) ; the closed form prefers putting the two heavy ones together.
    loads = np.array([10.0, 9.0, 1.0, 1.0])
    r = deal_to_replicas(loads, dp=2, n_micro=2, pp=4, max_passes=50)
    t = [one_f_one_b_time(loads[r == k], 4) for k in range(2)]
    brute = min(max(one_f_one_b_time(loads[list(a)], 4), one_f_one_b_time(loads[[i for i in range(4) if i not in a]], 4))
                for a in [(0, 1), (0, 2), (0, 3)])
    assert max(t) == pytest.approx(brute)
    assert one_f_one_b_time([2.0, 1.0], 1) == 3.0 and one_f_one_b_time([2.0, 1.0], 4) == pytest.approx(2.25)
    packer = PaperPacker(2, 100, unit_cost(parallel=wlb.ParallelSpec(pp=4, dp=2)), thresholds=[])
    assert (packer.dp, packer.pp) == (2, 4)  # both from the cost model's layout
    plan = packer.pack([90, 80, 5, 5, 5, 5], None)
    assert np.bincount(plan.replica_of).tolist() == [2, 2]
    check_plan(plan, 100)


def test_auto_ids_and_piece_offsets():
    packer = PaperPacker(2, 100, COST, thresholds=[])
    p1 = packer.pack([5, 6])
    p2 = packer.pack([7])
    assert p1.doc_ids.tolist() == [0, 1] and p2.doc_ids.tolist() == [2]
    pieces, ids, offsets = wlb.split_documents([250, 20], window=100, ids=[10, 11])
    plan = packer.pack(pieces, ids, offsets)
    wlb.check_pack(plan, pieces, 100, ids=ids, offsets=offsets)


@pytest.mark.parametrize("kwargs, match", [
    (dict(thresholds=[50, 40]), "increasing"),
    (dict(thresholds=[0, 40]), r"thresholds\[0\]"),
    (dict(thresholds=[-5]), "positive"),
    (dict(thresholds="manual"), "auto"),
    (dict(thresholds=[10, 20], n_queues=3), "n_queues"),
    (dict(max_delay=0), "max_delay"),
    (dict(n_micro=0), "n_micro"),
    (dict(delay_budget=-1), "delay_budget"),
    (dict(release="eager"), "release"),
    (dict(balance_tolerance=0.9), "balance_tolerance"),
])
def test_bad_configuration(kwargs, match):
    args = dict(n_micro=2, max_tokens=100, cost=COST)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        PaperPacker(**args)


def test_bad_batches():
    packer = PaperPacker(2, 100, COST, thresholds=[50], max_delay=None)
    with pytest.raises(ValueError, match="ids.*same size"):
        packer.pack([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="repeated within the batch"):
        packer.pack([1, 2, 3], [1, 2, 1])
    with pytest.raises(ValueError, match="max_tokens=100.*split_documents"):
        packer.pack([101], [1])
    packer.pack([60, 5], [7, 8])  # 7 is now queued
    with pytest.raises(ValueError, match="id 7.*already held"):
        packer.pack([5], [7])
    packer.pack([5], [8])  # 8 was emitted: not remembered (documented), so accepted


@pytest.mark.parametrize("lookahead", [0, 2])
def test_a_held_document_rejects_its_held_piece_and_accepts_its_others(lookahead):
    # a piece is (id, offset): the check of a batch against the held pieces looks at the ids
    # first, then at the pairs of the shared ids (queued, carried or buffered ahead)
    packer = wlb.WLBPacker(2, 100, COST, config=wlb.PackerConfig(thresholds=[50], max_delay=None, release="paper",
                                                                  lookahead=lookahead))
    packer.pack([60, 5, 6], [7, 8, 9], [0, 0, 40])  # 7 is queued; with lookahead 8 and 9 are buffered
    with pytest.raises(ValueError, match="id 7 .offset 0, position 1. is already held"):
        packer.pack([5, 5], [3, 7], [0, 0])
    if lookahead:
        with pytest.raises(ValueError, match="id 9 .offset 40, position 0. is already held"):
            packer.pack([5], [9], [40])
    packer.pack([5, 5, 5], [7, 9, 8], [60, 0, 6])  # other pieces of the held documents
    assert sorted(packer.queued_ids().tolist()) == [7]


def test_bad_state_dict():
    packer = PaperPacker(2, 100, COST, thresholds=[50], max_delay=4)
    packer.pack([60, 5], [1, 2])
    state = packer.state_dict()
    with pytest.raises(ValueError, match="version"):
        PaperPacker(2, 100, COST, thresholds=[50], max_delay=4).load_state_dict(dict(state, version=99))
    with pytest.raises(ValueError, match="config.max_tokens"):
        PaperPacker(2, 120, COST, thresholds=[50], max_delay=4).load_state_dict(state)
    with pytest.raises(ValueError, match="config.max_delay"):
        PaperPacker(2, 100, COST, thresholds=[50], max_delay=None).load_state_dict(state)
    with pytest.raises(ValueError, match="thresholds"):
        PaperPacker(2, 100, COST, thresholds=[40], max_delay=4).load_state_dict(state)
    with pytest.raises(ValueError, match="cost_fingerprint"):
        PaperPacker(2, 100, unit_cost(attn=2e-6), thresholds=[50], max_delay=4).load_state_dict(state)
    with pytest.raises(ValueError, match="malformed"):
        PaperPacker(2, 100, COST, thresholds=[50], max_delay=4).load_state_dict(dict(state, queues=[[[1, 2]]]))
    fresh = PaperPacker(2, 100, COST, thresholds=[50], max_delay=4)
    fresh.load_state_dict(json.loads(json.dumps(state)))
    assert fresh.queued_ids().tolist() == [1] and fresh.step == 1


def test_bad_method_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown packing method 'nope'"):
        PaperPacker(2, 100, COST, method="nope")


def test_balance_release_takes_an_outlier_the_step_can_balance():
    # attention-only cost (length^2): a 52-token outlier costs 2704.
    cost = unit_cost(attn=1.0, linear=0.0)
    paper = PaperPacker(4, 400, cost, thresholds=[50], max_delay=None)
    bal = PaperPacker(4, 400, cost, thresholds=[50], max_delay=None, release="balance", balance_tolerance=1.05)
    for p in (paper, bal):  # 80 x 5 tokens (2000 in all) cannot balance it: it waits in both
        p.pack([52] + [5] * 80, list(range(81)))
        assert p.queued_ids().tolist() == [0]
    # 81 x 10 tokens (8100) fill the other three micro-batches to 2700: now it can go
    plan = bal.pack([10] * 81, list(range(100, 181)))
    assert bal.queued_ids().tolist() == [] and 0 in plan.placed_ids().tolist()
    assert plan.info.extra["released_early"] == 1 and plan.imbalance <= 1.05
    wlb.check_pack(plan, plan.lengths, 400, ids=plan.doc_ids, offsets=plan.offsets, cost=cost)
    paper.pack([10] * 81, list(range(100, 181)))
    assert paper.queued_ids().tolist() == [0]  # paper: waits for 3 more outliers


def test_balance_release_lets_an_idle_step_take_its_most_balanced_group():
    # a batch of outliers only: the paper's rule holds them (fewer than 4 queued), so the step
    # would train nothing; "balance" then takes its most balanced group whatever the tolerance
    cost = unit_cost(attn=1.0, linear=0.0)
    paper = PaperPacker(4, 400, cost, thresholds=[50], max_delay=None)
    bal = PaperPacker(4, 400, cost, thresholds=[50], max_delay=None, release="balance", balance_tolerance=1.0)
    assert paper.pack([60, 70], [0, 1]).placed_ids().tolist() == []
    plan = bal.pack([60, 70], [0, 1])
    assert sorted(plan.placed_ids().tolist()) != [] and plan.info.extra["released_early"] >= 1
    wlb.check_pack(plan, plan.lengths, 400, ids=plan.doc_ids, offsets=plan.offsets, cost=cost)


def test_balance_release_keeps_fifo_within_a_queue():
    cost = unit_cost(attn=1.0, linear=0.0)
    packer = PaperPacker(2, 300, cost, thresholds=[50], max_delay=None, release="balance", balance_tolerance=1.5)
    order = []
    next_id = 0
    for step in range(20):
        lengths = [60 + step % 3, 5, 5] if step % 2 == 0 else [5] * (2 + 30 * (step % 4 == 1))
        ids = list(range(next_id, next_id + len(lengths)))
        next_id += len(lengths)
        before = packer.queued_ids().tolist() + [i for i, n in zip(ids, lengths) if n >= 50]
        packer.pack(lengths, ids)
        after = packer.queued_ids().tolist()
        assert before[len(before) - len(after):] == after  # released ones are always the oldest
        order += before[:len(before) - len(after)]
    assert order == sorted(order)


def test_calibration_candidates_come_from_cost_and_data():
    rng = np.random.default_rng(0)
    sample = np.concatenate([rng.integers(1, 10, 400), rng.integers(40, 100, 40)])
    packer = PaperPacker(4, 100, unit_cost(attn=1e-3, linear=1e-3), thresholds="auto", n_queues=2,
                           release="balance")
    grid = packer.candidate_thresholds(sample, 320)
    assert grid == sorted(grid) and all(b > 1.05 * a for a, b in zip(grid, grid[1:]))
    outliers = np.sort(sample[sample >= grid[0]])
    assert int(outliers[len(outliers) // 2]) in grid or any(abs(g - outliers[len(outliers) // 2]) <= 0.05 * g
                                                           for g in grid)
    chosen = packer.calibrate(sample, n_batches=8)
    assert len(chosen) == 2 and set(chosen) <= set(grid)
    assert packer.state_dict()["config"]["release"] == "balance"


def test_original_is_rejected_and_an_overload_leaves_the_state_unchanged():
    import json

    import pytest


    with pytest.raises(ValueError, match="original"):
        PaperPacker(n_micro=1, max_tokens=10, thresholds=[], max_delay=None, method="original")
    p = PaperPacker(n_micro=2, max_tokens=1000, max_backlog_tokens=0)  # thresholds="auto"
    before = json.dumps(p.state_dict(), sort_keys=True)
    with pytest.raises(ValueError, match="overload"):
        p.pack([200] * 30)
    assert json.dumps(p.state_dict(), sort_keys=True) == before


def test_dp_dealing_balances_replicas_at_larger_dp():
    import numpy as np

    rng = np.random.default_rng(3)
    loads = rng.gamma(1.0, 1.0, 16 * 4)
    replica_of = deal_to_replicas(loads, dp=16, n_micro=4, pp=4, max_passes=50)
    assert np.bincount(replica_of).tolist() == [4] * 16
    times = [one_f_one_b_time(loads[replica_of == r], 4) for r in range(16)]
    naive = [one_f_one_b_time(loads[r * 4:(r + 1) * 4], 4) for r in range(16)]
    assert max(times) <= max(naive)
    # no single swap between two replicas lowers the largest replica time (local optimum)
    worst = int(np.argmax(times))
    for other in range(16):
        for a in np.flatnonzero(replica_of == worst):
            for b in np.flatnonzero(replica_of == other):
                r2 = replica_of.copy()
                r2[a], r2[b] = other, worst
                t2 = [one_f_one_b_time(loads[r2 == r], 4) for r in (worst, other)]
                rest = max(t for r, t in enumerate(times) if r not in (worst, other))
                assert max(max(t2), rest) >= max(times) - 1e-9


def test_group_release_lets_an_outlier_the_step_can_balance_leave_alone_at_arrival():
    # attention-only cost (length^2): a 52-token outlier costs 2704, 81 x 10 tokens fill the
    # other three micro-batches to 2700: a fair share, so it leaves alone in its own step.
    cost = unit_cost(attn=1.0, linear=0.0)
    paper = PaperPacker(4, 400, cost, thresholds=[50], max_delay=None)
    grp = PaperPacker(4, 400, cost, thresholds=[50], max_delay=None, release="group", balance_tolerance=1.05)
    plan = grp.pack([52] + [10] * 81, list(range(82)))
    assert grp.queued_ids().tolist() == [] and 0 in plan.placed_ids().tolist()
    assert plan.info.extra["released_early"] == 1 and plan.imbalance <= 1.05
    assert plan.arrival_step[plan.doc_ids.tolist().index(0)] == 0 and plan.step == 0
    wlb.check_pack(plan, plan.lengths, 400, ids=plan.doc_ids, offsets=plan.offsets, cost=cost)
    paper.pack([52] + [10] * 81, list(range(82)))
    assert paper.queued_ids().tolist() == [0]  # paper: waits for 3 more outliers
    # too few short documents to balance it: it waits in the pool
    grp.pack([52] + [5] * 20, list(range(100, 121)))
    assert grp.queued_ids().tolist() == [100]


def test_group_release_takes_similar_outliers_across_queue_levels():
    # 4 outliers, two per level, arriving one per step with little else: none balances alone
    # or in a pair, so the paper rule (a level needs 4) and the pool both hold them until the
    # fourth arrives; then the pool sends the 4 similar ones together (one per micro-batch).
    cost = unit_cost(attn=1.0, linear=0.0)
    paper = PaperPacker(4, 200, cost, thresholds=[50, 70], max_delay=None)
    grp = PaperPacker(4, 200, cost, thresholds=[50, 70], max_delay=None, release="group", balance_tolerance=1.1)
    for step, n in enumerate([65, 72, 68, 71]):
        ids = [100 * step + k for k in range(41)]
        plan = grp.pack([n] + [2] * 40, ids)
        paper.pack([n] + [2] * 40, ids)
        if step < 3:
            assert 100 * step in grp.queued_ids().tolist()
    assert grp.queued_ids().tolist() == [] and plan.info.extra["released_early"] == 4
    assert sorted(len(mb) and int(plan.lengths[mb].max()) for mb in plan.micro_batches) == [65, 68, 71, 72]
    assert sorted(paper.queued_ids().tolist()) == [0, 100, 200, 300]


def test_group_release_is_fifo_among_equal_outliers_and_honours_max_delay():
    cost = unit_cost(attn=1.0, linear=0.0)
    packer = PaperPacker(2, 300, cost, thresholds=[50], max_delay=3, release="group", balance_tolerance=1.3)
    order, next_id = [], 0
    for step in range(30):
        lengths = [60, 5, 5] if step % 2 == 0 else [5] * (2 + 20 * (step % 4 == 1))
        ids = list(range(next_id, next_id + len(lengths)))
        next_id += len(lengths)
        before = packer.queued_ids().tolist() + [i for i, n in zip(ids, lengths) if n >= 50]
        plan = packer.pack(lengths, ids)
        after = packer.queued_ids().tolist()
        assert before[len(before) - len(after):] == after  # equal lengths: the oldest leave first
        order += before[:len(before) - len(after)]
        assert plan.info.extra["queue_wait_max"] <= 3
    assert order == sorted(order) and order
    assert packer.stats()["queue_wait_max"] <= 3


def test_held_pieces_are_typed_records_and_the_state_keeps_lists_of_four():
    from wlb_opt.packer import STATE_VERSION, HeldPiece

    packer = PaperPacker(4, 100, COST, thresholds=[50], max_delay=None)  # the queue releases 4
    packer.pack([60, 70, 5], [1, 2, 3], [0, 10, 0])
    assert list(packer._queues[0]) == [HeldPiece(id=1, offset=0, length=60, arrival=0),
                                       HeldPiece(id=2, offset=10, length=70, arrival=0)]
    assert packer._queues[0][1].key == (2, 10)
    state = packer.state_dict()
    assert state["version"] == STATE_VERSION == 5
    assert state["queues"] == [[[1, 0, 60, 0], [2, 10, 70, 0]]] and state["carry"] == []
    resumed = PaperPacker(4, 100, COST, thresholds=[50], max_delay=None)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert list(resumed._queues[0]) == list(packer._queues[0])
    assert all(isinstance(piece, HeldPiece) for piece in resumed._queues[0])


def test_a_rejected_state_leaves_the_packer_unchanged():
    packer = PaperPacker(2, 100, COST, thresholds="auto", n_queues=1, max_delay=4)
    source = PaperPacker(2, 100, COST, thresholds="auto", n_queues=1, max_delay=4)
    source.pack([60, 5, 7, 80], [1, 2, 3, 4])
    state = dict(source.state_dict(), carry=[[1, 2]])
    with pytest.raises(ValueError, match="malformed"):
        packer.load_state_dict(state)
    assert packer.thresholds is None and packer.step == 0 and len(packer.queued_ids()) == 0


def test_dp_and_pp_come_from_the_cost_models_layout():
    layout = wlb.ParallelSpec(tp=8, cp=2, pp=4, dp=2)
    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), layout, wlb.HardwareSpec.preset("h100"))
    packer = PaperPacker(2, 16384, cost, thresholds=[])
    assert (packer.dp, packer.pp, packer.capacity_tokens) == (2, 4, 2 * 2 * 16384)
    assert PaperPacker(2, 16384, cost, 2, thresholds=[], pp=4).dp == 2  # agreeing values are fine
    with pytest.raises(ValueError, match="dp=4 disagrees"):
        PaperPacker(2, 16384, cost, 4, thresholds=[])
    with pytest.raises(ValueError, match="pp=1 disagrees"):
        PaperPacker(2, 16384, cost, thresholds=[], pp=1)
    free = PaperPacker(2, 100, COST, 3, thresholds=[])  # no layout: any dp, pp 1
    assert (free.dp, free.pp) == (3, 1)


def test_plans_are_frozen_and_carry_their_arrival_steps():
    packer = PaperPacker(2, 100, COST, dp=2, thresholds=[50], max_delay=2)
    packer.pack([60, 5, 5], [1, 2, 3])
    packer.pack([5], [4])
    plan = packer.pack([5], [5])  # step 2: id 1 is due
    assert plan.step == 2 and plan.arrival_step.dtype == np.int64
    assert dict(zip(plan.doc_ids.tolist(), plan.arrival_step.tolist()))[1] == 0
    assert "arrival_step" not in plan.info.extra and plan.info.extra["released"] == 1
    assert plan.info.extra["queue_wait_max"] == 2
    with pytest.raises(ValueError):
        plan.arrival_step[0] = 7  # read-only
    check_plan(plan, 100)


def test_release_policies_are_strategy_objects():
    from wlb_opt.packer import RELEASE_POLICIES
    from wlb_opt.packer.release import (BalanceRelease, DrainRelease, GroupRelease, MarginalRelease, PaperRelease,
                                        ReleasePolicy, make_release_policy)

    assert RELEASE_POLICIES == ("paper", "balance", "group", "marginal")
    rules = dict(need=4, max_delay=None, balance_tolerance=1.1, max_backlog_tokens=100)
    kinds = [type(make_release_policy(name, **rules, **(dict(price=0.5, capacity_tokens=400)
                                                        if name == "marginal" else {})))
             for name in RELEASE_POLICIES]
    assert kinds == [PaperRelease, BalanceRelease, GroupRelease, MarginalRelease]
    assert all(issubclass(k, ReleasePolicy) for k in kinds + [DrainRelease])
    packer = PaperPacker(2, 100, COST, thresholds=[50], release="group", balance_tolerance=1.1)
    assert isinstance(packer._release, GroupRelease) and isinstance(packer._drain_release, DrainRelease)


# ---------------------------------------------------------------- PackerConfig
def test_packer_config_is_frozen_keyword_only_and_normalises_its_fields():
    config = wlb.PackerConfig(thresholds=[np.int64(30), 60], balance_tolerance=1, delay_budget=1)
    assert config.thresholds == (30, 60) and config.balance_tolerance == 1.0 and config.delay_budget == 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_delay = 3
    with pytest.raises(TypeError):
        wlb.PackerConfig([30, 60])
    assert config.replace(max_delay=None).max_delay is None and config.max_delay == 32
    assert wlb.PackerConfig().resolved_release == "marginal"
    assert wlb.PackerConfig(lookahead=2).resolved_release == "marginal"
    assert wlb.PackerConfig(lookahead=2, release="paper").resolved_release == "paper"


@pytest.mark.parametrize("kwargs, match", [
    (dict(thresholds="manual"), "thresholds must be None, 'auto' or"),
    (dict(thresholds=[0]), r"thresholds\[0\] must be a positive integer"),
    (dict(thresholds=[True]), r"thresholds\[0\] must be a positive integer"),
    (dict(thresholds=[60, 50]), "strictly increasing"),
    (dict(n_queues=2), "does not match thresholds=None"),
    (dict(n_queues=True), "n_queues must be None or an integer"),
    (dict(thresholds=[30], n_queues=2), "does not match the 1 thresholds"),
    (dict(thresholds="auto", n_queues=0), "n_queues must be an integer >= 1"),
    (dict(release="eager"), "release must be one of"),
    (dict(max_delay=0), "max_delay must be an integer >= 1"),
    (dict(max_delay=True), "max_delay must be an integer >= 1"),
    (dict(balance_tolerance=0.9), "balance_tolerance must be 'auto' or"),
    (dict(balance_tolerance=True), "balance_tolerance must be 'auto' or"),
    (dict(delay_budget=-1.0), "delay_budget must be a finite number"),
    (dict(delay_budget=False), "delay_budget must be a finite number"),
    (dict(method="original"), "cannot run method='original'"),
    (dict(method=3), "method must be a solve_pack method name"),
    (dict(lookahead=-1), "lookahead must be an integer >= 0"),
    (dict(lookahead=True), "lookahead must be an integer >= 0"),
])
def test_packer_config_names_the_bad_field_and_what_is_valid(kwargs, match):
    with pytest.raises(ValueError, match=match):
        wlb.PackerConfig(**kwargs)


def test_the_layout_rules_of_a_config_are_checked_when_the_packer_is_built():
    config = wlb.PackerConfig(thresholds=[50, 2**70])  # valid alone: no piece length bound without a layout
    with pytest.raises(ValueError, match="must be <= max_tokens=100"):
        wlb.WLBPacker(2, 100, COST, config=config)
    assert wlb.WLBPacker(2, 200, COST, config=wlb.PackerConfig()).thresholds == [60]  # 0.3 x max_tokens


def test_presets_are_the_paper_rule_and_the_earlier_defaults():
    assert wlb.PackerConfig.paper([32768, 73728]) == wlb.PackerConfig(thresholds=[32768, 73728], max_delay=None,
                                                                     release="paper", method="wlb")
    assert wlb.PackerConfig.legacy() == wlb.PackerConfig(thresholds="auto", n_queues=2, max_delay=8, release="paper",
                                                         balance_tolerance=1.02, delay_budget=0.5, method="wlb")
    assert wlb.PackerConfig().method == "wlb_phases"
    assert wlb.PackerConfig.legacy(lookahead=2).lookahead == 2


def test_the_old_policy_keywords_warn_and_give_the_same_plans():
    rng = np.random.default_rng(5)
    batches = stream(rng, 40)
    config = wlb.PackerConfig(thresholds=[40, 70], max_delay=5, release="group", balance_tolerance=1.2, lookahead=1)
    with pytest.warns(DeprecationWarning, match=r"config=wlb_opt.PackerConfig\(thresholds=\[40, 70\]"):
        old = wlb.WLBPacker(2, 100, COST, thresholds=[40, 70], max_delay=5, release="group", balance_tolerance=1.2,
                            lookahead=1)
    new = wlb.WLBPacker(2, 100, COST, config=config)
    assert old.config == new.config
    digests = [[p.digest() for p in (packer.pack(*b) for b in batches) if p is not None] +
               [p.digest() for p in packer.drain()] for packer in (old, new)]
    assert digests[0] == digests[1] and len(digests[0]) >= 40
    assert old.state_dict() == new.state_dict()


def test_config_and_policy_keywords_do_not_mix_and_unknown_keywords_are_refused():
    with pytest.raises(TypeError, match="config= and the policy keywords"):
        wlb.WLBPacker(2, 100, COST, config=wlb.PackerConfig(), max_delay=3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_dealy'"):
        wlb.WLBPacker(2, 100, COST, max_dealy=3)
    with pytest.raises(ValueError, match="config must be a wlb_opt.PackerConfig"):
        wlb.WLBPacker(2, 100, COST, config=dict(max_delay=3))


def test_the_state_carries_the_config_and_refuses_another_on_load():
    packer = wlb.WLBPacker(2, 100, COST, config=wlb.PackerConfig(thresholds=[50], delay_budget=0.3))
    packer.pack([60, 5, 7])
    state = json.loads(json.dumps(packer.state_dict()))
    assert state["config"]["delay_budget"] == 0.3 and state["config"]["lookahead"] == 0
    assert state["config"]["release"] == "marginal" and state["thresholds"] == [50]
    for other in (dict(delay_budget=0.5), dict(release="group"), dict(max_delay=4)):
        fresh = wlb.WLBPacker(2, 100, COST, config=packer.config.replace(**other))
        name = next(iter(other))
        with pytest.raises(ValueError, match=f"config.{name}="):
            fresh.load_state_dict(state)
    same = wlb.WLBPacker(2, 100, COST, config=packer.config)
    same.load_state_dict(state)
    assert same.state_dict() == packer.state_dict()


def test_the_outlier_notice_is_logged_once(caplog):
    import logging
    import warnings

    packer = wlb.WLBPacker(2, 100, COST, config=wlb.PackerConfig(thresholds=[10]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the notice is no warning
        with caplog.at_level(logging.INFO, logger="wlb_opt"):
            for _ in range(3):
                packer.pack([60, 70, 5])
    notices = [r for r in caplog.records if "tokens are in outliers" in r.getMessage()]
    assert len(notices) == 1 and notices[0].name == "wlb_opt" and notices[0].levelno == logging.WARNING
    assert "use thresholds='auto'" in notices[0].getMessage()


def test_the_outlier_notice_of_calibrated_thresholds_points_to_the_default_pool(caplog):
    import logging

    packer = wlb.WLBPacker(4, 1000, COST, config=wlb.PackerConfig(thresholds="auto", n_queues=3))
    with caplog.at_level(logging.INFO, logger="wlb_opt"):
        packer.pack(list(np.random.default_rng(0).integers(1, 900, 40)))
    notices = [r.getMessage() for r in caplog.records if "tokens are in outliers" in r.getMessage()]
    assert len(notices) == 1 and "use the default pool (thresholds=None)" in notices[0]
    assert "thresholds='auto'" not in notices[0]


def test_pieces_from_a_table_are_the_pieces_it_was_made_from_and_the_collector_is_left_as_found():
    import gc

    from wlb_opt.packer.state import HeldPiece
    from wlb_opt.packer.pieces import piece_table, pieces_from_table

    pieces = [HeldPiece(7, 0, 5, 2), HeldPiece(-3, 9, 1, 2), HeldPiece(2**62, 2**40, 12, 3)]
    back = pieces_from_table(piece_table(pieces))
    assert back == pieces and all(type(p) is HeldPiece and type(p.length) is int for p in back)
    assert pieces_from_table(piece_table([])) == []
    was = gc.isenabled()
    try:
        for enabled in (True, False):
            gc.enable() if enabled else gc.disable()
            pieces_from_table(piece_table(pieces))
            assert gc.isenabled() == enabled
    finally:
        gc.enable() if was else gc.disable()


def test_config_stores_numpy_integers_as_python_ints_and_legacy_takes_explicit_thresholds():
    config = wlb.PackerConfig(max_delay=np.int64(4), lookahead=np.int32(1), thresholds="auto", n_queues=np.int64(2))
    assert all(type(v) is int for v in (config.max_delay, config.lookahead, config.n_queues))
    packer = wlb.WLBPacker(2, 4096, unit_cost(), config=config)
    json.dumps(packer.state_dict())  # a JSON checkpoint
    assert wlb.PackerConfig.legacy().n_queues == 2
    assert wlb.PackerConfig.legacy(thresholds=[1000, 3000]).thresholds == (1000, 3000)
    assert wlb.PackerConfig.legacy(thresholds=None).thresholds is None
    assert wlb.PackerConfig.legacy(thresholds=np.array([1000, 3000])).thresholds == (1000, 3000)


def test_calibration_without_a_bound_or_an_outlier_in_the_sample():
    import logging

    logging.getLogger("wlb_opt").setLevel(logging.ERROR)
    rng = np.random.default_rng(0)
    sample = np.concatenate([rng.integers(1, 600, 60), rng.integers(1200, 4096, 12)])
    unbounded = wlb.WLBPacker(2, 4096, wlb.cost.default_cost(), config=wlb.PackerConfig(thresholds="auto"))
    # budget=None runs every candidate to the end of the bootstrap stream (one that overloads is no choice)
    unbounded.calibrate(sample, budget=None)
    record = unbounded.calibration
    assert record["budget"] is None and len(record["candidates"]) > 1
    assert all(c["batches"] == record["n_batches"] for c in record["candidates"])
    # a tiny budget stops runs early: candidates that planned no step are never chosen
    tiny = wlb.WLBPacker(2, 4096, wlb.cost.default_cost(), config=wlb.PackerConfig(thresholds="auto"))
    tiny.calibrate(sample, budget=1.0)
    assert any(c["batches"] < tiny.calibration["n_batches"] for c in tiny.calibration["candidates"])
    chosen = [c for c in tiny.calibration["candidates"] if c["thresholds"] == tiny.thresholds]
    assert chosen and chosen[0]["batches"] >= 1
    # global batches so large that no length is an outlier: no queues, and the packer runs
    none = wlb.WLBPacker(2, 4096, wlb.cost.default_cost(), config=wlb.PackerConfig(thresholds="auto"))
    assert none.calibrate([100, 200, 3000, 50, 4000], tokens_per_batch=20 * none.capacity_tokens) == []
    assert none.n_queues == 0 and none.pack([100, 200, 300]).tokens.sum() == 600


def test_calibrate_warns_when_it_replaces_configured_thresholds(caplog):
    import logging

    sample = [5, 60, 70, 90, 10, 20, 30]
    configured = wlb.WLBPacker(2, 100, wlb.cost.default_cost(), config=wlb.PackerConfig(thresholds=[50]))
    with caplog.at_level(logging.WARNING, logger="wlb_opt"):
        chosen = configured.calibrate(sample)
    assert chosen != [50] and configured.thresholds == chosen
    assert f"replaces the configured thresholds [50] by {chosen}" in caplog.text
    caplog.clear()
    auto = wlb.WLBPacker(2, 100, wlb.cost.default_cost(), config=wlb.PackerConfig(thresholds="auto"))
    with caplog.at_level(logging.WARNING, logger="wlb_opt"):
        auto.calibrate(sample)
    assert "replaces the configured thresholds" not in caplog.text  # "auto" asks for it
