"""`wlb-opt bench cp-path`: host time of CP attention's index and copy path, per layer.

    wlb-opt bench cp-path --out results/cp_path                    (CPU, about 20 s)
    wlb-opt bench cp-path --device cuda --full --out results/cp_path   (one GPU: the device hot path)

CP attention needs, for every micro-batch, the permutation that restores packed order after
the K/V all-gather. Built on every call, it costs a numpy sort to validate the shard, an
argsort, and a pageable host-to-device copy (timed as "before": `_before`, the path as it
was built on every call; the library's `packed_order_index` now uploads pinned); the
executor builds it once per ShardPlan and device (`cp_context`), uploads it pinned and
non-blocking, and every later layer reuses it ("after"). For packed micro-batches of 32K and 128K
tokens (default distribution, documents of at most 16K tokens, per_doc shards of CP = 4,
rank 0) this times, per call: before; after, first layer (the build); after, later layers.
The work is host work, so each is timed in CPU time of this process (``time.process_time``)
and in wall time: every repeat times a batch of calls long enough for the clocks (at least
about a millisecond), the three measurements interleaved within each repeat, and the figures
are medians over `--repeats` repeats. The speedup is a ratio of CPU times from one run; the
load average at start and end is stored beside the wall times. The attention is not timed.

`--full` also runs the whole per-layer hot path (gather, attention forward and backward,
reduce-scatter) through `context_parallel_attention` in a one-rank process group (NCCL on
CUDA, gloo on CPU) and times it with CUDA events on a GPU (CPU time and wall time on CPU,
medians over the layers), at cp = 1.
"""
from __future__ import annotations

import argparse
import json
import os
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


def _clocks() -> tuple[float, float]:
    return time.process_time(), time.perf_counter()


def _batch_size(fn, sync=None, target_s: float = 1e-3) -> int:
    """Calls per timed batch: enough for about `target_s` of CPU time (at least 1)."""
    n = 1
    while True:
        c0 = time.process_time()
        for _ in range(n):
            fn()
        if sync is not None:
            sync()
        if time.process_time() - c0 >= target_s or n >= 1 << 16:
            return n
        n *= 4


def interleaved_medians(fns: dict, repeats: int, sync=None) -> dict:
    """{name: (CPU ms per call, wall ms per call)}: medians over `repeats` rounds, each round
    timing one batch of every function in turn (so load changes hit all of them alike)."""
    sizes = {name: _batch_size(fn, sync) for name, fn in fns.items()}
    samples: dict = {name: ([], []) for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            c0, w0 = _clocks()
            for _ in range(sizes[name]):
                fn()
            if sync is not None:
                sync()
            c1, w1 = _clocks()
            samples[name][0].append((c1 - c0) * 1e3 / sizes[name])
            samples[name][1].append((w1 - w0) * 1e3 / sizes[name])
    return {name: (float(statistics.median(cpu)), float(statistics.median(wall)))
            for name, (cpu, wall) in samples.items()}


def _before(shard, device):
    """The index as it was built on every call, before `cp_context`: the shard validated by a
    sort, the argsort, and a pageable (blocking) host-to-device copy."""
    import torch

    from ..executor.cp_attention import packed_order

    return torch.from_numpy(packed_order(shard)).to(device)


def host_rows(tokens=(32768, 131072), cp: int = 4, device: str = "cpu", repeats: int = 20, seed: int = DEFAULT_SEED):
    import torch

    from ..executor.cp_attention import CPContext, cp_context

    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else None
    rows = []
    for n in tokens:
        lengths = micro_batch(n, seed)
        shard = solve_shard(lengths, cp, "per_doc")
        cp_context(shard, None, device, rank=0, world=cp)  # built once, as by the first layer
        load = os.getloadavg()
        ms = interleaved_medians({
            "before": lambda: _before(shard, device),
            "after_first_layer": lambda: CPContext(shard, 0, cp, torch.device(device)),
            "after_later_layers": lambda: cp_context(shard, None, device, rank=0, world=cp),
        }, repeats, sync)
        row = dict(tokens=n, documents=len(lengths), cp=cp, device=device)
        for name, (cpu, wall) in ms.items():
            row[f"{name}_cpu_ms"] = cpu
        for name, (cpu, wall) in ms.items():
            row[f"{name}_wall_ms"] = wall
        later = row["after_later_layers_cpu_ms"]
        row["later_layers_speedup_cpu"] = row["before_cpu_ms"] / later if later > 0 else None
        row["load_average"] = " ".join(f"{x:.1f}" for x in (*load, *os.getloadavg()))
        rows.append(row)
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
        # NCCL binds the group to one device: "cuda" alone names none, so take the current one
        device_id = None
        if cuda:
            device_id = torch.device(device)
            if device_id.index is None:
                device_id = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60), device_id=device_id)
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
            cpu_ms = None
        else:
            cpu, wall = [], []
            for _ in range(layers):
                c0, w0 = _clocks()
                layer()
                c1, w1 = _clocks()
                cpu.append((c1 - c0) * 1e3)
                wall.append((w1 - w0) * 1e3)
            cpu_ms = float(statistics.median(cpu))
            host_ms = device_ms = float(statistics.median(wall))
        rows.append(dict(tokens=n, documents=len(lengths), device=device, layers=layers,
                         ms_per_layer=device_ms, host_ms_per_layer=host_ms, cpu_ms_per_layer=cpu_ms,
                         load_average=" ".join(f"{x:.1f}" for x in os.getloadavg()),
                         backend=dist.get_backend(), dtype=str(dtype)))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt bench cp-path", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/cp_path"), help="folder for cp_path.json")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--tokens", type=count, nargs="+", default=[32768, 131072], help="micro-batch sizes (tokens)")
    p.add_argument("--repeats", type=count, default=20, help="timed rounds per measurement (default 20)")
    p.add_argument("--full", action="store_true", help="also time the whole hot path at cp = 1")
    p.add_argument("--full-tokens", type=count, nargs="+", default=None,
                   help="micro-batch sizes of --full (default: 32768 on CUDA, 2048 on CPU)")
    p.add_argument("--head-dim", type=count, default=None, help="--full head dim (default 128 on CUDA, 32 on CPU)")
    args = p.parse_args(argv)
    if not args.full and (args.full_tokens is not None or args.head_dim is not None):
        p.error("--full-tokens and --head-dim size the --full run: give --full too")
    from ..profile import profile_device
    try:
        profile_device(args.device)  # a device this machine lacks: one line, before any folder is made
    except ValueError as exc:
        p.error(str(exc))
    args.out.mkdir(parents=True, exist_ok=True)
    result = dict(provenance=provenance("cp_path", argv), host=host_rows(tuple(args.tokens), device=args.device, repeats=args.repeats))
    (args.out / "cp_path.json").write_text(json.dumps(result, indent=1))  # kept if --full times out
    print(f"{'tokens':>7} {'docs':>5} {'clock':>5} {'before ms':>10} {'after, 1st':>11} {'after, later':>13} "
          f"{'load avg':>30}")
    for r in result["host"]:
        for clock in ("cpu", "wall"):
            print(f"{r['tokens']:>7} {r['documents']:>5} {clock:>5} {r[f'before_{clock}_ms']:>10.3f} "
                  f"{r[f'after_first_layer_{clock}_ms']:>11.3f} {r[f'after_later_layers_{clock}_ms']:>13.4f} "
                  f"{r['load_average']:>30}")
        print(f"{'':>13} later layers: {r['later_layers_speedup_cpu']:,.0f}x less CPU time than before")
    if args.full:
        cuda = args.device.startswith("cuda")
        tokens = args.full_tokens or ([32768] if cuda else [2048])
        result["full"] = full_path_rows(tuple(tokens), args.device, head_dim=args.head_dim or (128 if cuda else 32))
        for r in result["full"]:
            cpu = "" if r["cpu_ms_per_layer"] is None else f", CPU {r['cpu_ms_per_layer']:.3f} ms"
            print(f"full path, {r['tokens']} tokens on {r['device']} ({r['backend']}, {r['dtype']}): "
                  f"{r['ms_per_layer']:.3f} ms per layer (fwd+bwd), host {r['host_ms_per_layer']:.3f} ms{cpu} "
                  f"(load average {r['load_average']})")
    (args.out / "cp_path.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out / 'cp_path.json'}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
