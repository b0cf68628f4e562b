"""Hugging Face adapter: run transformers' causal LMs with document-masked (and CP) attention.

- `register()` adds the attention implementation ``"wlb"`` to transformers' attention registry
  (and a mask hook that builds no dense mask), so ``attn_implementation="wlb"`` runs any model
  whose attention goes through that registry (Llama, Qwen2, Mistral, Granite and their kin)
  with `doc_attention` at the model's own softmax scale (`module.scaling`). Called by the
  model's own forward on a packed batch of one row, documents are found from `position_ids`
  (a token whose position is not its predecessor's + 1 starts a document), as transformers'
  own packed path does; called by the executor, the attention is its CP attention.
- `split_hf_stages(model, pp, virtual_stages=1)` cuts a causal LM (embeddings, decoder layers,
  final norm, LM head) into executor stages with the library's stage contract
  ``stage(x, positions, attend)`` (`wlb_opt.executor.model.Stage`), sharing the model's
  parameters, so `train_step` runs it under PP, CP, DP, TP and FSDP2.
- Labels: inside the library, labels are pre-shifted (`labels[i]` is the token after i within
  the piece, -100 at each piece's last token). Transformers' convention is unshifted labels
  with -100 at each sequence's first token, the loss shifting inside; `hf_batch(step, j)`
  gives a micro-batch in that convention for a model's own forward, `to_hf_labels` converts.

Sliding-window attention and logit soft-capping are not document-masked attention as this
library computes it: a model that uses either gets a ValueError, not a silently different
model. Nothing is downloaded: build models from configs.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .._optional import require, unshadow_kernels

unshadow_kernels()  # before transformers probes for a `kernels` package (see the function)
require("transformers", "wlb_opt.integrations.hf")

NAME = "wlb"
TESTED_TRANSFORMERS = "5.24.0"
_registered = False


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
    if b.size < 2 or b[0] != 0 or b[-1] != n or np.any(np.diff(b) < 0):
        raise ValueError(f"cu_seq_lens_q must rise from 0 to the row's {n} tokens, got {b.tolist()}")
    return segments_from_lengths(np.diff(b))


def _check_supported(module, kwargs, dropout: float) -> None:
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    if window is not None:
        raise ValueError(f"attn_implementation='wlb' does not do sliding-window attention (sliding_window="
                         f"{window}); disable it in the config (e.g. use_sliding_window=False) or use another "
                         "attention implementation")
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
    if query.shape[0] != 1:
        raise ValueError(f"attn_implementation='wlb' takes packed sequences: a batch of one row, got batch size "
                         f"{query.shape[0]} (pack the documents into one row with position_ids)")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D] views; the kernel takes strides
    attend = kwargs.get("wlb_attend")
    if attend is not None:  # the executor's CP attention over the micro-batch's ShardPlan
        out = attend(q, k, v, softmax_scale=scaling)
    else:
        from ..kernels import doc_attention

        bounds = kwargs.get("cu_seq_lens_q")  # explicit piece boundaries (`hf_batch`), else from the positions
        seg = (_segments_from_bounds(bounds, q.shape[0]) if bounds is not None
               else _segments_from_positions(kwargs.get("position_ids"), q.shape[0]))
        out = doc_attention(q, k, v, seg, softmax_scale=scaling)
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs):
    """The mask hook of ``"wlb"``: the segment table is the mask; no dense mask is built."""
    return None


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
    if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
        if any(getattr(layer.self_attn, "sliding_window", None) for layer in decoder.layers):
            raise ValueError(f"{type(model).__name__} uses sliding-window attention (sliding_window="
                             f"{cfg.sliding_window}), which attn_implementation='wlb' does not do")
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "attn_logit_softcapping", None):
        raise ValueError(f"{type(model).__name__} uses logit soft-capping, which the adapter does not support")
    return decoder, head


class _ScaledHead(nn.Module):
    """The LM head with the model's logit scaling (Granite divides logits by `logits_scaling`)."""

    def __init__(self, head: nn.Module, divide_by: float):
        super().__init__()
        self.head, self.divide_by = head, float(divide_by)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.head(h)
        return logits / self.divide_by if self.divide_by != 1.0 else logits


class HFStage(nn.Module):
    """A contiguous slice of a transformers causal LM for one (virtual) pipeline stage, with the
    executor's stage contract (see `wlb_opt.executor.model.Stage`): token ids [T] (first stage)
    or hidden states [T, hidden] in, hidden states out; the last stage applies the final norm
    and exposes the LM head (with the model's logit scaling) as `head`. Shares the model's
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
        self.embedding_multiplier = float(getattr(cfg, "embedding_multiplier", 1.0) or 1.0)
        self.blocks = nn.ModuleList(decoder.layers[bounds[stage]:bounds[stage + 1]])
        # the rotary module has no parameters (only its inverse frequencies): every stage uses it
        object.__setattr__(self, "_rotary", decoder.rotary_emb)
        last = stage == n_stages - 1
        self.norm = decoder.norm if last else None
        self.head = _ScaledHead(head, getattr(cfg, "logits_scaling", 1.0) or 1.0) if last else None
        self.tp_heads = (int(cfg.num_attention_heads), int(getattr(cfg, "num_key_value_heads", None)
                                                           or cfg.num_attention_heads))

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
            attend = _without_dummy_row(attend)
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
        for layer in self.blocks:
            h = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=cos_sin,
                      wlb_attend=attend)
            if isinstance(h, tuple):  # older decoder layers return (hidden_states, ...)
                h = h[0]
        h = h[0]
        if self.head is not None:
            return self.norm(h)
        kind = h.device.type
        return h.to(torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else h


def _without_dummy_row(attend):
    """`attend` for a stage run on one dummy row: attention sees the real (zero) rows only,
    and the dummy row's output is a constant zero."""
    def call(q, k, v, **kwargs):
        out = attend(q[:0], k[:0], v[:0], **kwargs)
        return torch.cat([out, out.new_zeros((1,) + tuple(out.shape[1:]))])
    return call




def split_hf_stages(model: nn.Module, pp: int, virtual_stages: int = 1) -> list[HFStage]:
    """The pp x virtual_stages stages of a transformers causal LM in pipeline order (decoder
    layers split evenly). Rank r holds ``split_hf_stages(model, pp, v)[r::pp]``. The model
    must use ``attn_implementation="wlb"`` (`register()` first)."""
    for name, value in (("pp", pp), ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
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
    return [HFStage(model, s, n) for s in range(n)]


# ---------------------------------------------------------------------- labels
def to_hf_labels(input_ids: torch.Tensor, lengths) -> torch.Tensor:
    """Transformers' labels of a packed row of pieces: the token ids, -100 at each piece's
    first token (the model's loss shifts them: position t predicts labels[t + 1])."""
    labels = input_ids.clone()
    lengths = np.asarray(lengths, dtype=np.int64)
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
    from ..executor.train import packed_positions

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
