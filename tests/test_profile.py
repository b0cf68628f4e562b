"""Profiling: the fit recovers a known model; a real (tiny) profile on this CPU gives a sane model."""
import numpy as np
import pytest

import wlb_opt as wlb
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


def test_fit_needs_enough_valid_samples():
    with pytest.raises(ValueError, match="at least 4"):
        fit_cost_model([Sample(np.array([3]), 1.0, 1.0)])
    with pytest.raises(ValueError, match="positive"):
        fit_cost_model([Sample(np.array([3]), 0.0, 1.0)] * 4)


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
    cost.save(tmp_path / "c.json")
    assert wlb.CostModel.load(tmp_path / "c.json").doc_cost(d).tolist() == c.tolist()


def test_profile_prints_plain_numbers():
    from wlb_opt.profile import efficiency_table

    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"))
    table = efficiency_table(cost)
    assert all(type(q) is int and type(s) is float for q, s in table.items())
    assert "np." not in str(table) and str(table).startswith("{1: 0.6")
