"""Bad numeric values, rows of the bad-input table (`tests/unit/test_bad_input.py` holds the checker):
cost models that cost nothing, ids outside int64, caps and memory sizes out of range,
thresholds above max_tokens, booleans where numbers go, and a profiling device this machine
lacks. Each case is (id, call, exception type, message fragment); the fragment names what
the message must mention."""
from __future__ import annotations

import math

import numpy as np
import pytest

import wlb_opt as wlb
from test_bad_input import _POLICY, COST, LAID_OUT, PLAN, _check
from wlb_opt.cli import main

NAN, INF = math.nan, math.inf
ZERO = dict(attn=0.0, linear=0.0, comm=0.0, doc_const=0.0, mb_const=0.0)
TINY, CPU = wlb.ModelSpec.preset("tiny"), wlb.HardwareSpec.preset("cpu")


def _cost(fwd=None, bwd=None, **kw):
    return wlb.CostModel(coef={"fwd": {**ZERO, **(fwd or {})}, "bwd": {**ZERO, **(bwd or {})}},
                         attn_flops_per_pair=1.0, **kw)


def _hardware(**kw):
    base = dict(peak_tflops=100.0, gemm_efficiency=0.5, attn_efficiency=0.4, hbm_gbps=1000.0, nvlink_gbps=100.0,
                network_gbps=10.0)
    return wlb.HardwareSpec(**{**base, **kw})


def _pack(lengths=(5, 9, 3), n_micro=2, max_tokens=10, **kw):
    return wlb.solve_pack(list(lengths), n_micro, max_tokens, COST, **kw)


def _packer(**kw):
    """A WLBPacker from one set of keywords: the PackerConfig fields go in its config."""
    kw = {**dict(n_micro=2, max_tokens=100, cost=COST, thresholds=[50], max_delay=4), **kw}
    policy = {name: kw.pop(name) for name in list(kw) if name in _POLICY}
    return wlb.WLBPacker(**kw, config=wlb.PackerConfig(**policy))


def _pack_twice(first_ids):
    packer = _packer()
    packer.pack([5], ids=first_ids)
    return packer.pack([5, 6])  # automatic ids continue after the largest id given


def _calibrate(**kw):
    from wlb_opt.packer.calibrate import calibrate_thresholds

    return calibrate_thresholds(_packer(thresholds="auto", n_queues=1), [5, 60, 70], None, 4, **kw)


COST_CASES = [
    ("CostModel.all_zero", lambda: _cost(), ValueError, "every document costs 0 seconds"),
    ("CostModel.only_mb_const", lambda: _cost(fwd=dict(mb_const=1e-3), bwd=dict(mb_const=1e-3)), ValueError,
     "document terms"),
    ("CostModel.from_dict_all_zero", lambda: wlb.CostModel.from_dict(
        {**COST.to_dict(), "coef": {"fwd": dict(ZERO), "bwd": dict(ZERO)}}), ValueError, "every document costs 0"),
    ("CostModel.coef_bool", lambda: _cost(fwd=dict(attn=True)), ValueError, "CostModel.coef['fwd']['attn'] must be"),
    ("CostModel.tile_bool", lambda: _cost(fwd=dict(linear=1.0), tile=True), ValueError, "CostModel.tile must be"),
    ("CostModel.analytic_exposed_bool", lambda: wlb.CostModel.analytic(TINY, None, CPU, tp_comm_exposed=True),
     ValueError, "tp_comm_exposed must be"),
    ("CostModel.analytic_exposed_nan", lambda: wlb.CostModel.analytic(TINY, None, CPU, cp_comm_exposed=NAN),
     ValueError, "cp_comm_exposed must be"),
    ("CostModel.analytic_exposed_above_1", lambda: wlb.CostModel.analytic(TINY, None, CPU, tp_comm_exposed=1.5),
     ValueError, "<= 1"),
    ("CostModel.analytic_model_string", lambda: wlb.CostModel.analytic("7b"), TypeError,
     "model must be a ModelSpec"),
    ("CostModel.analytic_tile_bool", lambda: wlb.CostModel.analytic(TINY, None, CPU, tile=True), ValueError,
     "tile must be an integer"),
    ("HardwareSpec.kernel_launch_bool", lambda: _hardware(kernel_launch_s=True), ValueError,
     "kernel_launch_s must be a finite number"),
    ("HardwareSpec.kernel_launch_inf", lambda: _hardware(kernel_launch_s=INF), ValueError,
     "kernel_launch_s must be a finite number"),
    ("HardwareSpec.kernel_launch_nan", lambda: _hardware(kernel_launch_s=NAN), ValueError, "kernel_launch_s"),
    ("HardwareSpec.peak_bool", lambda: _hardware(peak_tflops=True), ValueError, "peak_tflops must be"),
    ("HardwareSpec.efficiency_bool", lambda: _hardware(gemm_efficiency=True), ValueError, "gemm_efficiency"),
    ("ModelSpec.layers_bool", lambda: wlb.ModelSpec(hidden=64, layers=True, heads=4, ffn=128), ValueError,
     "ModelSpec.layers must be an integer"),
    ("ParallelSpec.dp_bool", lambda: wlb.ParallelSpec(dp=True), ValueError, "ParallelSpec.dp must be an integer"),
]

IDS_CASES = [
    ("solve_pack.ids_2**63", lambda: _pack([5], ids=[2**63]), ValueError, "ids must fit in int64"),
    ("solve_pack.ids_2**63_named", lambda: _pack([5, 3], ids=[1, 2**63]), ValueError, str(2**63)),
    ("solve_pack.ids_2**64", lambda: _pack([5, 3], ids=[-1, 2**64]), ValueError, str(2**64)),
    ("solve_pack.ids_below_int64", lambda: _pack([5, 3], ids=[0, -2**63 - 1]), ValueError, str(-2**63 - 1)),
    ("solve_pack.ids_uint64_array", lambda: _pack([5], ids=np.array([2**63 + 7], np.uint64)), ValueError,
     str(2**63 + 7)),
    ("solve_pack.offsets_2**62", lambda: _pack([5, 3], offsets=[0, 2**62]), ValueError, "offsets must be below 2**62"),
    ("solve_pack.offsets_2**64", lambda: _pack([5, 3], offsets=[0, 2**64]), ValueError, "offsets must fit in int64"),
    ("WLBPacker.pack.ids_2**63", lambda: _packer().pack([5], ids=[2**63]), ValueError, "ids must fit in int64"),
    ("WLBPacker.pack.ids_mixed", lambda: _packer().pack([5, 6], ids=[3, 2**63]), ValueError, str(2**63)),
    ("WLBPacker.pack.ids_uint64", lambda: _packer().pack([5], ids=np.array([2**64 - 1], np.uint64)), ValueError,
     str(2**64 - 1)),
    ("WLBPacker.pack.auto_ids_overflow", lambda: _pack_twice([2**63 - 1]), ValueError,
     "automatic ids would pass 2**63 - 1"),
]

MAX_TOKENS_CASES = [
    ("solve_pack.max_tokens_2**63", lambda: _pack(max_tokens=2**63), ValueError, "max_tokens must be an integer >= 1 and"),
    ("solve_pack.max_tokens_2**62", lambda: _pack(max_tokens=2**62), ValueError, "2**62"),
    ("solve_pack.max_tokens_huge", lambda: _pack(max_tokens=10**30), ValueError, "max_tokens must be an integer"),
    ("solve_pack.max_tokens_uint64", lambda: _pack(max_tokens=np.uint64(2**63)), ValueError, "max_tokens must be"),
    ("WLBPacker.max_tokens_2**63", lambda: _packer(max_tokens=2**63, thresholds=None), ValueError,
     "max_tokens must be an integer >= 1 and"),
    ("WLBPacker.max_tokens_bool", lambda: _packer(max_tokens=True), ValueError, "max_tokens must be an integer"),
    ("solve_pack.memory_bytes_inf", lambda: wlb.solve_pack([5], 1, "auto", LAID_OUT, memory_bytes=INF), ValueError,
     "memory_bytes must be a finite number"),
    ("solve_pack.memory_bytes_nan", lambda: wlb.solve_pack([5], 1, "auto", LAID_OUT, memory_bytes=NAN), ValueError,
     "memory_bytes must be"),
    ("WLBPacker.memory_bytes_inf", lambda: _packer(max_tokens="auto", cost=LAID_OUT, memory_bytes=INF), ValueError,
     "memory_bytes must be a finite number"),
    ("WLBPacker.memory_bytes_bool", lambda: _packer(max_tokens="auto", cost=LAID_OUT, memory_bytes=True), ValueError,
     "memory_bytes must be"),
    ("max_tokens_for.memory_bytes_inf", lambda: wlb.max_tokens_for(TINY, None, CPU, INF), ValueError,
     "memory_bytes must be a positive number of bytes (finite)"),
    ("max_tokens_for.recompute_string", lambda: wlb.max_tokens_for(TINY, None, CPU, 1e9, recompute="False"),
     ValueError, "recompute must be True or False, got 'False'"),
    ("max_tokens_for.fsdp_string", lambda: wlb.max_tokens_for(TINY, None, CPU, 1e9, fsdp="no"), ValueError,
     "fsdp must be True or False, got 'no'"),
    ("MemoryModel.with_options.recompute_string",
     lambda: wlb.MemoryModel.analytic(TINY, None, CPU).with_options(recompute="yes"), ValueError,
     "recompute must be True or False"),
    ("MemoryModel.analytic.model_string", lambda: wlb.MemoryModel.analytic("7b"), TypeError,
     "model must be a ModelSpec, got str"),
    ("WLBPacker.thresholds_above_max_tokens", lambda: _packer(thresholds=[50, 101]), ValueError,
     "must be <= max_tokens=100"),
    ("WLBPacker.thresholds_huge", lambda: _packer(thresholds=[2**70]), ValueError, "max_tokens=100"),
]

BOOL_CASES = [
    ("WLBPacker.delay_budget_bool", lambda: _packer(delay_budget=True), ValueError, "delay_budget must be"),
    ("WLBPacker.balance_tolerance_bool", lambda: _packer(balance_tolerance=True), ValueError, "balance_tolerance"),
    ("WLBPacker.lookahead_bool", lambda: _packer(lookahead=True), ValueError, "lookahead must be an integer"),
    ("WLBPacker.max_delay_bool", lambda: _packer(max_delay=True), ValueError, "max_delay must be an integer"),
    ("WLBPacker.backlog_bool", lambda: _packer(max_backlog_tokens=True), ValueError, "max_backlog_tokens must be"),
    ("WLBPacker.dp_bool", lambda: _packer(dp=True), ValueError, "dp must be an integer"),
    ("solve_pack.carried_bool", lambda: _pack(carried=True), ValueError, "carried must be an integer"),
    ("solve_pack.seed_bool", lambda: _pack(seed=True), ValueError, "seed must be an integer"),
    ("solve_pack.dp_bool", lambda: _pack(dp=True), ValueError, "dp must be an integer"),
    ("solve_pack.time_limit_bool", lambda: _pack(method="wlb", time_limit=True), ValueError, "time_limit must be"),
    ("solve_shard.token_skew_bool", lambda: wlb.solve_shard([5, 9], 2, "hybrid", COST, token_skew=True), ValueError,
     "token_skew must be a number"),
    ("solve_shard.workers_bool", lambda: wlb.solve_shard([5, 9], 2, "cpsat", COST, workers=True), ValueError,
     "workers must be an integer"),
    ("simulate_step.p2p_bool", lambda: wlb.simulate_step(PLAN, None, COST, p2p_s=True), ValueError,
     "p2p_s must hold seconds"),
    ("simulate_step.p2p_nan", lambda: wlb.simulate_step(PLAN, None, COST, p2p_s=NAN), ValueError,
     "p2p_s must be seconds >= 0"),
    ("simulate_step.allreduce_bool", lambda: wlb.simulate_step(PLAN, None, COST, allreduce_s=True), ValueError,
     "allreduce_s must be a finite number"),
    ("simulate_step.allreduce_negative", lambda: wlb.simulate_step(PLAN, None, COST, allreduce_s=-1.0), ValueError,
     "allreduce_s must be a finite number >= 0"),
    ("simulate_step.allreduce_inf", lambda: wlb.simulate_step(PLAN, None, COST, allreduce_s=INF), ValueError,
     "allreduce_s"),
    ("simulate_step.search_order_string", lambda: wlb.simulate_step(PLAN, None, COST, search_order="yes"), ValueError,
     "search_order must be True or False"),
    ("simulate_pipeline.fwd_bool", lambda: wlb.simulate_pipeline(np.ones((2, 2), bool), np.ones((2, 2))), ValueError,
     "fwd must hold seconds"),
    ("simulate_pipeline.bwd_strings", lambda: wlb.simulate_pipeline(np.ones((2, 2)), [["1", "2"], ["3", "4"]]),
     ValueError, "bwd must hold seconds"),
    ("simulate_pipeline.p2p_bool", lambda: wlb.simulate_pipeline(np.ones((2, 2)), np.ones((2, 2)), p2p_s=True),
     ValueError, "p2p_s must hold seconds"),
    ("compare_to_measured.bool", lambda: wlb.simulate.compare_to_measured(
        wlb.simulate_pipeline(np.ones((2, 2)), np.ones((2, 2))), True), ValueError, "measured_step_s must be"),
    ("compare_to_measured.nan", lambda: wlb.simulate.compare_to_measured(
        wlb.simulate_pipeline(np.ones((2, 2)), np.ones((2, 2))), NAN), ValueError, "measured_step_s must be"),
    ("calibrate_thresholds.budget_bool", lambda: _calibrate(budget=True), ValueError, "budget must be"),
    ("calibrate_thresholds.budget_zero", lambda: _calibrate(budget=0), ValueError, "budget must be"),
]

ONES = np.ones((2, 2))

BOOL_AMONG_NUMBERS_CASES = [
    ("solve_pack.lengths_bool_in_list", lambda: wlb.solve_pack([True, 3], 2, 64, COST), ValueError,
     "lengths must be integer token counts, got the bool True at index 0"),
    ("solve_pack.lengths_false_in_list", lambda: _pack([5, False]), ValueError, "the bool False at index 1"),
    ("solve_pack.lengths_numpy_bool_in_tuple", lambda: _pack((5, np.True_)), ValueError, "the bool True at index 1"),
    ("solve_pack.lengths_bool_among_floats", lambda: _pack([5.0, True]), ValueError, "the bool True at index 1"),
    ("solve_pack.lengths_bool_after_many_ones", lambda: _pack([1] * 100 + [True], max_tokens=200), ValueError,
     "the bool True at index 100"),
    ("solve_pack.lengths_bool_array", lambda: _pack(np.array([True, True])), ValueError,
     "must be integers, got dtype bool"),
    ("solve_pack.ids_bool_in_list", lambda: _pack([5, 3], ids=[True, 5]), ValueError,
     "ids must be integers, got the bool True at position 0"),
    ("solve_pack.offsets_bool_in_list", lambda: _pack([5, 3], offsets=[0, False]), ValueError,
     "offsets must be integers, got the bool False at position 1"),
    ("WLBPacker.pack.lengths_bool_in_list", lambda: _packer().pack([True, 3]), ValueError,
     "lengths must be integer token counts, got the bool True"),
    ("WLBPacker.pack.ids_bool_in_list", lambda: _packer().pack([5, 6], ids=[4, True]), ValueError,
     "ids must be integers, got the bool True"),
    ("solve_shard.lengths_bool_in_list", lambda: wlb.solve_shard([True, 3], 2), ValueError,
     "lengths must be integer token counts, got the bool True"),
    ("solve_shard.offsets_bool_in_list", lambda: wlb.solve_shard([4, 3], 2, offsets=[True, 0]), ValueError,
     "offsets must be integers, got the bool True"),
    ("simulate_pipeline.fwd_bool_in_list", lambda: wlb.simulate_pipeline([[True, 1]], [[1, 1]]), ValueError,
     "fwd must hold seconds (real numbers), got a bool at index [0, 0]"),
    ("simulate_pipeline.bwd_bool_among_floats", lambda: wlb.simulate_pipeline([[1, 1]], [[0.5, False]]),
     ValueError, "bwd must hold seconds (real numbers), got a bool at index [0, 1]"),
    ("simulate_pipeline.p2p_bool_in_list", lambda: wlb.simulate_pipeline(ONES, ONES, p2p_s=[True, 1]),
     ValueError, "p2p_s must hold seconds (real numbers), got a bool"),
    ("simulate_rendezvous.fwd_bool_in_list", lambda: wlb.simulate_rendezvous([[True, 1]], [[1, 1]]), ValueError,
     "fwd must hold seconds (real numbers), got a bool"),
    ("simulate_rendezvous.p2p_bool", lambda: wlb.simulate_rendezvous(ONES, ONES, p2p_s=True), ValueError,
     "p2p_s must be seconds >= 0 (a finite real number), got True"),
    ("simulate_rendezvous.p2p_string", lambda: wlb.simulate_rendezvous(ONES, ONES, p2p_s="1"), ValueError,
     "p2p_s must be seconds >= 0"),
    ("simulate_rendezvous.p2p_huge_int", lambda: wlb.simulate_rendezvous(ONES, ONES, p2p_s=10**400), ValueError,
     "p2p_s must be seconds >= 0"),
    ("simulate_rendezvous.virtual_stages_bool", lambda: wlb.simulate_rendezvous(ONES, ONES, virtual_stages=True),
     ValueError, "virtual_stages must be an integer >= 1, got True"),
    ("simulate_step.virtual_stages_bool", lambda: wlb.simulate_step(PLAN, None, COST, virtual_stages=True),
     ValueError, "virtual_stages must be an integer >= 1, got True"),
    ("simulate_step.virtual_stages_zero", lambda: wlb.simulate_step(PLAN, None, COST, virtual_stages=0),
     ValueError, "virtual_stages must be an integer >= 1, got 0"),
    ("simulate_step.p2p_bool_in_list", lambda: wlb.simulate_step(PLAN, None, COST, p2p_s=[0.1, True]),
     ValueError, "p2p_s must hold seconds (real numbers), got a bool"),
    ("simulate_pipeline.order_bools", lambda: wlb.simulate_pipeline(ONES, ONES, order=[True, False]), ValueError,
     "order must be a permutation of range(2) (integers), got True"),
    ("simulate_pipeline.order_floats", lambda: wlb.simulate_pipeline(ONES, ONES, order=[1.0, 0.0]), ValueError,
     "order must be a permutation of range(2) (integers), got 1.0"),
    ("simulate_pipeline.order_bool_array", lambda: wlb.simulate_pipeline(ONES, ONES, order=np.array([True, False])),
     ValueError, "order must be a permutation of range(2) (integers)"),
    ("simulate_pipeline.order_scalar", lambda: wlb.simulate_pipeline(ONES, ONES, order=1), ValueError,
     "order must be a permutation of range(2)"),
    ("simulate_pipeline.order_string", lambda: wlb.simulate_pipeline(ONES, ONES, order="10"), ValueError,
     "order must be a permutation of range(2)"),
    ("simulate_pipeline.order_2**63", lambda: wlb.simulate_pipeline(ONES, ONES, order=[2**63, 0]), ValueError,
     "order must be a permutation of range(2), got [9223372036854775808, 0]"),
    ("simulate_pipeline.order_uint64", lambda: wlb.simulate_pipeline(
        ONES, ONES, order=np.array([2**63, 0], np.uint64)), ValueError, "order must be a permutation of range(2)"),
    ("pipeline_recurrence.order_bools", lambda: wlb.simulate.pipeline_recurrence(ONES, ONES, order=[True, False]),
     ValueError, "order must be a permutation of range(2) (integers)"),
    ("build_dag.order_floats", lambda: wlb.simulate.build_dag(ONES, ONES, order=[1.0, 0.0]), ValueError,
     "order must be a permutation of range(2) (integers)"),
    ("simulate_pipeline.schedule_array", lambda: wlb.simulate_pipeline(
        ONES, ONES, schedule=np.array(["1f1b", "interleaved"])), ValueError, "schedule must be one of"),
    ("simulate_step.schedule_array", lambda: wlb.simulate_step(PLAN, None, COST, schedule=np.array(["1f1b"])),
     ValueError, "schedule must be one of"),
    ("best_order.max_exhaustive_string", lambda: wlb.simulate.best_order(ONES, ONES, max_exhaustive="6"),
     ValueError, "max_exhaustive must be an integer >= 0"),
    ("best_order.max_exhaustive_bool", lambda: wlb.simulate.best_order(ONES, ONES, max_exhaustive=True),
     ValueError, "max_exhaustive must be an integer >= 0"),
    ("compare_to_measured.busy_bool_in_list", lambda: wlb.simulate.compare_to_measured(
        wlb.simulate_pipeline(ONES, ONES), 1.0, [True, 1.0]), ValueError,
     "measured_stage_busy_s must hold seconds (real numbers), got a bool"),
]

HUGE = [[1e308, 1e308]]
OVERFLOW_CASES = [
    ("simulate_pipeline.seconds_sum_overflows", lambda: wlb.simulate_pipeline(HUGE, HUGE), ValueError,
     "must add up to a finite number of seconds"),
    ("simulate_pipeline.p2p_sum_overflows", lambda: wlb.simulate_pipeline(ONES, ONES, p2p_s=1e308), ValueError,
     "must add up to a finite number of seconds"),
    ("pipeline_recurrence.seconds_sum_overflows", lambda: wlb.simulate.pipeline_recurrence(HUGE, HUGE), ValueError,
     "must add up to a finite number of seconds"),
    ("simulate_rendezvous.seconds_sum_overflows", lambda: wlb.simulate_rendezvous(HUGE, HUGE), ValueError,
     "must add up to a finite number of seconds"),
    ("simulate_pipeline.fwd_uint64_2**64-1", lambda: wlb.simulate_pipeline(
        np.array([[2**64 - 1, 1]], np.uint64), [[1, 1]]), ValueError,
     "fwd must hold seconds that fit in int64 as integers, got 18446744073709551615"),
    ("simulate_pipeline.p2p_uint64_huge", lambda: wlb.simulate_pipeline(
        ONES, ONES, p2p_s=np.array([2**63, 0], np.uint64)), ValueError, "p2p_s must hold seconds that fit in int64"),
    ("simulate_pipeline.virtual_stages_2**70", lambda: wlb.simulate_pipeline(
        ONES, ONES, "interleaved", virtual_stages=2**70), ValueError, "virtual_stages must be an integer >= 1 and <="),
    ("simulate_pipeline.virtual_stages_too_many_ops", lambda: wlb.simulate_pipeline(
        ONES, ONES, "interleaved", virtual_stages=2**40), ValueError, "the simulator holds one object per operation"),
    ("simulate_rendezvous.virtual_stages_too_many_ops", lambda: wlb.simulate_rendezvous(
        ONES, ONES, virtual_stages=2**40), ValueError, "operations"),
    ("ParallelSpec.gpus_per_node_2**70", lambda: wlb.ParallelSpec(gpus_per_node=2**70), ValueError,
     "ParallelSpec.gpus_per_node must be an integer >= 1 and <= 2**63 - 1 (int64)"),
    ("ParallelSpec.dp_2**63", lambda: wlb.ParallelSpec(dp=2**63), ValueError, "ParallelSpec.dp must be an integer"),
    ("ParallelSpec.world_size_overflows", lambda: wlb.ParallelSpec(tp=2**62, cp=4), ValueError,
     "world size tp x cp x pp x dp must be <= 2**63 - 1"),
    ("ModelSpec.hidden_2**70", lambda: wlb.ModelSpec(hidden=2**70, layers=2, heads=2, ffn=4), ValueError,
     "ModelSpec.hidden must be an integer >= 1 and <= 2**63 - 1"),
    ("ModelSpec.head_dim_2**64", lambda: wlb.ModelSpec(hidden=64, layers=2, heads=2, ffn=4, head_dim=2**64),
     ValueError, "ModelSpec.head_dim must be an integer >= 1 or None and <= 2**63 - 1"),
    ("HardwareSpec.peak_beyond_float", lambda: _hardware(peak_tflops=10**400), ValueError,
     "peak_tflops must be a finite positive number"),
    ("HardwareSpec.kernel_launch_beyond_float", lambda: _hardware(kernel_launch_s=10**400), ValueError,
     "kernel_launch_s must be a finite number"),
    ("solve_pack.n_micro_huge", lambda: _pack(n_micro=2**62), ValueError, "dp x n_micro must be <= 4194304"),
    ("solve_pack.dp_huge", lambda: _pack(dp=2**40), ValueError, "dp x n_micro must be <="),
    ("solve_pack.n_micro_2**70", lambda: _pack(n_micro=2**70), ValueError, "n_micro must be an integer >= 1 and"),
    ("solve_pack.time_limit_beyond_float", lambda: _pack(time_limit=10**400), ValueError, "too large for a float"),
    ("solve_pack.memory_bytes_beyond_float", lambda: wlb.solve_pack([5], 1, "auto", LAID_OUT, memory_bytes=10**400),
     ValueError, "memory_bytes must be a finite number"),
    ("solve_shard.cp_huge", lambda: wlb.solve_shard([5, 9], 2**62), ValueError,
     "cp must be an integer >= 1 and <= 65536"),
    ("solve_shard.cp_2**70", lambda: wlb.solve_shard([5, 9], 2**70), ValueError, "cp must be an integer >= 1"),
    ("per_doc_sizes.cp_huge", lambda: wlb.shard.per_doc_sizes([5, 9], 2**40), ValueError, "cp must be an integer"),
    ("solve_shard.token_skew_beyond_float", lambda: wlb.solve_shard([5, 9], 2, "hybrid", COST, token_skew=10**400),
     ValueError, "token_skew must be a number >= 0"),
    ("solve_shard.time_limit_beyond_float", lambda: wlb.solve_shard([5, 9], 2, "cpsat", COST, time_limit=10**400),
     ValueError, "time_limit must be a number > 0 seconds"),
    ("solve_shard.seed_2**64", lambda: wlb.solve_shard([5, 9], 2, seed=2**64), ValueError,
     "seed must be an integer >= 0 and <= 2147483647"),  # CP-SAT's seed is 32-bit
    ("solve_shard.workers_2**64", lambda: wlb.solve_shard([5, 9], 2, "cpsat", COST, workers=2**64), ValueError,
     "workers must be an integer >= 1 and"),
]

CASES = COST_CASES + IDS_CASES + MAX_TOKENS_CASES + BOOL_CASES + BOOL_AMONG_NUMBERS_CASES + OVERFLOW_CASES


@pytest.mark.parametrize("call, exc_type, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_value_raises_a_clear_error(call, exc_type, fragment):
    _check(call, exc_type, fragment)


def test_valid_neighbours_of_the_refused_values_still_run():
    """The checks above refuse bools and overflow, not the ordinary values next to them."""
    assert wlb.solve_pack([1, 3], 2, 64, COST).tokens.sum() == 4  # a length of 1 given as an int
    assert wlb.solve_pack(np.array([1, 3]), 2, 64, COST, ids=[0, 1], offsets=[0, 1]).tokens.sum() == 4
    assert wlb.solve_shard([1, 3], 2).lengths.tolist() == [1, 3]
    assert wlb.solve_shard([5, 9], 2, "hybrid", COST, token_skew=1e308).cp == 2  # no token cap
    assert wlb.simulate_pipeline([[1, 1]], [[1, 1]], order=np.array([1, 0])).step_time_s == 4.0
    assert wlb.simulate_pipeline([[1e300, 1]], [[1, 1]]).step_time_s == pytest.approx(1e300)
    assert wlb.simulate_rendezvous(ONES, ONES, p2p_s=np.float64(0.5)).step_time_s > 0
    assert wlb.simulate.best_order(ONES, ONES, max_exhaustive=100)[0] in ([0, 1], [1, 0])
    assert wlb.ParallelSpec(tp=2**31, cp=2**31).world_size == 2**62


def test_a_saved_cost_model_that_costs_nothing_is_refused_on_load(tmp_path):
    path = tmp_path / "cost.json"
    COST.save(path)
    text = path.read_text()
    import json

    d = json.loads(text)
    d["coef"] = {"fwd": dict(ZERO), "bwd": dict(ZERO)}
    path.write_text(json.dumps(d))
    _check(lambda: wlb.CostModel.load(path), ValueError, "every document costs 0 seconds")


def test_calibration_candidates_need_no_table_of_every_length():
    """A huge max_tokens must not allocate one cost per length (a bisection finds them)."""
    from wlb_opt.packer.calibrate import candidate_thresholds

    grid = candidate_thresholds(COST, [10, 2**40, 2**41], 2**42, 4, 2**61)
    assert grid and all(1 <= g <= 2**61 for g in grid) and grid == sorted(grid)


def _profile_cli(argv, capsys) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, f"exit status {code}, stderr: {err}"
    assert "Traceback" not in err and err.count("\n") == 1, err  # one line
    assert err.startswith("wlb-opt profile: error: "), err
    return err


def test_profile_on_a_missing_cuda_device_is_one_line_and_exit_2(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert "has no CUDA device" in _profile_cli(["profile", "--device", "cuda", "--quick"], capsys)
    assert "has no CUDA device" in _profile_cli(["profile", "--device", "cuda:1", "--quick"], capsys)


@pytest.mark.parametrize("device, fragment", [("tpu", "device 'tpu' is not a torch device name"),
                                              ("xla", "profiling runs on 'cpu' or 'cuda', not 'xla'"),
                                              ("gpu0", "device 'gpu0'")])
def test_profile_on_a_device_it_cannot_use_is_one_line_and_exit_2(device, fragment, capsys):
    pytest.importorskip("torch")
    assert fragment in _profile_cli(["profile", "--device", device, "--quick"], capsys)


def test_calibration_on_a_one_token_capacity_batches_one_token():
    """The default bootstrap batch is the capacity / 1.25, at least one token: a packer whose
    step holds one token calibrates (it raised about a tokens_per_batch nobody passed)."""
    assert wlb.WLBPacker(1, 1).calibrate([1]) == [1]
    plan = wlb.WLBPacker(1, 1, config=wlb.PackerConfig(thresholds="auto")).pack([1])
    assert plan.tokens.tolist() == [1]


def test_a_state_taken_after_calibrate_names_the_thresholds_to_build_with():
    sample = np.random.RandomState(0).randint(1, 101, 60)
    packer = wlb.WLBPacker(2, 100, None, 2)
    thresholds = packer.calibrate(sample)
    packer.pack(sample[:20])
    with pytest.raises(ValueError, match=r"build this one with config.replace\(thresholds="):
        wlb.WLBPacker(2, 100, None, 2).load_state_dict(packer.state_dict())
    again = wlb.WLBPacker(2, 100, None, 2, config=wlb.PackerConfig().replace(thresholds=thresholds))
    again.load_state_dict(packer.state_dict())
    assert again.pack(sample[20:40]).digest() == packer.pack(sample[20:40]).digest()
