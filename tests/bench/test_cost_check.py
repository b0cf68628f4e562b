"""`wlb-opt bench cost-check`: the analytic model against a measured one, on a measured model
made from the analytic one with known factors (so every ratio is known beforehand)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import wlb_opt as wlb
from wlb_opt.cli import main

FACTORS = {"fwd": dict(attn=2.0, linear=0.5, doc_const=1.0, mb_const=4.0),
           "bwd": dict(attn=0.8, linear=1.25, doc_const=2.0, mb_const=1.0)}


def _analytic():
    return wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"), wlb.ParallelSpec(), wlb.HardwareSpec.preset("h200"))


def _measured(tmp_path, factors=FACTORS):
    base = _analytic()
    coef = {ph: {term: v * factors.get(ph, {}).get(term, 1.0) for term, v in base.coef[ph].items()}
            for ph in base.coef}
    path = tmp_path / "measured.json"
    dataclasses.replace(base, coef=coef).save(path)
    return path


def _run(tmp_path, measured, capsys):
    out = tmp_path / "out"
    assert main(["bench", "cost-check", "--measured", str(measured), "--window", "4096", "--steps", "40",
                 "--seeds", "300", "--out", str(out)]) == 0
    capsys.readouterr()
    return json.loads((out / "cost_check.json").read_text())


def test_ratios_are_the_factors_the_measured_model_was_made_with(tmp_path, capsys):
    result = _run(tmp_path, _measured(tmp_path), capsys)
    assert result["provenance"]["command"].startswith("wlb-opt bench cost-check --measured ")
    seen = {(r["phase"], r["term"]): r["analytic_over_measured"] for r in result["coefficients"]}
    for phase, terms in FACTORS.items():
        for term, factor in terms.items():
            assert seen[phase, term] == pytest.approx(1.0 / factor, rel=1e-12), (phase, term)
    analytic = _analytic()
    measured = wlb.CostModel.load(tmp_path / "measured.json")
    for row in result["mixes"]:
        lengths = np.full(row["documents"], row["document_tokens"])
        for phase in ("fwd", "bwd"):
            want = analytic.micro_batch_cost(lengths, phase) / measured.micro_batch_cost(lengths, phase)
            assert row[f"{phase}_analytic_over_measured"] == pytest.approx(want, rel=1e-12)
    assert [r["document_tokens"] for r in result["mixes"]] == [4096, 2048, 1024, 512, 256, 128]
    assert [r["planned_with"] for r in result["planning"]] == ["analytic", "measured"]
    assert all(r["fwd_imbalance"] >= 1.0 and r["bwd_imbalance"] >= 1.0 for r in result["planning"])


def test_the_same_model_twice_plans_the_same_steps(tmp_path, capsys):
    result = _run(tmp_path, _measured(tmp_path, factors={}), capsys)
    assert all(r["analytic_over_measured"] in (None, pytest.approx(1.0, rel=1e-12)) for r in result["coefficients"])
    analytic, measured = result["planning"]
    for key in ("fwd_imbalance", "bwd_imbalance", "displacement_per_token"):
        assert analytic[key] == measured[key], key


def test_a_model_without_its_architecture_is_refused_in_one_line(tmp_path, capsys):
    path = tmp_path / "bare.json"
    dataclasses.replace(_analytic(), model=None).save(path)
    assert main(["bench", "cost-check", "--measured", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "names no ModelSpec" in err and "Traceback" not in err
