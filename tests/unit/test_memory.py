"""The memory model: max_tokens_for is monotone and exact at its boundary, the pipeline's
in-flight count follows the schedule, the static part follows the ZeRO count, solve_pack's
max_tokens="auto", and the prediction against the peak measured on this CPU."""
import numpy as np
import pytest

import wlb_opt as wlb
from wlb_opt.cost_memory import MemoryModel

M7B = wlb.ModelSpec.preset("7b")
H100 = wlb.HardwareSpec.preset("h100")
LAYOUTS = [wlb.ParallelSpec(tp=8, cp=2, pp=4), wlb.ParallelSpec(tp=8, pp=1), wlb.ParallelSpec(tp=4, cp=4, pp=2, dp=2)]
GiB = 2**30


@pytest.mark.parametrize("parallel", LAYOUTS)
def test_max_tokens_is_monotone_in_memory_and_recomputation(parallel):
    previous = {False: 0, True: 0}
    for gib in (24, 40, 64, 80, 141):
        for recompute in (False, True):
            t = wlb.max_tokens_for(M7B, parallel, H100, gib * GiB, recompute=recompute)
            assert t >= previous[recompute]
            previous[recompute] = t
        assert previous[True] > previous[False]  # recomputation keeps less per layer
    fsdp = wlb.max_tokens_for(M7B, parallel, H100, 40 * GiB, fsdp=True)
    assert fsdp >= wlb.max_tokens_for(M7B, parallel, H100, 40 * GiB) or parallel.dp == 1


def test_max_tokens_is_the_exact_boundary():
    """Independent check by linear search on a small model: the answer fits, one more does not."""
    tiny = wlb.ModelSpec.preset("tiny")
    par = wlb.ParallelSpec(pp=2)
    mem = MemoryModel.analytic(tiny, par, wlb.HardwareSpec.preset("cpu"), dtype="fp32")
    budget = 3_000_000
    brute = max(t for t in range(1, 3000) if all(mem.peak([t], s) <= budget for s in range(2)))
    got = wlb.max_tokens_for(tiny, par, wlb.HardwareSpec.preset("cpu"), budget, dtype="fp32")
    assert got == brute


def test_refuses_memory_too_small_for_one_token():
    with pytest.raises(ValueError, match="cannot hold one token.*weights, gradients and optimizer"):
        wlb.max_tokens_for(M7B, wlb.ParallelSpec(), H100, 16 * GiB)  # 7B x 16 bytes = 108 GB of static state
    with pytest.raises(ValueError, match="positive number of bytes"):
        wlb.max_tokens_for(M7B, wlb.ParallelSpec(), H100, 0)


@pytest.mark.parametrize("bad, match", [(dict(dtype="int8"), "dtype must be one of"),
                                        (dict(optimizer="lion"), "optimizer must be one of"),
                                        (dict(virtual_stages=0), "virtual_stages"),
                                        (dict(loss_chunk=0), "loss_chunk")])
def test_bad_options_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        wlb.max_tokens_for(M7B, wlb.ParallelSpec(pp=4), H100, 80 * GiB, **bad)


def test_in_flight_follows_1f1b_and_the_interleaved_warmup():
    """1F1B: stage s keeps pp - s micro-batches. Interleaved (v chunks of L / (pp v) layers):
    rank 0 runs 2 (pp - 1) + (v - 1) pp warm-up forwards and one more before its first
    backward (Megatron-LM), so it holds that many chunks."""
    pp, L = 4, 32
    m = wlb.ModelSpec(hidden=64, layers=L, heads=4, ffn=128, vocab=100)
    mem = MemoryModel.analytic(m, wlb.ParallelSpec(pp=pp), H100)
    d = [1000]
    per_layer = mem.stored_per_token * 1000
    for s in range(pp):
        layers_here = L // pp
        want = (pp - s) * layers_here * per_layer
        got = mem.breakdown(d, s)["activations"]
        head = 0 if s < pp - 1 else (2 * 2 * 64 + 4) * 1000
        assert got == pytest.approx(want + head, rel=1e-9)
    v = 2
    inter = mem.with_options(virtual_stages=v)
    chunks = 2 * (pp - 1) + (v - 1) * pp + 1
    assert inter.breakdown(d, 0)["activations"] == pytest.approx(chunks * L / (pp * v) * per_layer, rel=1e-9)


def test_static_part_follows_the_zero_count():
    par = wlb.ParallelSpec()
    mem = MemoryModel.analytic(M7B, par, H100)
    static = mem.static_breakdown(0)
    params = M7B.n_params + (2 * M7B.layers + 1) * M7B.hidden  # + RMSNorm weights
    assert sum(static.values()) == pytest.approx(16 * params, rel=1e-6)  # 2 + 2 + 12 bytes per weight
    fp32_sgd = mem.with_options(dtype="fp32", optimizer="sgd").static_breakdown(0)
    assert sum(fp32_sgd.values()) == pytest.approx(8 * params, rel=1e-6)
    sharded = MemoryModel.analytic(M7B, wlb.ParallelSpec(dp=8), H100, fsdp=True).static_breakdown(0)
    assert sharded["optimizer"] == pytest.approx(static["optimizer"] / 8, rel=1e-6)
    assert 0 < sharded["fsdp_gathered"] < static["params"] / 4
    # FSDP2 shards over dp x cp (apply_fsdp's mesh); gradients accumulate unsharded over the
    # micro-batches (sync off until a chunk's last one), so they are counted whole
    both = MemoryModel.analytic(M7B, wlb.ParallelSpec(dp=2, cp=4), H100, fsdp=True).static_breakdown(0)
    assert both["optimizer"] == pytest.approx(static["optimizer"] / 8, rel=1e-6)
    assert both["params"] == pytest.approx(static["params"] / 8, rel=1e-6)
    assert both["grads"] == pytest.approx(static["grads"], rel=1e-6)


def test_context_parallel_attention_memory_follows_what_each_path_keeps():
    """torch path: each rank keeps the gathered K and V of the whole micro-batch for backward;
    flash path: nothing gathered is kept, the backward gathers K and V again and makes the
    whole dK and dV (working memory)."""
    T, b, kv = 32768, 2, M7B.kv_dim
    for attention in ("flash", "torch"):
        one = MemoryModel.analytic(M7B, wlb.ParallelSpec(cp=1), H100, attention=attention, loss_chunk=16)
        two = MemoryModel.analytic(M7B, wlb.ParallelSpec(cp=2), H100, attention=attention, loss_chunk=16)
        a1, a2 = one.breakdown([T]), two.breakdown([T])
        per_layer_1, per_layer_2 = a1["activations"] / M7B.layers, a2["activations"] / M7B.layers
        if attention == "torch":
            # half the tokens per rank, plus the other rank's half of K and V (2 kv_dim x T/2)
            assert per_layer_2 == pytest.approx(per_layer_1 / 2 + 2 * kv * b * T / 2, rel=1e-6)
            assert a2["transient"] == pytest.approx(a1["transient"] / 2, rel=1e-6)
        else:
            assert per_layer_2 == pytest.approx(per_layer_1 / 2, rel=1e-6)
            assert a2["transient"] == pytest.approx(a1["transient"] / 2 + 4 * kv * b * T, rel=1e-6)


def test_cost_memory_and_solve_pack_auto():
    par = wlb.ParallelSpec(tp=8, cp=2, pp=4)
    cost = wlb.CostModel.analytic(M7B, par, H100)
    assert cost.memory([4096]) < cost.memory([8192]) < cost.memory([4096] * 4)
    assert cost.memory([8192], stage=0) > cost.memory([8192], stage=3)  # 4 in flight against 1
    lengths = np.array([60000, 30000, 20000, 9000] * 4)
    plan = wlb.solve_pack(lengths, 4, "auto", cost, memory_bytes=80 * GiB)
    assert plan.max_tokens == wlb.max_tokens_for(M7B, par, H100, 80 * GiB) and plan.max_tokens > 131072
    with pytest.raises(ValueError, match="needs memory_bytes"):
        wlb.solve_pack(lengths, 4, "auto", cost)
    with pytest.raises(ValueError, match="only read with max_tokens='auto'"):
        wlb.solve_pack(lengths, 4, 163840, cost, memory_bytes=80 * GiB)
    with pytest.raises(ValueError, match="max_tokens"):
        wlb.solve_pack(lengths, 4, "big", cost)


def test_auto_counts_the_interleaved_schedule_with_a_memory_model_of_its_virtual_stages():
    """"auto" alone counts 1F1B's in-flight micro-batches; the interleaved schedule keeps more,
    so a cost model given the memory model of its virtual stages sizes S_max for it."""
    import dataclasses
    par = wlb.ParallelSpec(tp=8, cp=2, pp=4)
    cost = wlb.CostModel.analytic(M7B, par, H100)
    interleaved = dataclasses.replace(cost, memory_model=MemoryModel.analytic(M7B, par, H100, virtual_stages=2))
    lengths = [1000] * 8
    one_f_one_b = wlb.solve_pack(lengths, 4, "auto", cost, memory_bytes=80 * GiB).max_tokens
    two_chunks = wlb.solve_pack(lengths, 4, "auto", interleaved, memory_bytes=80 * GiB).max_tokens
    assert two_chunks == wlb.max_tokens_for(M7B, par, H100, 80 * GiB, virtual_stages=2) < one_f_one_b
    assert wlb.WLBPacker(4, "auto", interleaved, memory_bytes=80 * GiB).max_tokens == two_chunks
    assert interleaved.memory_model.worst_peak(two_chunks) <= 80 * GiB < interleaved.memory_model.worst_peak(one_f_one_b)


def test_auto_counts_the_layout_the_packer_plans_not_the_memory_models_own():
    """A memory model calibrated for another layout (one GPU's: pp=1) beside a cost model for
    pp=4: "auto" counts the pipeline the packer plans, whether pp is given or taken from the
    cost model, and solve_pack counts the same."""
    import dataclasses
    cost = wlb.CostModel.analytic(M7B, wlb.ParallelSpec(tp=8, cp=2, pp=4), H100)
    cost = dataclasses.replace(cost, memory_model=MemoryModel.analytic(M7B, wlb.ParallelSpec(tp=8, cp=2), H100))
    given = wlb.WLBPacker(4, "auto", cost, memory_bytes=40 * GiB, pp=4).max_tokens
    assert wlb.WLBPacker(4, "auto", cost, memory_bytes=40 * GiB).max_tokens == given
    assert wlb.solve_pack([1000] * 8, 4, "auto", cost, memory_bytes=40 * GiB).max_tokens == given
    own = cost.memory_model.max_tokens(40 * GiB)  # pp=1: every layer's weights, one micro-batch in flight
    assert given != own
    # without a layout on the cost model, the memory model's own counts
    free = dataclasses.replace(cost, parallel=None)
    assert wlb.WLBPacker(4, "auto", free, memory_bytes=40 * GiB).max_tokens == own


def test_wlb_packer_max_tokens_auto():
    par = wlb.ParallelSpec(tp=8, cp=2, pp=4)
    cost = wlb.CostModel.analytic(M7B, par, H100)
    packer = wlb.WLBPacker(4, "auto", cost, memory_bytes=80 * GiB)
    assert packer.max_tokens == wlb.max_tokens_for(M7B, par, H100, 80 * GiB)
    assert wlb.WLBPacker(4, "auto", cost, memory_bytes=40 * GiB).max_tokens < packer.max_tokens
    plan = packer.pack([60000, 30000, 20000, 9000] * 4)
    assert all(int(plan.lengths[mb].sum()) <= packer.max_tokens for mb in plan.micro_batches)
    with pytest.raises(ValueError, match="needs memory_bytes"):
        wlb.WLBPacker(4, "auto", cost)
    with pytest.raises(ValueError, match="only read with max_tokens='auto'"):
        wlb.WLBPacker(4, 163840, cost, memory_bytes=80 * GiB)
    with pytest.raises(ValueError, match="cannot hold one token"):
        wlb.WLBPacker(4, "auto", cost, memory_bytes=1)


def test_profiled_model_without_hardware_needs_a_calibration():
    profiled = wlb.CostModel(coef=wlb.CostModel.analytic(M7B).coef, attn_flops_per_pair=1.0, model=M7B)
    with pytest.raises(ValueError, match="no memory model.*calibrated.*hardware=None"):
        wlb.solve_pack([100, 200], 2, "auto", profiled, memory_bytes=80 * GiB)
    calibrated = MemoryModel.analytic(M7B, wlb.ParallelSpec(tp=8), H100)
    with_memory = wlb.CostModel(coef=profiled.coef, attn_flops_per_pair=1.0, model=M7B, memory_model=calibrated)
    plan = wlb.solve_pack([100, 200], 2, "auto", with_memory, memory_bytes=80 * GiB)
    assert plan.max_tokens == calibrated.max_tokens(80 * GiB)
    again = wlb.CostModel.from_dict(with_memory.to_dict())
    assert again.memory_model == calibrated




def test_a_calibrated_memory_model_is_counted_for_the_packers_pipeline():
    # a profiled cost model: no layout, its memory model calibrated on one GPU (pp = dp = 1)
    calibrated = MemoryModel.analytic(M7B, wlb.ParallelSpec(gpus_per_node=1), H100)
    profiled = wlb.CostModel(coef=wlb.CostModel.analytic(M7B).coef, attn_flops_per_pair=1.0, model=M7B,
                             memory_model=calibrated)
    # with pp = 4 each stage holds a quarter of the layers' weights and optimizer state, and four
    # micro-batches in flight: the count of the same coefficients for that pipeline
    expected = MemoryModel.analytic(M7B, wlb.ParallelSpec(gpus_per_node=1, pp=4), H100).max_tokens(80 * GiB)
    assert wlb.WLBPacker(4, "auto", profiled, pp=4, memory_bytes=80 * GiB).max_tokens == expected
    with pytest.raises(ValueError, match="cannot hold one token"):  # one GPU holding all of 7B
        wlb.WLBPacker(4, "auto", profiled, memory_bytes=80 * GiB)
    # pp and dp not given: the memory model's own layout stands
    laid_out = MemoryModel.analytic(M7B, wlb.ParallelSpec(gpus_per_node=1, pp=4, dp=2, cp=2), H100, fsdp=True)
    own = wlb.CostModel(coef=profiled.coef, attn_flops_per_pair=1.0, model=M7B, memory_model=laid_out)
    assert wlb.WLBPacker(4, "auto", own, memory_bytes=80 * GiB).max_tokens == laid_out.max_tokens(80 * GiB)
    # FSDP over the replicas the plan has
    fsdp = calibrated.with_options(fsdp=True)
    sharded = wlb.CostModel(coef=profiled.coef, attn_flops_per_pair=1.0, model=M7B, memory_model=fsdp)
    plan = wlb.solve_pack([100, 200], 2, "auto", sharded, dp=4, memory_bytes=80 * GiB)
    assert plan.max_tokens == MemoryModel.analytic(M7B, wlb.ParallelSpec(gpus_per_node=1, dp=4), H100,
                                                   fsdp=True).max_tokens(80 * GiB)


def test_numpy_integers_are_accepted_where_python_ones_are():
    tiny, cpu = wlb.ModelSpec.preset("tiny"), wlb.HardwareSpec.preset("cpu")
    par = wlb.ParallelSpec(pp=2)
    plain = wlb.max_tokens_for(tiny, par, cpu, 10**9, virtual_stages=1, loss_chunk=4096)
    assert wlb.max_tokens_for(tiny, par, cpu, np.int64(10**9), virtual_stages=np.int64(1),
                              loss_chunk=np.int32(4096)) == plain
    mem = wlb.MemoryModel.analytic(tiny, par, cpu, virtual_stages=np.int64(1), fsdp=np.bool_(False))
    assert type(mem.virtual_stages) is int and mem.fsdp is False
