"""The Triton kernels through Triton's real compiler, for an H100/H200 target, on a CPU.

The interpreter (TRITON_INTERPRET=1, which every other kernel test on CPU uses) runs the
kernels as numpy and never type-checks them: a kernel that names one variable with two
pointer types across an ``if`` runs there and fails to compile on every GPU. Lowering each
kernel to a cubin for sm_90 (ptxas ships in the triton wheel) catches such errors here.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")


def test_every_kernel_compiles_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    res = subprocess.run(
        [sys.executable, "-m", "wlb_opt.kernels.aot_check", "--arch", "90", "--head-dims", "64", "128",
         "--dtypes", "bf16", "--first-config"],
        env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("kernel=")]
    compiled = {(ln.split()[0], ln.split()[2]) for ln in lines}
    assert compiled == {(k, f"head_dim={d}") for k in ("kernel=fwd", "kernel=dq", "kernel=dkdv", "kernel=dkdv_atomic")
                        for d in (64, 128)}, res.stdout + res.stderr
    errors = [ln for ln in lines if " error=" in ln]
    assert not errors and res.returncode == 0, "\n".join(errors) or res.stderr[-2000:]
    assert all(" fits=True" in ln for ln in lines), res.stdout
