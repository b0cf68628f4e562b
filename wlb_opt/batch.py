"""A micro-batch as tensors: token packing, pre-shifted labels, RoPE positions and one CP
rank's rows.

One place owns these conventions so that the executor (`train_step`), the stream
(`Step.tokens`, `Step.inputs`), the HF adapter and the one-process references all train on
the same tokens:

- `pack_micro_batch(plan, j, data)`: token ids of micro-batch j in packed order and their
  labels, pre-shifted: the next token within the piece, `IGNORE` (-100) at each piece's
  last token and wherever the next token's loss mask is False.
- `rank_inputs(tokens, labels, shard, cp_rank)`: one CP rank's rows of a packed
  micro-batch, in `shard.rank_indices[cp_rank]` order, with RoPE positions taken from
  `shard.positions[cp_rank]`: the ShardPlan is the one source of positions of a sharded
  micro-batch. `packed_positions` is its one-process twin (positions of a whole packed
  micro-batch), used where no ShardPlan exists (references, the HF adapter's rows).
- `target_tokens(plan)`: the target tokens of a whole global batch, the denominator of the
  loss (docs/architecture.md, "Invariants").

Imports torch and numpy only (no executor module, no torch.distributed), and
`import wlb_opt` does not import it, so a loader process can plan without torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .tokens import as_mask

IGNORE = -100
"""The label of a token that is not a training target."""


def packed_labels(tokens: torch.Tensor, lengths) -> torch.Tensor:
    """Next-token targets inside each piece; IGNORE at the last token of every piece."""
    labels = torch.full_like(tokens, IGNORE)
    start = 0
    for d in np.asarray(lengths, dtype=np.int64).tolist():
        labels[start: start + d - 1] = tokens[start + 1: start + d]
        start += d
    return labels


def packed_positions(lengths, offsets) -> np.ndarray:
    """Position of every packed token inside its document (piece offset + index in the piece),
    for a whole micro-batch in packed order: the one-process twin of `ShardPlan.positions`
    (`shard.positions[r]` equals `packed_positions(...)[shard.rank_indices[r]]`)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) - starts + np.repeat(np.asarray(offsets, np.int64), lengths)


def target_tokens(plan) -> int:
    """Target tokens of the whole global batch (all replicas and micro-batches of the plan),
    without loss masks: each piece's length - 1. With loss masks, count the labels that are
    not -100 (`WLBStream`'s `step.target_tokens` and `train_step` do)."""
    placed = np.concatenate(plan.micro_batches) if plan.micro_batches else np.zeros(0, np.int64)
    return int((plan.lengths[placed] - 1).sum())


def _document(data, doc_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(token ids, loss mask or None) of a document: `data(id)` returns the token ids (a 1-D
    tensor, array or list of ints), or a pair (token ids, loss mask) whose first item is a
    sequence, the mask True where a token is a training target (None: every token is)."""
    got = data(doc_id)
    if isinstance(got, (tuple, list)) and len(got) == 2 and _is_sequence(got[0]):
        tokens, mask = torch.as_tensor(got[0]), got[1]
        if mask is None:
            return tokens, None
        # booleans or 0/1 of the document's length: a weight mask (0.1) would read as True
        return tokens, torch.from_numpy(as_mask(doc_id, mask, len(tokens)))
    return torch.as_tensor(got), None


def _is_sequence(x) -> bool:
    """A list, tuple, array or tensor of at least one dimension (not one token id)."""
    return isinstance(x, (list, tuple)) or getattr(x, "ndim", 0) >= 1


def _piece(data, doc_id: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, loss mask) of tokens [lo, hi) of a document, from `data(id)` (the whole
    document) or from `data.piece(id, offset, length)` (a `WLBStream` step holds pieces)."""
    piece = getattr(data, "piece", None)
    if callable(piece):
        tokens, mask = piece(doc_id, lo, hi - lo)
        tokens = torch.as_tensor(tokens)
        got = tokens.shape[0] if tokens.dim() == 1 else None
        if got != hi - lo:
            raise ValueError(f"document {doc_id}: the piece at offset {lo} should have {hi - lo} tokens, got "
                             f"{got if got is not None else tuple(tokens.shape)}")
        if mask is not None:  # checked against the piece: one of the wrong length would shift the targets after it
            mask = torch.from_numpy(as_mask(doc_id, mask, hi - lo))
    else:  # the document's mask was checked whole (`_document`)
        doc, mask = _document(data, doc_id)
        doc = torch.as_tensor(doc)
        if doc.dim() != 1 or doc.shape[0] < hi:
            raise ValueError(f"document {doc_id}: data({doc_id}) returned {tuple(doc.shape)} tokens, but the plan "
                             f"holds its tokens [{lo}, {hi}) (a 1-D tensor of at least {hi} tokens is needed)")
        tokens = doc[lo:hi]
        mask = mask[lo:hi] if mask is not None else None
    return tokens, (torch.ones(hi - lo, dtype=torch.bool) if mask is None else mask)


def pack_micro_batch(plan, j: int, data) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, next-token labels) of micro-batch j in packed order. Labels are -100 at the
    last token of every piece and wherever the next token is not a target (its loss mask,
    when `data` gives one, is False). `data(id)` returns a whole document (or (ids, mask));
    an object with `piece(id, offset, length)` (a `WLBStream` step) returns pieces."""
    tokens, masks = [], []
    for i in plan.micro_batches[j]:
        lo, hi = int(plan.offsets[i]), int(plan.offsets[i] + plan.lengths[i])
        piece_tokens, piece_mask = _piece(data, int(plan.doc_ids[i]), lo, hi)
        kind = piece_tokens.dtype
        if kind == torch.bool or kind.is_floating_point or kind.is_complex:  # .long() would truncate silently
            raise ValueError(f"document {int(plan.doc_ids[i])}: token ids must be integers, got dtype {kind}")
        if kind == torch.uint64 and bool((piece_tokens.view(torch.int64) < 0).any()):  # .long() would wrap
            raise ValueError(f"document {int(plan.doc_ids[i])}: token ids must fit in int64, got a uint64 id of "
                             "2**63 or more")
        tokens.append(piece_tokens.long())
        masks.append(piece_mask)
    if not tokens:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    tokens_t, mask_t = torch.cat(tokens), torch.cat(masks)
    lengths = plan.lengths[plan.micro_batches[j]]
    labels = packed_labels(tokens_t, lengths)
    target_is_real = torch.cat([mask_t[1:], torch.zeros(1, dtype=torch.bool)])
    return tokens_t, labels.masked_fill(~target_is_real, IGNORE)


def pack_tokens(plan, j: int, doc_tokens: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """Token ids of micro-batch j in packed order; doc_tokens(id) returns a whole document."""
    return pack_micro_batch(plan, j, doc_tokens)[0]


@dataclass(frozen=True)
class RankInputs:
    """One CP rank's rows of a packed micro-batch, in `shard.rank_indices[rank]` order.

    - `index`: int64 rows of the packed micro-batch this rank holds.
    - `tokens`, `labels`: token ids and pre-shifted labels of those rows.
    - `positions`: their RoPE positions (`shard.positions[rank]`).
    - `targets`: how many of the rows have a target (labels != IGNORE), counted on the host.
    """

    index: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    targets: int

    @classmethod
    def empty(cls, device=None) -> "RankInputs":
        """The inputs of an empty micro-batch slot: zero rows."""
        zero = torch.zeros(0, dtype=torch.long, device=device)
        return cls(zero, zero, zero, zero, 0)

    def to(self, device) -> "RankInputs":
        return RankInputs(self.index.to(device), self.tokens.to(device), self.positions.to(device),
                          self.labels.to(device), self.targets)


def rank_inputs(tokens: torch.Tensor, labels: torch.Tensor, shard, rank: int) -> RankInputs:
    """CP rank `rank`'s rows of a packed micro-batch (`tokens`, `labels` from
    `pack_micro_batch`), on the host, positions from `shard.positions[rank]`."""
    index = torch.tensor(shard.rank_indices[rank], dtype=torch.int64)
    positions = torch.tensor(shard.positions[rank], dtype=torch.int64)
    rows = labels[index]
    return RankInputs(index, tokens[index], positions, rows, int((rows != IGNORE).sum()))


def local_inputs(tokens: torch.Tensor, shard, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, RoPE positions) of CP rank `rank` for one packed micro-batch.

    `tokens` is the micro-batch in packed order; the result is in shard.rank_indices[rank]
    order, the order context_parallel_attention expects for q, k and v.
    """
    idx = torch.tensor(shard.rank_indices[rank], dtype=torch.int64).to(tokens.device)
    pos = torch.tensor(shard.positions[rank], dtype=torch.int64).to(tokens.device)
    return tokens.index_select(0, idx), pos


__all__ = ["IGNORE", "RankInputs", "local_inputs", "pack_micro_batch", "pack_tokens", "packed_labels",
           "packed_positions", "rank_inputs", "target_tokens"]
