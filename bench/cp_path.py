"""`wlb-opt bench cp-path`: host time of CP attention's index and copy path, per layer.

    wlb-opt bench cp-path --out results/cp_path                    (CPU, about 20 s)
    wlb-opt bench cp-path --device cuda --full --out results/cp_path   (one GPU: the device hot path)

CP attention needs, for every micro-batch, the permutation that restores packed order after
the K/V all-gather. Built on every call, it costs a numpy sort to validate the shard, an
argsort, and a pageable host-to-device copy (`packed_order_index`, timed as "before"); the
executor builds it once per ShardPlan and device (`cp_context`), uploads it pinned and
non-blocking, and every later layer reuses it ("after"). For packed micro-batches of 32K and 128K
tokens (default distribution, documents of at most 16K tokens, per_doc shards of CP = 4,
rank 0) this times, per call: before; after, first layer (the build); after, later layers.
Medians of `--repeats` calls; the attention itself is not timed.

`--full` also runs the whole per-layer hot path (gather, attention forward and backward,
reduce-scatter) through `context_parallel_attention` in a one-rank process group (NCCL on
CUDA, gloo on CPU) and times it with CUDA events on a GPU (perf_counter on CPU), at cp = 1.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from ..cost_args import count
from ..shard import solve_shard
from ..workloads import DEFAULT_SEED, document_stream
from ._provenance import provenance


def micro_batch(n_tokens: int, seed: int, max_doc: int = 16384) -> np.ndarray:
    """Document lengths (<= max_doc) filling exactly n_tokens, cut from the default stream."""
    out, left = [], n_tokens
    for d in document_stream(2 * n_tokens, "default", seed):
        if left <= 0:
            break
        out.append(int(min(d, max_doc, left)))
        left -= out[-1]
    return np.array(out, dtype=np.int64)


def _median_ms(fn, repeats: int, sync=None) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def host_rows(tokens=(32768, 131072), cp: int = 4, device: str = "cpu", repeats: int = 20, seed: int = DEFAULT_SEED):
    import torch

    from ..executor.cp_attention import CPContext, cp_context, packed_order_index

    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else None
    rows = []
    for n in tokens:
        lengths = micro_batch(n, seed)
        shard = solve_shard(lengths, cp, "per_doc")
        before = _median_ms(lambda: packed_order_index(shard, device), repeats, sync)
        first = _median_ms(lambda: CPContext(shard, 0, cp, torch.device(device)), repeats, sync)
        cp_context(shard, None, device, rank=0, world=cp)  # built once, as by the first layer
        later = _median_ms(lambda: cp_context(shard, None, device, rank=0, world=cp), max(repeats, 200), sync)
        rows.append(dict(tokens=n, documents=len(lengths), cp=cp, device=device, before_ms=before,
                         after_first_layer_ms=first, after_later_layers_ms=later,
                         later_layers_speedup=before / later if later > 0 else None))
    return rows


def full_path_rows(tokens=(32768,), device: str = "cpu", layers: int = 8, heads: int = 8, kv_heads: int = 2,
                   head_dim: int = 128, seed: int = DEFAULT_SEED):
    """Per-layer time of the whole CP hot path at cp = 1 in a one-rank group, on `device`."""
    import datetime
    import os
    import socket

    import torch
    import torch.distributed as dist

    from ..executor import context_parallel_attention

    cuda = torch.device(device).type == "cuda"
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60),
                                device_id=torch.device(device) if cuda else None)
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for n in tokens:
        lengths = micro_batch(n, seed)
        shard = solve_shard(lengths, 1, "per_doc")
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(n, heads, head_dim, device=device, dtype=dtype, generator=g).requires_grad_()
        k = torch.randn(n, kv_heads, head_dim, device=device, dtype=dtype, generator=g).requires_grad_()
        v = torch.randn(n, kv_heads, head_dim, device=device, dtype=dtype, generator=g).requires_grad_()

        def layer():
            out = context_parallel_attention(q, k, v, shard, group=dist.group.WORLD)
            out.sum().backward()

        layer()  # compile / build
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            for _ in range(layers):
                layer()
            end.record()
            host_ms = (time.perf_counter() - t0) * 1e3 / layers
            torch.cuda.synchronize()
            device_ms = start.elapsed_time(end) / layers
        else:
            t0 = time.perf_counter()
            for _ in range(layers):
                layer()
            host_ms = device_ms = (time.perf_counter() - t0) * 1e3 / layers
        rows.append(dict(tokens=n, documents=len(lengths), device=device, layers=layers,
                         ms_per_layer=device_ms, host_ms_per_layer=host_ms,
                         backend=dist.get_backend(), dtype=str(dtype)))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt bench cp-path", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/cp_path"), help="folder for cp_path.json")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--tokens", type=count, nargs="+", default=[32768, 131072], help="micro-batch sizes (tokens)")
    p.add_argument("--repeats", type=count, default=20, help="timed calls per measurement (default 20)")
    p.add_argument("--full", action="store_true", help="also time the whole hot path at cp = 1")
    p.add_argument("--full-tokens", type=count, nargs="+", default=None,
                   help="micro-batch sizes of --full (default: 32768 on CUDA, 2048 on CPU)")
    p.add_argument("--head-dim", type=count, default=None, help="--full head dim (default 128 on CUDA, 32 on CPU)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = dict(provenance=provenance("cp_path", argv), host=host_rows(tuple(args.tokens), device=args.device, repeats=args.repeats))
    (args.out / "cp_path.json").write_text(json.dumps(result, indent=1))  # kept if --full times out
    print(f"{'tokens':>7} {'docs':>5} {'before ms':>10} {'after, 1st':>11} {'after, later':>13} {'speedup':>8}")
    for r in result["host"]:
        print(f"{r['tokens']:>7} {r['documents']:>5} {r['before_ms']:>10.3f} {r['after_first_layer_ms']:>11.3f} "
              f"{r['after_later_layers_ms']:>13.4f} {r['later_layers_speedup']:>7.0f}x")
    if args.full:
        cuda = args.device.startswith("cuda")
        tokens = args.full_tokens or ([32768] if cuda else [2048])
        result["full"] = full_path_rows(tuple(tokens), args.device, head_dim=args.head_dim or (128 if cuda else 32))
        for r in result["full"]:
            print(f"full path, {r['tokens']} tokens on {r['device']} ({r['backend']}, {r['dtype']}): "
                  f"{r['ms_per_layer']:.3f} ms per layer (fwd+bwd), host {r['host_ms_per_layer']:.3f} ms")
    (args.out / "cp_path.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out / 'cp_path.json'}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
