"""Bench-side data plumbing: streams of global batches fed through the planners, the
calibration report of the length data, and the builder of the real length file.

The distributions themselves (`sample_documents`, `document_stream`, `global_batches`, the
"real" file) live in the core module `wlb_opt.workloads`, so the CLI and the examples use them
without importing the benchmarks. What sits here needs the planners, which that module may
not import:

- `carried_plans`: one `solve_pack` per global batch (or pool of k batches), the deferred
  pieces carried to the front of the next one (Table 2's pooled rows, e2e's Plain-4D and
  Fixed-4D streams);
- `run_packer`: a stream through a `WLBPacker`, then its drain (Table 2's WLB rows, parity,
  e2e's WLB-LLM stream);
- the maintainer commands

    python -m wlb_opt.bench.data                 the two calibration targets of "default"
    python -m wlb_opt.bench.data --make-real     rebuild wlb_opt/real_lengths.npy here
    python -m wlb_opt.bench.data --make-kinds    rebuild bench/code_lengths.npy and
                                                 bench/prose_lengths.npy here
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .._optional import progress
from ..cost import CostModel
from ..cost_args import count, natural
from ..documents import split_documents
from ..plan import PackPlan, imbalance
from ..specs import HardwareSpec, ModelSpec, ParallelSpec
from ..step_pack import solve_pack
from ..workloads import DEFAULT_SEED, REAL_FILE, GlobalBatch, document_stream, kind_file

CALIBRATION_TARGETS = dict(short_doc_token_share="> 0.75 (paper §2)", original_imbalance_mean="1.44 (paper Table 2)")


def carried_plans(batches: Sequence[GlobalBatch], n_micro: int, max_tokens: int, cost: CostModel | None,
                  method: str, *, pool: int = 1, desc: str | None = None, show: bool = False,
                  **solve_kw) -> Iterator[tuple[PackPlan, float]]:
    """(plan, planning seconds) for each pool of `pool` consecutive global batches.

    Each plan packs the pieces its plan before deferred (placed first: `carried`) and then the
    pool's pieces, into `n_micro` micro-batches (`solve_kw` goes to `solve_pack`, e.g. `dp`).
    Batches past the last whole pool are not planned."""
    carry = (np.zeros(0, np.int64),) * 3
    for p in progress(range(len(batches) // pool), desc=desc, enable=show):
        group = batches[p * pool:(p + 1) * pool]
        pieces, ids, offsets = (np.concatenate([carry[f]] + [b[f] for b in group]) for f in range(3))
        t0 = time.process_time()
        plan = solve_pack(pieces, n_micro, max_tokens, cost, method, ids=ids, offsets=offsets,
                          carried=len(carry[0]), **solve_kw)
        seconds = time.process_time() - t0
        yield plan, seconds
        d = plan.deferred
        carry = (plan.lengths[d], plan.doc_ids[d], plan.offsets[d])


@dataclass(frozen=True)
class PackerRun:
    """What `run_packer` saw: the streamed plans (one per global batch) with their planning
    seconds, the packer's stats before and after the drain, and the drain's plans."""

    plans: list
    seconds: list
    streamed_stats: dict
    drained: list
    stats: dict


def run_packer(packer, batches: Sequence[GlobalBatch], *, desc: str | None = None, show: bool = False) -> PackerRun:
    """Feed every global batch to `packer` (a WLBPacker), then drain it (nothing stays queued)."""
    plans, seconds = [], []
    for pieces, ids, offsets in progress(batches, desc=desc, enable=show):
        t0 = time.process_time()
        plans.append(packer.pack(pieces, ids, offsets))
        seconds.append(time.process_time() - t0)
    streamed = packer.stats()
    drained = packer.drain()
    return PackerRun(plans=plans, seconds=seconds, streamed_stats=streamed, drained=drained, stats=packer.stats())


def make_real_lengths(roots=None, max_files: int = 60000, seed: int = 0) -> np.ndarray:
    """Token estimates of the text files under `roots` (default: Python's stdlib, the
    installed site-packages, /usr/share/doc and /usr/include): one document per file,
    tokens ~= ceil(bytes / 4) (the usual BPE rule of thumb for English and code), files
    that are not UTF-8 text or shorter than 64 bytes skipped."""
    import sysconfig

    roots = roots or [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], "/usr/share/doc",
                      "/usr/include"]
    sizes = []
    for root in roots:
        for path in sorted(Path(root).rglob("*")):
            if not path.is_file() or path.is_symlink():
                continue
            try:
                raw = path.read_bytes()
                raw.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if len(raw) >= 64 and b"\x00" not in raw[:4096]:
                sizes.append(-(-len(raw) // 4))
    sizes = np.asarray(sizes, dtype=np.int64)
    rng = np.random.default_rng(seed)
    if len(sizes) > max_files:
        sizes = rng.choice(sizes, size=max_files, replace=False)
    return rng.permutation(sizes).astype(np.int32)


CODE_SUFFIXES = frozenset({".py", ".pyi", ".pyx", ".pxd", ".h", ".hpp", ".hh", ".c", ".cc", ".cpp", ".cxx", ".cu",
                           ".cuh", ".pm", ".pl", ".vim", ".cmake", ".tcl", ".f90", ".td", ".inc", ".js", ".sh",
                           ".rs", ".go", ".java", ".lua", ".rb"})
"""File suffixes counted as source code by `make_kind_lengths`."""
PROSE_SUFFIXES = frozenset({".rst", ".txt", ".md", ".html", ".htm", ".tex", ".texi", ".rtf", ".org", ".adoc"})
"""File suffixes counted as prose (plus the gzipped changelogs and READMEs of /usr/share/doc)."""


def make_kind_lengths(roots=None) -> dict[str, np.ndarray]:
    """Token estimates (ceil(bytes / 4)) of the source-code files and of the prose files
    under `roots` (default: Python's stdlib, site-packages, /usr/share/doc, /usr/include
    and /usr/share), one document per file, each file counted once (by real path). A
    `.gz` file under /usr/share/doc counts, decompressed, by the suffix under `.gz` (prose
    if it has none: changelogs). Files that are not UTF-8 text or shorter than 64 bytes are
    skipped. Returns {"code": lengths, "prose": lengths} in a fixed shuffled order."""
    import gzip
    import os
    import sysconfig

    roots = roots or [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], "/usr/share/doc",
                      "/usr/include", "/usr/share"]
    seen: set[str] = set()
    sizes: dict[str, list[int]] = {"code": [], "prose": []}
    for root in roots:
        for path in sorted(Path(root).rglob("*")):
            if path.is_symlink() or not path.is_file():
                continue
            real = os.path.realpath(path)
            if real in seen:
                continue
            seen.add(real)
            suffix, packed = path.suffix.lower(), False
            if suffix == ".gz" and str(path).startswith("/usr/share/doc"):
                suffix, packed = Path(path.stem).suffix.lower() or ".txt", True
            kind = "code" if suffix in CODE_SUFFIXES else "prose" if suffix in PROSE_SUFFIXES else None
            if kind is None:
                continue
            try:
                raw = path.read_bytes()
                raw = gzip.decompress(raw) if packed else raw
                raw.decode("utf-8")
            except (OSError, EOFError, UnicodeDecodeError, gzip.BadGzipFile):
                continue
            if len(raw) >= 64 and b"\x00" not in raw[:4096]:
                sizes[kind].append(-(-len(raw) // 4))
    rng = np.random.default_rng(0)
    return {kind: rng.permutation(np.asarray(v, dtype=np.int64)).astype(np.int32) for kind, v in sizes.items()}


def calibration_report(steps: int = 300, seed: int = 0) -> dict:
    """The two calibration targets of the default distribution (see `wlb_opt.workloads`):
    the token share of documents under half the window, and the mean PP imbalance of
    Plain-4D on consecutive sequences of the stream (7B, (8, 2, 4, 1), H100, N = 4)."""

    window, n_micro = 131072, 4
    cost = CostModel.analytic(ModelSpec.preset("7b"), ParallelSpec(tp=8, cp=2, pp=4, dp=1), HardwareSpec.preset("h100"))
    stream = document_stream(steps * n_micro * window + window, "default", DEFAULT_SEED + seed)
    pieces, ids, offsets = split_documents(stream, window)
    share = float(pieces[pieces < window // 2].sum() / pieces.sum())
    imbalances = []
    # Plain-4D on consecutive sequences of the token stream: feed everything, defer the rest.
    for _ in range(steps):
        take = int(np.searchsorted(np.cumsum(pieces), n_micro * window)) + 1
        plan = solve_pack(pieces[:take], n_micro, window, cost, "original", ids=ids[:take], offsets=offsets[:take])
        imbalances.append(imbalance([cost.micro_batch_cost(plan.lengths[mb], "fwd") for mb in plan.micro_batches]))
        d = plan.deferred
        pieces = np.concatenate([plan.lengths[d], pieces[take:]])
        ids = np.concatenate([plan.doc_ids[d], ids[take:]])
        offsets = np.concatenate([plan.offsets[d], offsets[take:]])
    return dict(short_doc_token_share=share, original_imbalance_mean=float(np.mean(imbalances)),
                original_imbalance_sem=float(np.std(imbalances) / np.sqrt(steps)), steps=steps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wlb_opt.bench.data", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--make-real", action="store_true", help=f"rebuild {REAL_FILE} from this machine's text files")
    p.add_argument("--steps", type=count, default=300, help="Plain-4D steps of the calibration report (default 300)")
    p.add_argument("--seed", type=natural, default=0, help="stream seed, an offset from DEFAULT_SEED (default 0)")
    p.add_argument("--make-kinds", action="store_true",
                   help="rebuild the code and prose length files (bench/*_lengths.npy) from this machine's files")
    args = p.parse_args(argv)
    if args.make_kinds:
        for kind, arr in make_kind_lengths().items():
            path = kind_file(kind)
            np.save(path, arr)
            print(f"wrote {path}: {len(arr)} documents, median {int(np.median(arr))}, "
                  f"{int((arr >= 32768).sum())} >= 32768, max {int(arr.max())}")
        return 0
    if args.make_real:
        arr = make_real_lengths()
        np.save(REAL_FILE, arr)
        print(f"wrote {REAL_FILE}: {len(arr)} documents, median {int(np.median(arr))}, max {int(arr.max())}")
        return 0
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    report = calibration_report(args.steps, args.seed)
    print(json.dumps(dict(report, targets=CALIBRATION_TARGETS), indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
