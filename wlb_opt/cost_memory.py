"""The memory model: peak bytes of one pipeline rank, and the largest `max_tokens` that fits.

What bounds S_max (`max_tokens`) in practice is memory: the activations that the
pipeline schedule keeps in flight on a rank, plus one operation's working memory, plus the
static part (weights, gradients, optimizer state). Per rank, for micro-batches of T tokens
whose documents are d_1..d_k (all in flight assumed as large as this one: the worst case):

    peak = static + max over the schedule of (in-flight layers x stored(T)
           + in-flight head x head(T)) + max(layer transient(T), loss transient)
    stored(T)    = stored_per_token x T / cp + stored_per_square x sum d^2 / cp
                   (+ the all-gathered K/V of all T tokens under CP)
    transient(T) = transient_per_token x T / cp + transient_per_square x sum d^2 / cp

The in-flight count comes from the schedule itself (`wlb_opt.schedule.stage_order`):
under 1F1B stage s keeps pp - s micro-batches, the interleaved schedule more chunks.
With full recomputation a layer keeps only its input (`recompute_per_token`) and the
layer being recomputed adds its full stored activations to the transient.

Coefficients (bytes per layer on this rank) are analytic (`MemoryModel.analytic`, counted
from what the executor's Block saves for backward) or calibrated on a device by
`wlb_opt.profile` (fitted to peaks measured with torch's memory statistics). The executor's
attention saves no score matrix and builds none in backward on either path: Triton on a GPU,
torch's fused CPU attention on CPU (a HardwareSpec named "cpu" selects the torch path), both
flash-style, so the quadratic terms are zero unless a calibration finds otherwise.

Static bytes per parameter follow the ZeRO paper's convention (Rajbhandari et al. 2020):
16-bit weights and gradients (2 + 2) plus an fp32 master copy and Adam's two moments (12);
fp32 training keeps 4 + 4 + 8. FSDP shards the weights and the optimizer state over dp x cp
(as `apply_fsdp` does), counts the gradients whole (`MemoryModel.analytic` says why), and adds
the gathered working copy of two blocks (the one running and the one prefetched) and the root (the
embedding and LM head stay gathered, as the executor's FSDP2 keeps its root unit).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Literal

import numpy as np

from ._validate import check_positive_real, validate_lengths
from .specs import HardwareSpec, ModelSpec, ParallelSpec

Dtype = Literal["bf16", "fp16", "fp32"]
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
OPTIMIZERS: tuple[str, ...] = ("adam", "adamw", "sgd", "none")
MEMORY_TERMS: tuple[str, ...] = ("stored_per_token", "stored_per_square", "transient_per_token",
                                 "transient_per_square", "recompute_per_token")


def dtype_name(dtype) -> str:
    """"bf16", "fp16" or "fp32" from those names, torch-style names or a torch.dtype."""
    aliases = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
               "fp32": "fp32", "float32": "fp32", "float": "fp32"}
    key = str(dtype).removeprefix("torch.")
    if key not in aliases:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)} (or bfloat16, float16, float32), got {dtype!r}")
    return aliases[key]


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryModel:
    """Peak-memory coefficients of one rank and the training options they assume."""

    model: ModelSpec
    parallel: ParallelSpec
    stored_per_token: float
    """Bytes one layer keeps for backward per token on this rank (no recomputation)."""
    stored_per_square: float
    """Bytes one layer keeps per d^2 of each document (0 for the executor's attention)."""
    transient_per_token: float
    """Working bytes of one layer's backward per token, above what it stored."""
    transient_per_square: float
    """Working bytes of one layer's backward per d^2 of each document."""
    recompute_per_token: float
    """Bytes one layer keeps per token under full recomputation (its input)."""
    dtype: str = "bf16"
    optimizer: str = "adam"
    fsdp: bool = False
    virtual_stages: int = 1
    loss_chunk: int = 8192
    recompute: bool = False
    attention: str = "flash"
    """"flash" (a fused kernel: no score matrices) or "torch" (scores recomputed per document)."""
    source: str = "analytic"
    """"analytic", or where and how it was calibrated."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelSpec) or not isinstance(self.parallel, ParallelSpec):
            raise ValueError("MemoryModel needs a ModelSpec and a ParallelSpec")
        for name in MEMORY_TERMS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
                raise ValueError(f"MemoryModel.{name} must be a finite number >= 0 (bytes), got {value!r}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        for name in ("virtual_stages", "loss_chunk"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
            object.__setattr__(self, name, int(value))
        for name in ("fsdp", "recompute"):  # "False" or "no" would count as true
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{name} must be True or False, got {value!r}")
            object.__setattr__(self, name, bool(value))
        if self.model.layers < self.parallel.pp * self.virtual_stages:
            raise ValueError(f"{self.model.layers} layers cannot fill pp x virtual_stages = "
                             f"{self.parallel.pp * self.virtual_stages} pipeline chunks")
        if self.attention not in ("flash", "torch"):
            raise ValueError(f"attention must be 'flash' or 'torch', got {self.attention!r}")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def analytic(cls, model: ModelSpec, parallel: ParallelSpec | None = None, hardware: HardwareSpec | None = None,
                 **options) -> "MemoryModel":
        """Coefficients counted from the tensors the executor's Block and CP attention keep.

        Per token and layer, in the activation dtype (b bytes), split over tp (sequence
        parallelism divides everything): the norms' inputs and outputs (4 hidden; torch's
        composite RMSNorm on CPU also keeps the normalised copy: 6), q and the attention
        output (2 q_dim), k and v (2 kv_dim), the SwiGLU's w1 and w3 outputs, silu(w1) and
        their product (4 ffn), plus fp32 norm statistics and log-sum-exp. The attention
        (`context_parallel_attention`) saves no score matrix: on a GPU it re-gathers K/V in
        backward (`breakdown` adds the gathered K/V and the whole dK/dV to the backward's
        working memory under CP); on CPU it keeps the gathered K/V (2 kv_dim more per local
        token here, `breakdown` adds the other ranks' share under CP), and torch's fused CPU
        attention keeps only its output and log-sum-exp, as the flash kernel does (no
        quadratic term). With `fsdp`, parameters and optimizer state are sharded over dp x cp
        (as `apply_fsdp` shards) and the gradients are counted whole (they accumulate
        unsharded until a chunk's last micro-batch). Calibrate on a device (`wlb-opt
        profile`) to replace the count by measurements.
        """
        _check_specs(model, parallel, hardware)
        parallel = parallel or ParallelSpec()
        hardware = hardware or HardwareSpec.preset("h100")
        m, tp = model, parallel.tp
        attention = options.pop("attention", "torch" if hardware.name == "cpu" else "flash")
        dtype = dtype_name(options.get("dtype", "bf16"))
        b = DTYPE_BYTES[dtype]
        torch_path = attention == "torch"
        norms = 6 if torch_path else 4
        kv = 4 if torch_path else 2  # local k, v (+ the kept gathered copy on CPU)
        stored_tok = b * (norms * m.hidden + 2 * m.q_dim + kv * m.kv_dim + 4 * m.ffn) / tp + 4 * (2 + m.heads / tp)
        if torch_path:
            stored_tok += b * 2 * m.head_dim  # RoPE cos/sin of q and k, per token
        # backward of one layer: gradients of the activations (hidden states, q/k/v, ffn)
        transient_tok = b * (2 * m.hidden + 2 * m.q_dim + 2 * m.kv_dim + 3 * m.ffn) / tp
        transient_sq = 0.0
        return cls(model=model, parallel=parallel, stored_per_token=stored_tok, stored_per_square=0.0,
                   transient_per_token=transient_tok, transient_per_square=transient_sq,
                   recompute_per_token=b * m.hidden / tp, attention=attention, source="analytic", **options)

    def with_options(self, **options) -> "MemoryModel":
        """The same coefficients under other training options (dtype, recompute, fsdp, ...)."""
        return replace(self, **options)

    # ------------------------------------------------------------------ static part
    def static_breakdown(self, stage: int = 0) -> dict[str, int]:
        """Bytes of weights, gradients and optimizer state on pipeline rank `stage`."""
        m, par = self.model, self.parallel
        _check_stage(stage, par.pp)
        layer_counts = self._chunk_layers()
        layers_here = sum(layer_counts[c * par.pp + stage] for c in range(self.virtual_stages))
        root = 0
        if stage == 0:
            root += m.vocab * m.hidden / par.tp
        if stage == par.pp - 1:
            root += m.vocab * m.hidden / par.tp + m.hidden
        block = (m.params_per_layer + 2 * m.hidden) / par.tp
        params = layers_here * block + root
        b = DTYPE_BYTES[self.dtype]
        master = 4 if b < 4 and self.optimizer != "none" else 0
        moments = 8 if self.optimizer in ("adam", "adamw") else 0
        # FSDP2 shards over dp x cp (`executor.fsdp.fsdp_mesh`); the executor turns its gradient
        # sync off until a chunk's last micro-batch, so the gradients accumulate unsharded
        shard = par.dp * par.cp if self.fsdp else 1
        out = dict(params=params * b / shard, grads=params * b, optimizer=params * (master + moments) / shard)
        if self.fsdp:  # gathered working copies: two blocks (running + prefetched) and the root
            out["fsdp_gathered"] = (block * min(2, layers_here) + root) * b
        return {k: int(round(v)) for k, v in out.items()}

    # ------------------------------------------------------------------ activations
    def _chunk_layers(self) -> list[int]:
        n = self.parallel.pp * self.virtual_stages
        bounds = [round(i * self.model.layers / n) for i in range(n + 1)]  # as split_stages
        return [bounds[i + 1] - bounds[i] for i in range(n)]

    def _in_flight(self, stage: int) -> list[tuple[int, int]]:
        """(layers, last-stage heads) held in flight after each op of `stage`'s schedule."""
        from .schedule import stage_order

        pp, v = self.parallel.pp, self.virtual_stages
        layers = self._chunk_layers()
        last = pp * v - 1
        n_micro = 2 * pp * v  # enough micro-batches to reach the steady state
        held_layers = held_heads = 0
        states = []
        for phase, _, vs in stage_order(stage, pp, n_micro, v):
            sign = 1 if phase == "F" else -1
            held_layers += sign * layers[vs]
            held_heads += sign * (vs == last)
            states.append((held_layers, held_heads))
        return states

    def breakdown(self, lengths, stage: int = 0) -> dict[str, int]:
        """Bytes of each part of the peak on `stage` for micro-batches like `lengths`."""
        if np.size(lengths) == 0:
            raise ValueError("lengths must be a non-empty list of document lengths >= 1")
        d = validate_lengths(lengths).astype(np.float64)  # integers >= 1: NaN and 2.5 are refused by name
        m, par = self.model, self.parallel
        b = DTYPE_BYTES[self.dtype]
        tokens = d.sum() / par.cp
        squares = float((d * d).sum()) / par.cp
        full_layer = self.stored_per_token * tokens + self.stored_per_square * squares
        gathered = 2 * m.kv_dim / par.tp * b * d.sum()  # K and V of the whole micro-batch
        if par.cp > 1 and self.attention == "torch":
            # kept for backward: the coefficients count a copy of this rank's share (what one
            # rank keeps), the gathered copy holds every rank's
            full_layer += gathered * (1 - 1 / par.cp)
        per_layer = self.recompute_per_token * tokens if self.recompute else full_layer
        head = (2 * b * m.hidden / par.tp + 4) * tokens  # final norm input and output
        activations = max(layers * per_layer + heads * head for layers, heads in self._in_flight(stage))
        transient = self.transient_per_token * tokens + self.transient_per_square * squares
        if par.cp > 1 and self.attention != "torch":
            # the fused kernel's backward gathers K and V again and makes the whole dK and dV
            transient += 2 * gathered
        if self.recompute:
            transient += full_layer
        if stage == par.pp - 1:
            # one chunk of logits at a time (recomputed in backward): at the peak two fp32
            # logits-sized tensors live (measured on CPU, fp32), plus the 16-bit head output
            chunk = min(self.loss_chunk, tokens)
            transient = max(transient, chunk * m.vocab / par.tp * (8 if b == 4 else b + 8))
        out = self.static_breakdown(stage)
        out.update(activations=int(round(activations)), transient=int(round(transient)))
        return out

    def peak(self, lengths, stage: int = 0) -> int:
        """Peak bytes of pipeline rank `stage` for micro-batches like `lengths` (worst case:
        every micro-batch the schedule keeps in flight is as large)."""
        return int(sum(self.breakdown(lengths, stage).values()))

    def worst_peak(self, max_tokens: int) -> int:
        """Largest peak over the stages when a micro-batch is one document of `max_tokens`
        tokens (the largest quadratic term a micro-batch of that size can have)."""
        return max(self.peak([max_tokens], s) for s in range(self.parallel.pp))

    def max_tokens(self, memory_bytes) -> int:
        """The largest `max_tokens` whose worst case fits in `memory_bytes` (binary search:
        `worst_peak` increases with tokens)."""
        if (isinstance(memory_bytes, (bool, np.bool_)) or not isinstance(memory_bytes, (int, float, np.integer,
                                                                                         np.floating))
                or not memory_bytes > 0 or not math.isfinite(memory_bytes)):
            raise ValueError(f"memory_bytes must be a positive number of bytes (finite), got {memory_bytes!r}")
        if self.worst_peak(1) > memory_bytes:
            static = max(sum(self.static_breakdown(s).values()) for s in range(self.parallel.pp))
            raise ValueError(f"memory_bytes={int(memory_bytes)} cannot hold one token: the worst stage needs "
                             f"{self.worst_peak(1)} bytes for a 1-token micro-batch ({static} of them weights, "
                             f"gradients and optimizer state); use more memory, fsdp=True, a larger "
                             f"pp or tp, or optimizer='sgd'")
        low, high = 1, 2
        while self.worst_peak(high) <= memory_bytes:
            low, high = high, high * 2
            if high > 2**40:
                return low
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self.worst_peak(mid) <= memory_bytes else (low, mid)
        return low

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict:
        out = asdict(self)
        out["model"], out["parallel"] = self.model.to_dict(), self.parallel.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "MemoryModel":
        if not isinstance(d, dict):
            raise ValueError(f"memory_model must be a dict, got {type(d).__name__}")
        missing = [k for k in ("model", "parallel", *MEMORY_TERMS) if k not in d]
        if missing:
            raise ValueError(f"memory_model is missing {missing}")
        parts = {}
        for name, spec in (("model", ModelSpec), ("parallel", ParallelSpec)):
            if not isinstance(d[name], dict):
                raise ValueError(f"memory_model.{name} must be a dict of {spec.__name__} fields, got "
                                 f"{type(d[name]).__name__}")
            try:
                parts[name] = spec(**d[name])
            except TypeError as exc:
                raise ValueError(f"memory_model.{name}: {exc}") from None
        d = dict(d, **parts)
        try:
            return cls(**d)
        except TypeError as exc:
            raise ValueError(f"memory_model has unknown fields: {exc}") from None


def _check_stage(stage, pp: int) -> None:
    if isinstance(stage, bool) or not isinstance(stage, (int, np.integer)) or not 0 <= stage < pp:
        raise ValueError(f"stage must be an integer in [0, {pp}), got {stage!r}")


def _check_specs(model, parallel, hardware) -> None:
    if not isinstance(model, ModelSpec):
        raise TypeError(f"model must be a ModelSpec, got {type(model).__name__}")
    if parallel is not None and not isinstance(parallel, ParallelSpec):
        raise TypeError(f"parallel must be a ParallelSpec or None, got {type(parallel).__name__}")
    if hardware is not None and not isinstance(hardware, HardwareSpec):
        raise TypeError(f"hardware must be a HardwareSpec or None, got {type(hardware).__name__}")


def max_tokens_for(model: ModelSpec, parallel: ParallelSpec | None, hardware: HardwareSpec | None, memory_bytes,
                   *, recompute: bool = False, dtype: str = "bf16", optimizer: str = "adam", fsdp: bool = False,
                   virtual_stages: int = 1, loss_chunk: int = 8192) -> int:
    """The largest `max_tokens` (S_max) whose worst-case peak fits in `memory_bytes` per GPU.

    Worst case: every micro-batch the pipeline keeps in flight on the most loaded stage holds
    `max_tokens` tokens in one document (the largest attention term). Raises ValueError when
    not even one token fits (the static part alone may not).
    """
    mem = MemoryModel.analytic(model, parallel, hardware, recompute=recompute, dtype=dtype,
                               optimizer=optimizer, fsdp=fsdp, virtual_stages=virtual_stages,
                               loss_chunk=loss_chunk)
    return mem.max_tokens(memory_bytes)


def resolve_max_tokens(max_tokens, cost, memory_bytes=None, *, pp: int | None = None, dp: int | None = None) -> int:
    """`max_tokens` itself, or with "auto" the largest that fits in `memory_bytes` under
    `cost`'s memory model (calibrated, else analytic from its model, layout and hardware).

    `pp`, `dp`: the caller's pipeline stages and replicas where they differ from the memory
    model's layout: a calibrated model (`wlb-opt profile`, one GPU) is then counted for that
    pipeline (each stage's layers and weights, the schedule's in-flight micro-batches) and for
    FSDP over those replicas; its per-token coefficients are one GPU's at its own tp and cp."""
    if not (isinstance(max_tokens, str) and max_tokens == "auto"):
        if memory_bytes is not None:
            raise ValueError("memory_bytes is only read with max_tokens='auto'")
        return max_tokens
    if memory_bytes is None:
        raise ValueError("max_tokens='auto' needs memory_bytes (bytes of memory per GPU)")
    check_positive_real("memory_bytes", memory_bytes, "bytes")  # finite: inf would fit any max_tokens
    mem = cost.memory_model_or_analytic()
    layout = {k: v for k, v in (("pp", pp), ("dp", dp)) if v is not None and v != getattr(mem.parallel, k)}
    if layout:
        mem = mem.with_options(parallel=replace(mem.parallel, **layout))
    return mem.max_tokens(memory_bytes)
