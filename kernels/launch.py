"""Launchers for the Triton kernels: block configs, bucketed autotuning, index upload.

The kernels' grids come from host-built indices whose shape depends on the block sizes
(segments.py), so ``triton.autotune`` (which only re-runs one grid) does not fit. Instead
each launcher picks its config from a small list by timing it once per bucket key
``(kernel, device, dtype, head_dim, group, next_pow2(Tq), next_pow2(Tk))``: a new length in
the same bucket reuses the choice and the compiled kernel. Under ``TRITON_INTERPRET=1`` or
with ``WLB_KERNEL_AUTOTUNE=0`` the first config that compiles is used (pinned, as the
tests need). bf16 under the interpreter is computed in fp32: the interpreter's ``tl.dot``
multiplies bf16 bit patterns.

Indices for one segment table are uploaded to the device in one copy and cached, so the
backward pass of a step reuses the forward's upload. The cache key is (BLAKE2b digest of the
table's bytes, index kind, block_m, block_n, device); it holds the ``_INDEX_CACHE_SIZE``
(16) most recently used tables (one index each; a CP rank's micro-batch needs one forward
and one dK/dV index). Every part of an uploaded buffer starts on a 16-byte boundary, the
alignment Triton specialises pointer arguments on, so a new table (a new length) never
changes a kernel's specialisation key and never recompiles. On CUDA the host copy is
pinned and the upload non-blocking, so it does not synchronise the stream.

Pinning configs across ranks: the tuned choices are a dict keyed by (kernel, dtype, head
dim, GQA group, query and key size buckets), see ``export_tuned``. CP ranks that must run
identical kernels (bitwise-equal results) either set ``WLB_KERNEL_AUTOTUNE=0`` (first
candidate everywhere), or tune on one rank, ``export_tuned()`` to JSON, and point every
rank at the file with ``WLB_KERNEL_CONFIGS=path.json`` (or call ``load_tuned``); a pinned
bucket is never re-tuned.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from . import segments as _seg
from . import work_model as _work


@dataclass(frozen=True, slots=True)
class BlockConfig:
    """Tile shape and launch parameters of one kernel."""

    block_m: int
    """Query rows per block (>= 16: the GPU's minimum ``tl.dot`` size)."""
    block_n: int
    """Key rows per block (>= 16)."""
    num_warps: int = 4
    num_stages: int = 2


# Candidates per kernel, best guess first, for head_dim 128 (False) and <= 64 (True), on
# H100/H200 in fp16/bf16. Chosen with aot_check.py (shared memory, registers, stack) since no
# GPU was at hand: the head-dim-128 firsts compile with no or small register spills. The
# interpreter uses _INTERPRET_CONFIG unless a test overrides it.
_GPU_CONFIGS: dict[str, dict[bool, list[BlockConfig]]] = {
    "fwd": {
        False: [BlockConfig(128, 64, 8, 3), BlockConfig(64, 128, 8, 2), BlockConfig(128, 128, 8, 2),
                BlockConfig(64, 64, 4, 3)],
        True: [BlockConfig(128, 64, 4, 3), BlockConfig(128, 128, 8, 3), BlockConfig(64, 64, 4, 3),
               BlockConfig(64, 32, 4, 2)],
    },
    "dq": {
        False: [BlockConfig(128, 64, 8, 2), BlockConfig(64, 64, 8, 2), BlockConfig(64, 32, 4, 3),
                BlockConfig(128, 32, 8, 2)],
        True: [BlockConfig(128, 64, 4, 3), BlockConfig(128, 32, 4, 3), BlockConfig(64, 64, 4, 2),
               BlockConfig(64, 32, 4, 2)],
    },
    "dkdv": {
        False: [BlockConfig(32, 128, 8, 2), BlockConfig(64, 128, 8, 2), BlockConfig(32, 64, 8, 2),
                BlockConfig(16, 128, 8, 3)],
        True: [BlockConfig(64, 128, 8, 2), BlockConfig(32, 128, 4, 3), BlockConfig(32, 64, 4, 2),
               BlockConfig(64, 64, 4, 2)],
    },
}
# The atomic-dQ dK/dV kernel (deterministic=False) holds one more accumulator block: same
# candidates, tuned apart; forced_configs(dkdv=...) pins both.
_GPU_CONFIGS["dkdv_atomic"] = _GPU_CONFIGS["dkdv"]
_BASE_KERNEL = {"dkdv_atomic": "dkdv"}
_INTERPRET_CONFIG = BlockConfig(32, 32, 4, 1)
_FORCED: dict[str, BlockConfig] = {}
_TUNED: dict[tuple, BlockConfig] = {}
_INDEX_CACHE: OrderedDict[tuple, dict[str, torch.Tensor]] = OrderedDict()
_INDEX_CACHE_SIZE = 16


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _autotune_enabled() -> bool:
    return not interpreting() and os.environ.get("WLB_KERNEL_AUTOTUNE", "1") not in ("", "0")


_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_PINNED_FROM_ENV = False


def _bucket(full_key: tuple) -> str:
    """A device-independent text key: kernel/dtype/head_dim/group/q_bucket/k_bucket."""
    kernel, _device, dtype, head_dim, group, q_bucket, k_bucket = full_key
    return f"{kernel}/{_DTYPE_NAMES.get(dtype, str(dtype))}/{head_dim}/{group}/{q_bucket}/{k_bucket}"


def export_tuned() -> dict[str, list[int]]:
    """The configs chosen so far, as JSON-ready {bucket: [block_m, block_n, warps, stages]}."""
    return {_bucket(k): [c.block_m, c.block_n, c.num_warps, c.num_stages] for k, c in _TUNED.items()}


_PINNED: dict[str, BlockConfig] = {}


_KERNELS = ("fwd", "dq", "dkdv", "dkdv_atomic")


def _is_pow2(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1 and value & (value - 1) == 0


def _bucket_problem(bucket) -> str | None:
    """What is wrong with a pinned bucket's text key (None: one `_bucket` can make)."""
    parts = bucket.split("/") if isinstance(bucket, str) else []
    if len(parts) != 6:
        return "is not 'kernel/dtype/head_dim/group/q/k'"
    kernel, dtype, *numbers = parts
    if kernel not in _KERNELS:
        return f"names kernel {kernel!r}; valid: {_KERNELS}"
    if dtype not in _DTYPE_NAMES.values():
        return f"names dtype {dtype!r}; valid: {sorted(_DTYPE_NAMES.values())}"
    if not all(n.isdigit() for n in numbers) or not all(_is_pow2(int(n)) for n in numbers[2:]) or not int(numbers[1]):
        return ("needs a head dim, a GQA group >= 1 and power-of-two q and k buckets (the next power of two of the "
                f"lengths), got {'/'.join(numbers)}")
    return None


def load_tuned(configs: dict | str | os.PathLike) -> None:
    """Pin buckets to configs (a dict from `export_tuned`, or the path of its JSON file).
    Raises ValueError for a bucket no launch could match (a mistyped key would be ignored,
    and that rank would autotune) or a config no kernel can run: block sizes are powers of
    two >= 16, warps a power of two, stages >= 1, all integers."""
    if not isinstance(configs, dict):
        configs = json.loads(open(configs).read())
    pinned = {}
    for bucket, cfg in configs.items():
        problem = _bucket_problem(bucket)
        if problem is not None:
            raise ValueError(f"pinned config {bucket!r} {problem}")
        if (not isinstance(cfg, (list, tuple)) or len(cfg) != 4 or not all(_is_pow2(x) for x in cfg[:3])
                or min(cfg[:2]) < 16 or isinstance(cfg[3], bool) or not isinstance(cfg[3], int) or cfg[3] < 1):
            raise ValueError(f"pinned config {bucket!r}: {cfg!r} is not [block_m, block_n, num_warps, num_stages] "
                             "(block sizes powers of two >= 16, num_warps a power of two, num_stages >= 1)")
        pinned[bucket] = BlockConfig(*cfg)
    _PINNED.update(pinned)  # all or nothing


def _pinned(full_key: tuple) -> BlockConfig | None:
    global _PINNED_FROM_ENV
    if not _PINNED_FROM_ENV:
        _PINNED_FROM_ENV = True
        if os.environ.get("WLB_KERNEL_CONFIGS"):
            load_tuned(os.environ["WLB_KERNEL_CONFIGS"])
    return _PINNED.get(_bucket(full_key)) if _PINNED else None


@contextlib.contextmanager
def forced_configs(**configs: BlockConfig | tuple[int, int]) -> Iterator[None]:
    """Pin kernels to configs, e.g. ``forced_configs(fwd=(16, 16), dkdv=(32, 64))`` (tests)."""
    unknown = set(configs) - set(_GPU_CONFIGS)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}; valid: {sorted(_GPU_CONFIGS)}")
    saved = dict(_FORCED)
    for name, cfg in configs.items():
        _FORCED[name] = cfg if isinstance(cfg, BlockConfig) else BlockConfig(*cfg)
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(saved)


def _forced(kernel: str) -> BlockConfig | None:
    return _FORCED.get(kernel) or _FORCED.get(_BASE_KERNEL.get(kernel, kernel))


def _candidates(kernel: str, head_dim: int) -> list[BlockConfig]:
    if _forced(kernel) is not None:
        return [_forced(kernel)]
    if interpreting():
        return [_INTERPRET_CONFIG]
    return _GPU_CONFIGS[kernel][head_dim <= 64]


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _time_ms(fn: Callable[[], None], reps: int = 3) -> float:
    """Milliseconds per call of `fn` on the current stream. Only this stream is waited on,
    never the whole device: tuning runs inside a pipeline step, where the interleaved
    schedule has receives posted on other streams that wait for this rank's later work (a
    `torch.cuda.synchronize()` there would wait on them forever)."""
    stream = torch.cuda.current_stream()
    fn()  # compile and warm up
    stream.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(reps):
        fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / reps


def _is_resource_error(exc: Exception) -> bool:
    name = type(exc).__name__
    return "OutOfResources" in name or "out of resource" in str(exc).lower()


def run_tuned(kernel: str, key: tuple, head_dim: int, launch: Callable[[BlockConfig], None]) -> BlockConfig:
    """Run ``launch(config)`` with the bucket's chosen config, tuning the bucket on a miss.

    Every candidate computes the same result (outputs are fully overwritten), so the timing
    runs are harmless. Configs that do not fit the chip (out of shared memory) are skipped.
    """
    cands = _candidates(kernel, head_dim)
    full_key = (kernel,) + key
    forced = _forced(kernel) is not None
    chosen = None
    if not forced:
        chosen = _TUNED.get(full_key) or (None if interpreting() else _pinned(full_key))
    if chosen is not None:
        launch(chosen)
        return chosen
    tune = _autotune_enabled() and len(cands) > 1
    best, best_ms, errors = None, math.inf, []
    for cfg in cands:
        try:
            ms = _time_ms(lambda: launch(cfg)) if tune else (launch(cfg) or 0.0)
        except Exception as exc:  # noqa: BLE001 - only resource errors are skipped
            if not _is_resource_error(exc):
                raise
            errors.append(f"{cfg}: {exc}")
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
        if not tune:
            break
    if best is None:
        raise RuntimeError(f"no {kernel} config fits this device: " + "; ".join(errors))
    if tune:
        launch(best)  # leave the best config's result in the outputs
    if not forced:
        _TUNED[full_key] = best
    return best


def tune_key(q: torch.Tensor, k: torch.Tensor) -> tuple:
    return (str(q.device), q.dtype, q.shape[-1], q.shape[1] // k.shape[1],
            _pow2(q.shape[0]), _pow2(k.shape[0]))


INDEX_ALIGN = 4  # int32 elements = 16 bytes: Triton specialises pointers on 16-byte alignment


def pack_index(parts: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, int]]:
    """One flat int32 buffer holding every part, each starting at a multiple of 16 bytes.

    Returns (buffer, element offset of each part). The tail is padded too, so that no part
    ends at the buffer's end (a masked load may form, though never use, a pointer past it).
    """
    offsets, pos = {}, 0
    for name, arr in parts.items():
        offsets[name] = pos
        pos += -(-arr.size // INDEX_ALIGN) * INDEX_ALIGN
    flat = np.zeros(pos + INDEX_ALIGN, dtype=np.int32)
    for name, arr in parts.items():
        flat[offsets[name]:offsets[name] + arr.size] = arr.reshape(-1)
    return flat, offsets


def table_digest(seg: np.ndarray) -> bytes:
    """BLAKE2b digest of a segment table's bytes: the cache key of everything built from it."""
    return hashlib.blake2b(np.ascontiguousarray(seg).tobytes(), digest_size=16).digest()


def device_index(seg: np.ndarray, kind: str, cfg: BlockConfig, device: torch.device,
                 max_blocks: int | None = None) -> dict:
    """Upload (and cache) the forward ("fwd", split-K at `max_blocks` key tiles) or the
    transposed ("dkdv") index for a table. Returns its device tensors ("tiles", and for a
    split forward index "targets") and host facts ("n_chunks")."""
    key = (table_digest(seg), kind, cfg.block_m, cfg.block_n, max_blocks, str(device))
    hit = _INDEX_CACHE.get(key)
    if hit is not None:
        _INDEX_CACHE.move_to_end(key)
        return hit
    info = {}
    if kind == "fwd":
        tiles, n_chunks, targets = _seg.forward_index(seg, cfg.block_m, cfg.block_n, max_blocks)
        parts = {"tiles": tiles}
        if len(targets):
            parts["targets"] = targets.astype(np.int32)
        info["n_chunks"] = n_chunks
    else:
        tiles, entries = _seg.key_tiles(seg, cfg.block_m, cfg.block_n)
        parts = {"tiles": tiles, "entries": entries}
    if "targets" in parts:  # rows of the split tiles that exist, and where they go (host side: no sync)
        pos = np.flatnonzero(parts["targets"] >= 0)
        parts["split_pos"], parts["split_rows"] = pos.astype(np.int32), parts["targets"][pos].astype(np.int32)
    flat, offsets = pack_index(parts)
    host = torch.from_numpy(flat)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()  # a pinned source lets the copy run asynchronously
        buf = host.to(device, non_blocking=True)
    else:
        buf = host.to(device)
    out = {name: buf[offsets[name]: offsets[name] + arr.size].view(arr.shape) for name, arr in parts.items()}
    for name in ("split_pos", "split_rows"):  # index tensors for the host-side combine
        if name in out:
            out[name] = out[name].long()
    out.update(info)
    _INDEX_CACHE[key] = out
    if len(_INDEX_CACHE) > _INDEX_CACHE_SIZE:
        _INDEX_CACHE.popitem(last=False)
    return out


_SPLIT_MEMO: OrderedDict[tuple, int | None] = OrderedDict()


def forward_split(seg: np.ndarray, cfg: BlockConfig, heads: int, n_sm: int) -> int | None:
    """`max_blocks` of the forward/dQ index for this table (kernels/work_model.py): None when
    the unsplit launch is within 5% of the ideal on `n_sm` SMs. Memoised per table."""
    key = (table_digest(seg), cfg.block_m, cfg.block_n, heads, n_sm)
    if key not in _SPLIT_MEMO:
        work = _work.forward_work(seg, cfg.block_m, cfg.block_n)
        _SPLIT_MEMO[key] = _work.choose_forward_split(work, heads, n_sm)
        if len(_SPLIT_MEMO) > 4 * _INDEX_CACHE_SIZE:
            _SPLIT_MEMO.popitem(last=False)
    return _SPLIT_MEMO[key]


def _split_buffers(index: dict, block_m: int, heads: int, d: int, device, with_lse: bool):
    """Zeroed fp32 partial outputs [slots, block_m, heads, d] (and lse at -inf) of a split index."""
    if "targets" not in index:
        return None, None
    slots = index["targets"].numel() // block_m * index["n_chunks"]
    part = torch.zeros((slots, block_m, heads, d), dtype=torch.float32, device=device)
    lse = torch.full((slots, block_m, heads), float("-inf"), dtype=torch.float32, device=device) if with_lse else None
    return part, lse


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 on H100/H200 SXM; 132 assumed off-GPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 132


def dkdv_split(seg: np.ndarray, index: dict, cfg: BlockConfig, kv_heads: int, group: int, n_sm: int) -> int:
    """Shares the dK/dV kernel splits a GQA group's query heads into for this table: the
    smallest whose modelled launch (kernels/work_model.py, one program per SM) is within 5%
    of the ideal. Computed once per (table, config, heads, SMs) and kept with the index."""
    memo = index.setdefault("_split", {})
    key = (kv_heads, group, n_sm)
    if key not in memo:
        work = _work.dkdv_work(seg, cfg.block_m, cfg.block_n)
        memo[key] = _work.choose_dkdv_split(work, kv_heads, group, n_sm)
    return memo[key]


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact IEEE products (the GPU would default to TF32 and lose ~3 digits).
    return "ieee" if dtype == torch.float32 else "tf32"


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: np.ndarray, scale: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """out [Tq, Hq, D] (zeros on uncovered rows), lse [Hq, Tq] fp32 natural log (-inf there)."""
    from . import triton_kernels as tk

    n_q, hq, d = q.shape
    out = torch.zeros_like(q)
    lse = torch.full((hq, n_q), float("-inf"), dtype=torch.float32, device=q.device)
    if len(seg) == 0 or n_q == 0:
        return out, lse
    group = hq // k.shape[1]
    n_sm = sm_count(q.device)
    state: dict = {}

    def launch(cfg: BlockConfig) -> None:
        index = device_index(seg, "fwd", cfg, q.device, forward_split(seg, cfg, hq, n_sm))
        tiles = index["tiles"]
        o_part, l_part = _split_buffers(index, cfg.block_m, hq, d, q.device, with_lse=True)
        tk._fwd_kernel[(tiles.shape[0] * hq,)](
            q, k, v, out, lse, o_part if o_part is not None else lse, l_part if l_part is not None else lse, tiles,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), n_q, hq, scale * tk.LOG2E,
            GROUP=group, HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            PRECISION=_precision(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        state.update(index=index, o_part=o_part, l_part=l_part, block_m=cfg.block_m)

    run_tuned("fwd", tune_key(q, k), d, launch)
    if state["o_part"] is not None:  # combine the key chunks of split tiles, in chunk order
        index, c = state["index"], state["index"]["n_chunks"]
        o = state["o_part"].view(-1, c, state["block_m"], hq, d)
        parts_lse = state["l_part"].view(-1, c, state["block_m"], hq)
        total = torch.logsumexp(parts_lse, dim=1)
        weight = torch.exp(parts_lse - total.unsqueeze(1)).nan_to_num(0.0)  # -inf - -inf: no keys
        combined = (weight.unsqueeze(-1) * o).sum(1).reshape(-1, hq, d)
        pos, rows = index["split_pos"], index["split_rows"]
        out[rows] = combined[pos].to(out.dtype)
        lse[:, rows] = total.reshape(-1, hq)[pos].T
    return out, lse


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, dlse: torch.Tensor | None, seg: np.ndarray, scale: float,
             deterministic: bool = True,
             on_dkdv: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (zeros outside every segment).

    ``on_dkdv(dk, dv)``, if given, is called as soon as dK and dV are final, before the dQ
    kernel is launched (deterministic mode): CP attention starts its dK/dV reduce-scatter
    there, so that the collective overlaps the dQ kernel. With ``deterministic=False`` dQ
    comes out of the dK/dV kernel itself, so the hook runs after both.

    deterministic (default): a dQ kernel and a dK/dV kernel, no atomics, seven matmuls per
    block pair, bitwise reproducible for one config. ``deterministic=False``: the dK/dV
    kernel also adds dQ = dS K into an fp32 buffer with atomics (five matmuls, as
    FlashAttention-2/3); the sum order of dQ then varies from run to run.
    """
    from . import triton_kernels as tk

    n_q, hq, d = q.shape
    n_k, hkv, _ = k.shape
    dq = torch.zeros_like(q)
    if len(seg) == 0 or n_q == 0:
        # contiguous, as the dK/dV the kernels sum are (what the custom op's fake declares)
        return dq, torch.zeros(k.shape, dtype=k.dtype, device=k.device), torch.zeros(v.shape, dtype=v.dtype,
                                                                                      device=v.device)
    group = hq // hkv
    key = tune_key(q, k)
    delta = torch.empty((hq, n_q), dtype=torch.float32, device=q.device)
    block = 64
    tk._delta_kernel[(triton_cdiv(n_q, block), hq)](
        out, dout, dlse if dlse is not None else lse, delta,
        out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), n_q,
        HEAD_DIM=d, BLOCK_M=block, HAS_DLSE=dlse is not None,
    )
    prec = _precision(q.dtype)
    dq_acc = torch.zeros((n_q, hq, d), dtype=torch.float32, device=q.device) if not deterministic else delta
    n_sm = sm_count(q.device)
    partial: dict = {}

    def launch_dq(cfg: BlockConfig) -> None:
        index = device_index(seg, "fwd", cfg, q.device, forward_split(seg, cfg, hq, n_sm))
        tiles = index["tiles"]
        dq_part, _ = _split_buffers(index, cfg.block_m, hq, d, q.device, with_lse=False)
        tk._dq_kernel[(tiles.shape[0] * hq,)](
            q, k, v, dout, dq, dq_part if dq_part is not None else delta, lse, delta, tiles,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1),
            n_q, hq, scale * tk.LOG2E, scale,
            GROUP=group, HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            PRECISION=prec, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        partial.update(dq_index=index, dq_part=dq_part, dq_block_m=cfg.block_m)

    def launch_dkdv(cfg: BlockConfig) -> None:
        index = device_index(seg, "dkdv", cfg, q.device)
        n_tiles = index["tiles"].shape[0]
        split = dkdv_split(seg, index, cfg, hkv, group, n_sm)
        dk_part = torch.zeros((split, n_k, hkv, d), dtype=torch.float32, device=q.device)
        dv_part = torch.zeros_like(dk_part)
        if not deterministic:
            dq_acc.zero_()  # a tuning run must not add twice
        tk._dkdv_kernel[(n_tiles * hkv * split,)](
            q, k, v, dout, dk_part, dv_part, lse, delta, dq_acc, index["tiles"], index["entries"],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            dout.stride(0), dout.stride(1), dq_acc.stride(0) if not deterministic else 0,
            dq_acc.stride(1) if not deterministic else 0,
            dk_part.stride(0), dk_part.stride(1), dk_part.stride(2),
            n_q, n_k, hkv, split, group // split, scale * tk.LOG2E, scale,
            GROUP=group, HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            PRECISION=prec, ATOMIC_DQ=not deterministic, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        partial["dk"], partial["dv"] = dk_part, dv_part

    # the dK/dV kernel first: its results can leave (on_dkdv) while the dQ kernel runs
    run_tuned("dkdv" if deterministic else "dkdv_atomic", key, d, launch_dkdv)
    # the head shares add up in a fixed order (a sum over a leading dim has no atomics)
    dk, dv = partial["dk"], partial["dv"]
    dk = (dk[0] if dk.shape[0] == 1 else dk.sum(0)).to(k.dtype)  # one share: no sum, one conversion
    dv = (dv[0] if dv.shape[0] == 1 else dv.sum(0)).to(v.dtype)
    if deterministic:
        if on_dkdv is not None:
            on_dkdv(dk, dv)
        run_tuned("dq", key, d, launch_dq)
        if partial["dq_part"] is not None:  # key chunks of split tiles, added in chunk order
            index = partial["dq_index"]
            summed = partial["dq_part"].view(-1, index["n_chunks"], partial["dq_block_m"], hq, d).sum(1)
            dq[index["split_rows"]] = summed.reshape(-1, hq, d)[index["split_pos"]].to(dq.dtype)
    else:
        dq = dq_acc.to(q.dtype)
        if on_dkdv is not None:
            on_dkdv(dk, dv)
    return dq, dk, dv


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
