"""Hugging Face adapter: run transformers' causal LMs with document-masked (and CP) attention.

- `register()` adds the attention implementation ``"wlb"`` to transformers' attention registry
  (and a mask hook that builds no dense mask), so ``attn_implementation="wlb"`` runs any model
  whose attention goes through that registry (Llama, Qwen2, Mistral, Granite and their kin)
  with `doc_attention` at the model's own softmax scale (`module.scaling`). Called by the
  model's own forward on a packed batch of one row, documents are found from `position_ids`
  (a token whose position is not its predecessor's + 1 starts a document), as transformers'
  own packed path does; called by the executor, the attention is its CP attention. An
  attention that receives neither `position_ids` nor `cu_seq_lens_q` (GPT-BigCode,
  Persimmon), or, inside a stage, not the stage's attention (a decoder layer that drops its
  keyword arguments, such as StableLM's), raises a ValueError naming its class.
- `split_hf_stages(model, pp, virtual_stages=1)` cuts a causal LM (embeddings, decoder layers,
  final norm, LM head) into executor stages with the library's stage contract
  ``stage(x, positions, attend)`` (`wlb_opt.executor.model.Stage`), sharing the model's
  parameters, so `train_step` runs it under PP, CP, DP, TP and FSDP2.
- Labels: inside the library, labels are pre-shifted (`labels[i]` is the token after i within
  the piece, -100 at each piece's last token). Transformers' convention is unshifted labels
  with -100 at each sequence's first token, the loss shifting inside; `hf_batch(step, j)`
  gives a micro-batch in that convention for a model's own forward, `to_hf_labels` converts.

Sliding-window and chunked attention and attention-logit soft-capping are not document-masked
attention as this library computes it, and some things a model computes from the row rather
than the document (Llama 4's NoPE temperature, 'dynamic' and 'longrope' rotary frequencies) or
adds to its loss (an MoE router's auxiliary loss) the stages would get wrong: a model that uses
any of them gets a ValueError at `split_hf_stages` naming the config field, not a silently
different model. What a family does around its layers (Granite's and HyperCLOVA X's embedding
multiplier, Cohere's `logit_scale`, Granite's `logits_scaling`, Gemma 2's final logit
soft-capping, ...) the stages re-apply, and `split_hf_stages` proves the result: before it
returns, the stages chained reproduce the model's own logits on a short input, or it raises
naming the first module whose output differs (see `split_hf_stages`). Nothing is downloaded:
build models from configs.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging

import numpy as np
import torch
from torch import nn

from .._optional import require, unshadow_kernels
from ..executor.model import without_dummy_row

unshadow_kernels()  # before transformers probes for a `kernels` package (see the function)
require("transformers", "wlb_opt.integrations.hf")

NAME = "wlb"
TESTED_TRANSFORMERS = "5.24.0"
_registered = False
_log = logging.getLogger("wlb_opt")
_IN_STAGE = contextvars.ContextVar("wlb_in_stage", default=False)
"""True while an `HFStage` runs its layers: each attention call must then carry the stage's attention."""


# ---------------------------------------------------------------------- attention
def _segments_from_positions(position_ids: torch.Tensor | None, n: int) -> np.ndarray:
    """Segment table of a packed row: a document starts where a position is not its
    predecessor's + 1 (pieces of one document continue their positions)."""
    from ..kernels.segments import segments_from_lengths

    if position_ids is None:
        return segments_from_lengths([n])
    pos = position_ids.reshape(-1).cpu().numpy()
    starts = np.flatnonzero(np.concatenate([[True], pos[1:] != pos[:-1] + 1]))
    return segments_from_lengths(np.diff(np.concatenate([starts, [n]])))


def _segments_from_bounds(bounds, n: int) -> np.ndarray:
    """Segment table from cumulative sequence boundaries (0, ..., n), flash attention's
    ``cu_seq_lens_q``."""
    from ..kernels.segments import segments_from_lengths

    b = np.asarray(bounds.cpu() if isinstance(bounds, torch.Tensor) else bounds, dtype=np.int64).reshape(-1)
    if b.size < 2 or b[0] != 0 or b[-1] != n or np.any(np.diff(b) <= 0):
        raise ValueError(f"cu_seq_lens_q must rise strictly from 0 to the row's {n} tokens (no empty sequence), "
                         f"got {b.tolist()}")
    return segments_from_lengths(np.diff(b))


_UNSUPPORTED_KWARGS = {
    "s_aux": "attention sinks (a learned logit per head in the softmax)",
    "sinks": "attention sinks (a learned logit per head in the softmax)",
    "position_bias": "an additive position bias on the attention scores",
    "indices": "sparse attention over selected key indices",
    "block_indices": "block-sparse attention over selected key blocks",
}
"""Keyword arguments some models pass their attention function, each of which changes what the
attention computes; "wlb" computes none of them, so a model that passes one is refused."""


def _check_supported(module, kwargs, dropout: float) -> None:
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"attn_implementation='wlb' does not do {what}: {type(module).__name__} passes {name}=; "
                             "this architecture is not supported")
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    if causal is False:
        raise ValueError(f"attn_implementation='wlb' is causal within each document; {type(module).__name__} attends "
                         "bidirectionally (is_causal=False): not supported")
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    if window is not None:
        raise ValueError(f"attn_implementation='wlb' does not do sliding-window attention (sliding_window="
                         f"{window}); {_SLIDING_HINT}")
    softcap = kwargs.get("softcap", getattr(getattr(module, "config", None), "attn_logit_softcapping", None))
    if softcap is not None:
        raise ValueError(f"attn_implementation='wlb' does not do logit soft-capping (softcap={softcap})")
    if dropout:
        raise ValueError(f"attn_implementation='wlb' has no attention dropout (got dropout={dropout}); set "
                         "attention_dropout=0 in the config")


def wlb_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """The ``"wlb"`` attention function: transformers' [1, H, T, D] layout in, [1, T, H, D] out."""
    _check_supported(module, kwargs, dropout)
    if isinstance(attention_mask, torch.Tensor):  # a prepared 4-D mask skips the mask hook and lands here
        raise ValueError(f"attn_implementation='wlb' builds its mask from the documents (position_ids or "
                         f"cu_seq_lens_q) and cannot apply a dense attention mask (got one of shape "
                         f"{tuple(attention_mask.shape)} in {type(module).__name__}): pass no 4-D attention_mask; "
                         "a model whose own code builds one is not supported")
    if query.shape[0] != 1:
        raise ValueError(f"attn_implementation='wlb' takes packed sequences: a batch of one row, got batch size "
                         f"{query.shape[0]} (pack the documents into one row with position_ids)")
    if value.shape[-1] != key.shape[-1]:
        raise ValueError(f"attn_implementation='wlb' needs values of the keys' head size; {type(module).__name__} has "
                         f"keys of {key.shape[-1]} and values of {value.shape[-1]} channels per head (multi-head "
                         "latent attention): this architecture is not supported")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D] views; the kernel takes strides
    attend = kwargs.get("wlb_attend")
    if attend is not None:  # the executor's CP attention over the micro-batch's ShardPlan
        out = attend(q, k, v, softmax_scale=scaling)
    else:
        from ..kernels import doc_attention

        name = type(module).__name__
        if _IN_STAGE.get():
            raise ValueError(f"{name} was called inside a pipeline stage without the stage's attention (wlb_attend): "
                             "its decoder layer does not pass the attention's keyword arguments on, so the "
                             "micro-batch's documents and CP shards cannot reach it; the adapter does not support "
                             "this architecture")
        if key.shape[-2] != query.shape[-2]:  # keys from a cache: decoding
            raise ValueError(f"attn_implementation='wlb' attends within the packed row it is given: {name} has "
                             f"{query.shape[-2]} queries and {key.shape[-2]} keys (a KV cache, as in generate()); "
                             "decode with attn_implementation 'sdpa' (model.set_attn_implementation('sdpa'))")
        bounds = kwargs.get("cu_seq_lens_q")  # explicit piece boundaries (`hf_batch`), else from the positions
        if bounds is None and kwargs.get("position_ids") is None:
            raise ValueError(f"attn_implementation='wlb' got neither position_ids nor cu_seq_lens_q in {name}: its "
                             "model does not pass them to the attention, so the documents of a packed row cannot "
                             "be told apart; this architecture is not supported")
        seg = (_segments_from_bounds(bounds, q.shape[0]) if bounds is not None
               else _segments_from_positions(kwargs.get("position_ids"), q.shape[0]))
        out = doc_attention(q, k, v, seg, softmax_scale=scaling)
    return out.unsqueeze(0), None


def _no_mask(*args, attention_mask=None, **kwargs):
    """The mask hook of ``"wlb"``: the segment table is the mask; no dense mask is built.

    The attention never sees the `attention_mask` given to the model, so one of any rank with a
    zero anywhere (padding, a 3-D token-pair mask) is refused here rather than ignored; an
    all-ones mask changes nothing and is accepted. So is a model that asks for a mask other
    than the causal one: bidirectional, or with mask functions of its own added (transformers
    then asks for the mask built with vmap, e.g. image tokens that see each other)."""
    if "allow_is_bidirectional_skip" in kwargs:  # only `create_bidirectional_mask` and its sliding form pass it
        raise ValueError("attn_implementation='wlb' is causal within each document; the model asks for a "
                         "bidirectional attention mask: not supported")
    # the model's own rules: or_mask_function / and_mask_function (transformers then asks for vmap),
    # or blocks that see each other (`block_sequence_ids`, OR-ed in: the mask function is an "or_mask")
    if kwargs.get("use_vmap") or getattr(kwargs.get("mask_function"), "__name__", None) == "or_mask":
        raise ValueError("attn_implementation='wlb' builds a causal mask per document; the model adds mask rules "
                         "of its own (or_mask_function / and_mask_function, e.g. image tokens that attend to each "
                         "other), which it would ignore: not supported")
    if not isinstance(attention_mask, torch.Tensor) or bool(attention_mask.all()):
        return None
    hidden = int((~attention_mask.bool()).sum())
    if attention_mask.dim() == 2:
        raise ValueError(f"attn_implementation='wlb' does not apply a padding attention_mask ({hidden} of "
                         f"{attention_mask.numel()} tokens masked): pack the documents into one row without padding "
                         "(position_ids, or hf_batch) and drop attention_mask, or pass an all-ones mask")
    raise ValueError(f"attn_implementation='wlb' does not apply a {attention_mask.dim()}-D attention_mask of shape "
                     f"{tuple(attention_mask.shape)} ({hidden} of {attention_mask.numel()} entries zero): it builds "
                     "its mask from the documents (position_ids or cu_seq_lens_q); drop attention_mask, or pass an "
                     "all-ones mask")


def register() -> None:
    """Register ``attn_implementation="wlb"`` with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, wlb_attention)
    AttentionMaskInterface.register(NAME, _no_mask)
    _registered = True


# ---------------------------------------------------------------------- stages
_SLIDING_HINT = ("build the model with sliding_window=None in its config (e.g. MistralConfig(..., "
                 "sliding_window=None)); use_sliding_window=False alone does not clear it in every family "
                 "(Mistral's attention reads sliding_window only)")


def _sliding_windows(model: nn.Module, decoder: nn.Module) -> dict[int, object]:
    """{layer index: window} of the layers that attend through a sliding window. A layer says so
    itself (`self_attn.sliding_window`, Qwen2), or the config does: Mistral's attention reads
    `config.sliding_window` at call time, and `layer_types` names the sliding layers (Gemma 2,
    Cohere 2: their own forward builds a sliding mask for those, whatever the window)."""
    cfg = model.config
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    found = {}
    for i, layer in enumerate(decoder.layers):
        own = getattr(getattr(layer, "self_attn", None), "sliding_window", None)
        if own:
            found[i] = own
        elif types is not None:
            if i < len(types) and "sliding" in str(types[i]):
                found[i] = window
        elif window is not None:
            found[i] = window
    return found


def _sliding_hint(model: nn.Module, windows: dict) -> str:
    """How to build the model without sliding-window layers, in the form its config takes."""
    cfg, n = model.config, len(windows)
    types = getattr(cfg, "layer_types", None)
    if types is not None and any("sliding" in str(t) for t in types):
        if hasattr(cfg, "use_sliding_window"):
            return ("build the model with sliding_window=None in its config (its layer_types then follow); "
                    "use_sliding_window=False alone does not clear it in every family")
        full = "['full_attention'] * num_hidden_layers"
        return (f"build the model with layer_types={full} in its config (sliding layers: {n} of {len(types)}); "
                "sliding_window=None alone leaves its own forward building sliding masks")
    return _SLIDING_HINT


def _parts(model: nn.Module):
    """(decoder, lm_head) of a causal LM built the usual way (model.model.layers, .norm,
    .embed_tokens, .rotary_emb; model.lm_head)."""
    decoder = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if getattr(model, "config", None) is None:
        decoder = None
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if decoder is None or head is None or not all(hasattr(decoder, n) for n in needed):
        raise ValueError(f"split_hf_stages needs a causal LM with .model.{{{', '.join(needed)}}} and .lm_head "
                         f"(Llama, Qwen2, Mistral, Granite, ...), got {type(model).__name__}")
    cfg = model.config
    windows = _sliding_windows(model, decoder)
    if windows:
        layers = sorted(windows)
        shown = ", ".join(map(str, layers[:8])) + (", ..." if len(layers) > 8 else "")
        raise ValueError(f"{type(model).__name__} uses sliding-window attention (sliding_window="
                         f"{windows[layers[0]]} in layers {shown}), which attn_implementation='wlb' does not do; "
                         f"{_sliding_hint(model, windows)}")
    if getattr(cfg, "attn_logit_softcapping", None):
        raise ValueError(f"{type(model).__name__} uses attention logit soft-capping (attn_logit_softcapping="
                         f"{cfg.attn_logit_softcapping}), which the adapter does not support; build it with "
                         "attn_logit_softcapping=None to train it without")
    _refuse_position_dependent(model, decoder)
    return decoder, head


# rotary types whose frequencies are fixed by the config: 'dynamic' rescales them, and 'longrope'
# switches its factors, by the largest position the rotary module sees, which in a packed row is
# the longest document's, not each document's own (one long document would change the short
# ones' frequencies)
_STATIC_ROPE = ("default", "linear", "yarn", "llama3")


def _rope_types(model: nn.Module, decoder: nn.Module) -> set[str]:
    """Every rope_type the model's rotary module or config names (per layer type where it has several)."""
    found = set()
    own = getattr(decoder.rotary_emb, "rope_type", None)
    for value in (own.values() if isinstance(own, dict) else [own]):
        if value is not None:
            found.add(str(value))
    params = getattr(model.config, "rope_parameters", None) or {}
    if isinstance(params, dict):
        nested = [v for v in params.values() if isinstance(v, dict)]
        for entry in nested or [params]:
            if entry.get("rope_type") is not None:
                found.add(str(entry["rope_type"]))
    return found


def _refuse_position_dependent(model: nn.Module, decoder: nn.Module) -> None:
    """ValueError for what the stages cannot compute from a packed row as transformers computes it
    from one document: chunked or other non-full attention layers, a query temperature keyed on
    the row index (Llama 4's NoPE layers), rotary frequencies that depend on the sequence length,
    and a router auxiliary loss the stages' loss would drop (MoE)."""
    cfg, kind = model.config, type(model).__name__
    types = [str(t) for t in (getattr(cfg, "layer_types", None) or [])]
    chunked = [i for i, t in enumerate(types) if "chunked" in t]
    if chunked:
        raise ValueError(f"{kind} uses chunked attention (layer_types 'chunked_attention' in {len(chunked)} of "
                         f"{len(types)} layers, attention_chunk_size={getattr(cfg, 'attention_chunk_size', None)}), "
                         "which attn_implementation='wlb' does not do (it attends over the whole document); build "
                         "the model with attention_chunk_size=None in its config (its layer_types then follow), or "
                         "with layer_types=['full_attention'] * num_hidden_layers")
    other = sorted({t for t in types if t != "full_attention"})
    if other:
        raise ValueError(f"{kind} has layer_types {other}, which attn_implementation='wlb' does not do (it runs "
                         "'full_attention' layers only); build the model with layer_types=['full_attention'] * "
                         "num_hidden_layers")
    nope = [i for i, layer in enumerate(decoder.layers)
            if getattr(getattr(layer, "self_attn", None), "attn_temperature_tuning", False)
            and not getattr(layer.self_attn, "use_rope", True)]
    if nope:
        raise ValueError(f"{kind} scales its NoPE layers' queries by a temperature of the token's index in the row "
                         f"(attn_temperature_tuning=True, floor_scale={getattr(cfg, 'floor_scale', None)}, layers "
                         f"{nope[:8]}), not of its position in its document, so packing would change it; build "
                         "the model with attn_temperature_tuning=False in its config")
    moving = sorted(_rope_types(model, decoder) - set(_STATIC_ROPE))
    if moving:
        raise ValueError(f"{kind} uses rope_type {moving[0]!r} (rope_parameters), whose rotary frequencies are not "
                         "fixed by the config ('dynamic' and 'longrope' follow the largest position seen, which in a "
                         "packed row is the longest document's, not each document's own); build the model with a "
                         "rope_type of "
                         f"{list(_STATIC_ROPE)} in rope_parameters, e.g. rope_parameters={{'rope_type': 'default', "
                         "'rope_theta': 10000.0}")
    if getattr(cfg, "output_router_logits", False):  # whatever its coefficient is called (JetMoe: aux_loss_coef)
        coef = {name: getattr(cfg, name) for name in ("router_aux_loss_coef", "aux_loss_coef", "router_z_loss_coef")
                if getattr(cfg, name, None)}
        raise ValueError(f"{kind} adds the router's losses to its training loss (output_router_logits=True"
                         + "".join(f", {name}={value}" for name, value in coef.items()) + "), which the stages do "
                         "not compute (their loss is the token cross-entropy only); build the model with "
                         "output_router_logits=False in its config")


def _embedding_scale(model: nn.Module) -> float:
    """The factor the model's decoder multiplies the token embeddings by before its first layer,
    outside `embed_tokens` (Gemma's scale sits inside its embedding module: nothing here)."""
    value = getattr(model.config, "embedding_multiplier", None)  # Granite, HyperCLOVA X
    return 1.0 if value is None else float(value)


def _head_scaling(model: nn.Module) -> dict:
    """What the model's forward does to the LM head's logits: ``multiply`` (Cohere's
    `logit_scale`, HyperCLOVA X's `logits_scaling`), ``divide_by`` (Granite's `logits_scaling`)
    and ``softcap`` (Gemma 2's `final_logit_softcapping`: ``cap * tanh(logits / cap)``)."""
    cfg = model.config
    multiply, divide_by = getattr(cfg, "logit_scale", None), None
    scaling = getattr(cfg, "logits_scaling", None)
    if scaling is not None:
        if getattr(cfg, "model_type", None) == "hyperclovax":
            multiply = scaling
        else:
            divide_by = scaling
    softcap = getattr(cfg, "final_logit_softcapping", None)
    return {"multiply": 1.0 if multiply is None else float(multiply),
            "divide_by": 1.0 if divide_by is None else float(divide_by),
            "softcap": None if not softcap else float(softcap)}


class _ScaledHead(nn.Module):
    """The LM head followed by the model's own logit transform, in transformers' order: the
    scale, then the soft-cap (see `_head_scaling`)."""

    def __init__(self, head: nn.Module, multiply: float = 1.0, divide_by: float = 1.0, softcap: float | None = None):
        super().__init__()
        self.head, self.multiply, self.divide_by, self.softcap = head, multiply, divide_by, softcap

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.head(h)
        if self.multiply != 1.0:
            logits = logits * self.multiply
        if self.divide_by != 1.0:
            logits = logits / self.divide_by
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class HFStage(nn.Module):
    """A contiguous slice of a transformers causal LM for one (virtual) pipeline stage, with the
    executor's stage contract (see `wlb_opt.executor.model.Stage`): token ids [T] (first stage)
    or hidden states [T, hidden] in, hidden states out; the last stage applies the final norm
    and exposes the LM head (with the model's logit transform) as `head`. Shares the model's
    parameters; `blocks` are the model's own decoder layers."""

    def __init__(self, model: nn.Module, stage: int, n_stages: int):
        super().__init__()
        decoder, head = _parts(model)
        cfg = model.config
        n = len(decoder.layers)
        if not 1 <= n_stages <= n or not 0 <= stage < n_stages:
            raise ValueError(f"cannot split {n} decoder layers into {n_stages} stages (stage {stage}); "
                             "pp x virtual_stages must be between 1 and the number of layers")
        bounds = [round(i * n / n_stages) for i in range(n_stages + 1)]
        self.hidden = int(cfg.hidden_size)
        self.embed = decoder.embed_tokens if stage == 0 else None
        self.embedding_multiplier = _embedding_scale(model)
        self.blocks = nn.ModuleList(decoder.layers[bounds[stage]:bounds[stage + 1]])
        names = {id(m): name for name, m in model.named_modules()}
        self.block_names = [names.get(id(b), f"blocks.{i}") for i, b in enumerate(self.blocks)]  # for messages
        # the rotary module has no parameters (only its inverse frequencies): every stage uses it
        object.__setattr__(self, "_rotary", decoder.rotary_emb)
        last = stage == n_stages - 1
        self.norm = decoder.norm if last else None
        self.head = _ScaledHead(head, **_head_scaling(model)) if last else None
        self.tp_heads = (int(cfg.num_attention_heads), int(getattr(cfg, "num_key_value_heads", None)
                                                           or cfg.num_attention_heads))

    # the attention and MLP classes whose forward works on a rank's share of the heads and
    # channels, each trained under TP against one process (tests/integration/test_hf.py); `apply_tensor_parallel`
    # refuses any other (DiffLlama's attention chunks along the global head axis, for one)
    tp_module_classes = {
        "self_attn": ("CohereAttention", "GraniteAttention", "LlamaAttention", "Qwen2Attention"),
        "mlp": ("CohereMLP", "GraniteMLP", "LlamaMLP", "Qwen2MLP"),
    }

    @staticmethod
    def block_tp_plan() -> dict:
        """Megatron-style TP plan of one decoder layer (`apply_tensor_parallel` uses it)."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        col = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
        row = ("self_attn.o_proj", "mlp.down_proj")
        return {**{n: ColwiseParallel() for n in col}, **{n: RowwiseParallel() for n in row}}

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        empty = x.shape[0] == 0
        if empty:
            # an empty slot or a zero-row CP shard still runs (its peers' collectives); transformers'
            # layers reshape with -1, which zero elements cannot, so the stage runs one dummy row
            # whose result is dropped, while attention and every collective see the zero rows
            x = (torch.zeros(1, dtype=torch.long, device=x.device) if self.embed is not None
                 else x.new_zeros((1,) + tuple(x.shape[1:])))
            positions = torch.zeros(1, dtype=torch.long, device=x.device)
            attend = without_dummy_row(attend)
        if self.embed is not None:
            x = self.embed(x)
            if self.embedding_multiplier != 1.0:
                x = x * self.embedding_multiplier
        out = self._layers(x, positions, attend)
        return out[:0] if empty else out

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        h = x.unsqueeze(0)
        position_ids = positions.unsqueeze(0)
        cos_sin = self._rotary(h, position_ids)
        inside = _IN_STAGE.set(True)  # a layer that drops wlb_attend is refused by wlb_attention
        try:
            for layer in self.blocks:
                h = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=cos_sin,
                          wlb_attend=attend)
                if isinstance(h, tuple):  # older decoder layers return (hidden_states, ...)
                    h = h[0]
        finally:
            _IN_STAGE.reset(inside)
        h = h[0]
        if self.head is not None:
            return self.norm(h)
        kind = h.device.type
        return h.to(torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else h


def split_hf_stages(model: nn.Module, pp: int, virtual_stages: int = 1, *, self_check: bool = True) -> list[HFStage]:
    """The pp x virtual_stages stages of a transformers causal LM in pipeline order (decoder
    layers split evenly). Rank r holds ``split_hf_stages(model, pp, v)[r::pp]``. The model
    must use ``attn_implementation="wlb"`` (`register()` first).

    Self-check (``self_check=True``, the default): before returning, the stages chained run a
    short random input (two documents of 7 and 5 tokens, the second a piece continuing a
    document at position 7) and must reproduce the model's own logits, computed by the
    model's own forward with attn_implementation "sdpa" (or "eager" where the model has no
    sdpa) one document per call with ``position_ids = offset + arange``: max |difference| <=
    1e-5 x max |logit| in fp32 (1e-6 in fp64; 1e-2 in bf16/fp16, or, if larger, 4 units of
    rounding at max |logit| and twice the gap between the model's own eager and sdpa forwards
    on the same input: two correct half-precision forwards differ by about that much). A
    mismatch raises a
    ValueError naming the first module whose output differs (the embeddings, a decoder layer,
    the final norm, or the head with its logit transform). It runs on the model's device
    under ``torch.no_grad`` in eval mode, and leaves the RNG state (CPU and CUDA), every
    module's training flag and every ``.grad`` as they were; a model on the meta device skips
    it with one logged notice. Its cost is two forwards of the whole model over 12 tokens.

    ``self_check=False`` skips it (for a model too large to run twice, say). The stages are
    then unproven: a family that does something around its layers the adapter does not
    reproduce (a scale on the embeddings or the logits, soft-capping, an extra input) trains
    as a different model, with no error."""
    for name, value in (("pp", pp), ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not isinstance(self_check, bool):
        raise TypeError(f"self_check must be True or False, got {self_check!r}")
    _parts(model)  # a causal LM of the usual layout, or a ValueError
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != NAME:
        raise ValueError(f"the model runs attn_implementation={impl!r}; build it with attn_implementation='wlb' "
                         "(after wlb_opt.integrations.hf.register()) so that its attention is the executor's")
    n = pp * virtual_stages
    decoder, head = _parts(model)
    if n > 1 and head.weight is decoder.embed_tokens.weight:
        raise ValueError("the model ties its LM head to its embeddings (tie_word_embeddings=True); the first and "
                         "last pipeline stages would hold one weight twice. Untie them for pp > 1")
    stages = [HFStage(model, s, n) for s in range(n)]
    if self_check:
        _self_check(model, stages)
    return stages


# ---------------------------------------------------------------------- self-check
_CHECK_DOCS = ((7, 0), (5, 7))  # (tokens, first position): a document, and a piece whose positions
# continue it, so that attention told the documents by their positions alone would join them
_CHECK_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@contextlib.contextmanager
def _isolated(modules, device: torch.device):
    """Eval mode and no autograd inside; the RNG streams (CPU, and the model's CUDA device), every
    module's training flag, and every buffer and plain attribute of a module that holds buffers
    (a rotary module's `inv_freq`, `max_seq_len_cached`, ..., which a length-dependent rope
    rewrites in its forward) restored after, also when the check raises."""
    flags = [(m, m.training) for root in modules for m in root.modules()]
    held = {id(m): m for root in modules for m in root.modules() if m._buffers}
    state = [(m, dict(m._buffers), {n: b.clone() for n, b in m._buffers.items() if b is not None},
              {k: v for k, v in vars(m).items() if not k.startswith("_")}) for m in held.values()]
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            for root in modules:
                root.eval()
            yield
    finally:
        for m, flag in flags:
            m.training = flag
        with torch.no_grad():
            for m, buffers, values, attrs in state:
                for key in [k for k in vars(m) if not k.startswith("_") and k not in attrs]:
                    delattr(m, key)
                vars(m).update(attrs)
                m._buffers.clear()
                m._buffers.update(buffers)
                for name, value in values.items():
                    buffers[name].copy_(value)


@contextlib.contextmanager
def _attention(model: nn.Module, impl: str):
    """The model's configs switched to attn_implementation `impl` inside, restored after."""
    configs = {id(c): c for m in model.modules() if hasattr(c := getattr(m, "config", None), "_attn_implementation")}
    saved = [(c, c._attn_implementation) for c in configs.values()]
    try:
        for c, _ in saved:
            c._attn_implementation = impl
        yield
    finally:
        for c, value in saved:
            c._attn_implementation = value


def _checkpoints(model: nn.Module, decoder: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """(name, module, output?) in forward order: what enters each decoder layer and the final
    norm (named after the module that produced it), then the norm's output."""
    names = {id(m): n for n, m in model.named_modules()}
    layers = list(decoder.layers)
    points = [(f"the embeddings ({names[id(decoder.embed_tokens)]} and the scale after it)", layers[0], False)]
    points += [(names[id(prev)], nxt, False) for prev, nxt in zip(layers, layers[1:] + [decoder.norm])]
    return points + [(names[id(decoder.norm)], decoder.norm, True)]


def _run_recorded(points, run) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """run()'s result, and each checkpoint's tensors over the run as [tokens, features]."""
    store = [[] for _ in points]

    def keep(i, t):
        t = t[0] if isinstance(t, (tuple, list)) else t
        store[i].append(t.detach().reshape(-1, t.shape[-1]).clone())

    handles = [module.register_forward_hook(lambda m, a, out, i=i: keep(i, out)) if output else
               module.register_forward_pre_hook(lambda m, a, kw, i=i: keep(i, a[0] if a else kw["hidden_states"]),
                                                with_kwargs=True)
               for i, (_, module, output) in enumerate(points)]
    try:
        logits = run()
    finally:
        for h in handles:
            h.remove()
    return [torch.cat(s) if s else None for s in store], logits


def _max_abs(t: torch.Tensor) -> float:
    return float(t.double().abs().max()) if t.numel() else 0.0


def _mismatch(got, ref, tol: float, noise=None) -> str | None:
    """Why `got` is not `ref` within tol x max |ref|, or None. In half precision the bound is
    at least 4 units of rounding at max |ref|, and twice the gap between two correct forwards
    (`noise`: eager against sdpa) where that is larger."""
    if got is None or ref is None or got.shape != ref.shape:
        return f"shape {None if got is None else tuple(got.shape)} against {None if ref is None else tuple(ref.shape)}"
    err, scale = _max_abs(got.double() - ref.double()), _max_abs(ref)
    floor = 0.0
    if ref.dtype in (torch.bfloat16, torch.float16):
        floor = 4 * torch.finfo(ref.dtype).eps / 2 * scale
        if noise is not None and noise.shape == ref.shape:
            floor = max(floor, 2 * _max_abs(noise.double() - ref.double()))
    if err <= max(tol * scale, floor) or err == 0.0:  # NaN fails both
        return None
    return f"max |difference| {err:.3g} against max |value| {scale:.3g}"


def _self_check(model: nn.Module, stages: list[HFStage]) -> None:
    """See `split_hf_stages`: the stages chained against the model's own forward."""
    from ..kernels import doc_attention
    from ..kernels.segments import segments_from_lengths

    decoder, head = _parts(model)
    weight = decoder.embed_tokens.weight
    device, dtype = weight.device, weight.dtype
    kind = type(model).__name__
    if device.type == "meta":
        _log.warning("split_hf_stages: %s is on the meta device; the self-check against its own forward is "
                     "skipped (the stages are unproven)", kind)
        return
    tol = _CHECK_TOLERANCE.get(dtype, 1e-2)
    gen = torch.Generator().manual_seed(0)
    docs = [(torch.randint(0, weight.shape[0], (n,), generator=gen).to(device),
             torch.arange(off, off + n).to(device)) for n, off in _CHECK_DOCS]
    ids, positions = torch.cat([d[0] for d in docs]), torch.cat([d[1] for d in docs])
    segments = segments_from_lengths([n for n, _ in _CHECK_DOCS])
    # half precision: two correct forwards (eager's bf16 softmax, sdpa, the stages' fp32-accumulating
    # attention) differ by a few units of rounding, about 1e-2 x max |logit| after a few layers;
    # eager against sdpa measures that gap on this input, and twice it is allowed too
    references = ["sdpa", "eager"] if getattr(model, "_supports_sdpa", False) else ["eager"]
    if tol < 1e-2:
        references = references[:1]

    def attend(q, k, v, softmax_scale=None, **kwargs):
        return doc_attention(q, k, v, segments, softmax_scale=softmax_scale, backend="torch")

    def own(impl):
        def run():
            with _attention(model, impl):
                return torch.cat([model(input_ids=t[None], position_ids=p[None], use_cache=False).logits[0]
                                  for t, p in docs])
        return run

    def chained():
        x = ids
        for stage in stages:
            x = stage(x, positions, attend)
        return stages[-1].head(x)

    points = _checkpoints(model, decoder)
    with _isolated([model, *stages], device):
        try:
            refs = [_run_recorded(points, own(impl)) for impl in references]
        except Exception as exc:
            raise ValueError(f"split_hf_stages' self-check could not run {kind}'s own forward on its input "
                             f"({type(exc).__name__}: {exc}); pass self_check=False to skip it, at the risk "
                             "described in split_hf_stages' docstring") from exc
        try:
            got, logits = _run_recorded(points, chained)
        except ValueError:
            raise
        except Exception as exc:
            raise ValueError(f"split_hf_stages cannot run {kind}: its stages failed on the self-check's input "
                             f"({type(exc).__name__}: {exc}); the adapter does not support this architecture") from exc
    (ref, ref_logits), (noise, noise_logits) = refs[0], refs[-1] if len(refs) > 1 else (None, None)
    why = _mismatch(logits, ref_logits, tol, noise_logits)
    if why is None:
        return
    where = "the head (lm_head and the logit transform after it)"
    for i, (name, _, _) in enumerate(points):
        first = _mismatch(got[i], ref[i], tol, None if noise is None else noise[i])
        if first is not None:
            where, why = name, first
            break
    raise ValueError(f"split_hf_stages' self-check: the stages of {kind} do not reproduce the model's own forward "
                     f"(attn_implementation={references[0]!r}, one document per call); the first output that differs "
                     f"is {where} ({why}; allowed {tol:g} x max |value| in {dtype}). Training through these stages "
                     "would train a different model: the adapter does not reproduce something this architecture "
                     "does there")


# ---------------------------------------------------------------------- labels
def to_hf_labels(input_ids: torch.Tensor, lengths) -> torch.Tensor:
    """Transformers' labels of a packed row of pieces: the token ids, -100 at each piece's
    first token (the model's loss shifts them: position t predicts labels[t + 1]).

    `input_ids` is a 1-D tensor, `lengths` the pieces' token counts in row order: integers
    >= 1 that sum to the row's length."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"to_hf_labels takes input_ids as a 1-D tensor (one packed row), got {shape}")
    if input_ids.dtype == torch.bool or input_ids.is_floating_point() or input_ids.is_complex():
        raise ValueError(f"to_hf_labels takes integer token ids, got input_ids of dtype {input_ids.dtype}")
    if isinstance(lengths, (list, tuple)) and any(isinstance(v, (bool, np.bool_)) for v in lengths):
        raise ValueError(f"to_hf_labels: lengths must be a 1-D sequence of integers, got {list(lengths)!r} "
                         "(True and False are no token counts)")
    raw = np.asarray(lengths.cpu() if isinstance(lengths, torch.Tensor) else lengths)
    if raw.ndim != 1 or (raw.size and (raw.dtype == bool or not np.issubdtype(raw.dtype, np.integer))):
        raise ValueError(f"to_hf_labels: lengths must be a 1-D sequence of integers, got {raw.tolist()!r} "
                         f"(dtype {raw.dtype})")
    n = input_ids.numel()
    if raw.size and raw.min() < 1:
        raise ValueError(f"to_hf_labels: lengths must be integers >= 1 (each a piece's token count), got "
                         f"{raw[raw < 1][0]}")
    if raw.size and raw.max() > n:
        raise ValueError(f"to_hf_labels: lengths must sum to the row's {n} tokens, got a piece of {raw.max()}")
    lengths = raw.astype(np.int64)
    if int(lengths.sum()) != n:
        raise ValueError(f"to_hf_labels: lengths must sum to the row's {n} tokens, got {int(lengths.sum())} "
                         f"(lengths {lengths.tolist()})")
    labels = input_ids.clone()
    starts = np.cumsum(lengths) - lengths
    labels[torch.as_tensor(starts, dtype=torch.long)] = -100
    return labels


def hf_batch(step, j: int) -> dict:
    """Micro-batch j of a `WLBStream` step as one packed row for a transformers model's own
    forward: ``input_ids``, ``position_ids`` and ``labels`` (transformers' convention), each
    [1, T], with where each piece starts given twice over, for each attention path of
    transformers. Loss masks are not carried over (use the executor for masked losses).

    - sdpa / eager (and attn_implementation="wlb" without the executor) find where a
      sequence starts from ``position_ids``: where a position is not the previous one + 1,
      and sdpa only without a cache (``use_cache`` is False here). Two pieces of one
      document packed in order (offsets 0 and 32, say) would read as one sequence, and so
      would any piece whose offset happens to follow the previous piece's last position, so
      the row lays the pieces out by decreasing offset (stable): each then starts below
      the end of the one before it.
    - flash attention takes ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32 piece boundaries,
      0 first) and ``max_length_q`` / ``max_length_k`` as given; from position_ids alone it
      would start sequences only where a position is 0.

    Every piece is then its own sequence, as the executor trains it. The loss is a mean over
    the row's targets, which the order does not change."""
    from ..batch import packed_positions

    mb = step.plan.micro_batches[j]
    lengths, offsets = step.plan.lengths[mb], step.plan.offsets[mb]
    order = np.argsort(-offsets, kind="stable")
    tokens = step.tokens(j)
    if len(order):
        pieces = torch.split(tokens, lengths.tolist())
        tokens = torch.cat([pieces[i] for i in order.tolist()])
    lengths, offsets = lengths[order], offsets[order]
    positions = torch.from_numpy(packed_positions(lengths, offsets))
    bounds = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    longest = int(lengths.max()) if lengths.size else 0
    return {"input_ids": tokens[None], "position_ids": positions[None], "labels": to_hf_labels(tokens, lengths)[None],
            "use_cache": False, "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": longest,
            "max_length_k": longest}


__all__ = ["NAME", "HFStage", "TESTED_TRANSFORMERS", "hf_batch", "register", "split_hf_stages", "to_hf_labels",
           "wlb_attention"]
