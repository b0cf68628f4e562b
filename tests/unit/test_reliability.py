"""Regressions for silent wrong results: each test names the behaviour it holds.

These are the inputs that used to be accepted with a wrong or odd result (or ended in a
raw exception from deep inside); `tests/unit/test_bad_input.py` holds the full table of bad
inputs, this file the cases where the right answer is worth spelling out.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import wlb_opt as wlb
from conftest import unit_cost

COST = unit_cost(attn=1e-3, linear=1e-2)


# ---------------------------------------------------------------- kernels
def test_triton_path_refuses_int64_segments_that_would_wrap_in_int32():
    torch = pytest.importorskip("torch")
    from wlb_opt.kernels.attention_ops import _segments_tensor

    # (0, 16, 2**32, 16) used to run as (0, 16, 0, 16), and k_len = 2**32 + 16 as 16
    for row in ([0, 16, 2**32, 16], [0, 16, 0, 2**32 + 16], [-2**32, 16, 0, 16]):
        with pytest.raises(ValueError, match="fit in int32"):
            _segments_tensor(torch.tensor([row], dtype=torch.int64))
    ok = _segments_tensor(torch.tensor([[0, 16, 0, 16]], dtype=torch.int64))
    assert ok.dtype == torch.int32 and ok.tolist() == [[0, 16, 0, 16]]


def test_softmax_scale_must_be_finite_and_positive():
    torch = pytest.importorskip("torch")
    from wlb_opt.kernels import doc_attention

    q = torch.randn(8, 1, 16)
    seg = np.array([[0, 8, 0, 8]])
    for scale in (float("nan"), float("inf"), -1.0, 0.0):
        with pytest.raises(ValueError, match="softmax_scale"):
            doc_attention(q, q, q, seg, softmax_scale=scale, backend="torch")
    assert torch.isfinite(doc_attention(q, q, q, seg, softmax_scale=0.25, backend="torch")).all()


def test_numpy_inputs_to_doc_attention_are_a_type_error_under_auto():
    pytest.importorskip("torch")
    from wlb_opt.kernels import doc_attention

    q = np.zeros((8, 1, 16), np.float32)
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got ndarray"):
        doc_attention(q, q, q, np.array([[0, 8, 0, 8]]))


# ---------------------------------------------------------------- exact solvers
def test_cbc_optimality_bound_never_exceeds_the_proven_optimum():
    for name in ("ortools", "pulp"):
        pytest.importorskip(name)
    from wlb_opt.solvers.milp import _CBC_REL_TOLERANCE

    rng = np.random.default_rng(3)
    seen_cbc_bound = False
    for _ in range(6):
        lengths = rng.integers(1, 60, size=int(rng.integers(8, 13)))
        n_micro = int(rng.integers(2, 4))
        cap = int(max(lengths.max(), lengths.sum() // n_micro * 1.3))
        exact = wlb.solve_pack(lengths, n_micro, cap, COST, "cpsat", time_limit=30)
        cbc = wlb.solve_pack(lengths, n_micro, cap, COST, "milp", time_limit=30, backend="cbc")
        if exact.info.status == "optimal":
            assert cbc.info.bound <= exact.loads.max() * (1 + 1e-12)
        if "CBC optimality" in cbc.info.status:
            seen_cbc_bound = True
            # CBC's "optimal" is good to its tolerances only: the bound sits below its objective
            assert cbc.info.bound <= cbc.loads.max() * (1 - _CBC_REL_TOLERANCE / 2) or \
                cbc.info.bound == pytest.approx(exact.info.bound)
    assert seen_cbc_bound


# ---------------------------------------------------------------- cost model
@pytest.mark.parametrize("field, value", [("attn_flops_per_pair", float("nan")), ("attn_peak_flops", float("inf")),
                                          ("attn_bwd_ratio", float("nan")), ("eff_scale", (float("nan"),) * 5),
                                          ("tile", 128.0), ("tile", 0), ("attn_peak_flops", 0.0)])
def test_cost_model_refuses_values_that_make_latencies_nan_inf_or_zero(field, value):
    d = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny")).to_dict()
    d[field] = list(value) if isinstance(value, tuple) else value
    with pytest.raises(ValueError, match=f"CostModel.{field}"):
        wlb.CostModel.from_dict(d)


def test_cost_coefficients_that_overflow_long_documents_are_refused():
    d = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny")).to_dict()
    d["coef"]["fwd"]["attn"] = 1e308
    with pytest.raises(ValueError, match="<= 1e\\+09 seconds"):
        wlb.CostModel.from_dict(d)
    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"))
    for strategy in ("per_seq", "per_doc", "hybrid", "adaptive"):
        assert np.all(np.isfinite(wlb.solve_shard([3000, 100, 7], 2, strategy, cost.without_layout()).loads))


# ---------------------------------------------------------------- silent coercions
def test_uint64_ids_beyond_int63_are_refused_not_wrapped_to_negative():
    with pytest.raises(ValueError, match="ids must fit in int64"):
        wlb.solve_pack([5, 6], 2, 100, COST, ids=np.array([2**63, 7], dtype=np.uint64))
    plan = wlb.solve_pack([5, 6], 2, 100, COST, ids=np.array([2**63 - 1, 7], dtype=np.uint64))
    assert sorted(plan.doc_ids.tolist()) == [7, 2**63 - 1]


def test_text_length_files_are_read_exactly(tmp_path):
    (tmp_path / "l.txt").write_text(f"{2**53 + 1}\n# a comment\n12\n1e3\n")
    assert wlb.load_lengths(tmp_path / "l.txt").tolist() == [2**53 + 1, 12, 1000]  # not 2**53 through float


def test_jsonl_true_is_not_a_length_of_one(tmp_path):
    (tmp_path / "l.jsonl").write_text('{"length": 5}\n{"length": true}\n')
    with pytest.raises(ValueError, match="l.jsonl:2: field 'length' must be an integer length"):
        wlb.load_lengths(tmp_path / "l.jsonl")


def test_plans_refuse_float_lengths_instead_of_truncating():
    plan = wlb.solve_pack([5, 9, 3], 2, 10, COST)
    d = plan.to_dict()
    d["lengths"] = [5, 9, 990.9]
    with pytest.raises(ValueError, match="990.9"):
        wlb.PackPlan.from_dict(d)
    with pytest.raises(ValueError, match="must be integers, got 3.5"):
        wlb.check_pack(plan, [5, 9, 3.5], 10)
    assert wlb.PackPlan.from_dict(plan.to_dict()).digest() == plan.digest()


def test_solve_pack_refuses_repeated_pieces_that_check_pack_would_reject():
    with pytest.raises(ValueError, match="id 3 with offset 4 is repeated"):
        wlb.solve_pack([5, 6], 2, 100, COST, ids=[3, 3], offsets=[4, 4])
    wlb.solve_pack([5, 6], 2, 100, COST, ids=[3, 3], offsets=[0, 5])  # two pieces of one document


def test_cpsat_sharding_options_are_checked():
    with pytest.raises(ValueError, match="time_limit"):
        wlb.solve_shard([10, 20], 2, "cpsat", COST, time_limit=-1)
    with pytest.raises(ValueError, match="workers must be an integer >= 1"):
        wlb.solve_shard([10, 20], 2, "cpsat", COST, workers=0)


def test_original_method_never_drops_a_document_of_huge_lengths():
    lengths = np.array([2**60, 2**60, 3, 2**59])
    plan = wlb.solve_pack(lengths, 2, 2**61, COST.without_layout(), "original")
    placed = sum(int(plan.lengths[i]) for mb in plan.micro_batches for i in mb)
    assert placed + plan.deferred_tokens == int(lengths.sum())
    assert set(plan.doc_ids.tolist()) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="fewer than 2\\*\\*62 tokens in total"):
        wlb.solve_pack(np.array([2**61, 2**61]), 2, 2**61, COST, "original")


def test_check_pack_sums_micro_batch_tokens_without_wrapping():
    plan = wlb.solve_pack([2**60, 2**60, 2**60], 1, 2**62 - 1, COST.without_layout(), ids=[0, 1, 2])
    # a forged plan whose pieces sum past int64 in one micro-batch (an int64 sum would wrap)
    # (built by the constructor: PackPlan.replace checks changed token counts itself)
    forged = dataclasses.replace(plan, lengths=[2**62 - 1] * 3, tokens=[3 * (2**62 - 1) - 2**64])
    with pytest.raises(wlb.PlanError, match="tokens"):
        wlb.check_pack(forged, [2**60, 2**60, 2**60], 2**62 - 1)


def test_check_pack_refuses_a_plan_that_merges_or_splits_pieces():
    pieces, ids, offsets = wlb.split_documents([10], 5)
    merged = wlb.solve_pack([10], 1, 100, COST, ids=[0])
    with pytest.raises(wlb.PlanError, match="not the input's"):
        wlb.check_pack(merged, pieces, 100, ids=ids, offsets=offsets)
    split = wlb.solve_pack(pieces, 1, 100, COST, ids=ids, offsets=offsets)
    with pytest.raises(wlb.PlanError, match="not the input's"):
        wlb.check_pack(split, [10], 100, ids=[0])
    wlb.check_pack(split, pieces, 100, ids=ids, offsets=offsets)
    original = wlb.solve_pack([4, 4], 2, 5, COST, "original")  # plain 4D cuts by design
    assert len(original.doc_ids) == 3
    wlb.check_pack(original, [4, 4], 5)


# ---------------------------------------------------------------- raw exceptions
def test_former_raw_exceptions_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="cost must be a wlb_opt.CostModel"):
        wlb.simulate_step(wlb.solve_pack([5], 1, 10, COST), None, "7b")
    with pytest.raises(ValueError, match="thresholds\\[0\\]"):
        wlb.WLBPacker(2, 100, COST, config=wlb.PackerConfig(thresholds=[float("inf")]))
    with pytest.raises(ValueError, match="is not a file"):
        wlb.load_lengths(tmp_path)
    np.savez(tmp_path / "a.npz", x=np.arange(3))
    (tmp_path / "a.npz").rename(tmp_path / "a.npy")
    with pytest.raises(ValueError, match="a.npy"):
        wlb.load_lengths(tmp_path / "a.npy")
    with pytest.raises(ValueError, match="would make 1000000000000 pieces"):
        wlb.split_documents([10**12], 1)
