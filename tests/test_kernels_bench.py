"""`wlb-opt bench kernel` runs end to end on CPU in --cpu-smoke mode (no figures, just plumbing)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from wlb_opt.bench import kernel as bench_kernel


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
