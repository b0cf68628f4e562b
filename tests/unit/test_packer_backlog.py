"""WLBPacker's backlog guard and the checks on a loaded state.

The guard bounds everything the packer holds (queued outliers and carried pieces). It must
never leave the packer unable to make progress: a step without new input always passes,
`drain()` always empties the packer, a rejected step leaves the state exactly as it was,
and the limit can be raised when a state is reloaded. A loaded state is trusted for
nothing: every held piece, the step and the statistics are checked before it is adopted.
"""
from __future__ import annotations

import gc
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wlb_opt as wlb
import wlb_opt.packer.packer as packer_module
from wlb_opt.step_pack import solve_pack
from conftest import unit_cost

COST = unit_cost(attn=1e-6, linear=1e-3)


def _placed(plans) -> list[tuple[int, int, int]]:
    """(id, offset, length) of every placed piece of `plans`."""
    out = []
    for plan in plans:
        for mb in plan.micro_batches:
            out.extend(zip(plan.doc_ids[mb].tolist(), plan.offsets[mb].tolist(), plan.lengths[mb].tolist()))
    return out


def test_pack_of_nothing_progresses_after_an_outlier_is_released_into_a_full_carry():
    # An outlier released into a nearly full carry used to push the carry over the limit
    # with no new input; every later pack(), even of nothing, then raised.
    p = wlb.WLBPacker(n_micro=1, max_tokens=4096,
                      config=wlb.PackerConfig(thresholds=[2048], max_delay=None, release="paper"))
    batch = [4096, 4096, 2000, 2000, 2000, 2000, 192]
    plans = [p.pack(batch)]
    while p.held_tokens:
        held = p.held_tokens
        plans.append(p.pack([]))
        assert p.held_tokens <= held
    assert sorted(_placed(plans)) == sorted((i, 0, n) for i, n in enumerate(batch))
    assert p.pack([5]).placed_ids().tolist() == [7]


def test_queues_with_max_delay_none_are_bounded_by_max_backlog_tokens():
    # 3 outliers of 990 tokens per step into 2 x 1000-token micro-batches: the paper's rule
    # releases 2 per step, so the queue grows by one outlier per step until the guard says so.
    p = wlb.WLBPacker(n_micro=2, max_tokens=1000, cost=COST, max_backlog_tokens=4000,
                      config=wlb.PackerConfig(thresholds=[900], max_delay=None))
    sent, plans = [], []
    with pytest.raises(ValueError, match=r"max_backlog_tokens=4000.*set max_delay") as err:
        for step in range(2000):
            ids = [3 * step, 3 * step + 1, 3 * step + 2]
            before = json.dumps(p.state_dict(), sort_keys=True)
            plans.append(p.pack([990] * 3, ids))
            sent.extend(ids)
    assert "overload at step" in str(err.value) and "queued" in str(err.value)
    assert step < 10  # raised as soon as the bound was crossed, not after thousands of steps
    assert json.dumps(p.state_dict(), sort_keys=True) == before  # the failing call changed nothing
    assert p.held_tokens <= 4000
    plans.append(p.pack([]))
    plans += p.drain()
    assert sorted(i for i, _, _ in _placed(plans)) == sorted(sent)


def test_overload_raises_once_and_the_stream_continues_with_smaller_batches():
    p = wlb.WLBPacker(2, 100, COST, max_backlog_tokens=150, config=wlb.PackerConfig(thresholds=[], max_delay=None))
    p.pack([90] * 3, [0, 1, 2])
    with pytest.raises(ValueError, match="overload"):
        p.pack([90] * 3, [3, 4, 5])
    plans = [p.pack([30], [3]), p.pack([], None)] + p.drain()
    assert sorted(i for i, _, _ in _placed(plans)) == [2, 3]


@pytest.mark.parametrize("enabled", [True, False])
def test_pack_and_drain_leave_the_garbage_collector_as_they_found_it(enabled):
    # the collector is paused within a step (pieces.gc_paused), also one that raises
    seen = []

    def watch(lengths, n_micro, max_tokens, cost, method, **kwargs):
        seen.append(gc.isenabled())
        return solve_pack(lengths, n_micro, max_tokens, cost, method, **kwargs)

    p = wlb.WLBPacker(2, 100, COST, max_backlog_tokens=150, config=wlb.PackerConfig(thresholds=[], max_delay=None,
                                                                                     method="wlb_ls"))
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(packer_module, "solve_pack", watch)
            p.pack([90] * 3, [0, 1, 2])
            assert gc.isenabled() is enabled
            with pytest.raises(ValueError, match="overload"):
                p.pack([90] * 3, [3, 4, 5])
            assert gc.isenabled() is enabled
            p.drain()
            assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
    assert seen and not any(seen)


@pytest.mark.parametrize("lookahead", [1, 2, 4])
def test_with_lookahead_a_stream_over_the_limit_progresses_by_pack_of_nothing(lookahead):
    # A batch of 5 steps' capacity is buffered unchecked (what is seen ahead is not counted);
    # K calls later its step holds 800 carried tokens, over the limit, whatever the new batch
    # brings: that batch is refused, and pack([]) must pass, or no call ever would again.
    p = wlb.WLBPacker(2, 100, COST, max_backlog_tokens=300,
                      config=wlb.PackerConfig(thresholds=[], max_delay=None, lookahead=lookahead))
    plans = [p.pack([100] * 10, list(range(10)))]
    plans += [p.pack([10], [10 + k]) for k in range(lookahead - 1)]
    sent = list(range(10 + lookahead - 1))
    with pytest.raises(ValueError, match="overload at step 0"):
        p.pack([10], [100])
    plans.append(p.pack([]))
    assert plans[-1].step == 0 and len(plans[-1].placed_ids()) == 2 and p.held_tokens == 800
    plans.append(p.pack([10], [100]))  # the refused batch, once the backlog shrinks
    sent.append(100)
    plans += p.drain()
    assert sorted(i for i, _, _ in _placed(p for p in plans if p is not None)) == sorted(sent)


def test_backlog_limit_can_be_raised_when_a_state_is_reloaded():
    p = wlb.WLBPacker(2, 100, COST, max_backlog_tokens=150, config=wlb.PackerConfig(thresholds=[], max_delay=None))
    p.pack([90] * 3, [0, 1, 2])
    state = json.loads(json.dumps(p.state_dict()))
    same = wlb.WLBPacker(2, 100, COST, max_backlog_tokens=150, config=wlb.PackerConfig(thresholds=[], max_delay=None))
    with pytest.raises(ValueError, match="config.max_backlog_tokens"):
        wlb.WLBPacker(2, 100, COST, config=wlb.PackerConfig(thresholds=[], max_delay=None)).load_state_dict(state)
    same.load_state_dict(state, max_backlog_tokens=1000)
    assert same.max_backlog_tokens == 1000 and same.state_dict()["config"]["max_backlog_tokens"] == 1000
    same.pack([90] * 3, [3, 4, 5])  # the batch that overloaded under 150 now fits
    assert same.held_tokens == 180
    lower = wlb.WLBPacker(2, 100, COST, max_backlog_tokens=150, config=wlb.PackerConfig(thresholds=[], max_delay=None))
    lower.load_state_dict(same.state_dict(), max_backlog_tokens=10)  # above the new limit: still drains
    plans = [lower.pack([])] + lower.drain()
    assert sorted(i for i, _, _ in _placed(plans)) == sorted(same.carried_ids().tolist())
    with pytest.raises(ValueError, match="max_backlog_tokens must be an integer >= 0"):
        same.load_state_dict(state, max_backlog_tokens=-1)


def test_a_state_of_an_explicit_limit_equal_to_the_default_is_not_taken_for_the_default():
    """The default limit lets a batch pass it by its own tokens beyond a step and bounds the
    deferrals by two steps; an explicit one of the same value is strict: the two plan apart,
    so a state of one is refused by the other, and a state of before the mode was recorded
    loads into either."""
    batches = [[11, 41, 15, 53, 54, 18, 31], [57, 58, 35, 59, 34, 12, 42, 58], [33, 21, 44, 34, 31, 29, 19],
               [41, 5, 20, 27, 20, 34, 32, 58], [48, 39, 56], [44, 28, 53, 55, 18, 60, 21, 36],
               [44, 16, 8, 56, 4, 21, 57, 19, 14], [48, 24, 8]]
    default = wlb.WLBPacker(2, 100, COST).max_backlog_tokens
    explicit = wlb.WLBPacker(2, 100, COST, max_backlog_tokens=default)
    for batch in batches[:2]:
        explicit.pack(batch)
    state = json.loads(json.dumps(explicit.state_dict()))
    with pytest.raises(ValueError, match="config.backlog_burst=False does not match this packer's backlog_burst=True"):
        wlb.WLBPacker(2, 100, COST).load_state_dict(state)
    same = wlb.WLBPacker(2, 100, COST, max_backlog_tokens=default)
    same.load_state_dict(state)
    assert [explicit.pack(b).digest() for b in batches[2:]] == [same.pack(b).digest() for b in batches[2:]]
    del state["config"]["backlog_burst"]  # as written before the mode was recorded
    wlb.WLBPacker(2, 100, COST).load_state_dict(state)


def test_default_backlog_limit_counts_one_release_per_queue():
    p = wlb.WLBPacker(2, 100, COST, dp=1, config=wlb.PackerConfig(thresholds=[40, 70], max_delay=4))
    assert p.max_backlog_tokens == (2 + 2) * 2 * 100


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31), max_delay=st.sampled_from([None, 1, 2, 5]),
       release=st.sampled_from(["paper", "balance", "group", "marginal"]), limit=st.sampled_from([100, 300, 1000]))
def test_a_rejected_step_never_blocks_the_packer(seed, max_delay, release, limit):
    rng = np.random.default_rng(seed)
    p = wlb.WLBPacker(2, 100, COST, max_backlog_tokens=limit,
                      config=wlb.PackerConfig(thresholds=[50, 80], max_delay=max_delay, release=release))
    sent, plans, next_id = [], [], 0
    for _ in range(25):
        lengths = rng.integers(1, 101, size=int(rng.integers(0, 6))).tolist()
        ids = list(range(next_id, next_id + len(lengths)))
        try:
            plans.append(p.pack(lengths, ids))
        except ValueError as exc:
            assert "overload" in str(exc)
            held = p.held_tokens
            plans.append(p.pack([]))  # never raises
            assert p.held_tokens <= held
            continue
        next_id += len(lengths)
        sent.extend(zip(ids, lengths))
        assert p.held_tokens <= limit
    plans += p.drain()
    assert sorted((i, n) for i, _, n in _placed(plans)) == sorted(sent)


# ---------------------------------------------------------------- a loaded state is checked
def _state_with_held_pieces() -> dict:
    p = wlb.WLBPacker(2, 100, COST, config=wlb.PackerConfig(thresholds=[50], max_delay=None))
    p.pack([60, 95, 95, 45, 45, 45, 45], [0, 1, 2, 3, 4, 5, 6])
    state = json.loads(json.dumps(p.state_dict()))
    assert state["queues"][0] and state["carry"]
    return state


def _fresh() -> wlb.WLBPacker:
    return wlb.WLBPacker(2, 100, COST, config=wlb.PackerConfig(thresholds=[50], max_delay=None))


def _edit(change):
    state = _state_with_held_pieces()
    change(state)
    return state


BAD_STATES = [
    ("duplicated carry entry", lambda s: s["carry"].append(list(s["carry"][0])), "twice"),
    ("piece queued and carried", lambda s: s["carry"].append(list(s["queues"][0][0])), "twice"),
    ("pieces of one document that overlap", lambda s: s["carry"].append([s["queues"][0][0][0], s["queues"][0][0][1] + 1,
                                                                        5, s["queues"][0][0][3]]),
     "pieces of document .* overlap in the state"),
    ("float length", lambda s: s["carry"][0].__setitem__(2, 90.9), "length must be an integer"),
    ("zero length", lambda s: s["carry"][0].__setitem__(2, 0), "length must be an integer in \\[1, 100\\]"),
    ("negative length", lambda s: s["carry"][0].__setitem__(2, -5), "length must be an integer in \\[1, 100\\]"),
    ("length over max_tokens", lambda s: s["carry"][0].__setitem__(2, 101), "in \\[1, 100\\]"),
    ("negative offset", lambda s: s["carry"][0].__setitem__(1, -1), "offset must be an integer"),
    ("string id", lambda s: s["carry"][0].__setitem__(0, "7"), "id must be an integer"),
    ("bool arrival", lambda s: s["carry"][0].__setitem__(3, True), "arrival"),
    ("future arrival", lambda s: s["carry"][0].__setitem__(3, 5), "arrival .*before the state's step"),
    ("row of 3", lambda s: s["carry"].__setitem__(0, [1, 0, 5]), "must be \\[id, offset, length, arrival\\]"),
    ("negative step", lambda s: s.__setitem__("step", -1), "field step must be an integer"),
    ("string step", lambda s: s.__setitem__("step", "1"), "field step must be an integer"),
    ("float step", lambda s: s.__setitem__("step", 1.0), "field step must be an integer"),
    ("pieces at step 0", lambda s: s.__setitem__("step", 0), "at step 0"),
    ("negative next id", lambda s: s.__setitem__("next_auto_id", -3), "next_auto_id"),
    ("NaN imbalance", lambda s: s["imbalance"].__setitem__(0, float("nan")), "imbalance\\[0\\] must be a finite"),
    ("imbalance below one", lambda s: s["imbalance"].__setitem__(0, 0.5), "imbalance\\[0\\]"),
    ("negative accumulator", lambda s: s["accumulators"].__setitem__("tokens", -1), "accumulators.tokens"),
    ("float accumulator", lambda s: s["accumulators"].__setitem__("pieces", 1.5), "accumulators.pieces"),
    ("short outlier queued", lambda s: s["queues"][0][0].__setitem__(2, 10), "outside its queue's range"),
    ("queues not a list", lambda s: s.__setitem__("queues", 5), "field queues must be a list of 1"),
    ("carry not a list", lambda s: s.__setitem__("carry", {"a": 1}), "field carry must be a list"),
]


@pytest.mark.parametrize("change, match", [(c, m) for _, c, m in BAD_STATES], ids=[n for n, _, _ in BAD_STATES])
def test_load_state_dict_refuses_invalid_held_pieces_and_leaves_the_packer_unchanged(change, match):
    packer = _fresh()
    packer.pack([20], [100])
    before = json.dumps(packer.state_dict(), sort_keys=True)
    with pytest.raises(ValueError, match=match):
        packer.load_state_dict(_edit(change))
    assert json.dumps(packer.state_dict(), sort_keys=True) == before


def test_an_unedited_state_still_loads_and_resumes():
    state = _state_with_held_pieces()
    packer = _fresh()
    packer.load_state_dict(state)
    plans = packer.drain()
    assert sorted(i for i, _, _ in _placed(plans)) == sorted(
        [piece[0] for q in state["queues"] for piece in q] + [piece[0] for piece in state["carry"]])
