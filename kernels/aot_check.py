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


_FP32_POINTERS = ("LSE", "DELTA", "DLSE", "DK", "DV", "DQ_ACC", "O_PART", "LSE_PART", "DQ_PART")  # fp32 whatever the input dtype


def _signature(fn, dtype: str, const: dict) -> tuple[dict[str, str], dict]:
    """(signature, attrs) as the JIT sees a launch from launch.py on a GPU: every pointer is
    16-byte aligned (torch allocations; index parts are padded to 16 bytes) and every
    specialised integer (the strides) is a multiple of 16, so both carry the
    ``tt.divisibility = 16`` hint; lengths and head counts are ``do_not_specialize``."""
    sig, attrs = {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        hinted = False
        if name in const:
            sig[name] = "constexpr"
        elif name in ("TILES", "KV_TILES", "ENTRIES"):
            sig[name], hinted = "*i32", True
        elif name in _FP32_POINTERS:
            sig[name], hinted = "*fp32", True
        elif name.isupper():
            sig[name], hinted = f"*{dtype}", True
        elif name in ("qk_scale", "sm_scale"):
            sig[name] = "fp32"
        else:
            sig[name], hinted = "i32", not param.do_not_specialize
        if hinted:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


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


SM_SHARED = {90: 233472, 80: 167936, 89: 102400}  # shared memory per SM (bytes)
SM_REGISTERS = 65536


def programs_per_sm(shared_bytes: int, registers: int, num_warps: int, arch: int = 90) -> int:
    """Programs one SM holds at once: limited by shared memory and by the register file
    (registers per thread x 32 threads per warp; 1 KiB of shared memory is reserved per block)."""
    by_shared = SM_SHARED.get(arch, 233472) // (shared_bytes + 1024)
    by_regs = SM_REGISTERS // max(1, registers * 32 * num_warps) if registers > 0 else by_shared
    return int(min(by_shared, by_regs, 32))


def check(arch: int = 90, head_dims=(64, 128), dtypes=("bf16", "fp16"), group: int = 4,
          first_only: bool = False) -> list[dict]:
    """Compile fwd/dq/dkdv (and the atomic-dQ dK/dV of ``deterministic=False``) for every
    candidate config (`first_only`: the first of each), as the JIT specialises them; one
    result dict per compile, with registers, spills (local memory) and shared memory."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter replaces the compiler")
    import triton
    from triton.backends.compiler import GPUTarget

    from . import launch
    from . import triton_kernels as tk

    kernels = {"fwd": tk._fwd_kernel, "dq": tk._dq_kernel, "dkdv": tk._dkdv_kernel,
               "dkdv_atomic": tk._dkdv_kernel}
    rows = []
    for dtype in dtypes:
        for d in head_dims:
            for name, fn in kernels.items():
                configs = launch._GPU_CONFIGS[name][d <= 64]
                for cfg in configs[:1] if first_only else configs:
                    const = dict(GROUP=group, HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                 PRECISION="ieee" if dtype == "fp32" else "tf32")
                    if fn is tk._dkdv_kernel:
                        const["ATOMIC_DQ"] = name == "dkdv_atomic"
                    row = dict(kernel=name, dtype=dtype, head_dim=d, block_m=cfg.block_m,
                               block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
                    try:
                        sig, attrs = _signature(fn, _DTYPE[dtype], const)
                        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
                        out = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                             options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
                        row["shared_bytes"] = int(out.metadata.shared)
                        row["fits"] = row["shared_bytes"] <= SHARED_LIMIT.get(arch, 232448)
                        row.update(_resource_usage(out.asm["cubin"]))
                        row["programs_per_sm"] = programs_per_sm(row["shared_bytes"], row["registers"],
                                                                 cfg.num_warps, arch)
                    except Exception as exc:  # noqa: BLE001 - reported, not raised
                        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    rows.append(row)
                    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=sorted(_DTYPE))
    p.add_argument("--first-config", action="store_true", help="only the first candidate config of each kernel")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    rows = check(args.arch, tuple(args.head_dims), tuple(args.dtypes), first_only=args.first_config)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if "error" in r]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
