"""torchtitan adapter: torchtitan's decoders under WLB's variable-length 4D step.

- `use_wlb_attention(model_config)` replaces every layer's inner attention in a torchtitan
  `Decoder.Config` by `WLBAttention`, before the model is built, so that torchtitan's own
  parallelize functions shard it: its forward takes ``(q_BLNH, k_BLNH, v_BLNH)`` positionally
  (the names torchtitan's `local_map` shardings are keyed on; under TP each rank sees its own
  heads) and gets the document boundaries explicitly, as its ``attention_masks`` argument: the
  executor's CP attention over the micro-batch's ShardPlan segments. Nothing is inferred from
  positions, so positions continue across the pieces of a long document (RoPE) while every
  piece stays its own document.
- `titan_stages(model, pp, virtual_stages=1)` cuts a built decoder into the executor's
  stages (``stage(x, positions, attend)``, `wlb_opt.executor.model.Stage`'s contract:
  embeddings, layers, final norm, `head` = the LM head), sharing its parameters, with layers
  split evenly as the cost model assumes.
- `WLBDataLoader` is a torchtitan `BaseDataLoader` (and `Stateful`) over a `WLBStream`;
  `WLBTrainer` is a torchtitan `Trainer` whose step runs `wlb_opt.executor.train_step` over
  torchtitan's model parts and meshes, keeping torchtitan's optimizer, LR schedule, gradient
  clipping, metrics and checkpointer (see their docstrings).
- `run_on_cpu()` makes torchtitan run on a CPU with gloo (tests, examples); on a GPU it is
  not called and nothing of it is used.

Supported families: torchtitan's dense llama3 and qwen3 decoders (fused or separate Q/K/V).
The others are refused by name (`check_family`): MoE layers, qwen3_5's linear-attention
layers, gpt_oss, deepseek_v3, kimi_k2_7, muse_glimmer, flux. Tested with torchtitan
`TESTED_TORCHTITAN`; its APIs move between releases.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from itertools import chain

import torch
from torch import nn

from .._optional import require
from ..executor.model import without_dummy_row
from ..schedule import check_pipeline_shape

require("torchtitan", "wlb_opt.integrations.torchtitan")

from torchtitan.models.common.attention import GQAttention  # noqa: E402
from torchtitan.protocols.module import Module  # noqa: E402

TESTED_TORCHTITAN = "0.3.0"
_log = logging.getLogger("wlb_opt")

SUPPORTED = ("llama3", "qwen3")
_REFUSED = {
    "Qwen35Model": "qwen3_5 (its linear-attention layers cannot be expressed as segment tables)",
    "GptOssModel": "gpt_oss (MoE layers and attention sinks)",
    "DeepSeekV3Model": "deepseek_v3 (MLA and MoE layers)",
    "KimiK25Model": "kimi_k2_7 (MLA and MoE layers)",
    "MuseGlimmerModel": "muse_glimmer (sliding-window layers and soft-capping)",
    "FluxModel": "flux (a diffusion model, not a decoder LM)",
}


# ---------------------------------------------------------------------- families
def check_family(config) -> str:
    """The family of a torchtitan `Decoder.Config` ("llama3" or "qwen3"), or a ValueError
    naming what is not supported: another family, an MoE layer, a layer without full
    attention, an attention that is not torchtitan's plain GQAttention, or layers of
    different shapes."""
    owner = type(config).__qualname__.split(".")[0]
    if owner in _REFUSED:
        raise ValueError(f"torchtitan model {_REFUSED[owner]} is not supported by wlb-opt; supported: "
                         f"dense {' and '.join(SUPPORTED)}")
    family = {"Llama3Model": "llama3", "Qwen3Model": "qwen3"}.get(owner)
    if family is None:
        raise ValueError(f"torchtitan model config {type(config).__qualname__} is not a family wlb-opt knows; "
                         f"supported: dense {' and '.join(SUPPORTED)} (Llama3Model.Config, Qwen3Model.Config)")
    layers = list(getattr(config, "layers", None) or [])
    if not layers:
        raise ValueError(f"torchtitan {family} config has no layers")
    for i, layer in enumerate(layers):
        if getattr(layer, "moe", None) is not None or getattr(layer, "feed_forward", None) is None:
            raise ValueError(f"torchtitan {family} layer {i} is an MoE layer; wlb-opt supports dense layers only "
                             f"(a {family} flavor without moe)")
        attention = getattr(layer, "attention", None)
        if attention is None or type(attention) is not GQAttention.Config:
            kind = "no attention" if attention is None else type(attention).__qualname__
            raise ValueError(f"torchtitan {family} layer {i} has {kind}; wlb-opt supports GQAttention layers only")
    shapes = {_layer_shape(layer) for layer in layers}
    if len(shapes) > 1:
        raise ValueError(f"torchtitan {family} layers differ in shape ({sorted(shapes)}); wlb-opt's cost model needs "
                         "every layer alike")
    return family


def _layer_shape(layer) -> tuple:
    a = layer.attention
    n_kv = a.n_kv_heads or a.n_heads
    head_dim = a.head_dim or a.dim // a.n_heads
    return (a.dim, a.n_heads, n_kv, head_dim, layer.feed_forward.w1.out_features)


def model_spec_kwargs(config) -> dict:
    """`ModelSpec` fields of a torchtitan dense decoder config (see `ModelSpec.from_torchtitan`)."""
    family = check_family(config)
    dim, heads, kv_heads, head_dim, ffn = _layer_shape(config.layers[0])
    return dict(name=f"torchtitan-{family}", hidden=int(config.dim), layers=len(config.layers), heads=int(heads),
                kv_heads=int(kv_heads), ffn=int(ffn), vocab=int(config.vocab_size), head_dim=int(head_dim))


# ---------------------------------------------------------------------- attention
class Boundaries:
    """What a layer gets as ``attention_masks``: the executor's attention callable of one
    micro-batch (`attend(q, k, v, softmax_scale=)` over this rank's [T, heads, head_dim] rows,
    document-masked by the ShardPlan's segment table, CP K/V gathered inside)."""

    __slots__ = ("attend",)

    def __init__(self, attend):
        self.attend = attend


class WLBAttention(Module):
    """torchtitan inner attention that runs the executor's document-masked (CP) attention.

    ``forward(q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale=None, enable_gqa=False)``:
    batch 1, ``attention_masks`` a `Boundaries` (the stages pass it), GQA by head count
    (the executor's attention groups query heads over K/V heads itself), ``scale`` the
    softmax scale (qwen3 gives head_dim**-0.5; None: 1/sqrt(head_dim))."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: "WLBAttention.Config | None" = None):
        super().__init__()

    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *, attention_masks=None,
                scale: float | None = None, enable_gqa: bool = False, **kwargs) -> torch.Tensor:
        if not isinstance(attention_masks, Boundaries):
            raise ValueError("WLBAttention needs the micro-batch's document boundaries (a Boundaries from the "
                             "executor); run the model through titan_stages / WLBTrainer, not its own forward, got "
                             f"attention_masks={type(attention_masks).__name__}")
        if q_BLNH.shape[0] != 1:
            raise ValueError(f"WLBAttention runs one packed sequence (batch 1), got batch {q_BLNH.shape[0]}")
        out = attention_masks.attend(q_BLNH[0], k_BLNH[0], v_BLNH[0], softmax_scale=scale)
        return out.unsqueeze(0)


def use_wlb_attention(model_config) -> None:
    """Replace every layer's inner attention config of a torchtitan dense decoder config by
    `WLBAttention.Config()` (in place, before the model is built; checks the family first)."""
    check_family(model_config)
    for layer in model_config.layers:
        layer.attention.inner_attention = WLBAttention.Config()


def _check_wlb_attention(decoder: nn.Module) -> None:
    for name, layer in decoder.layers.items():
        inner = getattr(getattr(layer, "attention", None), "inner_attention", None)
        if not isinstance(inner, WLBAttention):
            raise ValueError(f"layer {name}'s inner attention is {type(inner).__name__}, not WLBAttention: call "
                             "use_wlb_attention(model_config) before building the model")


# ---------------------------------------------------------------------- stages
class TitanStage(nn.Module):
    """A contiguous slice of a torchtitan decoder as one executor stage (shares its modules).

    `embed` (first stage), `blocks` (the torchtitan layers), `norm` and `head` (last stage:
    it returns the normed hidden states; the loss applies `head`). ``hidden`` is the width
    sent between stages. `max_position` is the RoPE table's size: a micro-batch whose pieces
    reach past it is refused before any layer runs (torchtitan indexes its RoPE cache by
    position, and positions continue across the pieces of a document)."""

    def __init__(self, embed, blocks, norm, head, hidden: int, max_position: int | None, fsdp_root=None,
                 decoder=None):
        super().__init__()
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)
        self.norm, self.head, self.hidden, self.max_position = norm, head, hidden, max_position
        self._fsdp_root = [fsdp_root] if fsdp_root is not None else []  # a list: not registered as a child
        self.decoder = decoder
        """The whole (partial) torchtitan Decoder when the stage is one, run through its own
        forward (FSDP2's root hooks run there), with its LM head left to the loss."""
        if decoder is not None:
            decoder._skip_lm_head = True

    @property
    def fsdp_root(self):
        """The FSDP2 module whose gradient sync this stage's backward controls (a torchtitan
        model part sharded by torchtitan's parallelize function), or None."""
        return self._fsdp_root[0] if self._fsdp_root else None

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """FSDP2's switch, on the model part this stage runs (see `fsdp_root`)."""
        if self.fsdp_root is None:
            raise ValueError("this stage's model part is not sharded with FSDP2")
        self.fsdp_root.set_requires_gradient_sync(requires_gradient_sync)

    @classmethod
    def from_decoder(cls, decoder: nn.Module, *, fsdp_root=None) -> "TitanStage":
        """The stage of a (partial) torchtitan Decoder: its parts that are not None."""
        _check_wlb_attention(decoder)
        return cls(decoder.tok_embeddings, list(decoder.layers.values()), decoder.norm, decoder.lm_head,
                   _hidden(decoder), _max_position(decoder), fsdp_root=fsdp_root, decoder=decoder)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        shard = getattr(attend, "shard", None)
        if self.max_position is not None and shard is not None and len(shard.lengths):
            reach = int((shard.offsets + shard.lengths).max())
            if reach > self.max_position:
                raise ValueError(f"a piece reaches position {reach - 1} of its document but the model's RoPE table "
                                 f"holds {self.max_position} positions; set training.seq_len (torchtitan resizes "
                                 "RoPE to it) to at least the longest document's length")
        empty = x.shape[0] == 0
        if empty:  # torchtitan's layers reshape with -1: run one dummy row, attention sees zero rows
            x = (torch.zeros(1, dtype=torch.long, device=x.device) if self.embed is not None
                 else x.new_zeros((1,) + tuple(x.shape[1:])))
            positions = torch.zeros(1, dtype=torch.long, device=x.device)
            attend = without_dummy_row(attend)
        masks, pos = Boundaries(attend), positions.unsqueeze(0)
        if self.decoder is not None:  # embeddings, layers and norm, as the part has them
            h = self.decoder(x.unsqueeze(0), pos, masks).squeeze(0)
        else:
            h = self.embed(x.unsqueeze(0)) if self.embed is not None else x.unsqueeze(0)
            for block in self.blocks:
                h = block(h, masks, pos)
            h = h.squeeze(0)
            if self.head is not None:
                h = self.norm(h)
        if self.head is None:  # what the pipeline carries: the autocast dtype
            kind = h.device.type
            h = h.to(torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else h
        return h[:0] if empty else h


def _hidden(decoder) -> int:
    config = getattr(decoder, "config", None)
    if config is not None and getattr(config, "dim", None):
        return int(config.dim)
    first = next(iter(decoder.layers.values()))
    return int(first.attention_norm.normalized_shape[0])


def _max_position(decoder) -> int | None:
    for layer in decoder.layers.values():
        cache = getattr(getattr(layer.attention, "rope", None), "cache", None)
        if cache is not None and cache.ndim >= 1 and cache.device.type != "meta":
            return int(cache.shape[0])
    return None


def stage_bounds(n_layers: int, n_stages: int) -> list[int]:
    """Layer boundaries of `n_stages` stages, split evenly as the cost model (and
    `wlb_opt.executor.split_stages`) does."""
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {n_stages} stages; pp x virtual_stages must be "
                         "between 1 and the number of layers")
    return [round(i * n_layers / n_stages) for i in range(n_stages + 1)]


def titan_stages(model: nn.Module, pp: int, virtual_stages: int = 1) -> list[TitanStage]:
    """The pp x virtual_stages stages of a built torchtitan decoder (built after
    `use_wlb_attention`), in pipeline order, sharing its parameters. Pipeline rank r holds
    ``titan_stages(model, pp, v)[r::pp]``; with pp = v = 1 the whole model is one stage."""
    for name, value in (("pp", pp), ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"titan_stages: {name} must be an integer >= 1, got {value!r}")
    config = getattr(model, "config", None)
    if config is not None:
        check_family(config)
    _check_wlb_attention(model)
    if pp > 1 and getattr(model.lm_head, "weight", None) is getattr(model.tok_embeddings, "weight", False):
        raise ValueError("titan_stages: the model ties its LM head to its embeddings (enable_weight_tying=True); "
                         f"with pp={pp} the first and last stages live on different ranks, each with its own copy "
                         "of the weight and only its own stage's share of the gradient. Untie them for pp > 1")
    layers = list(model.layers.values())
    n = pp * virtual_stages
    bounds = stage_bounds(len(layers), n)
    hidden, max_position = _hidden(model), _max_position(model)
    return [TitanStage(model.tok_embeddings if s == 0 else None, layers[bounds[s]:bounds[s + 1]],
                       model.norm if s == n - 1 else None, model.lm_head if s == n - 1 else None, hidden,
                       max_position) for s in range(n)]


def full_logits_loss(hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module) -> torch.Tensor:
    """Summed next-token cross-entropy with the LM head applied once to the whole micro-batch
    (as torchtitan's CrossEntropyLoss does), in fp32 (fp64 stays fp64). Under FSDP the head
    must run exactly once per micro-batch on every rank of its group (each call is a
    collective), which the executor's chunked loss does not promise when ranks hold
    different token counts. Under TP the head's vocabulary-sharded output is gathered (the
    full logits, on every TP rank)."""
    logits = head(hidden)
    if hasattr(logits, "full_tensor"):  # torchtitan's TP plan shards the head's output over the vocabulary
        logits = logits.full_tensor()
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


# ---------------------------------------------------------------------- reference
def reference_loss(model: nn.Module, step, dp_rank: int | None = None) -> torch.Tensor:
    """torchtitan's own path on one process, as the reference of a WLB step: every piece of
    the step's plan (of replica `dp_rank`, or all) through the decoder as its own batch-1
    sequence with causal SDPA and positions offset + arange, the summed token losses divided
    by the step's target count. `model` is a torchtitan decoder built with the same weights
    and `ScaledDotProductAttention` as its inner attention."""
    import numpy as np

    from ..batch import pack_micro_batch

    plan = step.plan
    mbs = range(len(plan.micro_batches)) if dp_rank is None else plan.replica_micro_batches(dp_rank)
    total = None
    device = next(model.parameters()).device
    for j in mbs:
        mb = plan.micro_batches[j]
        if not len(mb):
            continue
        tokens, labels = pack_micro_batch(plan, j, step)
        start = 0
        for i in mb:
            length, offset = int(plan.lengths[i]), int(plan.offsets[i])
            ids = tokens[start:start + length].to(device)[None]
            pos = torch.arange(offset, offset + length, device=device)[None]
            logits = model(ids, pos)[0]
            logits = logits if logits.dtype == torch.float64 else logits.float()
            piece = torch.nn.functional.cross_entropy(logits, labels[start:start + length].to(device),
                                                      ignore_index=-100, reduction="sum")
            total = piece if total is None else total + piece
            start += length
        assert start == int(np.sum(plan.lengths[mb]))
    return total / step.target_tokens


# ---------------------------------------------------------------------- CPU
class _NoDeviceMemory:
    """torchtitan's device-memory monitor on a CPU (its own calls CUDA memory APIs)."""

    device_name = "cpu"

    def get_peak_stats(self):
        from torchtitan.components.metrics import DeviceMemStats

        return DeviceMemStats(0, 0, 0.0, 0.0, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


def run_on_cpu() -> None:
    """Make torchtitan run on a CPU with gloo: its device defaults to CUDA when none is
    found (`tools.utils.device_type`, copied by several of its modules at import), its
    metrics read CUDA memory statistics, and `set_pg_timeouts` calls a barrier with device
    ids. Patches those three points, in every torchtitan module already imported; call it
    before building a Trainer on a machine without GPUs (tests, examples). The
    fourth point, FlexAttention having no CPU backward, does not arise: WLB's stages use
    `WLBAttention`. Where CUDA is available it does nothing."""
    import sys

    if torch.cuda.is_available():
        return

    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools_utils

    torch._utils._get_available_device_type = lambda: "cpu"
    for name, module in list(sys.modules.items()):
        if not name.startswith("torchtitan") or module is None:
            continue
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = torch.cpu
    tools_utils.device_type, tools_utils.device_module = "cpu", torch.cpu
    metrics.build_device_memory_monitor = lambda: _NoDeviceMemory()
    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None


# ---------------------------------------------------------------------- data loader
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.loss import CrossEntropyLoss  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer, default_adamw  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

STATE_KEY = "wlb_stream"
"""Key of the stream's JSON state in `WLBDataLoader.state_dict()` (under torchtitan's
checkpoint key "dataloader")."""
DONE_KEY = "wlb_stream_micro_batches_done"
"""The loader's state besides the stream's: micro-batches of the next step already handed out."""


class WLBDataLoader(BaseDataLoader):
    """A torchtitan data loader (`BaseDataLoader`, `Stateful`) over a `WLBStream`.

    Every rank iterates the whole stream (the same plans on every rank; each runs its own
    part of a step: `step.local(dp_rank, cp_rank)`). `steps()` yields whole steps, which
    `WLBTrainer` runs; iterating the loader itself yields what a stock torchtitan Trainer
    consumes: this DP rank's micro-batches one at a time, as ``({"input", "positions"},
    labels)`` of batch 1 with positions restarting at 0 at each piece (torchtitan's document
    convention; that gives a stock Trainer WLB's balanced DP packing, not its PP or CP; an
    empty slot is one token with no target).

    `state_dict()` is the stream's state after what was handed out: after a whole step
    (`steps()`, or the last micro-batch of a step), or before a step with the number of its
    micro-batches already handed out (a stock Trainer whose optimizer steps take fewer
    micro-batches than a WLB step holds); torchtitan's checkpointer saves it after training
    an optimizer step, and a resume hands out exactly what had not been; a loop left within a
    step and entered again (a new iter()) goes on where it stopped. A checkpoint taken
    within a step resumes only through the iterator (`steps()` runs whole steps). Built by torchtitan from `WLBDataLoader.Config(stream=...)`, or
    directly as ``WLBDataLoader(stream, dp_world_size=, dp_rank=, seq_len=)``. Refused by
    name: a stream whose packer has another DP degree than the trainer's batch degree, a
    stock-Trainer batch size other than 1, a position past ``training.seq_len`` (the size
    of torchtitan's RoPE table: with `steps()` positions continue across the pieces of a
    document, through the iterator they restart at each piece)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        stream: object = None
        """The `WLBStream` (its packer's dp must equal the trainer's DP degree)."""

    def __init__(self, config, *, dp_world_size: int = 1, dp_rank: int = 0, tokenizer=None,
                 seq_len: int | None = None, local_batch_size: int | None = None, **kwargs):
        from ..stream import WLBStream

        if isinstance(config, WLBStream):  # WLBDataLoader(stream, ...): the config built here
            config = WLBDataLoader.Config(stream=config)
        stream = config.stream
        if not isinstance(stream, WLBStream):
            raise ValueError(f"WLBDataLoader.Config.stream must be a wlb_opt.WLBStream, got {type(stream).__name__}")
        if stream.packer.dp != dp_world_size:
            raise ValueError(f"WLBDataLoader: the stream's packer plans dp={stream.packer.dp} replicas but the trainer "
                             f"has a DP degree (dp_replicate x dp_shard) of {dp_world_size}")
        self.stream, self.dp_rank, self.seq_len = stream, dp_rank, seq_len
        self.local_batch_size = local_batch_size
        self._state = stream.state_dict()
        self._done = 0  # micro-batches of the next step already handed out (the iterator's)
        # the step the iterator is handing out and the position of its next item, while a step is
        # handed out in part: a new iter() (a loop left and entered again) goes on from there
        self._partial = None

    @property
    def n_micro(self) -> int:
        return self.stream.packer.n_micro

    def steps(self):
        """The stream's steps, each checked against the RoPE table; the state advances when a
        step is handed out."""
        if self._done:
            raise ValueError(f"WLBDataLoader.steps(): the loaded state is within a step ({self._done} of its "
                             "micro-batches handed out through the iterator); resume it through the iterator")
        for step in self.stream:
            self._check_positions(step, restart=False)
            self._state = step.state
            yield step

    def _check_positions(self, step, restart: bool) -> None:
        """Positions continue across the pieces of a document (`steps()`), or restart at 0 at
        each piece (`restart`: the iterator's)."""
        plan = step.plan
        placed = [i for mb in plan.micro_batches for i in mb]
        if self.seq_len is None or not placed:
            return
        reach = plan.lengths[placed] + (0 if restart else plan.offsets[placed])
        worst = int(reach.argmax())
        if int(reach[worst]) > self.seq_len:
            i = placed[worst]
            raise ValueError(f"step {step.index}: document {int(plan.doc_ids[i])} reaches position "
                             f"{int(reach[worst]) - 1} (piece at offset {int(plan.offsets[i])}, "
                             f"{int(plan.lengths[i])} tokens), past training.seq_len={self.seq_len}, the size of "
                             "torchtitan's RoPE table; set training.seq_len to at least "
                             + ("the longest piece's length (the packer's max_tokens)" if restart
                                else "the longest document's length"))

    def __iter__(self):
        from ..batch import pack_micro_batch

        if self.local_batch_size not in (None, 1):
            raise ValueError(f"WLBDataLoader yields one packed micro-batch per item: a stock Trainer needs "
                             f"training.local_batch_size=1 (got {self.local_batch_size}) and gradient accumulation x "
                             f"pipeline micro-batches = n_micro ({self.n_micro}); WLBTrainer runs whole steps")
        before = self._state
        if self._partial is not None:  # an earlier iterator stopped within this step: go on where it stopped
            partial, skip = self._partial
            steps = chain([partial], self.stream)
        else:  # skip: the step's items handed out before the checkpoint this state came from
            partial, skip = None, self._done
            steps = iter(self.stream)
        for step in steps:
            if step is not partial:
                self._check_positions(step, restart=True)
            plan = step.plan
            local = list(step.local(self.dp_rank))
            for k, j in enumerate(local):
                if k < skip:
                    continue
                # what the trainer holds once it has this item: the whole step after its last
                last = k == len(local) - 1
                self._state, self._done = (step.state, 0) if last else (before, k + 1)
                self._partial = None if last else (step, k + 1)
                if not len(plan.micro_batches[j]):  # an empty slot: one ignored token keeps the count
                    zero = torch.zeros(1, 1, dtype=torch.long)
                    yield {"input": zero, "positions": zero.clone()}, torch.full((1, 1), -100, dtype=torch.long)
                    continue
                tokens, labels = pack_micro_batch(plan, j, step)
                positions = torch.cat([torch.arange(int(n)) for n in plan.lengths[plan.micro_batches[j]]])
                yield {"input": tokens[None], "positions": positions[None]}, labels[None]
            skip, before = 0, step.state

    def state_dict(self) -> dict:
        import json

        return {STATE_KEY: json.dumps(self._state), DONE_KEY: self._done}

    def load_state_dict(self, state_dict: dict) -> None:
        import json

        if STATE_KEY not in state_dict:
            raise ValueError(f"WLBDataLoader.load_state_dict: no {STATE_KEY!r} in the checkpoint's dataloader state "
                             f"(keys: {sorted(state_dict)}); it was not saved by a WLBDataLoader")
        state = json.loads(state_dict[STATE_KEY])
        done = state_dict.get(DONE_KEY, 0)
        if isinstance(done, bool) or not isinstance(done, int) or not 0 <= done < self.n_micro:
            raise ValueError(f"WLBDataLoader.load_state_dict: {DONE_KEY!r} must be an integer in [0, n_micro) = "
                             f"[0, {self.n_micro}) (micro-batches of the next step already handed out), got {done!r}")
        self.stream.load_state_dict(state)
        self._state, self._done, self._partial = state, done, None


class NoTokenizer(BaseTokenizer):
    """The tokenizer slot of a WLB trainer: the stream brings token ids, nothing is encoded."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 0

    def __init__(self, config: "NoTokenizer.Config", *, tokenizer_path=None, **kwargs):
        super().__init__()
        self.vocab_size = config.vocab_size

    def encode(self, *args, **kwargs) -> list[int]:
        raise ValueError("WLB trainers take token ids from the WLBStream; nothing is encoded")

    def decode(self, *args, **kwargs) -> str:
        raise ValueError("WLB trainers take token ids from the WLBStream; nothing is decoded")

    def get_vocab_size(self) -> int:
        return self.vocab_size


# ---------------------------------------------------------------------- trainer
SPMD_BACKENDS = ("partial_dtensor",)
"""torchtitan `parallelism.spmd_backend` values WLBTrainer runs: "partial_dtensor" (DTensor on the
model-parallel axes only). "spmd_types" (torchtitan's default) fails in FSDP2 setup with torch
2.13 at any DP or TP degree, and "full_dtensor" hands the model DTensor inputs."""


class _WithoutTitanCP:
    """torchtitan's ParallelDims as its parallelize functions should see them under WLB: CP
    "disabled", so that they do not install torchtitan's own CP (which shards each sequence
    its own way); the meshes, FSDP's dp_shard x cp included, are unchanged. WLB's stages run
    CP themselves, over the shard plan."""

    cp_enabled = False

    def __init__(self, dims):
        self._dims = dims

    def __getattr__(self, name):
        return getattr(self._dims, name)


def _wlb_parallelize(parallelize_fn):
    def parallelize(model, *, parallel_dims, **kwargs):
        model = parallelize_fn(model, parallel_dims=_WithoutTitanCP(parallel_dims), **kwargs)
        import torch.distributed as dist
        from torch.distributed.fsdp import FSDPModule

        if dist.is_initialized() and "gloo" in str(dist.get_backend()).lower():
            # torchtitan sums gradients (divide factor 1), which FSDP2 does with PREMUL_SUM; gloo has no such op
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
        return model
    return parallelize


def _wlb_pipelining(virtual_stages: int):
    """A torchtitan `pipelining_fn` that builds no schedule: this pipeline rank's
    `virtual_stages` model parts (partial decoders with the layers `titan_stages` would give
    them), each parallelized by torchtitan's parallelize function."""
    def pipeline(model, *, parallel_dims, training, parallelism, compile_config, ac_config, dump_folder, device,
                 model_config, parallelize_fn, loss_fn):
        import copy

        pp = parallel_dims.pp
        pp_rank = parallel_dims.get_mesh("pp").get_local_rank()
        n = pp * virtual_stages
        keys = list(model.layers.keys())
        bounds = stage_bounds(len(keys), n)
        parts = []
        for s in range(pp_rank, n, pp):
            part = copy.deepcopy(model)  # on the meta device: no memory
            keep = set(keys[bounds[s]:bounds[s + 1]])
            for key in keys:
                if key not in keep:
                    del part.layers[key]
            if s != 0:
                part.tok_embeddings = None
            if s != n - 1:
                part.norm, part.lm_head = None, None
            parts.append(parallelize_fn(part, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                                        compile_config=compile_config, ac_config=ac_config, dump_folder=dump_folder))
        return None, parts, pp_rank == 0, pp_rank == pp - 1
    return pipeline


def wlb_mesh(parallel_dims):
    """wlb-opt's `Mesh` over torchtitan's meshes: its named sub-mesh of the dimensions
    pp, batch (our dp), cp and tp that are larger than 1 (None on one process)."""
    from ..executor.mesh import Mesh

    sizes = {"pp": parallel_dims.pp, "batch": parallel_dims.dp_replicate * parallel_dims.dp_shard,
             "cp": parallel_dims.cp, "tp": parallel_dims.tp}
    dims = [d for d, size in sizes.items() if size > 1]
    if not dims:
        return None
    return Mesh.from_device_mesh(parallel_dims.get_mesh(dims), names={"batch": "dp"} if "batch" in dims else None)


class WLBTrainer(Trainer):
    """A torchtitan Trainer whose step is WLB's: `wlb_opt.executor.train_step` runs a whole
    planned step (variable-length micro-batches, WLB's CP sharding and attention, the
    executor's 1F1B or interleaved pipeline) over torchtitan's model parts and meshes, then
    torchtitan's own gradient clipping, optimizer, LR schedule, metrics and checkpointer run
    as in `Trainer.train_step` (this class overrides `train_step` and `batch_generator`).

    What it sets up: every layer's inner attention becomes `WLBAttention`
    (`use_wlb_attention`); torchtitan's parallelize function runs as usual (TP, activation
    checkpointing, compile, FSDP2) except its own CP; with PP, a pipelining function builds
    this rank's parts with `titan_stages`' layer split and no `pp_schedule`. The loss is
    `full_logits_loss` over the global batch's target tokens (torchtitan's `loss` config is
    not used). Gradients are reduced by torchtitan's FSDP2 over dp x cp.

    torchtitan's `pipeline_parallel_schedule` is not used (the executor's schedule is 1F1B,
    interleaved when `virtual_stages` > 1), nor is its CP (`_WithoutTitanCP`).

    Refused by name, before anything is built: a data loader that is not a `WLBDataLoader`,
    a stream sharded for another CP degree than `parallelism.context_parallel_degree`, a
    model family `check_family` refuses, `training.local_batch_size` other than the
    packer's n_micro (one packed sequence per micro-batch), gradient accumulation, an
    `spmd_backend` outside `SPMD_BACKENDS`, sequence parallelism with TP > 1, TP > 1 with
    more than one data-parallel replica (DTensor could not add up the micro-batches'
    gradients of a row-wise weight), expert parallelism, weight tying with PP, a loss other
    than `CrossEntropyLoss` (chunked included), the validator, a custom layer split per
    pipeline stage, `virtual_stages` > 1 without PP or with n_micro not a multiple of it."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        tokenizer: BaseTokenizer.Config = dataclasses.field(default_factory=NoTokenizer.Config)
        dataloader: BaseDataLoader.Config = dataclasses.field(default_factory=WLBDataLoader.Config)
        loss: CrossEntropyLoss.Config = dataclasses.field(default_factory=CrossEntropyLoss.Config)
        optimizer: OptimizersContainer.Config = dataclasses.field(default_factory=default_adamw)
        """torchtitan's AdamW (its own default has no parameter groups and cannot be built)."""
        virtual_stages: int = 1
        """Model chunks per pipeline rank (1: 1F1B; more: interleaved 1F1B)."""
        attention_backend: str = "auto"
        """The executor's attention backend ("auto": Triton on CUDA, torch on CPU)."""

    def __init__(self, config: "WLBTrainer.Config"):
        check_trainer_config(config)
        use_wlb_attention(config.model_spec.model)
        config.model_spec = dataclasses.replace(
            config.model_spec, parallelize_fn=_wlb_parallelize(config.model_spec.parallelize_fn),
            pipelining_fn=_wlb_pipelining(config.virtual_stages))
        super().__init__(config)
        from ..executor.fsdp import is_fsdp

        self.wlb_mesh = wlb_mesh(self.parallel_dims)
        self.wlb_stages = [TitanStage.from_decoder(part, fsdp_root=part if is_fsdp(part) else None)
                           for part in self.model_parts]

    def batch_generator(self, data_iterable):
        """Whole WLB steps (not micro-batches) from the `WLBDataLoader`."""
        from torchtitan.components.dataloader import DataloaderExhaustedError

        steps = data_iterable.steps()
        while True:
            try:
                yield next(steps)
            except StopIteration as exc:
                raise DataloaderExhaustedError() from exc

    def train_step(self, data_iterator) -> None:
        """One WLB step, then torchtitan's clipping, optimizer, LR and metrics."""
        import time

        from torchtitan.distributed import utils as dist_utils

        from ..executor import train_step

        self.optimizers.zero_grad(set_to_none=self.config.training.disable_cuda_graphs)
        lr_metrics = self.lr_schedulers.get_metrics()
        started = time.perf_counter()
        step = next(data_iterator)
        self.metrics_processor.data_loading_times.append(time.perf_counter() - started)
        loss = train_step(self.wlb_stages, step.plan, step.shards, data=step, mesh=self.wlb_mesh,
                          loss_fn=full_logits_loss, reduce_grads=False, backend=self.config.attention_backend)
        if not math.isfinite(loss):  # the global loss: every rank stops alike, before the step is checkpointed
            raise RuntimeError(f"Loss is not finite (loss={loss}) at step {self.step}. Stopping training.")
        plan = step.plan
        tokens = int(plan.lengths[[i for mb in plan.micro_batches for i in mb]].sum())
        self.ntokens_seen += tokens
        # as torchtitan counts: this rank's replica's tokens (its metrics divide by the
        # non-data-parallel ranks to give tokens per second per device)
        dp_rank = self.wlb_mesh.dp_rank if self.wlb_mesh is not None else 0
        mine = [i for j in plan.replica_micro_batches(dp_rank) for i in plan.micro_batches[j]]
        self.metrics_processor.ntokens_since_last_log += int(plan.lengths[mine].sum())
        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()], self.config.training.max_norm, foreach=True,
            pp_mesh=self.parallel_dims.get_optional_mesh("pp"), ep_enabled=self.parallel_dims.ep_enabled)
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        self.last_loss = loss
        if self.metrics_processor.should_log(self.step):
            self.metrics_processor.log(self.step, loss, loss, float(grad_norm.item()),
                                       extra_metrics={"n_tokens_seen": self.ntokens_seen, **lr_metrics})


def check_trainer_config(config) -> None:
    """The ValueErrors of `WLBTrainer` (see its docstring), raised before anything is built."""
    loader = config.dataloader
    if not isinstance(loader, WLBDataLoader.Config):
        raise ValueError(f"WLBTrainer needs dataloader=WLBDataLoader.Config(stream=...), got "
                         f"{type(loader).__qualname__}")
    if loader.stream is None:
        raise ValueError("WLBTrainer: WLBDataLoader.Config.stream is None; give it the WLBStream")
    check_family(config.model_spec.model)
    training, parallelism = config.training, config.parallelism
    n_micro = loader.stream.packer.n_micro
    if training.local_batch_size != n_micro:
        raise ValueError(f"WLBTrainer: training.local_batch_size={training.local_batch_size} must equal the packer's "
                         f"n_micro={n_micro} (each micro-batch is one packed sequence of a replica's step)")
    if training.global_batch_size not in (-1, None):
        raise ValueError(f"WLBTrainer runs one planned step per optimizer step: leave training.global_batch_size at -1 "
                         f"(no gradient accumulation), got {training.global_batch_size}")
    cp = getattr(parallelism, "context_parallel_degree", 1)
    if loader.stream.cp != cp:
        raise ValueError(f"WLBTrainer: the stream shards each micro-batch for cp={loader.stream.cp} ranks but "
                         f"parallelism.context_parallel_degree is {cp}; build the stream (its cost model's "
                         f"ParallelSpec, or WLBStream(cp=...)) with cp={cp}")
    if parallelism.spmd_backend not in SPMD_BACKENDS:
        raise ValueError(f"WLBTrainer: parallelism.spmd_backend={parallelism.spmd_backend!r} is not supported; use one "
                         f"of {list(SPMD_BACKENDS)}")
    if parallelism.tensor_parallel_degree > 1 and parallelism.enable_sequence_parallel:
        raise ValueError("WLBTrainer: parallelism.enable_sequence_parallel needs each rank's tokens divisible by the "
                         "TP degree, which variable-length micro-batches are not; set it to False")
    if parallelism.expert_parallel_degree > 1:
        raise ValueError("WLBTrainer: expert parallelism is not supported (dense models only)")
    if getattr(config.model_spec.model, "enable_weight_tying", False) and parallelism.pipeline_parallel_degree > 1:
        raise ValueError("WLBTrainer: weight tying with pipeline parallelism is not supported (torchtitan refuses it)")
    if type(config.loss) is not CrossEntropyLoss.Config:
        raise ValueError(f"WLBTrainer computes the loss itself (full_logits_loss over the global batch's target "
                         f"tokens); leave loss at CrossEntropyLoss.Config(), got {type(config.loss).__qualname__}")
    if getattr(config.validator, "enable", False):
        raise ValueError("WLBTrainer: validator.enable runs the model through torchtitan's own forward, which has no "
                         "document boundaries for WLBAttention; validate with train_step-free code or disable it")
    for name in ("module_fqns_per_model_part", "pipeline_parallel_layers_per_stage"):
        if getattr(parallelism, name, None) is not None:
            raise ValueError(f"WLBTrainer splits the layers evenly (titan_stages, as the cost model assumes); leave "
                             f"parallelism.{name} at None")
    v = config.virtual_stages
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"WLBTrainer.Config.virtual_stages must be an integer >= 1, got {config.virtual_stages!r}")
    check_pipeline_shape(parallelism.pipeline_parallel_degree, n_micro, v)  # v > 1 without PP would be ignored
    dp = _dp_degree(parallelism)
    if parallelism.tensor_parallel_degree > 1 and dp > 1:
        # seen on qwen3 (tp 2 x dp 2): DTensor gave one micro-batch's gradient of a row-wise
        # weight as Partial and the next one's as Shard, which it cannot add up
        raise ValueError(f"WLBTrainer: tensor_parallel_degree={parallelism.tensor_parallel_degree} with {dp} "
                         f"data-parallel replicas is not supported (DTensor cannot accumulate the micro-batches' "
                         f"gradients of the row-wise weights); use TP with CP and PP, or DP without TP")


def _dp_degree(parallelism) -> int:
    """Data-parallel replicas of the layout: replicate x shard degree, a shard degree of -1
    taking the ranks the other degrees leave (torchtitan's rule; WORLD_SIZE as torchrun sets it,
    or the process group's size)."""
    replicate, shard = parallelism.data_parallel_replicate_degree, parallelism.data_parallel_shard_degree
    if shard == -1:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        others = (replicate * parallelism.tensor_parallel_degree * parallelism.pipeline_parallel_degree
                  * getattr(parallelism, "context_parallel_degree", 1))
        shard = max(world // others, 1)
    return replicate * shard


# ---------------------------------------------------------------------- small configs
def small_config(family: str = "llama3", *, dim: int = 64, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                 vocab: int = 256, max_seq_len: int = 4096, fuse_qkv: bool = True):
    """A small torchtitan model config of `family` ("llama3" or "qwen3"), built with
    torchtitan's own layer builders (the ones its registered flavors use), for tests and
    examples on a CPU. Real runs take a registered flavor (`model_registry("8B")`)."""
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim

    if family == "llama3":
        from torchtitan.models import llama3

        init = llama3._EMBEDDING_INIT
        return llama3.Llama3Model.Config(
            dim=dim, vocab_size=vocab,
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=init),
            norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
            layers=llama3._build_llama3_layers(
                n_layers=layers, dim=dim, n_heads=heads, n_kv_heads=kv_heads,
                hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=32),
                rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=max_seq_len, theta=500000, scaling="llama"),
                attn_backend="flex", fuse_qkv=fuse_qkv))
    if family == "qwen3":
        from torchtitan.models import qwen3

        head_dim = dim // heads
        return qwen3.Qwen3Model.Config(
            vocab_size=vocab, dim=dim, norm=qwen3._qwen3_norm(dim), enable_weight_tying=False,
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=qwen3._LINEAR_INIT),
            layers=qwen3._build_qwen3_layers(
                fuse_qkv=fuse_qkv, n_layers=layers, dim=dim, n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim,
                hidden_dim=4 * dim, attn_backend="flex",
                rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=max_seq_len, theta=1e6)))
    raise ValueError(f"small_config: family must be one of {list(SUPPORTED)}, got {family!r}")


def reference_model(config, seq_len: int | None = None, device="cpu"):
    """torchtitan's own decoder for `config` (a copy; the copy's inner attention is torchtitan's
    causal SDPA, its RoPE table `seq_len` long when given), built and initialised on
    `device`: the model `reference_loss` runs, before the trained model's weights are loaded
    into it."""
    import copy

    from torchtitan.models.common import ScaledDotProductAttention

    config = copy.deepcopy(config)
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        if seq_len is not None:
            layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq_len)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))
    return model
