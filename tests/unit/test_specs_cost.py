"""Specs and the cost model: validation, presets, monotonicity, phases, JSON round trip."""
import dataclasses
import json

import numpy as np
import pytest

import wlb_opt as wlb


@pytest.fixture(scope="module")
def cost():
    return wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4, dp=1),
                                  wlb.HardwareSpec.preset("h100"))


def test_llama2_7b_preset_matches_paper_table1():
    m = wlb.ModelSpec.preset("7b")
    assert (m.hidden, m.layers, m.heads, m.ffn, m.vocab) == (4096, 32, 32, 11008, 32000)
    assert 6.5e9 < m.n_params < 7.0e9  # Llama-2-7B has 6.74 B weights


@pytest.mark.parametrize("name, low, high", [("550m", 0.45e9, 0.65e9), ("30b", 30e9, 35e9), ("70b", 65e9, 72e9)])
def test_presets_have_their_sizes(name, low, high):
    assert low < wlb.ModelSpec.preset(name).n_params < high


@pytest.mark.parametrize("bad", [dict(tp=0), dict(cp=-1), dict(pp=1.5), dict(dp=True)])
def test_parallel_spec_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="ParallelSpec"):
        wlb.ParallelSpec(**bad)


def test_unknown_presets_name_the_valid_ones():
    with pytest.raises(ValueError, match="valid"):
        wlb.ModelSpec.preset("13b")
    with pytest.raises(ValueError, match="valid"):
        wlb.HardwareSpec.preset("a100")
    with pytest.raises(ValueError, match=r"hidden=100 must be divisible by heads=3"):
        wlb.ModelSpec(hidden=100, layers=2, heads=3, ffn=10)
    with pytest.raises(ValueError, match=r"gemm_efficiency must be in \(0, 1\], got 1.5"):
        wlb.HardwareSpec(peak_tflops=1, gemm_efficiency=1.5, attn_efficiency=0.5, hbm_gbps=1,
                         nvlink_gbps=1, network_gbps=1)


def test_specs_are_frozen():
    spec = wlb.ParallelSpec()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.tp = 2


def test_doc_cost_is_monotone_and_quadratic_dominates(cost):
    d = np.arange(1, 200_000, 997)
    c = cost.doc_cost(d)
    assert np.all(np.diff(c) > 0)
    terms = cost.doc_cost_terms([131072])
    assert terms["attn"][0] > terms["linear"][0] + terms["comm"][0]
    short = cost.doc_cost_terms([256])
    assert short["attn"][0] < short["linear"][0]
    # quadratic growth: doubling a long document more than triples its cost
    assert cost.doc_cost([131072])[0] > 3 * cost.doc_cost([65536])[0]


def test_phases_add_up(cost):
    d = np.array([1, 17, 4096, 131072])
    np.testing.assert_allclose(cost.doc_cost(d, "fwd") + cost.doc_cost(d, "bwd"), cost.doc_cost(d, "fwd_bwd"))
    assert np.isclose(cost.micro_batch_cost(d, "fwd") + cost.micro_batch_cost(d, "bwd"),
                      cost.micro_batch_cost(d, "fwd_bwd"))
    assert cost.micro_batch_cost([]) == pytest.approx(cost.mb_const())
    with pytest.raises(ValueError, match="phase"):
        cost.doc_cost(d, "forward")


def test_cost_scales_with_parallelism():
    m, hw = wlb.ModelSpec.preset("7b"), wlb.HardwareSpec.preset("h100")
    one = wlb.CostModel.analytic(m, wlb.ParallelSpec(), hw)
    tp8 = wlb.CostModel.analytic(m, wlb.ParallelSpec(tp=8), hw)
    ratio = one.coef["fwd"]["attn"] / tp8.coef["fwd"]["attn"]
    assert ratio == pytest.approx(8.0)
    assert tp8.coef["fwd"]["comm"] > 0 == one.coef["fwd"]["comm"]


@pytest.mark.parametrize("bad", [[0], [-3], [1.5], [float("nan")], [[1, 2]], ["a"]])
def test_doc_cost_rejects_bad_lengths(cost, bad):
    with pytest.raises(ValueError):
        cost.doc_cost(bad)


def test_attention_tiles_match_brute_force(cost):
    T = cost.tile
    rng = np.random.default_rng(0)
    for _ in range(200):
        q = int(rng.integers(1, 700))
        kv = q + int(rng.integers(0, 700))
        # brute force: a tile (i, j) is visited if any (row, key) pair in it is unmasked
        rows = np.arange(q)
        last_key = kv - q + rows  # key index visible up to (inclusive)
        visited = 0
        for i in range(-(-q // T)):
            r_end = min((i + 1) * T, q) - 1
            visited += last_key[r_end] // T + 1
        assert cost.attention_tiles(q, kv) == visited, (q, kv)


def test_attention_latency_pads_to_tiles_and_penalises_short_queries(cost):
    # flat up to one tile: 16 and 128 query rows cost the same
    assert cost.attention_latency(16, 4096) == pytest.approx(cost.attention_latency(128, 4096))
    # throughput per useful FLOP is worse for 128-row than for 256-row segments
    per_row_128 = cost.attention_latency(128, 8192) / 128
    per_row_256 = cost.attention_latency(256, 8192) / 256
    assert per_row_128 > per_row_256
    # vectorised
    out = cost.attention_latency(np.array([16, 256]), np.array([4096, 8192]))
    assert out.shape == (2,)
    with pytest.raises(ValueError):
        cost.attention_latency(10, 5)


def test_long_segment_latency_matches_doc_cost_attention():
    # cp=1: a whole-document segment has ~the doc_cost attention term (tile padding aside)
    c = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8), wlb.HardwareSpec.preset("h100"))
    d = 131072
    assert c.attention_latency(d, d) == pytest.approx(c.doc_cost_terms([d])["attn"][0], rel=0.01)


def test_cost_json_round_trip(cost, tmp_path):
    path = tmp_path / "cost.json"
    cost.save(path)
    back = wlb.CostModel.load(path)
    d = np.array([5, 500, 50000])
    np.testing.assert_array_equal(back.doc_cost(d), cost.doc_cost(d))
    assert back.attention_latency(300, 900) == cost.attention_latency(300, 900)
    data = json.loads(path.read_text())
    data["format_version"] = 99
    with pytest.raises(ValueError, match="format_version"):
        wlb.CostModel.from_dict(data)


def test_a_cost_model_holds_its_own_copy_and_round_trips_numpy_numbers():
    """The coefficients are copied (a caller's dict changed later changes nothing: the model
    costs and saves what it was built with), and numpy numbers become the Python numbers JSON
    writes, so the JSON reads back to an equal model."""
    coef = {p: dict(attn=1e-9, linear=np.float32(1e-6), comm=0.0, doc_const=0.0, mb_const=0) for p in ("fwd", "bwd")}
    cost = wlb.CostModel(coef=coef, attn_flops_per_pair=1.0, tile=np.int64(64), eff_q_len=[1, np.int64(256)],
                         eff_scale=[np.float32(0.5), 1.0], meta={"kind": "test"})
    before = cost.micro_batch_cost([1000])
    coef["fwd"]["attn"] = 1e-3
    assert cost.micro_batch_cost([1000]) == before and cost.coef["fwd"]["attn"] == 1e-9
    back = wlb.CostModel.from_dict(json.loads(json.dumps(cost.to_dict())))
    assert back == cost and back.micro_batch_cost([1000]) == before
    assert back.attention_latency(300, 900) == cost.attention_latency(300, 900)


def test_the_three_phases_weighed_at_once_are_the_costs_of_each(cost):
    """The streaming packer weighs a step's pieces in the three phases at once: bit for bit
    what `doc_cost` gives for each (plans are compared by digest)."""
    lengths = np.array([1, 2, 17, 500, 4096, 131072, 163840], dtype=np.int64)
    together = cost._phase_costs_valid(lengths)
    for phase, values in zip(("fwd_bwd", "fwd", "bwd"), together):
        assert values.tobytes() == cost.doc_cost(lengths, phase).tobytes(), phase


def test_cost_model_carries_a_typed_layout(cost, tmp_path):
    assert isinstance(cost.model, wlb.ModelSpec) and isinstance(cost.hardware, wlb.HardwareSpec)
    assert cost.parallel == wlb.ParallelSpec(tp=8, cp=2, pp=4)
    back = wlb.CostModel.load(_saved(cost, tmp_path))
    assert back.parallel == cost.parallel and back.model == cost.model and back.hardware == cost.hardware
    assert back == cost
    assert cost.degree("pp") == 4 and cost.degree("pp", 4) == 4 and cost.degree("dp") == 1
    with pytest.raises(ValueError, match=r"pp=2 disagrees with the cost model's layout \(pp=4"):
        cost.degree("pp", 2)
    with pytest.raises(ValueError, match="integer >= 1"):
        cost.degree("dp", 0)
    with pytest.raises(ValueError, match="one of"):
        cost.degree("ep", 1)
    free = cost.without_layout()
    assert free.parallel is None and free.degree("pp", 7) == 7 and free.degree("pp") == 1
    from wlb_opt.cost import default_cost

    assert default_cost().parallel is None and default_cost().degree("cp", 8) == 8


def test_cost_format_1_with_the_layout_in_meta_still_loads(cost, tmp_path):
    old = cost.to_dict()
    old["format_version"] = 1
    old["meta"] = dict(old["meta"], model=old.pop("model"), parallel=old.pop("parallel"),
                       hardware=old.pop("hardware"))
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(old))
    back = wlb.CostModel.load(path)
    assert back.parallel == cost.parallel and back.model == cost.model and back.hardware == cost.hardware
    assert "parallel" not in back.meta
    np.testing.assert_array_equal(back.doc_cost([7, 7000]), cost.doc_cost([7, 7000]))


def _saved(cost, tmp_path):
    path = tmp_path / "cost.json"
    cost.save(path)
    return path


def test_specs_take_numpy_numbers_as_the_python_numbers_they_hold():
    spec = wlb.ParallelSpec(tp=np.int64(8), cp=np.int32(2))
    assert spec == wlb.ParallelSpec(tp=8, cp=2) and type(spec.cp) is int
    json.dumps(spec.to_dict() if hasattr(spec, "to_dict") else dataclasses.asdict(spec))
    model = wlb.ModelSpec(hidden=np.int64(64), layers=2, heads=4, ffn=128, vocab=100, kv_heads=np.int64(2))
    assert type(model.hidden) is int and type(model.kv_heads) is int
    hw = dataclasses.replace(wlb.HardwareSpec.preset("h100"), peak_tflops=np.float32(500.0))
    assert type(hw.peak_tflops) is float and hw.peak_tflops == 500.0
    with pytest.raises(ValueError, match=r"ParallelSpec.cp must be an integer >= 1, got np.True_"):
        wlb.ParallelSpec(cp=np.bool_(True))
