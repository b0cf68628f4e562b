"""Test configuration shared by every test module, in every tier.

The tiers: `unit/` (one process, no spawn, fast: the whole tier runs in about a minute),
`integration/` (one process, whole components: Hugging Face model families, the Triton
interpreter, exact solvers, streams over many steps), `distributed/` (gloo process groups)
and `bench/` (the benchmarks, the CLI, the examples and scripts as processes). A module may
import another test module's helpers by its name (`from test_training import make_model`):
every tier's folder is on the import path.

TRITON_INTERPRET must be set before any Triton kernel module is imported, so it is set here,
at collection time, for CPU runs. Hypothesis runs with no deadline and capped examples so the
suite stays well inside its time budget on a 2-core machine.
"""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

TIERS = ("unit", "integration", "distributed", "bench")
for _tier in TIERS:
    _path = str(Path(__file__).resolve().parent / _tier)
    if _path not in sys.path:
        sys.path.append(_path)

os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402

if importlib.util.find_spec("transformers") is not None:  # tests build HF models: no second kernels copy
    from wlb_opt._optional import unshadow_kernels

    unshadow_kernels()

import pytest  # noqa: E402

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "ci",
        deadline=None,
        max_examples=40,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        derandomize=True,
    )
    # HYPOTHESIS_PROFILE=stress runs many more examples (derandomize off) for a local soak.
    settings.register_profile(
        "stress",
        deadline=None,
        max_examples=400,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # pragma: no cover
    pass


def unit_cost(attn=1.0, linear=0.0, doc_const=0.0, mb_const=0.0, *, backward=False, parallel=None):
    """A CostModel with hand-computable weights: doc_cost(d) = attn * d(d+1)/2 + linear * d
    + doc_const (forward; the backward is the same when `backward`, else zero), `parallel`
    its layout (None: any layout). Import it with ``from conftest import unit_cost``."""
    import wlb_opt as wlb

    fwd = dict(attn=attn, linear=linear, comm=0.0, doc_const=doc_const, mb_const=mb_const)
    bwd = dict(fwd) if backward else dict.fromkeys(fwd, 0.0)
    return wlb.CostModel(coef={"fwd": fwd, "bwd": bwd}, attn_flops_per_pair=1.0, parallel=parallel)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a spawned gloo process group."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def port() -> int:
    return free_port()


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
