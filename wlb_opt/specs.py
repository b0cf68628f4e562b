"""Model, parallel layout and hardware descriptions: frozen, validating dataclasses.

These three specs are all the analytic cost model needs. Presets follow paper Table 1
(arXiv 2503.17924, §7.1) for the models, and vendor datasheets for the hardware; each preset
says where its numbers come from.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from ._validate import INT64_MAX


def _finite(value) -> bool:
    """Whether a real number is finite as a float (an int too large for a float is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _python_numbers(obj: Any, *names: str) -> None:
    """The fields `names` of a frozen spec that hold numpy integer or float scalars, as the
    Python numbers they hold (a spec is compared, hashed and written to JSON as Python values);
    numpy bools stay as given, to be refused by the checks."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, (np.integer, np.floating)):
            object.__setattr__(obj, name, value.item())


def _check_count(owner: str, name: str, value, what: str = "an integer >= 1") -> None:
    """An integer field >= 1 that fits in int64 (products and numpy arrays of it must not wrap)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name} must be {what}, got {value!r}")
    if value > INT64_MAX:
        raise ValueError(f"{owner}.{name} must be {what} and <= 2**63 - 1 (int64), got {value!r}")


def _check_positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not _finite(value):
            raise ValueError(f"{type(obj).__name__}.{name} must be a finite positive number, got {value!r}")


def _check_fraction(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
            raise ValueError(f"{type(obj).__name__}.{name} must be in (0, 1], got {value!r}")


def _preset(cls, table: dict[str, dict], name: str):
    """`cls` built from the preset `name` of `table` (case-insensitive), or a ValueError."""
    try:
        kwargs = table[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unknown {cls.__name__} preset {name!r}; valid: {sorted(table)}") from None
    return cls(name=name.lower(), **kwargs)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A Llama-like decoder-only transformer."""

    name: str = "custom"
    """Label used in tables and saved cost models."""
    hidden: int
    """Model width (d_model)."""
    layers: int
    """Number of transformer blocks."""
    heads: int
    """Query heads."""
    kv_heads: int | None = None
    """Key/value heads (GQA); None means heads (multi-head attention)."""
    ffn: int
    """SwiGLU inner width (three hidden x ffn matrices per block)."""
    vocab: int = 32000
    """Vocabulary size (embedding and LM head)."""
    head_dim: int | None = None
    """Width of one attention head; None means hidden // heads (which must then divide).
    Some models (Qwen3, Gemma) set it apart from hidden / heads."""

    def __post_init__(self) -> None:
        _python_numbers(self, "hidden", "layers", "heads", "ffn", "vocab", "kv_heads", "head_dim")
        for name in ("hidden", "layers", "heads", "ffn", "vocab"):
            _check_count("ModelSpec", name, getattr(self, name))
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if (isinstance(self.kv_heads, bool) or not isinstance(self.kv_heads, int) or self.kv_heads < 1
                or self.heads % self.kv_heads):
            raise ValueError(
                f"ModelSpec.kv_heads must be a positive divisor of heads={self.heads}, got {self.kv_heads!r}"
            )
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise ValueError(f"ModelSpec.hidden={self.hidden} must be divisible by heads={self.heads} "
                                 f"(or give head_dim explicitly)")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        _check_count("ModelSpec", "head_dim", self.head_dim, "an integer >= 1 or None")

    @property
    def q_dim(self) -> int:
        """Width of Q (and of the attention output): heads x head_dim."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): kv_heads x head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def params_per_layer(self) -> int:
        """Weights of one block: Q, O (hidden x q_dim each), K, V (hidden x kv_dim), SwiGLU (3 x hidden x ffn)."""
        return 2 * self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim + 3 * self.hidden * self.ffn

    @property
    def n_params(self) -> int:
        """Total weights, untied embedding and LM head included."""
        return self.layers * self.params_per_layer + 2 * self.vocab * self.hidden

    @classmethod
    def preset(cls, name: str) -> "ModelSpec":
        """One of "tiny", "550m", "7b", "30b", "70b".

        - "7b": Llama-2-7B exactly (Touvron et al. 2023; the paper says its 7B equals it).
        - "550m": the paper's internal 550M is unpublished; a scaled Llama shape with
          hidden 1536, 16 layers, 12 heads, ffn 4096 gives 0.55 B weights with embeddings.
        - "30b": the Llama-1 33B shape (hidden 6656, 60 layers, 52 heads, ffn 17920).
        - "70b": Llama-2-70B (hidden 8192, 80 layers, 64 heads, 8 KV heads, ffn 28672).
        - "tiny": 2 layers of width 64 for tests and CPU examples.
        """
        return _preset(cls, _MODEL_PRESETS, name)

    @classmethod
    def from_hf_config(cls, config) -> "ModelSpec":
        """The ModelSpec of a Hugging Face decoder config: a `transformers.PretrainedConfig` or
        a plain dict such as a Llama, Qwen or Mistral ``config.json``.

        Reads hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads
        (absent or null: multi-head attention), intermediate_size, vocab_size and head_dim
        where present. Norms, biases, RoPE and tied embeddings do not change the cost model's
        terms and are not read. A missing or invalid key raises a ValueError naming it.
        """
        if isinstance(config, dict):
            values = config
        elif hasattr(config, "to_dict"):
            values = config.to_dict()
        else:
            raise TypeError(f"ModelSpec.from_hf_config needs a transformers PretrainedConfig or a dict, "
                            f"got {type(config).__name__}")
        # multimodal configs (e.g. Qwen2-VL, Llava) nest the language model's config
        if "hidden_size" not in values and isinstance(values.get("text_config"), dict):
            values = values["text_config"]

        def read(key: str, *, required: bool = True):
            value = values.get(key)
            if value is None:
                if required:
                    raise ValueError(f"HF config has no {key!r} (needed by ModelSpec); keys present: "
                                     f"{sorted(k for k in values if not k.startswith('_'))}")
                return None
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"HF config {key!r} must be an integer >= 1, got {value!r}")
            return value

        name = values.get("_name_or_path") or values.get("model_type") or "hf"
        try:
            return cls(name=str(name), hidden=read("hidden_size"), layers=read("num_hidden_layers"),
                       heads=read("num_attention_heads"), kv_heads=read("num_key_value_heads", required=False),
                       ffn=read("intermediate_size"), vocab=read("vocab_size"),
                       head_dim=read("head_dim", required=False))
        except ValueError as exc:
            if str(exc).startswith("HF config"):
                raise
            raise ValueError(f"HF config gives an invalid model shape: {exc}") from None

    @classmethod
    def from_torchtitan(cls, config) -> "ModelSpec":
        """The ModelSpec of a torchtitan 0.3 dense decoder config (`Llama3Model.Config` or
        `Qwen3Model.Config`, e.g. the trainer's `model_config`): width, layer count, query and
        K/V heads, head width and SwiGLU width from its per-layer list, the vocabulary from
        the config. MoE, hybrid (qwen3_5) and other families, and layers of different shapes,
        are refused with a ValueError naming them (needs the ``titan`` extra)."""
        from .integrations.torchtitan import model_spec_kwargs

        return cls(**model_spec_kwargs(config))

    def to_dict(self) -> dict:
        return asdict(self)


_MODEL_PRESETS: dict[str, dict] = {
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=176, vocab=256),
    "550m": dict(hidden=1536, layers=16, heads=12, ffn=4096, vocab=32000),
    "7b": dict(hidden=4096, layers=32, heads=32, ffn=11008, vocab=32000),
    "30b": dict(hidden=6656, layers=60, heads=52, ffn=17920, vocab=32000),
    "70b": dict(hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=32000),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelSpec:
    """A 4D layout: tensor, context, pipeline and data parallel degrees."""

    tp: int = 1
    """Tensor parallel size (with sequence parallelism)."""
    cp: int = 1
    """Context parallel size (all-gather K/V, Llama-3 style)."""
    pp: int = 1
    """Pipeline stages; layers are split evenly."""
    dp: int = 1
    """Data parallel replicas."""
    gpus_per_node: int = 8
    """Intra-node group size: TP x CP groups that fit in a node use NVLink."""

    def __post_init__(self) -> None:
        _python_numbers(self, *(f.name for f in fields(self)))
        for f in fields(self):
            _check_count("ParallelSpec", f.name, getattr(self, f.name))
        if self.world_size > INT64_MAX:
            raise ValueError(f"ParallelSpec world size tp x cp x pp x dp must be <= 2**63 - 1 (int64), got "
                             f"{self.tp} x {self.cp} x {self.pp} x {self.dp} = {self.world_size}")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareSpec:
    """One accelerator and its links. Bandwidths are per GPU, one direction, GB/s (1e9 B/s)."""

    name: str = "custom"
    peak_tflops: float
    """Dense bf16 peak, TFLOP/s."""
    gemm_efficiency: float
    """Achieved fraction of peak on large GEMMs."""
    attn_efficiency: float
    """Achieved fraction of peak of the attention kernel on long (>= 256-row) tiles."""
    hbm_gbps: float
    """Device memory bandwidth."""
    nvlink_gbps: float
    """Intra-node link bandwidth."""
    network_gbps: float
    """Inter-node bandwidth per GPU."""
    kernel_launch_s: float = 5e-6
    """Fixed cost of one kernel launch (per micro-batch and layer constants use it)."""

    def __post_init__(self) -> None:
        _python_numbers(self, *(f.name for f in fields(self)))
        _check_positive(self, "peak_tflops", "hbm_gbps", "nvlink_gbps", "network_gbps")
        _check_fraction(self, "gemm_efficiency", "attn_efficiency")
        value = self.kernel_launch_s
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0
                or not _finite(value)):
            raise ValueError(f"HardwareSpec.kernel_launch_s must be a finite number of seconds >= 0, got {value!r}")

    @classmethod
    def preset(cls, name: str) -> "HardwareSpec":
        """One of "h100", "h200", "cpu".

        - "h100": H100 SXM5 datasheet: 989 TFLOP/s dense bf16, HBM3 3.35 TB/s, NVLink 4
          900 GB/s bidirectional (450 one way), 400 Gb/s RoCE/IB per GPU (50 GB/s).
          Efficiencies: 0.75 for GEMM and 0.25 for the document-masked attention kernel. These
          are not measured: they were chosen so that the default length distribution
          reproduces the paper's Plain-4D imbalance of 1.44 at 7B-128K (docs/profiling.md);
          with FA2-class values such as 0.60 / 0.45 no distribution with the paper's short-
          document share exceeds about 1.3. Replace them with `wlb-opt profile` on a GPU.
        - "h200": same compute as H100, HBM3e 4.8 TB/s.
        - "cpu": a 2-core x86 host running fp32 (about 0.1 TFLOP/s peak), for examples.
        """
        return _preset(cls, _HARDWARE_PRESETS, name)

    def to_dict(self) -> dict:
        return asdict(self)


_HARDWARE_PRESETS: dict[str, dict] = {
    "h100": dict(peak_tflops=989.0, gemm_efficiency=0.75, attn_efficiency=0.25, hbm_gbps=3350.0,
                 nvlink_gbps=450.0, network_gbps=50.0),
    "h200": dict(peak_tflops=989.0, gemm_efficiency=0.76, attn_efficiency=0.27, hbm_gbps=4800.0,
                 nvlink_gbps=450.0, network_gbps=50.0),
    "cpu": dict(peak_tflops=0.1, gemm_efficiency=0.5, attn_efficiency=0.3, hbm_gbps=20.0,
                nvlink_gbps=10.0, network_gbps=1.0, kernel_launch_s=2e-6),
}
