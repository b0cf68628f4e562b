"""Lookahead for `WLBPacker(..., lookahead=K)`: the packer sees K global batches ahead.

Every real data loader prefetches. With K > 0, `pack(batch s)` takes step s's global batch
and returns the plan of step s - K (None while the first K batches arrive); `drain()`
returns the rest. The rules (beyond the paper):

- an outlier (length >= L1) joins its queue when its batch arrives, with its arrival step,
  so the queues of step t = s - K already hold the outliers of batches t+1..s. Every
  release policy then works unchanged: a queue that fills (paper rule) or a group that
  balances ("group", "balance") may take outliers that arrive up to K steps later, which
  are trained early; "marginal", the default, takes those that arrive up to
  `defaults.MAX_LEAD` = 2 steps later (a longer lead did not pay on the calibration
  streams) and values such a piece at its lead less `defaults.EARLY_CREDIT` = 0.5 steps.
  FIFO order is arrival order, so the outliers that arrived first leave first.
- a regular document (below L1) waits in the buffer for its own step and is fresh there
  (it may still be carried later, as without lookahead).
- displacement of a piece = training step - arrival step, in [-K, max_delay] (in [-2,
  max_delay] with "marginal"; a piece placed later than max_delay because a step was over
  capacity counts in `stats()["late_pieces"]`). `stats()` reports
  `displacement_per_token` (token-weighted mean of |displacement|), `early_token_share` and
  `late_token_share`.
- K = 0 is the paper's behaviour, and the plans are exactly those of the packer without
  lookahead (the batch's outliers are queued and its regular documents are fresh in the
  same order).

This module holds the buffer of regular documents (`LookaheadBuffer`) and its JSON form in
the packer's state (key "lookahead_buffer"; the queues already hold the early outliers).
"""
from __future__ import annotations

from collections import deque
from typing import Iterable

import numpy as np

from .pieces import FreshPieces, fresh_pieces, piece_table, pieces_from_table
from .state import HeldPiece, LazyIds

STATE_KEY = "lookahead_buffer"
"""Key of the buffer in `WLBPacker.state_dict()`: one list of [id, offset, length, arrival]
rows per buffered step, oldest first."""


class LookaheadBuffer:
    """The regular documents of the buffered global batches, one `piece_table` per step,
    oldest first. The buffer holds at most K + 1 batches between the arrival of a batch and
    the plan of the oldest one (at most K between calls).

    A batch is kept as its table (4 x n int64) and becomes `HeldPiece`s only at its own step
    (`pop_oldest`): K batches of thousands of pieces held as Python objects would be
    traversed by every collection of Python's garbage collector (a tuple subclass is never
    untracked), step after step. A batch's table is never changed once buffered, so copies of
    the buffer share them."""

    def __init__(self, tables: Iterable[np.ndarray] = ()) -> None:
        self._tables: deque[np.ndarray] = deque(tables)
        # the ids of each batch's pieces, made once per batch, when a new batch is first checked
        # against the buffer (`state.KeySets`; a stream whose ids grow is never checked)
        self._ids: deque[LazyIds] = deque(LazyIds(table) for table in self._tables)

    def __len__(self) -> int:
        return len(self._tables)

    def copy(self) -> "LookaheadBuffer":
        out = LookaheadBuffer()
        out._tables, out._ids = deque(self._tables), deque(self._ids)
        return out

    def with_batch(self, table: np.ndarray) -> "LookaheadBuffer":
        """A copy with the pieces of `table` (a `piece_table`) appended as the newest batch
        (the packer commits a copy only when the whole step is valid)."""
        out = self.copy()
        out._tables.append(table)
        out._ids.append(LazyIds(table))
        return out

    def pop_oldest(self) -> tuple[FreshPieces | list[HeldPiece], np.ndarray]:
        """Remove and return the regular documents of the oldest buffered step (`fresh_pieces`:
        on a large step, HeldPieces made only where read), with their `piece_table`."""
        self._ids.popleft()
        table = self._tables.popleft()
        return fresh_pieces(table), table

    def pieces(self) -> list[HeldPiece]:
        """Every buffered piece, oldest batch first."""
        return [piece for table in self._tables for piece in pieces_from_table(table)]

    def tables(self) -> list[np.ndarray]:
        """The buffered pieces, one `piece_table` per batch, oldest first."""
        return list(self._tables)

    def id_sets(self) -> list[LazyIds]:
        """The ids of each batch's pieces, one `LazyIds` per batch (a new batch may not repeat
        a buffered piece: `state.KeySets` checks a batch's ids against them first)."""
        return list(self._ids)

    def tokens(self) -> int:
        return sum(int(table[2].sum()) for table in self._tables)

    # ------------------------------------------------------------------ checkpointing
    def to_json(self) -> list[list[list[int]]]:
        return [table.T.tolist() for table in self._tables]

    @classmethod
    def from_json(cls, rows, *, lookahead: int, next_step: int) -> "LookaheadBuffer":
        """Parse a state's buffer; ValueError naming what is wrong. A packer between calls
        holds at most `lookahead` buffered steps, the oldest being `next_step` (the next
        plan), and every piece's arrival is its batch's step."""
        if not isinstance(rows, list) or len(rows) > lookahead:
            got = len(rows) if isinstance(rows, list) else type(rows).__name__
            raise ValueError(f"state_dict field {STATE_KEY} must be a list of at most lookahead={lookahead} "
                             f"batches, got {got}")
        batches = []
        for k, batch in enumerate(rows):
            if not isinstance(batch, list):
                raise ValueError(f"state_dict field {STATE_KEY}[{k}] must be a list of pieces, got {batch!r}")
            pieces = []
            for row in batch:
                if not isinstance(row, list) or len(row) != 4 or not all(
                        isinstance(x, int) and not isinstance(x, bool) for x in row):
                    raise ValueError(f"state_dict field {STATE_KEY}[{k}] holds {row!r}; a piece is "
                                     "[id, offset, length, arrival] (4 ints)")
                piece = HeldPiece(*row)
                if (not -2**63 <= piece.id < 2**63 or not 0 <= piece.offset < 2**63 or not 1 <= piece.length < 2**63
                        or piece.arrival != next_step + k):
                    raise ValueError(f"state_dict field {STATE_KEY}[{k}] holds {row!r}: a buffered piece needs an "
                                     f"int64 id, 0 <= offset < 2**63, length >= 1 and arrival {next_step + k} (its "
                                     "batch's step)")
                pieces.append(piece)
            batches.append(piece_table(pieces))
        return cls(batches)
