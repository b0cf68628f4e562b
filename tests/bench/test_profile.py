"""Profiling: the fit recovers a known model; a real (tiny) profile on this CPU gives a sane model;
saved profiles that are wrong are refused."""
import json
import re

import numpy as np
import pytest

import wlb_opt as wlb
from wlb_opt.cost_fit import FIT_TERMS, coef_intervals, sample_micro_batches, validate, validation_line
from wlb_opt.profile import Sample, fit_cost_model


@pytest.mark.parametrize("noise", [0.0, 0.002])
def test_fit_recovers_known_coefficients(noise):
    truth = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2),
                                   wlb.HardwareSpec.preset("h100"))
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(30):
        lengths = rng.integers(1, 60000, rng.integers(1, 40))
        factors = rng.normal(1.0, noise, 2) if noise else (1.0, 1.0)
        samples.append(Sample(lengths, truth.micro_batch_cost(lengths, "fwd") * factors[0],
                              truth.micro_batch_cost(lengths, "bwd") * factors[1]))
    fit = fit_cost_model(samples, layers=1)
    tol = 1e-6 if noise == 0 else 0.05  # coefficients are correlated: noise moves them more than predictions
    for phase in ("fwd", "bwd"):
        t = truth.coef[phase]
        assert fit.coef[phase]["attn"] == pytest.approx(t["attn"], rel=tol)
        assert fit.coef[phase]["linear"] == pytest.approx(t["linear"] + t["comm"], rel=tol)
    test = rng.integers(1, 100000, 20)
    assert fit.micro_batch_cost(test) == pytest.approx(truth.micro_batch_cost(test), rel=0.01)


def test_the_efficiency_table_of_a_kernel_of_constant_throughput_on_whole_tiles_is_flat(monkeypatch):
    """attention_latency divides tile-padded FLOPs by the table's value, so the table must be
    measured on tile-padded FLOPs too: a kernel whose time is its padded tiles over one rate
    gives a flat table, and the model then reproduces its latencies."""
    import dataclasses

    import torch

    from wlb_opt import profile

    kernel = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"))
    kernel = dataclasses.replace(kernel, eff_q_len=(1,), eff_scale=(1.0,))
    kv, q_lens = 2048, (16, 64, 128, 256, 512, 1024)
    calls = iter(q_lens)
    monkeypatch.setattr(profile, "_time", lambda fn, dev, repeats, warmup=1: kernel.attention_latency(
        next(calls), kv, "fwd"))
    eff_q, eff_s, _ = profile._efficiency_table(wlb.ModelSpec.preset("tiny"), torch.device("cpu"), torch.float32,
                                                q_lens, 1, kv)
    assert eff_s == pytest.approx([1.0] * len(q_lens))
    fitted = dataclasses.replace(kernel, eff_q_len=tuple(eff_q), eff_scale=tuple(eff_s))
    for q in q_lens:
        assert fitted.attention_latency(q, kv, "fwd") == pytest.approx(kernel.attention_latency(q, kv, "fwd"))


def test_a_fit_without_a_visible_forward_attention_term_prices_it_from_the_backward():
    from wlb_opt.cost_fit import features

    rng = np.random.default_rng(0)
    fwd, bwd = np.array([1e-17, 5e-7, 5e-7, 7e-5]), np.array([2e-13, 1e-6, 1e-6, 1.5e-4])
    samples = [Sample(m, float(features(m) @ fwd), float(features(m) @ bwd))
               for m in sample_micro_batches(4096, 12, rng)]
    fit = fit_cost_model(samples, layers=2, attn_flops_per_pair=4 * 64 * 2)  # raised: ratio 2e4 > 1e3
    assert fit.attn_bwd_ratio == 2.5 and "attn_bwd_ratio_note" in fit.meta
    assert fit.attention_latency(4096, 4096, "bwd") > 0


def test_fit_needs_enough_valid_samples():
    with pytest.raises(ValueError, match="at least 4"):
        fit_cost_model([Sample(np.array([3]), 1.0, 1.0)])
    with pytest.raises(ValueError, match="positive"):
        fit_cost_model([Sample(np.array([3]), 0.0, 1.0)] * 4)


def _timed(lengths_list):
    from wlb_opt.cost_fit import features
    true = np.array([1e-9, 1e-6, 1e-4, 1e-3])
    return [Sample(np.array(lengths), float(features(lengths) @ true), 2 * float(features(lengths) @ true))
            for lengths in lengths_list]


@pytest.mark.parametrize("lengths_list, tied", [
    ([[1000]] * 6, "causal pairs, tokens, documents, micro-batch"),  # one sample six times: a perfect fit of nothing
    ([[100], [500], [1000], [4000], [9000], [20000]], "documents, micro-batch"),  # one document each
])
def test_a_fit_of_samples_whose_features_move_together_names_them(lengths_list, tied):
    for fit in (fit_cost_model, coef_intervals):
        with pytest.raises(ValueError, match=f"do not vary independently \\({tied} move together\\)"):
            fit(_timed(lengths_list))


def test_a_fit_refuses_a_sample_of_bad_lengths():
    good = _timed([[L] * k for L, k in ((100, 1), (500, 3), (1000, 2), (4000, 1), (90, 40))])
    for bad in ([-5, 2], [2.5, 3], [float("nan")]):
        with pytest.raises(ValueError, match="sample 0's lengths"):
            fit_cost_model([Sample(np.array(bad), 1e-3, 2e-3)] + good)
    assert fit_cost_model(good).coef["fwd"]["attn"] == pytest.approx(1e-9, rel=1e-6)


@pytest.mark.parametrize("n", [-1, 2.0, True])
def test_sampling_a_bad_number_of_micro_batches_is_refused(n):
    with pytest.raises(ValueError, match="n must be an integer >= 0"):
        sample_micro_batches(4096, n, np.random.default_rng(0))


def test_profile_tiny_block_on_cpu(tmp_path):
    pytest.importorskip("torch")
    from wlb_opt.profile import profile_block

    cost = profile_block(wlb.ModelSpec.preset("tiny"), window=128, n_samples=6, device="cpu", repeats=1,
                         show_progress=False, q_lens=(16, 32, 64))
    assert cost.meta["kind"] == "profiled"
    d = np.array([1, 16, 64, 128])
    c = cost.doc_cost(d)
    assert np.all(np.diff(c) >= 0) and np.all(c >= 0)
    assert len(cost.eff_scale) == 3 and max(cost.eff_scale) == pytest.approx(1.0)
    assert cost.model == wlb.ModelSpec.preset("tiny") and cost.parallel is None  # typed, and no layout
    # the per-token term includes the head measured apart, and so does its bracket
    fitted = [Sample(np.array(r["lengths"]), r["fwd_s"], r["bwd_s"]) for r in cost.meta["samples"] if not r["heldout"]]
    brackets = coef_intervals(fitted, cost.model.layers)
    for phase in ("fwd", "bwd"):
        head = cost.meta["head_s_per_token"][phase]
        assert cost.meta["coef_interval"][phase]["linear"] == pytest.approx(
            [v + head for v in brackets[phase]["linear"]])
    cost.save(tmp_path / "c.json")
    assert wlb.CostModel.load(tmp_path / "c.json").doc_cost(d).tolist() == c.tolist()


def test_profile_prints_plain_numbers():
    from wlb_opt.profile import efficiency_table

    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"))
    table = efficiency_table(cost)
    assert all(type(q) is int and type(s) is float for q, s in table.items())
    assert "np." not in str(table) and str(table).startswith("{1: 0.6")


def _synthetic(truth, mixes, noise, rng):
    out = []
    for lengths in mixes:
        f, b = rng.normal(1.0, noise, 2) if noise else (1.0, 1.0)
        out.append(Sample(lengths, truth.micro_batch_cost(lengths, "fwd") * f, truth.micro_batch_cost(lengths, "bwd") * b))
    return out


@pytest.mark.parametrize("noise", [0.0, 0.01])
def test_independent_sampling_recovers_every_term(noise):
    """All four named terms, doc_const and mb_const included: that needs micro-batches whose
    token and document counts vary independently (fixed-size micro-batches confound them)."""
    tiny = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"), hardware=wlb.HardwareSpec.preset("cpu"))
    coef = {p: dict(tiny.coef[p], comm=0.0, doc_const=3e-5, mb_const=2e-3) for p in ("fwd", "bwd")}
    truth = wlb.CostModel(coef=coef, attn_flops_per_pair=1.0)
    rng = np.random.default_rng(1)
    mixes = sample_micro_batches(4096, 40, rng)
    counts = np.array([[m.sum(), len(m)] for m in mixes])
    assert abs(np.corrcoef(counts.T)[0, 1]) < 0.6  # tokens and documents not locked together
    fit = fit_cost_model(_synthetic(truth, mixes, noise, rng), layers=1,
                         heldout=_synthetic(truth, sample_micro_batches(4096, 10, np.random.default_rng(2)),
                                            noise, rng))
    tol = 1e-6 if noise == 0 else 0.2
    for phase in ("fwd", "bwd"):
        for term in FIT_TERMS:
            want = truth.coef[phase][term]
            assert fit.coef[phase][term] == pytest.approx(want, rel=tol), (phase, term)
    v = fit.meta["validation"]
    assert v["n"] == 10 and (v["mape"] < 1e-6 if noise == 0 else 0.2 < v["mape"] < 3.0)
    assert v["worst"] >= v["mape"]


def test_resampled_fits_bracket_the_true_terms_and_narrow_with_more_samples():
    # exact samples: every resampled fit is the fit; noisy ones: the 10th-90th percentile of
    # the resampled fits holds the true attention and linear terms, and 160 samples pin every
    # term closer than 16 do (the per-document and per-micro-batch constants widest)
    tiny = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"), hardware=wlb.HardwareSpec.preset("cpu"))
    coef = {p: dict(tiny.coef[p], comm=0.0, doc_const=3e-5, mb_const=2e-3) for p in ("fwd", "bwd")}
    truth = wlb.CostModel(coef=coef, attn_flops_per_pair=1.0)
    rng = np.random.default_rng(3)
    exact = coef_intervals(_synthetic(truth, sample_micro_batches(4096, 16, rng), 0.0, rng))
    for phase in ("fwd", "bwd"):
        for term in FIT_TERMS:
            low, high = exact[phase][term]
            assert low == pytest.approx(coef[phase][term], rel=1e-6) and high == pytest.approx(low, rel=1e-6)
    few, many = (_synthetic(truth, sample_micro_batches(4096, n, rng), 0.02, rng) for n in (16, 160))
    wide = coef_intervals(many, layers=2, quantiles=(1.0, 99.0))
    few, many = coef_intervals(few, layers=2), coef_intervals(many, layers=2)
    for phase in ("fwd", "bwd"):
        for term in ("attn", "linear"):
            low, high = wide[phase][term]
            assert low <= 2 * coef[phase][term] <= high, (phase, term)  # scaled by layers, like fit_terms
        for term in FIT_TERMS:
            assert np.diff(many[phase][term])[0] < np.diff(few[phase][term])[0], (phase, term)
    fit = fit_cost_model(_synthetic(truth, sample_micro_batches(4096, 16, rng), 0.02, rng))
    assert set(fit.meta["coef_interval"]) == {"fwd", "bwd"} and len(fit.meta["samples"]) == 16
    from wlb_opt.profile import describe_fit
    assert "(in brackets: 10th-90th percentile" in describe_fit(fit)


def test_validation_is_the_held_out_error():
    coef = {p: dict(attn=0.0, linear=1.0, doc_const=0.0, mb_const=0.0) for p in ("fwd", "bwd")}
    # predicted fwd + bwd = 2 s per token; measured 2.2 s and 1.5 s -> errors 1/11 and 1/3
    held = [Sample(np.array([1]), 1.1, 1.1), Sample(np.array([1]), 0.5, 1.0)]
    v = validate(coef, held)
    assert v == {"mape": pytest.approx(100 * (1 / 11 + 1 / 3) / 2, abs=0.01), "worst": pytest.approx(33.33, abs=0.01),
                 "n": 2}
    assert validation_line(v) == "validation MAPE: 21.2%, worst: 33.3%"


def test_sampled_micro_batches_fit_the_window():
    mixes = sample_micro_batches(512, 30, np.random.default_rng(0))
    assert all(m.min() >= 1 and m.sum() <= 512 for m in mixes)
    assert mixes[0].tolist() == [512] and len(mixes[1]) == 64
    assert len({len(m) for m in mixes}) > 10 and len({int(m.sum()) for m in mixes}) > 20


@pytest.fixture
def saved(tmp_path):
    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"))
    return tmp_path / "c.json", cost.to_dict()


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["coef"]["fwd"].update(attn=-1e-9), r"coef\['fwd'\]\['attn'\].*>= 0.*-1e-09"),
    (lambda d: d["coef"]["bwd"].pop("linear"), r"coef\['bwd'\].*missing \['linear'\]"),
    (lambda d: d["coef"]["fwd"].update(gemm=1.0), r"unknown \['gemm'\]"),
    (lambda d: d["coef"].pop("bwd"), r"phases 'fwd' and 'bwd'"),
    (lambda d: d.update(format_version=99), r"format_version 99 is not supported"),
    (lambda d: d.pop("format_version"), r"format_version None is not supported"),
    (lambda d: d.update(coefficients={}), r"unknown fields \['coefficients'\]"),
    (lambda d: d["coef"]["fwd"].update(mb_const="0.1"), r"\['mb_const'\].*'0.1'"),
])
def test_bad_profiles_are_refused_with_a_clear_error(saved, edit, message):
    path, d = saved
    edit(d)
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=message) as info:
        wlb.CostModel.load(path)
    assert str(path) in str(info.value)


def test_invalid_json_and_old_formats(saved):
    path, d = saved
    path.write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        wlb.CostModel.load(path)
    d2 = dict(d, format_version=2)
    d2.pop("memory_model")
    assert wlb.CostModel.from_dict(d2).coef == wlb.CostModel.from_dict(d).coef


def test_profile_command_prints_validation_and_plain_numbers(tmp_path, capsys):
    pytest.importorskip("torch")
    from wlb_opt.cli import main

    config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
              "num_hidden_layers": 2, "num_key_value_heads": 1, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "cost.json"
    assert main(["profile", "--hf-config", str(tmp_path / "config.json"), "--window", "64", "--samples", "6",
                 "--holdout", "3", "--repeats", "1", "--device", "cpu", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^validation MAPE: \d+\.\d%, worst: \d+\.\d% \(3 held-out", text, re.M), text
    assert "np." not in text and "float64" not in text
    assert re.search(r"^fwd: attn \S+ s per causal pair \(\S+ to \S+\)", text, re.M), text
    cost = wlb.CostModel.load(out)
    assert [s["heldout"] for s in cost.meta["samples"]] == [False] * 6 + [True] * 3  # kept for a refit
    assert cost.meta["validation"]["n"] == 3 and cost.model.hidden == 32 and cost.model.kv_heads == 1
    command = cost.meta["provenance"]["command"]  # what `wlb-opt bench report` prints beside the figures
    assert command.startswith("wlb-opt profile --hf-config ") and command.endswith(str(out)), command
    assert cost.memory_model is not None and cost.memory_model.stored_per_token > 0
    assert cost.memory([64]) > 0  # a profiled model answers memory through its calibration


def test_profile_command_refuses_a_bad_config(tmp_path, capsys):
    from wlb_opt.cli import main

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 32}))
    assert main(["profile", "--hf-config", str(tmp_path / "config.json")]) == 2  # a usage error, no traceback
    assert "num_hidden_layers" in capsys.readouterr().err


def test_the_cpu_peak_counts_the_temporaries_an_op_allocates_and_frees_inside_itself():
    """cross_entropy holds its log-softmax (N x V floats) while it runs and frees it before it
    returns: the peak is at least that tensor, the bytes retained are its scalar result."""
    import torch
    import torch.nn.functional as F
    from wlb_opt.profile import measure_peak_bytes

    x, y = torch.randn(1024, 4096), torch.randint(0, 4096, (1024,))
    with torch.no_grad():
        retained, peak = measure_peak_bytes(lambda: F.cross_entropy(x, y), torch.device("cpu"))
    log_softmax = 1024 * 4096 * 4
    assert log_softmax <= peak < 2.5 * log_softmax
    assert 0 < retained < 1024


def test_the_cpu_peak_of_a_tensor_made_and_kept():
    import torch
    from wlb_opt.profile import measure_peak_bytes

    retained, peak = measure_peak_bytes(lambda: torch.ones(2**20).cumsum(0)[:2**18].clone(), torch.device("cpu"))
    assert retained >= 2**18 * 4 and peak >= 2 * 2**20 * 4  # the ones and their cumsum at once
