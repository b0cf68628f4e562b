"""`wlb-opt profile`: measure one transformer block on this device, fit a CostModel, and say
how good it is (paper §3: W_a, W_l "derived from offline profiling").

    wlb-opt profile --model tiny --quick                                 (CPU, well under 3 minutes)
    wlb-opt profile --hf-config config.json --device cuda --out cost.json

Measurements, all with the real kernels (`wlb_opt.kernels.doc_attention`, backend auto) and
the library's own Block at the model's sizes (an `--hf-config` sets the sizes; the HF layer
itself is not timed):

1. Micro-batches whose token count, document count and length spread are drawn
   independently (`cost_fit.sample_micro_batches`) run through one block forward and
   backward, after warm-up runs, median of repeats (on CPU the thread's CPU time, see
   `clock`: on a shared machine wall time measures the other processes too). Non-negative least squares fits the
   named terms per phase (`cost_fit`); a second, independent draw of micro-batches that the
   fit never sees validates it: `validation MAPE: x%, worst: y%`, saved in `meta["validation"]`.
2. The embedding, final norm, LM head and loss per token (added to the linear term).
3. Single attention segments of growing query length over a fixed key range: achieved
   attention throughput by query length, the `eff_q_len` / `eff_scale` table of
   `attention_latency` (paper §4.3, Fig. 10).
4. The memory of one block: bytes kept for backward and the backward's working bytes per
   token and per squared document length, fitted from peaks measured with torch's memory
   statistics (`torch.profiler(profile_memory=True)` on CPU, the CUDA allocator's peak on a
   GPU); saved as the cost model's calibrated `memory_model`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np

from ._optional import progress, require
from .cost import CostModel, attention_tiles
from .cost_args import count, natural
from .cost_fit import (FEATURE_NAMES, FIT_TERMS, Sample, coef_intervals, fit_terms, nnls, sample_micro_batches,
                       validate, validation_line)
from .cost_memory import MemoryModel, dtype_name
from .specs import HardwareSpec, ModelSpec, ParallelSpec

__all__ = ["Sample", "fit_cost_model", "profile_block", "profile_comm", "efficiency_table", "measure_peak_bytes",
           "main"]

QUICK_BUDGET_S = 150.0  # --quick must finish within 3 minutes on CPU; leave room for start-up


MAX_ATTN_BWD_RATIO = 1e3
"""The largest backward / forward attention ratio a CostModel takes (`CostModel.attn_bwd_ratio`)."""


def fit_cost_model(samples: list[Sample], layers: int = 1, tile: int = 128, eff_q_len=None, eff_scale=None,
                   attn_flops_per_pair: float | None = None, meta: dict | None = None,
                   model: ModelSpec | None = None, heldout: list[Sample] | None = None) -> CostModel:
    """Fit the CostModel to measured micro-batches (times per one block: scaled by `layers`).

    `heldout` samples, never used in the fit, give `meta["validation"]` (MAPE and worst
    error of fwd + bwd, percent). `attn_flops_per_pair` (FLOPs per causal pair over all
    layers on one rank) and the fitted attention coefficient give the attention throughput
    that `attention_latency` divides by. A fitted model has no layout and no hardware spec.
    """
    fitted = fit_terms(samples, layers)
    coef = {phase: dict(fitted[phase], comm=0.0) for phase in ("fwd", "bwd")}
    meta = dict(kind="profiled", fit_samples=len(samples), **(meta or {}))
    meta["coef_interval"] = coef_intervals(samples, layers)
    meta["samples"] = [dict(lengths=[int(d) for d in s.lengths], fwd_s=float(s.fwd_s), bwd_s=float(s.bwd_s),
                            heldout=held) for held, group in ((False, samples), (True, heldout or ())) for s in group]
    if heldout:
        meta["validation"] = validate(fitted, heldout, layers)
    flops = attn_flops_per_pair or 1.0
    # attention_latency = tiles * tile^2 * flops / (peak * scale): choose peak so a long
    # segment reproduces the fitted per-pair forward coefficient, and the backward's ratio to it
    fwd_attn, bwd_attn = coef["fwd"]["attn"], coef["bwd"]["attn"]
    bwd_ratio = bwd_attn / fwd_attn if fwd_attn > 0 else float("inf")
    if not 0 < bwd_ratio <= MAX_ATTN_BWD_RATIO:
        # a forward attention term the fit could not see (too short a window for the quadratic
        # term to show): price attention from the backward one at the usual ratio instead
        meta["attn_bwd_ratio_note"] = (f"fitted backward / forward attention ratio {bwd_ratio:.3g} is outside "
                                       f"(0, {MAX_ATTN_BWD_RATIO:g}]: 2.5 used, the forward priced from the backward")
        bwd_ratio = 2.5
        fwd_attn = max(fwd_attn, bwd_attn / bwd_ratio)
    peak = flops / max(fwd_attn, 1e-30)
    kwargs = {}
    if eff_q_len is not None:
        kwargs = dict(eff_q_len=tuple(int(x) for x in eff_q_len), eff_scale=tuple(float(x) for x in eff_scale),
                      efficiency_source="measured by wlb_opt.profile")
    return CostModel(coef=coef, attn_flops_per_pair=float(flops), attn_bwd_ratio=float(bwd_ratio),
                     attn_peak_flops=float(peak), tile=tile, meta=meta, model=model, **kwargs)


# ---------------------------------------------------------------------- measuring
def _sync(device):
    torch = require("torch", "profiling")
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def clock(device):
    """The clock measurements read: on CPU the calling thread's CPU time (`time.thread_time`:
    with one torch thread the kernels run in it, and time the scheduler gives to other
    processes on a shared machine is not counted: the uncontended compute time); on a GPU
    wall time after a synchronize."""
    return time.perf_counter if device.type == "cuda" else time.thread_time


def _time(fn, device, repeats: int, warmup: int = 1) -> float:
    """Median seconds of `repeats` runs of `fn` after `warmup` untimed ones."""
    sync, now = _sync(device), clock(device)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = now()
        fn()
        sync()
        times.append(now() - t0)
    return float(np.median(times))


def measure_peak_bytes(fn, device) -> tuple[int, int]:
    """(bytes still allocated when `fn` returns, peak bytes while it ran), both above what was
    allocated before. CPU: `torch.profiler(profile_memory=True)` (it sees libtorch's
    allocations; tracemalloc does not), the running sum of its allocation and free events in
    time order. CUDA: the caching allocator's statistics."""
    torch = require("torch", "profiling")
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        keep = fn()
        torch.cuda.synchronize()
        retained, peak = torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base
        del keep
        return int(retained), int(peak)
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "99")  # read when the profiler starts: no start/stop lines
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        keep = fn()
    del keep
    return cpu_memory_sums(prof)


def cpu_memory_sums(prof) -> tuple[int, int]:
    """(bytes still allocated at the end, peak bytes) of a `torch.profiler.profile(
    profile_memory=True)` run: the running sum of every CPU allocation (+) and free (-) the
    profiler recorded, in the order they happened. The raw events, not the ops' memory
    columns: an op's net usage, booked when it starts, would already subtract the
    temporaries its children allocate and free later, which then never show in the peak."""
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and str(e.device_type()) == "DeviceType.CPU"]
    running = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        running += event.nbytes()
        peak = max(peak, running)
    return int(running), int(peak)


class _BlockBench:
    """One Block of `model` on a device, with inputs built for given document lengths."""

    def __init__(self, model: ModelSpec, dev, dt):
        torch = require("torch", "profiling")
        from .executor.model import Block

        self.torch, self.model, self.dev, self.dt = torch, model, dev, dt
        self.block = Block(model.hidden, model.heads, model.kv_heads, model.ffn, model.head_dim).to(dev, dt)

    def inputs(self, lengths):
        """x, positions, output gradient and the executor's attention callable (CP attention
        over a one-rank shard plan: what `train_step` runs, its memory behaviour included)."""
        from . import solve_shard
        from .cost import default_cost
        from .executor.train import CPAttend

        torch = self.torch
        lengths = np.asarray(lengths, dtype=np.int64)
        T = int(lengths.sum())
        x = torch.randn(T, self.model.hidden, device=self.dev, dtype=self.dt, requires_grad=True)
        pos = torch.from_numpy(np.concatenate([np.arange(d) for d in lengths])).to(self.dev)
        attend = CPAttend(solve_shard(lengths, 1, "per_seq", default_cost()), None, "auto", None)
        return x, pos, torch.randn_like(x), attend

    def fns(self, lengths):
        x, pos, grad, attend = self.inputs(lengths)

        def fwd():  # with autograd on, as in training (saving activations costs time too)
            return self.block(x, pos, attend)

        def fwd_bwd():
            fwd().backward(grad)
            x.grad = None

        return fwd, fwd_bwd

    def sample(self, lengths, repeats: int, warmup: int) -> Sample:
        """Forward and backward timed apart in each run (median of `repeats` after `warmup`)."""
        x, pos, grad, attend = self.inputs(lengths)
        sync, now = _sync(self.dev), clock(self.dev)
        fwd_s, bwd_s = [], []
        for i in range(warmup + repeats):
            sync()
            t0 = now()
            out = self.block(x, pos, attend)
            sync()
            t1 = now()
            out.backward(grad)
            sync()
            t2 = now()
            x.grad = None
            if i >= warmup:
                fwd_s.append(t1 - t0)
                bwd_s.append(t2 - t1)
        return Sample(lengths, float(np.median(fwd_s)), max(float(np.median(bwd_s)), 1e-9))

    def memory(self, lengths) -> tuple[int, int]:
        """(bytes the block keeps for backward, working bytes of its backward above them) for
        one micro-batch, in the steady state of gradient accumulation: the weight gradients
        exist already (a first backward allocates them) and are added into."""
        fwd, fwd_bwd = self.fns(lengths)
        fwd_bwd()
        stored, _ = measure_peak_bytes(fwd, self.dev)  # the output (next block's input) included
        _, peak = measure_peak_bytes(fwd_bwd, self.dev)
        self.block.zero_grad(set_to_none=True)
        return stored, max(0, peak - stored)


def _calibrate_memory(bench: _BlockBench, window: int, device_name: str, dtype: str,
                      rng: np.random.Generator) -> tuple[MemoryModel, dict]:
    """Fit bytes per token and per squared length of one block to measured peaks."""
    shapes = [np.array([window]), np.full(max(1, window // 16), 16), np.array([window // 2] * 2),
              sample_micro_batches(window, 3, rng)[2]]
    rows, stored, transient = [], [], []
    for lengths in shapes:
        s, t = bench.memory(lengths)
        d = lengths.astype(np.float64)
        rows.append([d.sum(), (d * d).sum()])
        stored.append(s)
        transient.append(t)
    # absolute least squares: a working-memory peak can be 0 (the backward frees as much as
    # it allocates), which a relative weighting would blow up
    A = np.array(rows)
    st_tok, st_sq = nnls(A, np.array(stored, dtype=np.float64))
    tr_tok, tr_sq = nnls(A, np.array(transient, dtype=np.float64))
    hardware = HardwareSpec.preset("cpu" if device_name.startswith("cpu") else "h100")
    base = MemoryModel.analytic(bench.model, ParallelSpec(gpus_per_node=1), hardware, dtype=dtype)
    mem = dataclasses.replace(base, stored_per_token=float(st_tok), stored_per_square=float(st_sq),
                              transient_per_token=float(tr_tok), transient_per_square=float(tr_sq),
                              source=f"calibrated on {device_name} ({dtype}): one block, {len(shapes)} micro-batches, "
                                     + ("torch.profiler(profile_memory=True)" if device_name.startswith("cpu")
                                        else "CUDA allocator peak"))
    measured = [dict(tokens=int(r[0]), sum_sq=int(r[1]), stored=int(s), transient=int(t))
                for r, s, t in zip(rows, stored, transient)]
    return mem, dict(measured=measured, analytic=dict(stored_per_token=round(base.stored_per_token, 1),
                                                      stored_per_square=round(base.stored_per_square, 2)))


def profile_device(device: str | None = None):
    """The torch device to profile on: `device` (default: "cuda" if this machine has one,
    else "cpu"), if this machine has it. Raises ValueError naming the device and what this
    machine offers, before anything is measured (a missing GPU otherwise surfaces as torch's
    error from the first tensor)."""
    torch = require("torch", "profiling")
    name = device or ("cuda" if torch.cuda.is_available() else "cpu")
    here = "cpu" + (f", cuda (cuda:0..cuda:{torch.cuda.device_count() - 1})" if torch.cuda.is_available() else "")
    if not isinstance(name, str):
        raise ValueError(f"device must be a torch device name such as 'cpu' or 'cuda', got {name!r}")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"device {name!r} is not a torch device name; profiling runs on 'cpu' or 'cuda' "
                         f"(this machine: {here})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: this machine has no CUDA device (torch.cuda.is_available() is "
                             f"False); profile on --device cpu, or on a machine with a GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                             f"cuda:0..cuda:{torch.cuda.device_count() - 1}")
    elif dev.type != "cpu":
        raise ValueError(f"device {name!r}: profiling runs on 'cpu' or 'cuda', not {dev.type!r} "
                         f"(this machine: {here})")
    return dev


def profile_block(model: ModelSpec, window: int = 512, n_samples: int = 16, device: str | None = None,
                  dtype: str | None = None, repeats: int = 3, seed: int = 0, show_progress: bool = True,
                  q_lens=(16, 64, 128, 256, 512, 1024), n_holdout: int | None = None, warmup: int = 1,
                  memory: bool = True, budget_s: float | None = None, kv_len: int | None = None) -> CostModel:
    """Measure one block of `model` (full width, one layer) on `device` and fit a CostModel.

    `n_samples` micro-batches of at most `window` tokens are fitted; `n_holdout` more (default
    a third as many, at least 3) validate the fit. With `budget_s`, `window` is halved until
    the projected measuring time fits. `q_lens` and `kv_len` shape the attention-latency
    table (default: queries up to `window` over twice the longest). On CPU keep `model` and
    `window` small ("tiny", 512).
    """
    torch = require("torch", "profiling")
    dev = profile_device(device)
    if kv_len is not None and max(q_lens) > kv_len:  # before anything is measured
        raise ValueError(f"kv_len={kv_len} must be >= the longest q_len ({max(q_lens)}): a query attends to keys "
                         "up to its own position; pass shorter q_lens or a longer kv_len")
    dt = getattr(torch, _TORCH_DTYPES[dtype_name(dtype)]) if dtype else (
        torch.bfloat16 if dev.type == "cuda" else torch.float32)
    n_holdout = max(3, n_samples // 3) if n_holdout is None else n_holdout
    bench = _BlockBench(model, dev, dt)
    rng = np.random.default_rng(seed)
    notes = {}
    if budget_s is not None:
        window, notes = _fit_budget(bench, window, n_samples + n_holdout, repeats, warmup, budget_s)
    fit_mixes = sample_micro_batches(window, n_samples, rng)
    held_mixes = sample_micro_batches(window, n_holdout + 2, np.random.default_rng(seed + 1))[2:]
    samples, heldout = [], []
    for i, lengths in enumerate(progress(fit_mixes + held_mixes, total=len(fit_mixes) + len(held_mixes),
                                         desc="profile micro-batches", enable=show_progress)):
        (samples if i < len(fit_mixes) else heldout).append(bench.sample(lengths, repeats, warmup))

    if kv_len is None:
        q_lens = tuple(q for q in q_lens if q <= window) or (min(16, window),)
    eff_q, eff_s, latency = _efficiency_table(model, dev, dt, q_lens, repeats, kv_len)
    head_fwd, head_bwd = _head_seconds_per_token(model, dev, dt, window, repeats)
    meta = dict(device=str(dev), dtype=str(dt).removeprefix("torch."), window=window, repeats=repeats,
                threads=torch.get_num_threads(), clock="wall" if dev.type == "cuda" else "thread CPU time",
                warmup=warmup, head_s_per_token=dict(fwd=head_fwd, bwd=head_bwd), attention_latency=latency,
                **notes)
    mem = None
    if memory:
        mem, meta["memory_calibration"] = _calibrate_memory(bench, window, str(dev), dtype_name(dt), rng)
    cost = fit_cost_model(samples, layers=model.layers, eff_q_len=eff_q, eff_scale=eff_s,
                          attn_flops_per_pair=4.0 * model.q_dim * model.layers, model=model, meta=meta,
                          heldout=heldout)
    # The embedding, final norm, LM head and loss run once per token (not per layer): add them
    # to the per-token term so micro_batch_cost covers the whole model, as the analytic one does.
    coef = {ph: dict(cost.coef[ph]) for ph in ("fwd", "bwd")}
    coef["fwd"]["linear"] += head_fwd
    coef["bwd"]["linear"] += head_bwd
    # the resampled fits' brackets of the per-token term move with it (the head is measured apart)
    intervals = {ph: {t: list(v) for t, v in cost.meta["coef_interval"][ph].items()} for ph in ("fwd", "bwd")}
    for ph, head in (("fwd", head_fwd), ("bwd", head_bwd)):
        intervals[ph]["linear"] = [v + head for v in intervals[ph]["linear"]]
    return dataclasses.replace(cost, coef=coef, memory_model=mem, meta=dict(cost.meta, coef_interval=intervals))


_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _fit_budget(bench: _BlockBench, window: int, n: int, repeats: int, warmup: int,
                budget_s: float) -> tuple[int, dict]:
    """The largest window (halving from `window`, >= 64) whose projected profile fits `budget_s`:
    n micro-batches, each timed (warmup + repeats) times forward and forward + backward, at
    about half the cost of the largest one (one document of `window` tokens)."""
    start = window
    while True:
        _, fwd_bwd = bench.fns(np.array([window]))
        t = _time(fwd_bwd, bench.dev, 1, 1)
        projected = n * (warmup + repeats) * 1.5 * t * 0.6 + 4 * t
        if projected <= 0.6 * budget_s or window <= 64:
            break
        window //= 2
    notes = dict(budget_s=budget_s, projected_s=round(projected, 1))
    if window != start:
        notes["window_reduced_from"] = start
    return window, notes


def _head_seconds_per_token(model: ModelSpec, dev, dt, window: int, repeats: int) -> tuple[float, float]:
    """Seconds per token of embedding + final norm + LM head + cross-entropy, fwd and bwd."""
    torch = require("torch", "profiling")
    embed = torch.nn.Embedding(model.vocab, model.hidden).to(dev, dt)
    norm = torch.nn.RMSNorm(model.hidden).to(dev, dt)
    head = torch.nn.Linear(model.hidden, model.vocab, bias=False).to(dev, dt)
    tokens = torch.randint(0, model.vocab, (window,), device=dev)
    labels = torch.randint(0, model.vocab, (window,), device=dev)

    def fwd():
        x = embed(tokens)
        return torch.nn.functional.cross_entropy(head(norm(x)).float(), labels)

    def fwd_bwd():
        fwd().backward()

    f = _time(fwd, dev, repeats)
    fb = _time(fwd_bwd, dev, repeats)
    return f / window, max(fb - f, 0.0) / window


def _efficiency_table(model: ModelSpec, dev, dt, q_lens, repeats, kv_len: int | None = None, tile: int = 128):
    """Achieved attention FLOP/s by query length over a fixed key range (default twice the
    longest query; a query is bottom-right aligned, the last q_len rows of the range),
    normalised to the max; and the raw latencies behind it (plain numbers). The FLOP/s count
    the tile-padded pairs, as `CostModel.attention_latency` does (it divides those by the
    table's value): a kernel of constant throughput on whole tiles gives a flat table."""
    torch = require("torch", "profiling")
    from .kernels import doc_attention

    kv = int(kv_len or max(q_lens) * 2)
    if max(q_lens) > kv:
        raise ValueError(f"kv_len={kv} must be >= the longest q_len ({max(q_lens)})")
    k = torch.randn(kv, model.kv_heads, model.head_dim, device=dev, dtype=dt)
    rates, latency = [], []
    for q_len in q_lens:
        q = torch.randn(q_len, model.heads, model.head_dim, device=dev, dtype=dt)
        seg = np.array([[0, q_len, 0, kv]], dtype=np.int32)
        t = _time(lambda: doc_attention(q, k, k, seg), dev, repeats)
        pairs = q_len * kv - q_len * (q_len - 1) / 2
        rates.append(float(attention_tiles(q_len, kv, tile)) * tile * tile / t)
        latency.append(dict(q_len=int(q_len), kv_len=kv, fwd_s=float(t),
                            tflops=round(float(4.0 * model.q_dim * pairs / t / 1e12), 3)))
    rates = np.array(rates)
    scale = np.clip(rates / rates.max(), 1e-3, 1.0)
    q_lens = np.array(q_lens)
    q_lens[0] = 1  # the first bucket covers every shorter query
    return [int(q) for q in q_lens], [float(s) for s in scale], latency


def efficiency_table(cost: CostModel) -> dict[int, float]:
    """{q_len: achieved-efficiency scale} of `cost` as plain ints and floats (3 decimals)."""
    return {int(q): round(float(s), 3) for q, s in zip(cost.eff_q_len, cost.eff_scale)}


def describe_fit(cost: CostModel) -> str:
    """The fitted terms by name and unit, one line per phase (plain numbers), each with the
    range of its resampled fits (`cost_fit.coef_intervals`) when the profile has them."""
    rows = []
    intervals = (cost.meta or {}).get("coef_interval")
    for phase in ("fwd", "bwd"):
        c = cost.coef[phase]
        terms = []
        for term in FIT_TERMS:
            text = f"{term} {c[term]:.4g} s per {FEATURE_NAMES[term].rstrip('s')}"
            if intervals:
                low, high = intervals[phase][term]
                text += f" ({low:.3g} to {high:.3g})"
            terms.append(text)
        rows.append(f"{phase}: " + ", ".join(terms))
    if intervals:
        rows.append("(in brackets: 10th-90th percentile over fits to the samples drawn again with replacement)")
    return "\n".join(rows)


# ---------------------------------------------------------------------- communication
def _comm_worker(rank: int, world: int, port: int, sizes: list, repeats: int, out_file: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        rows = []
        for n_bytes in sizes:
            buf = torch.zeros(max(1, n_bytes // 4), dtype=torch.float32)
            p2p, reduce = [], []
            for i in range(repeats + 1):  # the first round trip is a warm-up
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:  # ping-pong: one way is half the round trip
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                elif rank == 1:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                t1 = time.perf_counter()
                dist.barrier()
                t2 = time.perf_counter()
                dist.all_reduce(buf)
                t3 = time.perf_counter()
                if i:
                    p2p.append((t1 - t0) / 2)
                    reduce.append(t3 - t2)
            rows.append(dict(bytes=int(buf.numel() * 4), p2p_s=float(np.median(p2p)),
                             all_reduce_s=float(np.median(reduce))))
        if rank == 0:
            Path(out_file).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def profile_comm(sizes=(1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24), repeats: int = 5, world: int = 2) -> dict:
    """Point-to-point (send/recv ping-pong, one way) and all-reduce seconds by message size
    between `world` gloo ranks on this machine, each fitted as latency + bytes x s_per_byte
    (non-negative least squares). Plain numbers: {"p2p": {...}, "all_reduce": {...}, "points": [...]}."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "comm.json")
        mp.spawn(_comm_worker, args=(world, port, [int(x) for x in sizes], repeats, out), nprocs=world, join=True)
        rows = json.loads(Path(out).read_text())
    A = np.array([[1.0, r["bytes"]] for r in rows])
    result = dict(world=world, backend="gloo", points=rows)
    for kind in ("p2p", "all_reduce"):
        t = np.array([r[f"{kind}_s"] for r in rows])
        w = 1.0 / t
        latency, per_byte = nnls(A * w[:, None], t * w)
        result[kind] = dict(latency_s=float(latency), s_per_byte=float(per_byte))
    return result


def comm_seconds(comm: dict, kind: str, n_bytes) -> np.ndarray:
    """Seconds of a `kind` ("p2p" or "all_reduce") message of `n_bytes` under a `profile_comm` fit."""
    fit = comm[kind]
    return fit["latency_s"] + fit["s_per_byte"] * np.asarray(n_bytes, dtype=np.float64)


# ---------------------------------------------------------------------- command line
DEFAULT_OUT = "results/profile/cost.json"
"""Where `wlb-opt profile` saves the fitted model without `--out`: a path the repository ignores."""


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="wlb-opt profile", description="Measure one block here, fit a CostModel, "
                                "validate it on held-out micro-batches, calibrate the memory model.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="ModelSpec preset: tiny, 550m, 7b, 30b, 70b (default tiny)")
    src.add_argument("--hf-config", metavar="CONFIG.json", help="a Hugging Face config.json: profile the "
                     "library's block at its sizes (ModelSpec.from_hf_config)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--quick", action="store_true", help=f"fewer samples and repeats, window shrunk to fit "
                   f"{QUICK_BUDGET_S:.0f} s of measuring (within 3 minutes on CPU)")
    p.add_argument("--window", type=count, default=None, help="max tokens per measured micro-batch (default 512 on "
                   "CPU, 16384 on GPU)")
    p.add_argument("--samples", type=count, default=None, help="fitted micro-batches, >= 4 (default 24; quick 12)")
    p.add_argument("--holdout", type=count, default=None, help="held-out micro-batches (default samples / 3, >= 3)")
    p.add_argument("--repeats", type=count, default=None, help="timed runs per measurement, median kept "
                   "(default 5; quick 3)")
    p.add_argument("--warmup", type=natural, default=1, help="untimed runs before each measurement (default 1)")
    p.add_argument("--q-lens", default=None, help="comma list of query lengths of the attention-latency table "
                   "(default 16,64,...,1024, capped at --window)")
    p.add_argument("--kv-len", type=count, default=None, help="key range of the attention-latency table "
                   "(default twice the longest query; the default queries are then those up to it)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory calibration")
    p.add_argument("--comm", action="store_true", help="also profile send/recv and all-reduce between 2 gloo "
                   "ranks on this machine (saved in meta['comm'])")
    p.add_argument("--threads", type=count, default=None, help="torch CPU threads (default 1 on CPU: a shared "
                   "machine's other load stalls multi-threaded kernels; untouched on GPU)")
    p.add_argument("--seed", type=natural, default=0, help="sampling seed (default 0)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"where to save the fitted CostModel (default {DEFAULT_OUT}, "
                   "under the ignored results/ folder, so that a run never overwrites a tracked file)")
    args = p.parse_args(argv)
    try:
        if args.hf_config:
            try:
                config = json.loads(Path(args.hf_config).read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"--hf-config {args.hf_config}: not a JSON config ({exc})") from None
            spec = ModelSpec.from_hf_config(config)
        else:
            spec = ModelSpec.preset(args.model or "tiny")
        dtype = dtype_name(args.dtype) if args.dtype else None
    except (ValueError, TypeError, OSError) as exc:
        p.error(str(exc))
    torch = require("torch", "profiling")
    on_gpu = profile_device(args.device).type == "cuda"  # a ValueError (one line, exit 2) if this machine lacks it
    if args.threads is not None or not on_gpu:
        torch.set_num_threads(args.threads or 1)
    samples = args.samples or (12 if args.quick else 24)
    try:
        q_lens = tuple(int(x) for x in args.q_lens.split(",")) if args.q_lens else None
    except ValueError:
        p.error(f"--q-lens must be a comma list of integers, got {args.q_lens!r}")
    if q_lens is not None and (not q_lens or min(q_lens) < 1 or list(q_lens) != sorted(q_lens)):
        p.error(f"--q-lens must be increasing positive integers, got {args.q_lens!r}")
    if samples < 4:
        p.error(f"--samples must be >= 4 (one per fitted term), got {samples}")
    window = args.window or (16384 if on_gpu else 512)
    if window < 16:  # before anything is timed: micro-batches of one document could not separate the terms
        p.error(f"--window must be >= 16 tokens (micro-batches of several documents), got {window}")
    if q_lens is not None and args.kv_len is None and max(q_lens) > window:
        p.error(f"--q-lens {args.q_lens} reaches past --window {window} (the default key range is twice the "
                "longest query within the window); give shorter --q-lens, a longer --window, or --kv-len")
    if args.holdout is not None and args.holdout < 3:
        p.error(f"--holdout must be >= 3 (held-out micro-batches for the validation), got {args.holdout}")
    if args.kv_len is not None and q_lens is not None and max(q_lens) > args.kv_len:
        p.error(f"--kv-len {args.kv_len} must be >= the longest --q-lens ({max(q_lens)})")
    if q_lens is None:
        q_lens = (16, 64, 128, 256, 512) if args.quick and not on_gpu else (16, 64, 128, 256, 512, 1024)
        if args.kv_len is not None:  # the default queries that fit the key range
            q_lens = tuple(q for q in q_lens if q <= args.kv_len) or (args.kv_len,)
    t0 = time.perf_counter()
    cost = profile_block(spec, window=window, n_samples=samples,
                         n_holdout=args.holdout, device=args.device, dtype=dtype,
                         repeats=args.repeats or (3 if args.quick else 5), warmup=args.warmup, seed=args.seed,
                         q_lens=q_lens,
                         kv_len=args.kv_len, memory=not args.no_memory,
                         budget_s=QUICK_BUDGET_S if args.quick else None)
    if args.comm:
        cost = dataclasses.replace(cost, meta=dict(cost.meta, comm=profile_comm()))
    from ._provenance import provenance

    # the command line and the machine, for `wlb-opt bench report`
    cost = dataclasses.replace(cost, meta=dict(cost.meta, provenance=provenance("profile", argv, ("wlb-opt",))))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    cost.save(args.out)
    meta = cost.meta
    print(f"profiled {spec.name}: hidden {spec.hidden}, {spec.layers} layers, {spec.heads} heads "
          f"({spec.kv_heads} KV, head dim {spec.head_dim}), ffn {spec.ffn} on {meta['device']} {meta['dtype']}, "
          f"micro-batches of <= {meta['window']} tokens" + (
              f" (reduced from {meta['window_reduced_from']} to fit --quick)" if "window_reduced_from" in meta else ""))
    print(describe_fit(cost))
    print("attention efficiency by q_len:", efficiency_table(cost))
    print(f"attention latency over {meta['attention_latency'][0]['kv_len']} keys (fwd, ms / TFLOP/s): " + ", ".join(
        f"{r['q_len']}: {1e3 * r['fwd_s']:.3g} / {r['tflops']:.3g}" for r in meta["attention_latency"]))
    if cost.memory_model is not None:
        m = cost.memory_model
        print(f"memory per layer: stored {m.stored_per_token:.0f} B/token + {m.stored_per_square:.2f} B/d^2, "
              f"backward working {m.transient_per_token:.0f} B/token + {m.transient_per_square:.2f} B/d^2 "
              f"({m.source})")
    if "comm" in meta:
        for kind in ("p2p", "all_reduce"):
            fit = meta["comm"][kind]
            print(f"{kind} (2 gloo ranks): {1e6 * fit['latency_s']:.0f} us + {fit['s_per_byte'] * 1e9:.3f} ns/byte")
    print(f"{validation_line(meta['validation'])} ({meta['validation']['n']} held-out micro-batches)")
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")
    return 0
