"""`wlb-opt bench kernel` runs end to end on CPU in --cpu-smoke mode (no figures, just plumbing)."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from wlb_opt.bench import kernel as bench_kernel  # noqa: E402


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cpu_smoke_writes_json(tmp_path, backend):
    rc = bench_kernel.main(["--cpu-smoke", "--backend", backend, "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "kernel_bench.json").read_text())
    assert result["correctness"]["passed"]
    cases = {r["case"]: r for r in result["cases"]}
    assert {"packed_96", "single_64", "scaling_32", "scaling_128"} <= set(cases)
    for row in cases.values():
        assert row["ours_fwd_ms"] > 0 and row["ours_fwd_bwd_tflops"] > 0
        assert row["sdpa_fwd_ms"] > 0
    assert cases["scaling_32"]["n_docs"] == 4 and cases["scaling_32"]["sum_d2"] == 4 * 32**2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_needs_a_gpu_without_smoke(tmp_path, capsys):
    assert bench_kernel.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_packed_lengths_fill_the_micro_batch():
    for n in (96, 8192, 131072):
        lengths = bench_kernel.packed_lengths(n, seed=3)
        assert lengths.sum() == n and lengths.min() >= 1


def test_schedule_model_rows(tmp_path):
    from wlb_opt.bench import _kernel_schedule as ks

    rows = ks.run(windows=(16384,), cps=(1, 8), heads=(4,), n_batches=1)
    assert {(r["cp"], r["kernel"]) for r in rows} == {(c, k) for c in (1, 8) for k in ("fwd", "dq", "dkdv")}
    for r in rows:
        assert r["makespan_ratio"] <= ks.TARGET and r["makespan_ratio"] <= r["makespan_ratio_before"] + 1e-9
        assert r["programs_per_sm"] == 1 and r["sms"] == 132 and r["tables"] > 0
    assert bench_kernel.main(["--schedule", "--out", str(tmp_path), "--batches", "1"]) == 0
    saved = json.loads((tmp_path / "kernel_schedule.json").read_text())
    assert {"makespan_ratio", "makespan_ratio_before"} <= set(saved["rows"][0])
