"""`wlb-opt bench loss-memory`: peak memory of the loss, full logits against chunked.

    wlb-opt bench loss-memory --out results/loss_memory        (CPU, about 20 s)

Forward and backward of the next-token loss of `--tokens` hidden states of width `--dim`
through an LM head of `--vocab` outputs (fp32), once with the full logits
(`F.cross_entropy(head(h))`) and once with `chunked_cross_entropy` at a few chunk sizes.
Peak memory is measured with `torch.profiler` (`profile_memory=True`: it sees libtorch's
allocations, which tracemalloc does not): the largest running sum of the allocations and
frees it records, in event order, above what was allocated before.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..cost_args import count
from ._provenance import provenance


def peak_bytes(fn) -> int:
    """Peak CPU bytes allocated while `fn` runs, above what was allocated before
    (`wlb_opt.profile.measure_peak_bytes`: the running sum of torch.profiler's raw allocation
    and free events)."""
    import torch

    from ..profile import measure_peak_bytes

    return measure_peak_bytes(fn, torch.device("cpu"))[1]


def run(tokens: int = 8192, dim: int = 256, vocab: int = 32000, chunks=(8192, 2048, 512), seed: int = 0):
    import torch
    import torch.nn.functional as F

    from ..executor.train import chunked_cross_entropy

    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(dim, vocab, bias=False)
    hidden = torch.randn(tokens, dim, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), generator=g)

    def full():
        F.cross_entropy(head(hidden), labels, reduction="sum").backward()

    rows = [dict(method="full logits", chunk=None, peak_mb=peak_bytes(full) / 2**20)]
    for chunk in chunks:
        rows.append(dict(method="chunked", chunk=chunk,
                         peak_mb=peak_bytes(lambda c=chunk: chunked_cross_entropy(hidden, labels, head, c).backward())
                         / 2**20))
    logits_mb = tokens * vocab * 4 / 2**20
    for r in rows:
        r.update(tokens=tokens, vocab=vocab, dim=dim, logits_mb=logits_mb)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt bench loss-memory", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=count, default=8192, help="hidden states (default 8192)")
    p.add_argument("--dim", type=count, default=256, help="hidden width (default 256)")
    p.add_argument("--vocab", type=count, default=32000, help="vocabulary (default 32000)")
    p.add_argument("--out", type=Path, default=Path("results/loss_memory"), help="folder for loss_memory.json")
    args = p.parse_args(argv)
    rows = run(args.tokens, args.dim, args.vocab)
    print(f"{args.tokens} tokens x vocabulary {args.vocab} (full fp32 logits: {rows[0]['logits_mb']:.0f} MB)")
    for r in rows:
        print(f"{r['method']:>12} chunk {str(r['chunk'] or '-'):>5}: peak {r['peak_mb']:8.1f} MB")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "loss_memory.json").write_text(json.dumps(rows, indent=1))
    (args.out / "loss_memory_meta.json").write_text(json.dumps(dict(provenance=provenance("loss_memory", argv)), indent=1))
    print(f"wrote {args.out / 'loss_memory.json'} (rows), {args.out / 'loss_memory_meta.json'}")
    return 0
