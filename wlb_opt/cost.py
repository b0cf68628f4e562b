"""The workload cost model: seconds of one document, one micro-batch, one attention segment.

Paper §3 models a micro-batch as sum over its documents of W_a(d) + W_l(d), attention
quadratic and the rest linear, both "derived from offline profiling" (Fig. 7). We keep that
structure with four explicit terms per phase ("fwd", "bwd"):

    doc_cost(d) = attn * d(d+1)/2  +  linear * d  +  comm * d  +  doc_const
    micro_batch_cost(ds) = sum(doc_cost(ds)) + mb_const

in seconds for all layers of one DP replica (a pipeline stage's share is 1/pp of it), with
d(d+1)/2 the exact number of causal (query, key) pairs. `CostModel.analytic` derives the
coefficients from FLOPs, bytes and the hardware's achieved efficiencies; a profiled model
(measured on a device) has the same fields, so everything downstream is agnostic.

`attention_latency(q_len, kv_len)` is the separate kernel-level model of paper §4.3 used to
choose CP sharding: FLOPs padded to the kernel tile (128) and divided by an achieved
throughput that depends on the query length (Fig. 10: flat up to one tile, a jump from 128
to 256 rows when Hopper's TMA multicast kicks in). Until `wlb_opt.profile` measures it, the
table below is a documented placeholder read qualitatively off the paper's Fig. 10.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Literal

import numpy as np

from ._validate import bool_position, check_int, check_real, exact_integers, validate_lengths
from .cost_memory import MemoryModel
from .specs import HardwareSpec, ModelSpec, ParallelSpec

Phase = Literal["fwd", "bwd", "fwd_bwd"]
PHASES: tuple[str, ...] = ("fwd", "bwd", "fwd_bwd")
TERMS: tuple[str, ...] = ("attn", "linear", "comm", "doc_const", "mb_const")
_DOC_TERMS = TERMS[:4]
"""The terms that make a document cost something (mb_const is per micro-batch)."""
FORMAT_VERSION = 3  # 3: + memory_model; 2: typed model / parallel / hardware; 1 (meta dicts); all load
LAYOUT_DIMS: tuple[str, ...] = ("dp", "pp", "cp", "tp")
_MAX_COEF = 1e9
"""Largest cost coefficient accepted (seconds per unit): keeps the cost of a 2**62-token
document's pairs finite in float64."""
_MAX_FLOPS = 1e200
"""Largest FLOP count per pair or FLOP/s accepted: a fit with a ~zero attention coefficient
gives a huge peak (legitimately); above this, latencies of long segments overflow."""

# Attention efficiency by query-segment length, as a multiplier of HardwareSpec.attn_efficiency.
# Placeholder from paper §4.3 / Fig. 10 (H100, FlashAttention, head dim 128): latency is flat
# for q_len <= 128 (padding to the 128-row tile, already counted in FLOPs), and achieved
# TFLOP/s jumps between 128 and 256 rows (TMA multicast of shared KV tiles), then saturates.
DEFAULT_EFF_Q_LEN: tuple[int, ...] = (1, 256, 512, 1024, 4096)
DEFAULT_EFF_SCALE: tuple[float, ...] = (0.60, 0.88, 0.95, 0.99, 1.0)
EFFICIENCY_SOURCE = "placeholder: paper §4.3 / Fig. 10 shape (flat <=128 rows, jump at 256), not measured"


def validate_phase(phase: str) -> None:
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")



def _token_counts(values, name: str) -> np.ndarray:
    """`values` as int64 token counts: integers (or whole floats); not strings or bools."""
    arr = np.asarray(values)
    if arr.dtype.kind not in "iuf" or bool_position(values) is not None:
        raise ValueError(f"{name} must be integer token counts, got {values!r:.60}")
    return exact_integers(arr, name).astype(np.int64, copy=False)


def attention_tiles(q_len, kv_len, tile: int) -> np.ndarray:
    """Number of tile x tile blocks a causal, bottom-right-aligned segment visits.

    Query tile i (rows [i*T, min((i+1)*T, q))) sees keys up to kv - q + its last row + 1,
    so it visits ceil((kv - q + min((i+1)T, q)) / T) key tiles. Summed in closed form.
    """
    q = _token_counts(q_len, "q_len")
    kv = _token_counts(kv_len, "kv_len")
    if q.shape != kv.shape and q.ndim and kv.ndim:
        try:
            np.broadcast_shapes(q.shape, kv.shape)
        except ValueError:
            raise ValueError(f"q_len and kv_len must have broadcastable shapes (the same, or one a scalar), got "
                             f"{q.shape} and {kv.shape}") from None
    if np.any(q < 0) or np.any(kv < q):
        raise ValueError("attention segments need 0 <= q_len <= kv_len")
    T = check_int("tile", tile, 1)
    n_q = -(-q // T)
    s = kv - q
    tiles = np.maximum(n_q - 1, 0) * (-(-s // T)) + n_q * np.maximum(n_q - 1, 0) // 2 + (-(-kv // T))
    return np.where(q > 0, tiles, 0)


@dataclass(frozen=True)
class CostModel:
    """Coefficients of the four-term document cost, per phase, plus the kernel model.

    `coef[phase][term]` is in seconds per causal pair (attn), per token (linear, comm),
    per document (doc_const) or per micro-batch (mb_const), for phase in ("fwd", "bwd").

    `model`, `parallel` and `hardware` say what the coefficients were derived for. An
    analytic model fills all three; a profiled one fills what it knows (the model, not the
    layout). Planning, sharding and the simulator read the layout from `parallel`: a
    `dp`, `pp` or `cp` argument that disagrees with it raises (see `degree`), and one left
    out takes its value. A model without a layout accepts any degree.
    """

    coef: dict
    attn_flops_per_pair: float
    """Forward attention FLOPs per causal (q, k) pair over all layers on one CP rank (heads / tp)."""
    attn_bwd_ratio: float = 2.5
    """Backward / forward attention FLOPs (FlashAttention-2 recomputes S and P: 5 vs 2 matmuls)."""
    attn_peak_flops: float = 1.0
    """FLOP/s that attention_latency divides by before the shape-dependent scale."""
    tile: int = 128
    eff_q_len: tuple = DEFAULT_EFF_Q_LEN
    eff_scale: tuple = DEFAULT_EFF_SCALE
    efficiency_source: str = EFFICIENCY_SOURCE
    meta: dict = field(default_factory=dict)
    """Untyped provenance (kind, exposure factors, device, dtype, ...); never read by planning."""
    model: ModelSpec | None = None
    """The model the coefficients describe, where known."""
    parallel: ParallelSpec | None = None
    """The layout the coefficients were derived for; None: any layout is accepted."""
    hardware: HardwareSpec | None = None
    """The accelerator of an analytic model; None for a profiled one."""
    memory_model: MemoryModel | None = None
    """A memory model calibrated on a device (`wlb-opt profile`); None: `memory` and
    `max_tokens="auto"` count it analytically from model, layout and hardware."""

    def __post_init__(self) -> None:
        for name, kind in (("model", ModelSpec), ("parallel", ParallelSpec), ("hardware", HardwareSpec),
                           ("memory_model", MemoryModel)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise ValueError(f"CostModel.{name} must be a {kind.__name__} or None, got {type(value).__name__}")
        self._check_fields()
        # the fields as plain Python numbers and tuples, copied: a caller's dict changed later
        # cannot change the model (its cached table would no longer match what it saves), and
        # to_dict gives JSON that reads back to an equal model
        object.__setattr__(self, "coef", {p: {t: float(self.coef[p][t]) for t in TERMS} for p in ("fwd", "bwd")})
        object.__setattr__(self, "tile", int(self.tile))
        object.__setattr__(self, "eff_q_len", tuple(int(q) for q in self.eff_q_len))
        object.__setattr__(self, "eff_scale", tuple(float(e) for e in self.eff_scale))
        object.__setattr__(self, "meta", dict(self.meta))
        # cached vectors: index 0 = fwd, 1 = bwd, 2 = fwd_bwd
        table = np.array([[self.coef[p][t] for t in TERMS] for p in ("fwd", "bwd")], dtype=np.float64)
        object.__setattr__(self, "_table", np.vstack([table, table.sum(axis=0)]))

    def _check_fields(self) -> None:
        """Every number planning reads is finite and in range: a NaN, inf, zero or float tile
        here would turn every latency into NaN, inf or zero without an error downstream."""
        if not isinstance(self.coef, dict) or any(not isinstance(self.coef.get(p), dict) for p in ("fwd", "bwd")):
            got = sorted(self.coef) if isinstance(self.coef, dict) else type(self.coef).__name__
            raise ValueError(f"CostModel.coef needs dicts for phases 'fwd' and 'bwd', got {got}")
        if set(self.coef) - {"fwd", "bwd"}:  # ("fwd_bwd" is their sum, never stored)
            raise ValueError(f"CostModel.coef has phases 'fwd' and 'bwd' only, got {sorted(self.coef)}")
        for phase in ("fwd", "bwd"):
            missing = [t for t in TERMS if t not in self.coef[phase]]
            unknown = sorted(set(self.coef[phase]) - set(TERMS))
            if missing or unknown:
                raise ValueError(f"CostModel.coef[{phase!r}] must have exactly the terms {TERMS}; missing "
                                 f"{missing}, unknown {unknown}")
            for term in TERMS:
                # above 1e9 (seconds per pair / token / document), the cost of a long document
                # overflows to inf and imbalances become NaN
                check_real(f"CostModel.coef[{phase!r}][{term!r}]", self.coef[phase].get(term), high=_MAX_COEF,
                           unit="seconds")
        if all(self.coef[phase][term] == 0 for phase in ("fwd", "bwd") for term in _DOC_TERMS):
            # every document would cost 0 seconds: every plan reads as balanced, whatever it holds
            raise ValueError(f"CostModel.coef: the document terms {_DOC_TERMS} are 0 in both phases, so every "
                             f"document costs 0 seconds and no plan can be balanced; at least one must be > 0 "
                             f"(e.g. linear, seconds per token); got {self.coef!r:.200}")
        check_real("CostModel.attn_flops_per_pair", self.attn_flops_per_pair, strict=True, high=_MAX_FLOPS)
        check_real("CostModel.attn_peak_flops", self.attn_peak_flops, strict=True, high=_MAX_FLOPS, unit="FLOP/s")
        check_real("CostModel.attn_bwd_ratio", self.attn_bwd_ratio, high=1e3)
        check_int("CostModel.tile", self.tile, 1, high=1 << 16)  # a tile of rows, not of a sequence
        if (not isinstance(self.eff_q_len, (tuple, list)) or not isinstance(self.eff_scale, (tuple, list))
                or len(self.eff_q_len) != len(self.eff_scale) or not self.eff_q_len):
            raise ValueError("CostModel.eff_q_len and eff_scale must be non-empty sequences of equal length, got "
                             f"{self.eff_q_len!r} and {self.eff_scale!r}")
        for i, (q, e) in enumerate(zip(self.eff_q_len, self.eff_scale)):
            check_int(f"CostModel.eff_q_len[{i}]", q, 0)
            check_real(f"CostModel.eff_scale[{i}]", e, strict=True, high=1e3)
        if any(b <= a for a, b in zip(self.eff_q_len, self.eff_q_len[1:])):
            raise ValueError(f"CostModel.eff_q_len must strictly increase, got {list(self.eff_q_len)}")
        if not isinstance(self.meta, dict):
            raise ValueError(f"CostModel.meta must be a dict (untyped provenance), got {type(self.meta).__name__}")
        if not isinstance(self.efficiency_source, str):
            raise ValueError("CostModel.efficiency_source must be a string (where eff_q_len and eff_scale come "
                             f"from), got {self.efficiency_source!r}")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def analytic(
        cls,
        model: ModelSpec,
        parallel: ParallelSpec | None = None,
        hardware: HardwareSpec | None = None,
        *,
        tp_comm_exposed: float = 0.3,
        cp_comm_exposed: float = 1.0,
        tile: int = 128,
    ) -> "CostModel":
        """Coefficients from FLOPs and bytes.

        - attention: 4 * q_dim (heads x head_dim) FLOPs per causal pair and layer (QK^T and
          PV), split over tp (heads) and cp (pairs), at peak x attn_efficiency; backward 2.5x.
        - linear: 2 x weights per token and layer plus the LM head, split over tp and cp, at
          peak x gemm_efficiency; plus about 32 bytes x hidden of element-wise HBM traffic
          per token and layer; backward 2x.
        - comm: TP with sequence parallelism moves 4 activation shards per layer and phase
          ((tp-1)/tp of tokens/cp x hidden bf16 each), of which `tp_comm_exposed` is not
          hidden behind GEMMs; CP all-gathers K and V forward and reduce-scatters dK/dV
          backward ((cp-1)/cp of the kv_dim/tp slice). TP on NVLink; CP on NVLink only when
          tp x cp fits in a node, else on the network.
        - doc_const: half a microsecond per layer (varlen kernel bookkeeping per document).
        - mb_const: about 15 kernel launches per layer forward, 30 backward.
        """
        parallel = parallel or ParallelSpec()
        hardware = hardware or HardwareSpec.preset("h100")
        for name, value in (("tp_comm_exposed", tp_comm_exposed), ("cp_comm_exposed", cp_comm_exposed)):
            check_real(name, value, high=1.0)  # a fraction in [0, 1]; not a bool
        for name, value, kind in (("model", model, ModelSpec), ("parallel", parallel, ParallelSpec),
                                  ("hardware", hardware, HardwareSpec)):
            if not isinstance(value, kind):
                raise TypeError(f"CostModel.analytic: {name} must be a {kind.__name__}"
                                f"{'' if name == 'model' else ' or None'}, got {type(value).__name__}")
        tile = check_int("tile", tile, 1)
        L, h = model.layers, model.hidden
        split = parallel.tp * parallel.cp
        peak = hardware.peak_tflops * 1e12

        attn_flops_pair = 4.0 * model.q_dim * L / split
        attn_fwd = attn_flops_pair / (peak * hardware.attn_efficiency)
        gemm_flops_tok = (2.0 * model.params_per_layer * L + 2.0 * model.vocab * h) / split
        elementwise_s_tok = 32.0 * h * L / split / (hardware.hbm_gbps * 1e9)
        linear_fwd = gemm_flops_tok / (peak * hardware.gemm_efficiency) + elementwise_s_tok

        # TP is the innermost dimension (NVLink when it fits in a node); CP crosses nodes
        # once tp x cp exceeds a node (paper §7.1 maps TP and CP inside a node when it can).
        nvlink, network = hardware.nvlink_gbps * 1e9, hardware.network_gbps * 1e9
        tp_bw = nvlink if parallel.tp <= parallel.gpus_per_node else network
        cp_bw = nvlink if split <= parallel.gpus_per_node else network
        tp_bytes_tok = 4 * (parallel.tp - 1) / parallel.tp * h * 2 / parallel.cp * L
        cp_bytes_tok = (parallel.cp - 1) / parallel.cp * 2 * model.kv_dim / parallel.tp * 2 * L
        comm_fwd = tp_comm_exposed * tp_bytes_tok / tp_bw + cp_comm_exposed * cp_bytes_tok / cp_bw

        doc_const_fwd = 0.5e-6 * L
        mb_const_fwd = 15 * hardware.kernel_launch_s * L
        coef = {
            "fwd": dict(attn=attn_fwd, linear=linear_fwd, comm=comm_fwd,
                        doc_const=doc_const_fwd, mb_const=mb_const_fwd),
            "bwd": dict(attn=2.5 * attn_fwd, linear=2.0 * linear_fwd, comm=comm_fwd,
                        doc_const=2 * doc_const_fwd, mb_const=2 * mb_const_fwd),
        }
        meta = dict(kind="analytic", tp_comm_exposed=tp_comm_exposed, cp_comm_exposed=cp_comm_exposed)
        return cls(coef=coef, attn_flops_per_pair=attn_flops_pair * parallel.cp,
                   attn_bwd_ratio=2.5, attn_peak_flops=peak * hardware.attn_efficiency,
                   tile=tile, meta=meta, model=model, parallel=parallel, hardware=hardware)

    # ------------------------------------------------------------------ layout
    def degree(self, name: str, value=None) -> int:
        """The `name` ("dp", "pp", "cp" or "tp") degree a caller should use.

        None takes `parallel`'s value (1 without a layout); an explicit value must be an
        integer >= 1 and, when the model has a layout, equal to it.
        """
        if name not in LAYOUT_DIMS:
            raise ValueError(f"layout dimension must be one of {LAYOUT_DIMS}, got {name!r}")
        mine = None if self.parallel is None else getattr(self.parallel, name)
        if value is None:
            return 1 if mine is None else mine
        value = check_int(name, value, 1)
        if mine is not None and value != mine:
            raise ValueError(f"{name}={value} disagrees with the cost model's layout ({name}={mine} in "
                             f"{self.parallel}); pass {name}=None to use the cost model's, or build the "
                             f"cost model for {name}={value}")
        return value

    def without_layout(self) -> "CostModel":
        """The same coefficients, accepting any layout (for models meant as per-device costs)."""
        return replace(self, parallel=None)

    # ------------------------------------------------------------------ costs
    def _row(self, phase: str) -> np.ndarray:
        validate_phase(phase)
        return self._table[PHASES.index(phase)]

    def doc_cost(self, lengths, phase: Phase = "fwd_bwd") -> np.ndarray:
        """Seconds of each document (all layers, one replica); vectorised over `lengths`."""
        return self._doc_cost_valid(validate_lengths(lengths), phase)

    def _doc_cost_valid(self, lengths: np.ndarray, phase: Phase = "fwd_bwd") -> np.ndarray:
        """`doc_cost` of lengths validated already (a 1-D integer array): the streaming packer
        validates a batch once on arrival and weighs its pieces several times a step."""
        d = lengths.astype(np.float64)
        attn, linear, comm, doc_const, _ = self._row(phase)
        return attn * (d * (d + 1.0) * 0.5) + (linear + comm) * d + doc_const

    def _phase_costs_valid(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(`_doc_cost_valid` of "fwd_bwd", "fwd", "bwd"), the same values, the terms every
        phase shares computed once (the streaming packer weighs a step's pieces in all three)."""
        d = lengths.astype(np.float64)
        pairs = d * (d + 1.0) * 0.5
        return tuple(attn * pairs + (linear + comm) * d + doc_const
                     for attn, linear, comm, doc_const, _ in (self._table[2], self._table[0], self._table[1]))

    def doc_cost_terms(self, lengths, phase: Phase = "fwd_bwd") -> dict[str, np.ndarray]:
        """The four terms of doc_cost separately (for breakdowns and plots)."""
        d = validate_lengths(lengths).astype(np.float64)
        attn, linear, comm, doc_const, _ = self._row(phase)
        return {"attn": attn * d * (d + 1.0) * 0.5, "linear": linear * d, "comm": comm * d,
                "doc_const": np.full_like(d, doc_const)}

    def micro_batch_cost(self, lengths, phase: Phase = "fwd_bwd") -> float:
        """Seconds of one micro-batch: its documents plus the per-micro-batch constant."""
        return float(self.doc_cost(lengths, phase).sum() + self._row(phase)[4])

    def linear_cost(self, tokens, phase: Phase = "fwd_bwd"):
        """Seconds of the token-linear work (GEMMs, element-wise, communication) of `tokens`."""
        _, linear, comm, _, _ = self._row(phase)
        arr = np.asarray(tokens)
        if (arr.dtype.kind not in "iuf" or bool_position(tokens) is not None or not np.all(np.isfinite(arr))
                or np.any(arr < 0)):
            raise ValueError(f"tokens must be finite token counts >= 0, got {tokens!r:.60}")
        return (linear + comm) * arr.astype(np.float64)

    def mb_const(self, phase: Phase = "fwd_bwd") -> float:
        return float(self._row(phase)[4])

    def attention_tiles(self, q_len, kv_len) -> np.ndarray:
        """Number of tile x tile blocks a causal, bottom-right-aligned segment visits
        (`attention_tiles` with this model's tile)."""
        return attention_tiles(q_len, kv_len, self.tile)

    def attention_efficiency(self, q_len) -> np.ndarray:
        """Shape-dependent multiplier of achieved attention throughput (see module docstring)."""
        q = _token_counts(q_len, "q_len")
        if np.any(q < 0):
            raise ValueError(f"q_len must be token counts >= 0, got {q_len!r:.60}")
        idx = np.searchsorted(np.asarray(self.eff_q_len), q, side="right") - 1
        return np.asarray(self.eff_scale, dtype=np.float64)[np.clip(idx, 0, len(self.eff_scale) - 1)]

    def attention_latency(self, q_len, kv_len, phase: Phase = "fwd_bwd"):
        """Seconds of one attention segment (all layers, this rank's heads), tile-padded.

        Vectorised: returns an array for array inputs, a float for scalars.
        """
        validate_phase(phase)
        scalar = np.ndim(q_len) == 0 and np.ndim(kv_len) == 0
        tiles = self.attention_tiles(q_len, kv_len)
        mult = {"fwd": 1.0, "bwd": self.attn_bwd_ratio, "fwd_bwd": 1.0 + self.attn_bwd_ratio}[phase]
        flops = tiles * float(self.tile * self.tile) * self.attn_flops_per_pair * mult
        seconds = flops / (self.attn_peak_flops * self.attention_efficiency(q_len))
        return float(seconds) if scalar else seconds

    # ------------------------------------------------------------------ memory
    def memory_model_or_analytic(self) -> MemoryModel:
        """The calibrated memory model, else the analytic one of `model`, `parallel` and
        `hardware` (defaults: bf16, Adam, no recomputation, the 1F1B schedule's in-flight
        micro-batches: for the interleaved schedule's, set `memory_model` to
        `MemoryModel.analytic(..., virtual_stages=v)`; see `wlb_opt.cost_memory`)."""
        if self.memory_model is not None:
            return self.memory_model
        if self.model is None or self.hardware is None:
            raise ValueError("this cost model has no memory model: it needs a calibrated one (`wlb-opt profile` "
                             "saves it) or a model and a hardware spec for the analytic count (a profiled "
                             "cost model has no hardware spec); got model="
                             f"{None if self.model is None else self.model.name!r}, hardware="
                             f"{None if self.hardware is None else self.hardware.name!r}")
        return MemoryModel.analytic(self.model, self.parallel, self.hardware)

    def memory(self, lengths, stage: int = 0) -> int:
        """Peak bytes of pipeline rank `stage` running micro-batches like `lengths` (the
        schedule's in-flight micro-batches all as large: the worst case), static part
        included. `memory_model_or_analytic().breakdown(...)` gives the parts."""
        return self.memory_model_or_analytic().peak(validate_lengths(lengths), stage)

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict:
        return dict(
            format_version=FORMAT_VERSION, coef={p: dict(c) for p, c in self.coef.items()},
            attn_flops_per_pair=self.attn_flops_per_pair, attn_bwd_ratio=self.attn_bwd_ratio,
            attn_peak_flops=self.attn_peak_flops, tile=self.tile, eff_q_len=list(self.eff_q_len),
            eff_scale=list(self.eff_scale), efficiency_source=self.efficiency_source, meta=dict(self.meta),
            model=None if self.model is None else self.model.to_dict(),
            parallel=None if self.parallel is None else self.parallel.to_dict(),
            hardware=None if self.hardware is None else self.hardware.to_dict(),
            memory_model=None if self.memory_model is None else self.memory_model.to_dict(),
        )

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        """Inverse of `to_dict`; also reads format 1, whose layout sat in `meta` dicts. Raises
        ValueError naming the field for a missing, unknown or malformed entry."""
        if not isinstance(d, dict):
            raise ValueError(f"a CostModel dict (CostModel.to_dict()) is a JSON object, got {type(d).__name__}")
        d = dict(d)
        version = d.pop("format_version", None)
        if version not in (1, 2, FORMAT_VERSION):
            raise ValueError(f"CostModel format_version {version!r} is not supported; expected 1, 2 or "
                             f"{FORMAT_VERSION} (a file written by a newer wlb-opt, or not a cost model)")
        if version == 1:
            meta = dict(d.get("meta") or {})
            for name in ("model", "parallel", "hardware"):
                if isinstance(meta.get(name), dict):
                    d[name] = meta.pop(name)
            d["meta"] = meta
        known = {f.name for f in fields(cls)}
        unknown, missing = sorted(set(d) - known), sorted({"coef", "attn_flops_per_pair"} - set(d))
        if unknown or missing:
            raise ValueError(f"CostModel dict: unknown fields {unknown}, missing fields {missing}; "
                             f"valid fields: {sorted(known)}")
        specs = (("model", ModelSpec), ("parallel", ParallelSpec), ("hardware", HardwareSpec))
        for name, kind in specs:
            if d.get(name) is not None:
                if not isinstance(d[name], dict):
                    raise ValueError(f"CostModel dict: {name} must be an object of {kind.__name__} fields, "
                                     f"got {d[name]!r:.60}")
                try:
                    d[name] = kind(**d[name])
                except TypeError as exc:  # unknown or missing spec fields
                    raise ValueError(f"CostModel dict: {name}: {exc}") from None
        for name in ("eff_q_len", "eff_scale"):
            if name in d:
                if not isinstance(d[name], (list, tuple)):
                    raise ValueError(f"CostModel dict: {name} must be a list of numbers, got {d[name]!r:.60}")
                d[name] = tuple(d[name])
        if "meta" in d and not isinstance(d["meta"], dict):
            raise ValueError(f"CostModel dict: meta must be an object, got {d['meta']!r:.60}")
        if d.get("memory_model") is not None:
            d["memory_model"] = MemoryModel.from_dict(d["memory_model"])
        return cls(**d)

    def save(self, path) -> None:
        if Path(path).is_dir():
            raise ValueError(f"CostModel.save: {str(path)!r} is a directory; give a file path (a .json file)")
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True))

    @classmethod
    def load(cls, path) -> "CostModel":
        """A CostModel saved with `save` (JSON). Raises ValueError naming the file for a
        missing or unreadable file, bad JSON or a malformed model."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"cost model file {str(path)!r} does not exist or is not a file")
        try:
            d = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"cost model file {str(path)!r} is not JSON, not a saved CostModel (invalid JSON: {exc})") from None
        try:
            return cls.from_dict(d)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cost model file {str(path)!r}: {exc}") from None

    def describe(self) -> str:
        """One line per phase with the coefficients, for logs and the CLI."""
        rows = []
        for p in ("fwd", "bwd"):
            c = self.coef[p]
            rows.append(f"{p}: attn {c['attn']:.3e} s/pair, linear {c['linear']:.3e} s/tok, "
                        f"comm {c['comm']:.3e} s/tok, doc {c['doc_const']:.2e} s, mb {c['mb_const']:.2e} s")
        return "\n".join(rows)


def default_cost() -> CostModel:
    """The cost model used when none is given: 7B on one H100 (no TP or CP split of the work),
    without a layout, so that any dp, pp or cp is accepted."""
    return CostModel.analytic(ModelSpec.preset("7b"), ParallelSpec(), HardwareSpec.preset("h100")).without_layout()
