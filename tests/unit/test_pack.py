"""solve_pack: every method against the independent checker, Algorithm 1's rules by hand,
dp > 1, carried documents, bad input, and plan serialisation."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import unit_cost

import wlb_opt as wlb
from wlb_opt import PlanError

HEURISTICS = ["original", "fixed", "wlb", "wlb_fill", "wlb_phases"]


def analytic(dp=1):
    return wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4, dp=dp),
                                  wlb.HardwareSpec.preset("h100"))


@pytest.fixture(scope="module")
def cost():
    return analytic()


@given(
    lengths=st.lists(st.integers(1, 400), min_size=0, max_size=60),
    n_micro=st.integers(1, 5),
    dp=st.integers(1, 3),
    slack=st.floats(0.5, 2.0),
    method=st.sampled_from(HEURISTICS),
    carried_frac=st.floats(0, 1),
)
def test_every_heuristic_passes_the_checker(lengths, n_micro, dp, slack, method, carried_frac):
    lengths = np.array(lengths, dtype=np.int64)
    max_tokens = max(int(lengths.max()) if len(lengths) else 1,
                     int(slack * lengths.sum() / (n_micro * dp)) if len(lengths) else 1)
    carried = int(carried_frac * len(lengths))
    ids = np.arange(100, 100 + len(lengths))
    cost = unit_cost(attn=1e-6, linear=1e-3)
    plan = wlb.solve_pack(lengths, n_micro, max_tokens, cost, method, ids=ids, dp=dp, carried=carried)
    wlb.check_pack(plan, lengths, max_tokens, ids=ids, cost=cost)
    assert plan.info.method == method


def _deferred_that_fit(plan, max_tokens):
    room = max_tokens - plan.tokens
    return [int(plan.lengths[d]) for d in plan.deferred if len(room) and plan.lengths[d] <= room.max()]


@pytest.mark.parametrize("method", ["wlb_ls", "wlb_fill"])
def test_local_search_places_a_deferred_piece_its_moves_made_room_for(method):
    """A move of the descent frees 4 tokens in a micro-batch after the deferred pieces were
    placed; the 4-token piece deferred goes there (Algorithm 1 leaves 61 tokens in the last)."""
    import dataclasses

    cost = dataclasses.replace(
        wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=4, pp=4),
                               wlb.HardwareSpec.preset("h100")),
        tile=8, eff_q_len=(1, 16, 32), eff_scale=(0.5, 0.8, 1.0)).without_layout()
    lengths = [30, 2, 23, 4, 7, 8, 33, 6, 33, 50, 47, 43, 63, 11, 53, 40, 63, 46]
    plan = wlb.solve_pack(lengths, 4, 64, cost=cost, method=method)
    wlb.check_pack(plan, lengths, 64, cost=cost)
    assert _deferred_that_fit(plan, 64) == []
    assert plan.tokens.sum() == 254  # every token but the deferred 63 + 40 + ... that fit nowhere


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(1, 64), min_size=1, max_size=40), n_micro=st.integers(1, 5),
       slack=st.floats(0.3, 1.0), method=st.sampled_from(["wlb_ls", "wlb_fill"]),
       attn=st.sampled_from([0.0, 1e-6, 1e-3]))
def test_local_search_leaves_no_deferred_piece_that_fits(lengths, n_micro, slack, method, attn):
    lengths = np.array(lengths, dtype=np.int64)
    max_tokens = max(int(lengths.max()), int(slack * lengths.sum() / n_micro))
    cost = unit_cost(attn=attn, linear=1e-3)
    plan = wlb.solve_pack(lengths, n_micro, max_tokens, cost, method)
    wlb.check_pack(plan, lengths, max_tokens, cost=cost)
    assert _deferred_that_fit(plan, max_tokens) == []


def test_checker_catches_a_dropped_and_a_duplicated_document():
    plan = wlb.solve_pack([5, 3, 2], 2, 6, unit_cost(), "wlb")
    wlb.check_pack(plan, [5, 3, 2], 6)
    mbs = plan.micro_batches
    broken = plan.replace(micro_batches=(mbs[0][:-1],) + mbs[1:])
    with pytest.raises(PlanError):
        wlb.check_pack(broken, [5, 3, 2], 6)
    tokens = plan.tokens.copy()
    tokens[1] += plan.lengths[mbs[0][0]]
    dup = plan.replace(micro_batches=(mbs[0], np.concatenate([mbs[1], mbs[0][:1]])), tokens=tokens)
    with pytest.raises(PlanError):
        wlb.check_pack(dup, [5, 3, 2], 100)
    with pytest.raises(PlanError, match="max_tokens"):
        wlb.check_pack(plan, [5, 3, 2], 4)


def test_checker_lets_original_cut_pieces_but_never_join_them():
    from wlb_opt.plan import PackPlan, SolveInfo

    pieces, ids, offsets = wlb.split_documents([10], 5)  # (0, [0, 5)), (0, [5, 10))

    def plan_of(starts, ends):
        n = len(starts)
        return PackPlan(doc_ids=np.zeros(n, np.int64), lengths=np.array(ends) - np.array(starts),
                        offsets=np.array(starts), micro_batches=(np.arange(n),), replica_of=np.zeros(1, np.int64),
                        deferred=np.zeros(0, np.int64), loads=np.zeros(1), tokens=np.array([10]), n_micro=1,
                        max_tokens=10, info=SolveInfo(method="original"))

    wlb.check_pack(plan_of([0, 3, 5], [3, 5, 10]), pieces, 10, ids=ids, offsets=offsets)  # a cut: allowed
    with pytest.raises(PlanError, match=r"the plan's piece \[0, 10\) joins pieces of the input"):
        wlb.check_pack(plan_of([0], [10]), pieces, 10, ids=ids, offsets=offsets)
    with pytest.raises(PlanError, match=r"the plan's piece \[3, 7\) joins"):
        wlb.check_pack(plan_of([0, 3, 7], [3, 7, 10]), pieces, 10, ids=ids, offsets=offsets)


def test_algorithm1_minimum_workload_first():
    # weights == lengths: 10 -> mb0, 6 -> mb1, 5 -> mb1 (load 6 < 10)
    plan = wlb.solve_pack([5, 10, 6], 2, 100, unit_cost(attn=0.0, linear=1.0), "wlb")
    assert [plan.lengths[mb].tolist() for mb in plan.micro_batches] == [[10], [6, 5]]


def test_algorithm1_falls_back_to_fewest_tokens_then_defers():
    # attention-only weights d(d+1)/2, cap 10, two micro-batches; longest first: 8, 5, 4, 2, 2.
    # 8 -> mb0 (36); 5 -> mb1 (15); 4 -> mb1 (25, 9 tokens); 2 -> least work is mb1 but 11 > 10,
    # fewest tokens is mb0 (8 + 2 = 10 fits); the last 2 fits in neither -> deferred.
    plan = wlb.solve_pack([2, 4, 8, 5, 2], 2, 10, unit_cost(), "wlb")
    assert [plan.lengths[mb].tolist() for mb in plan.micro_batches] == [[8, 2], [5, 4]]
    assert plan.lengths[plan.deferred].tolist() == [2]
    assert plan.tokens.tolist() == [10, 9]


def test_max_tokens_is_inclusive():
    plan = wlb.solve_pack([6, 4], 1, 10, unit_cost(), "wlb")
    assert len(plan.deferred) == 0 and plan.tokens.tolist() == [10]


def test_carried_documents_are_placed_first_in_their_order():
    # carried 1 and 2 go first (1 -> mb0, 2 -> mb1), then 10, 9 longest-first: 10 -> mb0 (load 1 < 3)
    plan = wlb.solve_pack([1, 2, 9, 10], 2, 100, unit_cost(attn=0.0, linear=1.0), "wlb", carried=2)
    assert [plan.lengths[mb].tolist() for mb in plan.micro_batches] == [[1, 10], [2, 9]]
    # without carrying, the longest go first
    plan = wlb.solve_pack([1, 2, 9, 10], 2, 100, unit_cost(attn=0.0, linear=1.0), "wlb")
    assert [plan.lengths[mb].tolist() for mb in plan.micro_batches] == [[10, 1], [9, 2]]
    # carried documents take the room first: a carried 9 leaves no room for the fresh 5
    plan = wlb.solve_pack([9, 5, 1], 1, 10, unit_cost(), "wlb", carried=1)
    assert plan.lengths[plan.deferred].tolist() == [5]


def test_original_cuts_at_sequence_boundaries_and_defers_the_tail():
    plan = wlb.solve_pack([5, 6, 4], 2, 6, unit_cost(), "original", ids=[10, 11, 12])
    got = [[(int(plan.doc_ids[i]), int(plan.offsets[i]), int(plan.lengths[i])) for i in mb] for mb in plan.micro_batches]
    assert got == [[(10, 0, 5), (11, 0, 1)], [(11, 1, 5), (12, 0, 1)]]
    assert [(int(plan.doc_ids[i]), int(plan.offsets[i]), int(plan.lengths[i])) for i in plan.deferred] == [(12, 1, 3)]
    wlb.check_pack(plan, [5, 6, 4], 6, ids=[10, 11, 12])


def test_fixed_balances_cost_within_fixed_length():
    cost = unit_cost()
    plan = wlb.solve_pack([4, 4, 3, 3, 2, 2], 2, 9, cost, "fixed")
    wlb.check_pack(plan, [4, 4, 3, 3, 2, 2], 9, cost=cost)
    assert len(plan.deferred) == 0
    assert plan.imbalance < 1.1


@pytest.mark.parametrize("method", HEURISTICS)
def test_dp_gives_n_micro_per_replica(method):
    rng = np.random.default_rng(0)
    lengths = rng.integers(100, 20000, 300)
    cost = analytic(dp=3)
    plan = wlb.solve_pack(lengths, 4, 200_000, cost, method)  # dp from the cost model
    assert len(plan.micro_batches) == 12
    assert np.bincount(plan.replica_of).tolist() == [4, 4, 4]
    wlb.check_pack(plan, lengths, 200_000, cost=cost)
    if method == "wlb":
        totals = [plan.loads[plan.replica_of == r].sum() for r in range(3)]
        assert max(totals) / min(totals) < 1.05


@pytest.mark.parametrize("kwargs, match", [
    (dict(lengths=[3, 0]), "positive"),
    (dict(lengths=[3, -1]), "positive"),
    (dict(lengths=[3.5]), "integers"),
    (dict(lengths=[float("nan")]), "NaN"),
    (dict(n_micro=0), "n_micro"),
    (dict(dp=0), "dp"),
    (dict(lengths=[5, 50]), "max_tokens"),
    (dict(method="magic"), "valid"),
    (dict(carried=3), "carried"),
    (dict(carried=-1), "carried"),
    (dict(ids=[1]), "ids"),
    (dict(time_limit=0), "time_limit"),
])
def test_bad_input_is_a_clear_error(kwargs, match):
    args = dict(lengths=[3, 4], n_micro=2, max_tokens=10, cost=unit_cost(), method="wlb")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        wlb.solve_pack(args.pop("lengths"), args.pop("n_micro"), args.pop("max_tokens"), **args)


def test_layout_comes_from_the_cost_model_and_a_disagreeing_dp_raises():
    cost = analytic(dp=2)
    assert wlb.solve_pack([5, 6, 7], 2, 100, cost).dp == 2
    assert wlb.solve_pack([5, 6, 7], 2, 100, cost, dp=2).dp == 2
    with pytest.raises(ValueError, match=r"dp=3 disagrees.*dp=2"):
        wlb.solve_pack([5, 6, 7], 2, 100, cost, dp=3)
    # a model without a layout (the default one, or a hand-made one) accepts any dp
    assert wlb.solve_pack([5, 6, 7], 2, 100, None, dp=3).dp == 3
    assert wlb.solve_pack([5, 6, 7], 2, 100, unit_cost(), dp=3).dp == 3
    assert wlb.solve_pack([5, 6, 7], 2, 100, unit_cost()).dp == 1


def test_plans_are_frozen_and_their_digest_cannot_change():
    import dataclasses

    plan = wlb.solve_pack(np.arange(1, 40), 2, 400, analytic(dp=2), "wlb")
    digest = plan.digest()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.replica_of = np.zeros(4, np.int64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.info.status = "optimal"
    for arr in (plan.doc_ids, plan.lengths, plan.offsets, plan.replica_of, plan.deferred, plan.loads,
                plan.tokens, *plan.micro_batches):
        with pytest.raises(ValueError, match="read-only"):
            arr[0:1] = 0
    with pytest.raises(TypeError):
        plan.micro_batches[0] = plan.micro_batches[1]
    with pytest.raises(TypeError):
        plan.info.extra["x"] = 1
    assert plan.digest() == digest
    swapped = plan.replace(replica_of=plan.replica_of[::-1])
    assert swapped.digest() != digest and plan.digest() == digest
    # the plan copies what it is built from: changing the caller's arrays changes nothing
    ids = np.arange(3, dtype=np.int64)
    built = wlb.PackPlan(doc_ids=ids, lengths=[1, 2, 3], offsets=[0, 0, 0], micro_batches=[[0, 1, 2]],
                         replica_of=[0], deferred=[], loads=[1.0], tokens=[6], n_micro=1)
    before = built.digest()
    ids[0] = 99
    assert built.digest() == before and built.doc_ids[0] == 0
    # a read-only view is kept as it is only where what it views is read-only too
    base = np.arange(6, dtype=np.int64)
    view = base[:3]
    view.flags.writeable = False

    def with_ids(doc_ids):
        return wlb.PackPlan(doc_ids=doc_ids, lengths=[1, 2, 3], offsets=[0, 0, 0], micro_batches=[[0, 1, 2]],
                            replica_of=[0], deferred=[], loads=[1.0], tokens=[6], n_micro=1)

    copied = with_ids(view)
    base[0] = 99
    assert copied.doc_ids is not view and copied.doc_ids[0] == 0
    base.flags.writeable = False
    assert with_ids(base[:3]).doc_ids.base is base
    # the streaming packer's plans, made from its own arrays without a copy, are as frozen
    packer = wlb.WLBPacker(2, 400, analytic(dp=1))
    packed = packer.pack(np.arange(1, 40))
    for arr in (packed.doc_ids, packed.lengths, packed.offsets, packed.replica_of, packed.deferred, packed.loads,
                packed.tokens, *packed.micro_batches):
        with pytest.raises(ValueError, match="read-only"):
            arr[0:1] = 0



def test_replace_copies_and_checks_what_it_changes_and_shares_the_rest():
    plan = wlb.solve_pack(np.arange(1, 40), 2, 400, analytic(dp=2), "wlb")
    arrival = np.zeros(len(plan.doc_ids), np.int64)
    moved = plan.replace(step=np.int64(3), arrival_step=arrival, replica_of=[1, 0, 1, 0])
    assert type(moved.step) is int and moved.step == 3 and plan.step is None
    assert moved.doc_ids is plan.doc_ids and moved.micro_batches is plan.micro_batches  # read-only: shared
    arrival[0] = 5  # the caller's arrays are copied
    assert moved.arrival_step[0] == 0 and not moved.arrival_step.flags.writeable
    assert moved.replica_of.tolist() == [1, 0, 1, 0] and not moved.replica_of.flags.writeable
    assert moved.digest() != plan.digest()
    with pytest.raises(ValueError, match="arrival_step needs one entry per piece"):
        plan.replace(arrival_step=[0, 1])
    with pytest.raises(ValueError, match="arrival_step needs one entry per piece"):
        moved.replace(doc_ids=moved.doc_ids[:-1])
    with pytest.raises(ValueError, match="could not convert"):  # as the constructor
        plan.replace(loads=[1.0, "x"])
    with pytest.raises(ValueError, match="plan field tokens"):
        plan.replace(tokens=[1.5, 2.0, 3.0, 4.0])
    with pytest.raises(TypeError, match=r"unknown fields \['stepp'\]"):
        plan.replace(stepp=3)

def test_shard_plans_are_frozen():
    import dataclasses

    shard = wlb.solve_shard([30, 50, 7], 2, "per_doc")
    digest = shard.digest()
    with pytest.raises(dataclasses.FrozenInstanceError):
        shard.strategy = "per_seq"
    for arr in (shard.chunks, shard.loads, *shard.segments, *shard.rank_indices, *shard.positions):
        with pytest.raises(ValueError, match="read-only"):
            arr[0:1] = 0
    assert shard.digest() == digest


def test_plan_format_1_still_loads():
    plan = wlb.solve_pack([5, 6, 7], 2, 100, unit_cost())
    old = plan.to_dict()
    old["format_version"] = 1
    old.pop("arrival_step")
    old["step"] = 4
    old["info"]["extra"] = {"arrival_step": [1, 2, 3]}
    back = wlb.PackPlan.from_dict(old)
    assert back.arrival_step.tolist() == [1, 2, 3] and back.delays().tolist() == [3, 2, 1]
    assert "arrival_step" not in back.info.extra and back.digest() == plan.digest()


def test_plan_json_round_trip_and_digest():
    import json

    cost = analytic(dp=2)
    lengths = np.random.default_rng(1).integers(1, 5000, 80)
    plan = wlb.solve_pack(lengths, 4, 40000, cost, "wlb")
    back = wlb.PackPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back.digest() == plan.digest()
    np.testing.assert_array_equal(back.loads, plan.loads)
    assert back.imbalance == plan.imbalance and back.info.method == "wlb"
    other = wlb.solve_pack(lengths, 4, 40000, cost, "fixed")
    assert other.digest() != plan.digest()


def test_split_documents():
    pieces, ids, offsets = wlb.split_documents([5, 12, 3], window=5, ids=[7, 8, 9])
    assert pieces.tolist() == [5, 5, 5, 2, 3]
    assert ids.tolist() == [7, 8, 8, 8, 9]
    assert offsets.tolist() == [0, 0, 5, 10, 0]
    with pytest.raises(ValueError, match="window"):
        wlb.split_documents([5], window=0)


def test_load_lengths(tmp_path):
    np.save(tmp_path / "a.npy", np.array([3, 4]))
    (tmp_path / "b.txt").write_text("# lengths\n3\n4\n")
    (tmp_path / "c.jsonl").write_text('{"n": 3}\n{"n": 4}\n')
    (tmp_path / "d.jsonl").write_text('{"text": "abcdefgh"}\n')
    assert wlb.load_lengths(tmp_path / "a.npy").tolist() == [3, 4]
    assert wlb.load_lengths(tmp_path / "b.txt").tolist() == [3, 4]
    assert wlb.load_lengths(tmp_path / "c.jsonl", field="n").tolist() == [3, 4]
    assert wlb.load_lengths(tmp_path / "d.jsonl", field="text").tolist() == [2]
    (tmp_path / "year.jsonl").write_text('{"text": "2023"}\n')  # a text of digits is a text, outside "length"
    assert wlb.load_lengths(tmp_path / "year.jsonl", field="text").tolist() == [1]
    (tmp_path / "bom.txt").write_bytes("\ufeff3\n4\n".encode())  # a byte-order mark, as some editors write
    assert wlb.load_lengths(tmp_path / "bom.txt").tolist() == [3, 4]
    with pytest.raises(ValueError, match="field"):
        wlb.load_lengths(tmp_path / "c.jsonl")
    (tmp_path / "e.txt").write_text("3\n0\n")
    with pytest.raises(ValueError, match="positive"):
        wlb.load_lengths(tmp_path / "e.txt")
    with pytest.raises(ValueError, match="does not exist"):
        wlb.load_lengths(tmp_path / "missing.npy")


def test_bad_offsets_options_and_length_files(tmp_path):
    cost = unit_cost()
    with pytest.raises(ValueError, match="offsets"):
        wlb.solve_pack([5, 6], 2, 100, cost, offsets=[-3, 0])
    with pytest.raises(ValueError, match="no option"):
        wlb.solve_pack([5, 6], 2, 100, cost, "wlb", allow_defer=True)
    assert wlb.solve_pack([5, 6], 2, 100, cost, time_limit=np.float32(1.0)).n_micro == 2
    plan = wlb.solve_pack([5], 1, 100, cost, ids=[0])
    with pytest.raises(PlanError, match="overlapping"):
        wlb.check_pack(plan, [5, 5], 100, ids=[0, 0])
    (tmp_path / "bad.jsonl").write_text('{"length": 3}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        wlb.load_lengths(tmp_path / "bad.jsonl")
    (tmp_path / "num.jsonl").write_text("7\n")
    with pytest.raises(ValueError, match="JSON object"):
        wlb.load_lengths(tmp_path / "num.jsonl")
    (tmp_path / "big.txt").write_text("1e30\n")
    with pytest.raises(ValueError, match="2\\*\\*62"):
        wlb.load_lengths(tmp_path / "big.txt")
