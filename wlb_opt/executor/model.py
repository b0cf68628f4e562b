"""A small Llama-style decoder whose attention is pluggable, for tests and examples.

Everything but attention is per token, so a CP rank can run the model on its own tokens in
any order as long as RoPE uses each token's position inside its document and attention is
`context_parallel_attention` (or, on one process, `doc_attention` over the whole micro-batch).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of x [T, H, D] at integer positions [T] (rotate-half convention)."""
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype)[:, None, :], ang.sin().to(x.dtype)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def without_dummy_row(attend: Attend) -> Attend:
    """`attend` for a stage that runs one dummy row in place of zero rows (an empty slot or
    a zero-row CP shard still runs, for its peers' collectives, but layers that reshape with
    -1 cannot take zero elements): attention sees the real (zero) rows only, so every
    collective matches its peers', and the dummy row's output is a constant zero."""
    def call(q, k, v, **kwargs):
        out = attend(q[:0], k[:0], v[:0], **kwargs)
        return torch.cat([out, out.new_zeros((1,) + tuple(out.shape[1:]))])
    return call


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int, head_dim: int | None = None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim or dim // heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        h = self.norm1(x)
        # K and V first: an attention with `prefetch` (CP) starts their all-gather, which then
        # runs while Q is projected and rotated
        # -1 heads: under tensor parallelism a rank computes only its share of the heads
        k = rope(self.wk(h).unflatten(-1, (-1, self.head_dim)), positions)
        v = self.wv(h).unflatten(-1, (-1, self.head_dim))
        prefetch = getattr(attend, "prefetch", None)
        pending = prefetch(k, v) if prefetch is not None else None
        q = rope(self.wq(h).unflatten(-1, (-1, self.head_dim)), positions)
        out = attend(q, k, v, prefetched=pending) if pending is not None else attend(q, k, v)
        x = x + self.wo(out.flatten(-2))
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class TinyLM(nn.Module):
    """Token ids [T] + positions [T] + an attention callable -> logits [T, vocab]."""

    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 ffn: int = 176, head_dim: int | None = None):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, ffn, head_dim) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    @classmethod
    def from_spec(cls, spec) -> "TinyLM":
        return cls(vocab=spec.vocab, dim=spec.hidden, layers=spec.layers, heads=spec.heads,
                   kv_heads=spec.kv_heads, ffn=spec.ffn, head_dim=spec.head_dim)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions, attend)
        return self.head(self.norm(x))


class Stage(nn.Module):
    """A contiguous slice of a TinyLM for one (virtual) pipeline stage, sharing its parameters.

    The first stage embeds token ids; the last applies the final norm and returns hidden
    states, and exposes the output projection as `head` (the loss applies it, in chunks, so
    the full logits never exist at once); the others map hidden states to hidden states.
    `hidden` is the activation width sent between stages.
    Under autocast a stage hands on its hidden states in the autocast dtype (what the
    pipeline carries; see `wlb_opt.executor.train.activation_dtype`).
    """

    def __init__(self, model: TinyLM, stage: int, n_stages: int):
        super().__init__()
        n = len(model.blocks)
        if not 1 <= n_stages <= n or not 0 <= stage < n_stages:
            raise ValueError(f"cannot split {n} blocks into {n_stages} stages (stage {stage}); "
                             f"pp x virtual_stages must be between 1 and the number of blocks")
        bounds = [round(i * n / n_stages) for i in range(n_stages + 1)]
        self.hidden = model.embed.embedding_dim
        self.embed = model.embed if stage == 0 else None
        self.blocks = nn.ModuleList(model.blocks[bounds[stage]:bounds[stage + 1]])
        last = stage == n_stages - 1
        self.norm = model.norm if last else None
        self.head = model.head if last else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x, positions, attend)
        if self.head is not None:
            return self.norm(x)
        kind = x.device.type
        return x.to(torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else x


def split_stages(model: TinyLM, pp: int, virtual_stages: int = 1) -> list[Stage]:
    """The pp x virtual_stages stages of `model` in pipeline order (layers split evenly, as the
    cost model assumes). Pipeline rank r holds stages r, r + pp, r + 2 pp, ...:
    ``split_stages(model, pp, v)[r::pp]`` (for v = 1, stage r alone)."""
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp must be an integer >= 1 (the pipeline stages), got {pp!r}")
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"virtual_stages must be an integer >= 1, got {virtual_stages!r}")
    n = pp * virtual_stages
    return [Stage(model, s, n) for s in range(n)]
