"""The memory model against the peak measured on this CPU."""

import numpy as np
import pytest

import wlb_opt as wlb
from wlb_opt.cost_memory import MemoryModel


def test_prediction_against_the_measured_cpu_peak():
    """The executor's real step (pp = 1, fp32, torch attention path) on this CPU: the peak
    above weights and gradients that torch.profiler measures, against the analytic and the
    calibrated prediction (bench/memory.py gives the full table)."""
    pytest.importorskip("torch")
    import torch

    import wlb_opt.executor as ex
    from wlb_opt.bench.memory import measure_step
    from wlb_opt.profile import _BlockBench, _calibrate_memory

    torch.manual_seed(0)
    spec = wlb.ModelSpec(hidden=64, layers=2, heads=4, kv_heads=2, ffn=176, vocab=512)
    model = ex.TinyLM.from_spec(spec)
    options = dict(dtype="fp32", optimizer="none", loss_chunk=256)
    analytic = MemoryModel.analytic(spec, wlb.ParallelSpec(), wlb.HardwareSpec.preset("cpu"), **options)
    calibrated, _ = _calibrate_memory(_BlockBench(spec, torch.device("cpu"), torch.float32), 256, "cpu", "fp32",
                                      np.random.default_rng(3))
    calibrated = calibrated.with_options(**options)
    for lengths in ([512], [32] * 16):
        measured = measure_step(model, lengths, 256)
        for mem, tol in ((analytic, 0.35), (calibrated, 0.25)):
            parts = mem.breakdown(lengths)
            assert parts["activations"] + parts["transient"] == pytest.approx(measured, rel=tol), (lengths, mem.source)
