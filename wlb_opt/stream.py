"""WLBStream: the loader side of the library, from documents to the plans and tensors of each step.

A training loop needs, per step, a PackPlan, one ShardPlan per micro-batch and the tokens of
every piece the plan places. The packer (`WLBPacker`) moves documents between steps (outlier
queues, carry), so the tokens of a piece are needed at a later step than the one that read
it. `WLBStream` owns that bookkeeping:

- it reads documents in data order, cuts those longer than `window` into pieces
  (`split_documents`), and fills each step's budget of `tokens_per_step` with whole pieces in
  data order (a piece that would cross the budget opens the next step, so a document larger
  than a step is fed across steps piece by piece and no step can overload the packer);
- it keeps the tokens of exactly the pieces the packer still holds (`cached_tokens`, bounded
  by the tokens the packer holds + `tokens_per_step` + `window`), and hands a step's placed
  pieces to its `Step`;
- its state (`state_dict()`, and `step.state` after each step) is JSON: the packer's state,
  the stream position and the tokens of held pieces. A fresh stream over the same source
  continues with identical plans and tensors after `load_state_dict()`.

`WLBStream.from_dataset(dataset, ..., lengths=...)` plans from the lengths alone and reads a
document's tokens only when a rank asks for a micro-batch that holds it.

Labels (one convention inside the library): `labels[i]` is the next token within the same
piece, -100 at each piece's last token and where the document's loss mask is False; the
Hugging Face adapter converts at its boundary (`wlb_opt.integrations.hf`).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Iterable, Iterator

import numpy as np

from ._validate import check_int
from .docs import split_documents
from .shard import solve_shard

STREAM_STATE_VERSION = 1
_IGNORE = -100


def _as_tokens(doc_id, tokens, what: str = "tokens") -> np.ndarray:
    """A document's tokens as a 1-D int64 array; ValueError naming the document otherwise."""
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # a torch tensor, without importing torch
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"document {doc_id}: {what} must be 1-D, got shape {arr.shape}")
    if arr.dtype == bool:
        return arr
    if not np.issubdtype(arr.dtype, np.integer):
        if arr.size == 0:
            arr = arr.astype(np.int64)
        else:
            raise ValueError(f"document {doc_id}: {what} must be integer token ids, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _check_index(name: str, value, n: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or not 0 <= value < n:
        raise ValueError(f"{name} must be an integer in [0, {n}), got {value!r}")
    return int(value)


def _doc_id(doc_id) -> int:
    if isinstance(doc_id, (bool, np.bool_)) or not isinstance(doc_id, (int, np.integer)):
        raise ValueError(f"document ids must be integers, got {doc_id!r}")
    return int(doc_id)


class _DatasetReader:
    """Reads a piece from a map-style dataset on demand, checking the document's length."""

    def __init__(self, dataset, lengths: np.ndarray):
        self.dataset, self.lengths = dataset, lengths

    def __call__(self, doc_id: int, offset: int, length: int):
        tokens = _as_tokens(doc_id, self.dataset[doc_id])
        expected = int(self.lengths[doc_id])
        if len(tokens) != expected:
            raise ValueError(f"document {doc_id}: the dataset returned {len(tokens)} tokens, but its length is "
                             f"{expected}")
        return tokens[offset:offset + length], None


class Step:
    """One training step: `index`, `plan` (PackPlan), `shards` (one ShardPlan per micro-batch,
    None for an empty one), `target_tokens` (the global batch's count of targets, the loss
    normalisation) and `state` (the stream's state after this step, JSON).

    `planning_s` is the time the stream spent planning it (packing and CP sharding).
    `tokens(j)` and `inputs(j, cp_rank)` build micro-batch j's tensors; `local(dp_rank,
    cp_rank)` lists the micro-batches of that rank. Pass the step itself as `data=` to
    `train_step` (it serves `piece(id, offset, length)`).
    """

    def __init__(self, index: int, plan, shards: list, pieces: dict | None, reader, cp: int, state_fn):
        self.index, self.plan, self.shards = index, plan, shards
        self._pieces, self._reader, self._cp, self._state_fn = pieces, reader, cp, state_fn
        self._state = None
        self.target_tokens = self._count_targets()

    def __repr__(self) -> str:
        placed = self._placed()
        return (f"Step(index={self.index}, micro_batches={len(self.plan.micro_batches)}, "
                f"tokens={int(self.plan.lengths[placed].sum()) if placed else 0}, target_tokens={self.target_tokens})")

    # ------------------------------------------------------------------ pieces
    def piece(self, doc_id: int, offset: int, length: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(token ids, loss mask or None) of the piece of document `doc_id` at `offset`."""
        if self._pieces is not None:
            hit = self._pieces.get((int(doc_id), int(offset)))
            if hit is None:
                raise ValueError(f"step {self.index} holds no piece of document {doc_id} at offset {offset}")
            tokens, mask = hit
        else:
            tokens, mask = self._reader(int(doc_id), int(offset), int(length))
        if len(tokens) != length:
            raise ValueError(f"document {doc_id}: the piece at offset {offset} should have {length} tokens, "
                             f"got {len(tokens)}")
        return tokens, mask

    def _placed(self):
        return [i for mb in self.plan.micro_batches for i in mb]

    def _count_targets(self) -> int:
        total = 0
        for i in self._placed():
            length = int(self.plan.lengths[i])
            if self._pieces is None:
                total += length - 1  # datasets carry no loss masks
                continue
            _, mask = self.piece(int(self.plan.doc_ids[i]), int(self.plan.offsets[i]), length)
            total += length - 1 if mask is None else int(np.count_nonzero(mask[1:]))
        return total

    # ------------------------------------------------------------------ tensors
    def _check_micro(self, j) -> int:
        return _check_index("micro-batch index", j, len(self.plan.micro_batches))

    def tokens(self, j: int):
        """The packed token ids of micro-batch j (all CP ranks), as a LongTensor."""
        from .executor.train import pack_micro_batch

        return pack_micro_batch(self.plan, self._check_micro(j), self)[0]

    def inputs(self, j: int, cp_rank: int = 0) -> dict:
        """One rank's tensors of micro-batch j, rows in `shards[j].rank_indices[cp_rank]` order:
        `input_ids`, `labels` (pre-shifted: the next token within the piece, -100 at each
        piece's last token and where the loss mask is False), `position_ids` (within each
        document, continuing across its pieces) and `segments` (int32 [n, 4], the rank's
        segment table for `doc_attention`)."""
        import torch

        from .executor.train import pack_micro_batch, packed_positions

        j = self._check_micro(j)
        cp_rank = _check_index("cp_rank", cp_rank, self._cp)
        mb = self.plan.micro_batches[j]
        if not len(mb):
            empty = torch.zeros(0, dtype=torch.long)
            return {"input_ids": empty, "labels": empty.clone(), "position_ids": empty.clone(),
                    "segments": torch.zeros((0, 4), dtype=torch.int32)}
        tokens, labels = pack_micro_batch(self.plan, j, self)
        positions = torch.from_numpy(packed_positions(self.plan.lengths[mb], self.plan.offsets[mb]))
        shard = self.shards[j]
        idx = torch.from_numpy(np.array(shard.rank_indices[cp_rank], dtype=np.int64))
        segments = torch.from_numpy(np.array(shard.segments[cp_rank], dtype=np.int32).reshape(-1, 4))
        return {"input_ids": tokens[idx], "labels": labels[idx], "position_ids": positions[idx], "segments": segments}

    def local(self, dp_rank: int = 0, cp_rank: int = 0) -> list[int]:
        """Indices of the micro-batches DP replica `dp_rank` runs, in order (every CP rank of
        the replica runs all of them, each on its own tokens: `inputs(j, cp_rank)`)."""
        _check_index("cp_rank", cp_rank, self._cp)
        return self.plan.replica_micro_batches(_check_index("dp_rank", dp_rank, self.plan.dp))

    @property
    def state(self) -> dict:
        """The stream's state after this step (JSON): checkpoint it with the model after
        training this step; `WLBStream.load_state_dict` resumes at the next one."""
        if self._state is None:
            self._state = self._state_fn()
        return self._state

    def __getstate__(self):  # a DataLoader worker pickles steps: take the state along, built
        d = dict(self.__dict__)
        d["_state"], d["_state_fn"] = self.state, None
        return d


class WLBStream:
    """Documents in, training steps out (see the module docstring).

    Args:
        documents: an iterable of `(doc_id, tokens)` or `(doc_id, tokens, loss_mask)`: tokens
            a 1-D integer list, numpy array or tensor; the mask True where a token is a
            target. Re-iterable (a list, a dataset) if the stream is to be resumed or run in a
            DataLoader worker. Ids are unique integers.
        packer: a `WLBPacker`; `tokens_per_step` must fit its capacity (dp x n_micro x max_tokens).
        tokens_per_step: the global batch's token budget; each step takes pieces in data order
            while they fit.
        cp: context-parallel ranks to shard each micro-batch for (None: the cost model's).
        strategy: `solve_shard` strategy (default "adaptive").
        window: documents longer than this are cut into pieces (default: packer.max_tokens).
    """

    def __init__(self, documents: Iterable, packer, tokens_per_step: int, *, cp: int | None = None,
                 strategy: str = "adaptive", window: int | None = None):
        if isinstance(documents, (str, bytes)) or not hasattr(documents, "__iter__"):
            raise ValueError(f"documents must be an iterable of (doc_id, tokens) pairs, got {type(documents).__name__}; "
                             "for a map-style dataset use WLBStream.from_dataset")
        self._init(packer, tokens_per_step, cp, strategy, window)
        self._documents, self._dataset, self._lengths = documents, None, None

    @classmethod
    def from_dataset(cls, dataset, packer, tokens_per_step: int, lengths=None, *, cp: int | None = None,
                     strategy: str = "adaptive", window: int | None = None) -> "WLBStream":
        """A stream over a map-style dataset whose item i is the tokens of document i (ids are
        the indices). With `lengths` (or `dataset.lengths`), planning needs the lengths alone
        and a document's tokens are read only when a micro-batch that holds it is built."""
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise ValueError(f"dataset must be map-style (__getitem__ and __len__), got {type(dataset).__name__}")
        self = cls.__new__(cls)
        self._init(packer, tokens_per_step, cp, strategy, window)
        if lengths is None:
            lengths = getattr(dataset, "lengths", None)
        if lengths is not None:
            from ._validate import validate_lengths

            lengths = validate_lengths(lengths)
            if len(lengths) != len(dataset):
                raise ValueError(f"lengths has {len(lengths)} entries, the dataset {len(dataset)} documents")
        self._documents, self._dataset, self._lengths = None, dataset, lengths
        return self

    def _init(self, packer, tokens_per_step, cp, strategy, window) -> None:
        from .packer import WLBPacker

        if not isinstance(packer, WLBPacker):
            raise ValueError(f"packer must be a wlb_opt.WLBPacker, got {type(packer).__name__}")
        self.packer = packer
        self.tokens_per_step = check_int("tokens_per_step", tokens_per_step, 1)
        if self.tokens_per_step > packer.capacity_tokens:
            raise ValueError(f"tokens_per_step={tokens_per_step} is more than the packer can place in one step "
                             f"({packer.dp} x {packer.n_micro} micro-batches x max_tokens={packer.max_tokens} = "
                             f"{packer.capacity_tokens}); lower it or give the packer more capacity")
        self.window = packer.max_tokens if window is None else check_int("window", window, 1)
        if self.window > packer.max_tokens:
            raise ValueError(f"window={window} is longer than the packer's max_tokens={packer.max_tokens}: a piece "
                             "must fit one micro-batch")
        if self.window > self.tokens_per_step:
            raise ValueError(f"window={self.window} is longer than tokens_per_step={tokens_per_step}: a piece must "
                             "fit one step")
        self.cp = packer.cost.degree("cp", cp)
        from .shard import SHARD_STRATEGIES

        if strategy not in SHARD_STRATEGIES:
            raise ValueError(f"strategy must be one of {list(SHARD_STRATEGIES)}, got {strategy!r}")
        self.strategy = strategy
        self._cache: dict[tuple[int, int], tuple] = {}
        self._pending: deque = deque()  # pieces read, not yet fed: (id, offset, length, tokens, mask)
        self._consumed = 0  # source items read (the last one maybe only in part)
        self._step = 0
        self._skip_offset: int | None = None  # on resume: pieces of item consumed-1 before it were fed
        self._ended = False

    # ------------------------------------------------------------------ reading
    def _items(self) -> Iterator[tuple[int, int, np.ndarray | None, np.ndarray | None, int]]:
        """(source index, doc id, tokens or None, mask or None, length), from position
        `_consumed` (earlier items are skipped: an iterable is re-iterated from the start)."""
        start = self._consumed
        if self._skip_offset is not None:
            start -= 1  # the partly fed document is read again; its fed pieces are dropped
        if self._dataset is not None:
            for i in range(start, len(self._dataset)):
                if self._lengths is not None:
                    yield i, i, None, None, int(self._lengths[i])
                else:
                    tokens = _as_tokens(i, self._dataset[i])
                    yield i, i, tokens, None, len(tokens)
            return
        for i, item in enumerate(self._documents):
            if i < start:
                continue
            if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
                raise ValueError(f"item {i} of documents must be (doc_id, tokens) or (doc_id, tokens, loss_mask), "
                                 f"got {type(item).__name__}")
            doc_id = _doc_id(item[0])
            tokens = _as_tokens(doc_id, item[1])
            mask = None
            if len(item) == 3 and item[2] is not None:
                mask = _as_tokens(doc_id, item[2], "loss_mask").astype(bool)
                if mask.shape != tokens.shape:
                    raise ValueError(f"document {doc_id}: loss mask of {len(mask)} entries for {len(tokens)} tokens")
            yield i, doc_id, tokens, mask, len(tokens)

    def _read_one(self, items) -> bool:
        """Read the next document into `_pending`; False at the end of the source."""
        for i, doc_id, tokens, mask, length in items:
            if length == 0:
                raise ValueError(f"document {doc_id} (item {i}) has no tokens; drop empty documents before the stream")
            pieces, _, offsets = split_documents([length], self.window)
            skip, self._skip_offset = self._skip_offset, None
            for n, off in zip(pieces.tolist(), offsets.tolist()):
                if skip is not None and off < skip:
                    continue
                tok = None if tokens is None else tokens[off:off + n]
                msk = None if mask is None else mask[off:off + n]
                self._pending.append((doc_id, off, n, tok, msk))
            self._consumed = i + 1
            return True
        return False

    def _fill(self, items) -> list | None:
        """The next step's pieces in data order within `tokens_per_step`; None at the end."""
        batch, used = [], 0
        while True:
            if not self._pending and not self._read_one(items):
                break
            piece = self._pending[0]
            if used + piece[2] > self.tokens_per_step:
                break
            batch.append(self._pending.popleft())
            used += piece[2]
        return batch if batch else None

    # ------------------------------------------------------------------ steps
    def _emit(self, plan, started: float) -> Step:
        placed = {(int(plan.doc_ids[i]), int(plan.offsets[i])) for mb in plan.micro_batches for i in mb}
        pieces = None
        if self._dataset is None or self._lengths is None:
            pieces = {key: self._cache.pop(key) for key in placed}
        shards = []
        for mb in plan.micro_batches:
            shards.append(solve_shard(plan.lengths[mb], self.cp, self.strategy, self.packer.cost,
                                      offsets=plan.offsets[mb]) if len(mb) else None)
        index = self._step
        self._step += 1
        snapshot = self._snapshot()
        reader = None if pieces is not None else _DatasetReader(self._dataset, self._lengths)
        step = Step(index, plan, shards, pieces, reader, self.cp, snapshot)
        step.planning_s = time.perf_counter() - started  # packing + CP sharding of this step
        return step

    def _feed(self, batch: list):
        lengths = np.array([p[2] for p in batch], dtype=np.int64)
        ids = np.array([p[0] for p in batch], dtype=np.int64)
        offsets = np.array([p[1] for p in batch], dtype=np.int64)
        for doc_id, off, _, tok, msk in batch:
            if (doc_id, off) in self._cache:
                raise ValueError(f"document id {doc_id} (offset {off}) is already held by the stream: ids must be "
                                 "unique")
        plan = self.packer.pack(lengths, ids, offsets)  # raises with its state unchanged
        if self._dataset is None or self._lengths is None:
            for doc_id, off, _, tok, msk in batch:
                self._cache[(doc_id, off)] = (tok, msk)
        return plan

    def __iter__(self) -> Iterator[Step]:
        """Steps until the source ends, then the packer's remaining steps (nothing is lost)."""
        items = self._items()
        while not self._ended:
            batch = self._fill(items)
            if batch is None:
                break
            started = time.perf_counter()
            plan = self._feed(batch)
            if plan is not None:  # a packer with lookahead returns None while it fills
                yield self._emit(plan, started)
        yield from self.drain()

    def drain(self) -> Iterator[Step]:
        """End the stream now: feed what was read and not yet fed, then yield the packer's
        remaining steps. Documents not yet read stay unread."""
        self._ended = True
        while self._pending:
            batch, used = [], 0
            while self._pending and used + self._pending[0][2] <= self.tokens_per_step:
                used += self._pending[0][2]
                batch.append(self._pending.popleft())
            started = time.perf_counter()
            plan = self._feed(batch)
            if plan is not None:
                yield self._emit(plan, started)
        started = time.perf_counter()
        for plan in self.packer.drain():
            yield self._emit(plan, started)
            started = time.perf_counter()

    # ------------------------------------------------------------------ accounting
    @property
    def cached_tokens(self) -> int:
        """Tokens the stream holds for pieces the packer still holds (plus, while a step is
        assembled, that step's pieces): at most the packer's held tokens + tokens_per_step +
        window, where held tokens include, with `lookahead=K`, the K batches seen ahead (so the
        bound over queued and carried tokens grows by K x tokens_per_step). The unfed rest of a document longer than a step is the source's, not counted."""
        return int(sum(len(t) for t, _ in self._cache.values() if t is not None))

    @property
    def held_tokens(self) -> int:
        """Tokens of the pieces the packer holds (queued, carried, or with `lookahead=K` in
        the K batches it has seen ahead: at most K x tokens_per_step more)."""
        return int(sum(piece.length for piece in self.packer.held_pieces()))

    # ------------------------------------------------------------------ state
    def _snapshot(self):
        """A function that builds the state as of now (cheap to take: references only)."""
        packer_state = self.packer.state_dict()
        cache = dict(self._cache)
        position = self._position()
        config = self._config()

        def build() -> dict:
            return {"version": STREAM_STATE_VERSION, "config": config, "packer": packer_state, **position,
                    "cache": [[k[0], k[1], t.tolist() if t is not None else None,
                               m.tolist() if m is not None else None] for k, (t, m) in sorted(cache.items())]}
        return build

    def _position(self) -> dict:
        pending_from = int(self._pending[0][1]) if self._pending else None
        return {"step": self._step, "consumed": self._consumed, "pending_from": pending_from,
                "ended": self._ended}

    def _config(self) -> dict:
        return {"tokens_per_step": self.tokens_per_step, "window": self.window, "cp": self.cp,
                "strategy": self.strategy, "lengths_only": self._lengths is not None}

    def state_dict(self) -> dict:
        """The stream's state now (JSON-serialisable)."""
        return self._snapshot()()

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (from `state_dict()` or `step.state`). The stream must be
        fresh and built over the same source with the same settings; it re-reads the source
        from the start and skips what the state had consumed."""
        if not isinstance(state, dict) or state.get("version") != STREAM_STATE_VERSION:
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a WLBStream state of version {STREAM_STATE_VERSION} (got {got!r})")
        if self._step or self._consumed:
            raise ValueError("load_state_dict needs a fresh stream (this one has already produced steps)")
        if state["config"] != self._config():
            raise ValueError(f"the state was saved by a stream with settings {state['config']}, this one has "
                             f"{self._config()}")
        if self._documents is not None and iter(self._documents) is self._documents and state["consumed"]:
            raise ValueError("documents is a one-shot iterator: a stream can only resume over a re-iterable "
                             "source (a list, a dataset, or an object whose __iter__ starts again)")
        for name in ("step", "consumed"):
            check_int(f"state[{name!r}]", state[name], 0)
        self.packer.load_state_dict(state["packer"])
        cache = {}
        for doc_id, off, tokens, mask in state["cache"]:
            cache[(int(doc_id), int(off))] = (None if tokens is None else np.asarray(tokens, dtype=np.int64),
                                              None if mask is None else np.asarray(mask, dtype=bool))
        self._cache = cache
        self._step, self._consumed, self._ended = int(state["step"]), int(state["consumed"]), bool(state["ended"])
        self._skip_offset = None if state["pending_from"] is None else int(state["pending_from"])
        self._pending.clear()

    # ------------------------------------------------------------------ DataLoader
    def as_dataset(self):
        """A `torch.utils.data.IterableDataset` that yields this stream's steps, so planning
        runs in a DataLoader worker: `DataLoader(stream.as_dataset(), batch_size=None,
        num_workers=1)`. More than one worker is refused (the stream is sequential)."""
        from torch.utils.data import IterableDataset, get_worker_info

        stream = self

        class _StepDataset(IterableDataset):
            def __iter__(self):
                info = get_worker_info()
                if info is not None and info.num_workers > 1:
                    raise ValueError(f"a WLBStream runs in at most one DataLoader worker, got num_workers="
                                     f"{info.num_workers} (steps depend on every step before them)")
                return iter(stream)

        return _StepDataset()


def cache_bound(stream: WLBStream) -> int:
    """The documented bound on `stream.cached_tokens` right now."""
    return stream.held_tokens + stream.tokens_per_step + stream.window


__all__ = ["Step", "WLBStream", "STREAM_STATE_VERSION", "cache_bound"]
