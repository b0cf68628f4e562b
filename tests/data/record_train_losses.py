"""Run examples/train.py under torchrun and record, per rank, the exact loss of every step and a
SHA-256 of every parameter's gradient after it (float.hex / bits), to compare two versions of the
executor to the bit.

    python -m torch.distributed.run --standalone --nproc_per_node N tests/data/record_train_losses.py OUT.json -- ARGS

ARGS are examples/train.py's; each rank writes OUT.json.rank<r>.

Bits depend on the CPU's vector instructions (ATen's kernels and MKL's BLAS pick their code
path from the CPU), so the script pins both to paths every x86-64 CPU runs alike before torch
is imported: one thread, ATen's scalar kernels, MKL's compatible code path.
"""
from __future__ import annotations

import hashlib
import json
import os
import runpy
import sys
from pathlib import Path

PINNED_ENV = {"OMP_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
os.environ.update(PINNED_ENV)

import torch  # noqa: E402

import wlb_opt.executor as ex  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _bits(t: torch.Tensor) -> bytes:
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def main() -> None:
    out, args = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    records = []
    real = ex.train_step

    def recording(stages, *a, **kw):
        loss = real(stages, *a, **kw)
        chunks = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        h = hashlib.sha256()
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                h.update(name.encode())
                h.update(_bits(p.grad) if p.grad is not None else b"none")
        records.append({"loss": float(loss).hex(), "grads": h.hexdigest()})
        return loss

    ex.train_step = recording
    sys.argv = [str(ROOT / "examples" / "train.py"), *args]
    rank = None
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        rank = int(os.environ.get("RANK", 0))
        Path(f"{out}.rank{rank}").write_text(json.dumps(records))


if __name__ == "__main__":
    main()
