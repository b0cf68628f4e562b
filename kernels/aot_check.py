"""Compile the Triton kernels for a GPU target without a GPU, and report their resources.

``python -m wlb_opt.kernels.aot_check [--arch 90] [--head-dims 64 128] [--dtypes bf16]``

Triton can lower a kernel to PTX and a cubin for any target on a CPU-only machine (ptxas
ships inside the triton wheel). This catches what the interpreter cannot: type errors
in the lowering, ``tl.dot`` shape limits, shared memory over the chip's limit (H100/H200:
227 KiB per block), register counts and spills to local memory (``cuobjdump`` on the cubin). It is a development aid,
run before a GPU is available; launch.py still skips configs that fail on the real device.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SHARED_LIMIT = {90: 232448, 80: 166912, 89: 101376}  # bytes of shared memory per block
_DTYPE = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32"}


def _signature(fn, dtype: str, const: dict) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name in ("TILES", "KV_TILES", "ENTRIES"):
            sig[name] = "*i32"
        elif name in ("LSE", "DELTA", "DLSE"):
            sig[name] = "*fp32"
        elif name.isupper():
            sig[name] = f"*{dtype}"
        elif name in ("qk_scale", "sm_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _resource_usage(cubin: bytes) -> dict:
    """Registers per thread and local memory (spills, stack) from ``cuobjdump`` on the cubin."""
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        res = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(path)],
                             capture_output=True, text=True)
    fields = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", res.stdout))
    return {"registers": int(fields.get("REG", -1)), "local_bytes": int(fields.get("LOCAL", -1)),
            "stack_bytes": int(fields.get("STACK", -1))}


def check(arch: int = 90, head_dims=(16, 32, 64, 128), dtypes=("bf16", "fp16", "fp32"), group: int = 4) -> list[dict]:
    """Compile fwd/dq/dkdv for every candidate config; one result dict per compile."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter replaces the compiler")
    import triton
    from triton.backends.compiler import GPUTarget

    from . import launch
    from . import triton_kernels as tk

    kernels = {"fwd": tk._fwd_kernel, "dq": tk._dq_kernel, "dkdv": tk._dkdv_kernel}
    rows = []
    for dtype in dtypes:
        for d in head_dims:
            for name, fn in kernels.items():
                for cfg in launch._GPU_CONFIGS[name][d <= 64]:
                    const = dict(GROUP=group, HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                 PRECISION="ieee" if dtype == "fp32" else "tf32")
                    row = dict(kernel=name, dtype=dtype, head_dim=d, block_m=cfg.block_m,
                               block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
                    try:
                        src = triton.compiler.ASTSource(fn=fn, signature=_signature(fn, _DTYPE[dtype], const),
                                                        constexprs=const)
                        out = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                             options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
                        row["shared_bytes"] = int(out.metadata.shared)
                        row["fits"] = row["shared_bytes"] <= SHARED_LIMIT.get(arch, 232448)
                        row.update(_resource_usage(out.asm["cubin"]))
                    except Exception as exc:  # noqa: BLE001 - reported, not raised
                        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    rows.append(row)
                    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--head-dims", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp16", "fp32"], choices=sorted(_DTYPE))
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    rows = check(args.arch, tuple(args.head_dims), tuple(args.dtypes))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if "error" in r]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
