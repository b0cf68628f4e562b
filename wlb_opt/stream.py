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
- its state (`state_dict()`, and `step.state` after each step, drain steps included) is
  JSON: the packer's state, the stream position, the tokens of held pieces and a
  fingerprint of the source. A fresh stream over the same source continues with identical
  plans and tensors after `load_state_dict()`, which checks every field, and the source
  against the fingerprint, before it changes anything (docs/reliability.md says which
  checks run at load and which when the source is read again).

`WLBStream.from_dataset(dataset, ..., lengths=...)` plans from the lengths alone and reads a
document's tokens only when a rank asks for a micro-batch that holds it.

Labels (one convention inside the library): `labels[i]` is the next token within the same
piece, -100 at each piece's last token and where the document's loss mask is False; the
Hugging Face adapter converts at its boundary (`wlb_opt.integrations.hf`).
"""
from __future__ import annotations

import copy
import time
from collections import deque
from typing import Iterable, Iterator

import numpy as np

from ._validate import check_index, check_int
from .documents import split_documents
from .shard import solve_shards
from .stream_state import (SourceFingerprint, cache_digest, check_integrity, check_state_fields, decode_cache,
                           integrity)
from .tokens import _INT64_MAX, as_mask, as_tokens

STREAM_STATE_VERSION = 2
_IGNORE = -100


def _doc_id(doc_id) -> int:
    if isinstance(doc_id, (bool, np.bool_)) or not isinstance(doc_id, (int, np.integer)):
        raise ValueError(f"document ids must be integers, got {doc_id!r}")
    if not -2**63 <= int(doc_id) <= _INT64_MAX:
        raise ValueError(f"document id {int(doc_id)} does not fit in int64; ids must be in [-2**63, 2**63 - 1]")
    return int(doc_id)


class _DatasetReader:
    """Reads a piece from a map-style dataset on demand, checking the document's length."""

    def __init__(self, dataset, lengths: np.ndarray):
        self.dataset, self.lengths = dataset, lengths

    def __call__(self, doc_id: int, offset: int, length: int):
        tokens = as_tokens(doc_id, _dataset_item(self.dataset, doc_id))
        expected = int(self.lengths[doc_id])
        if len(tokens) != expected:
            raise ValueError(f"document {doc_id}: the dataset returned {len(tokens)} tokens, but its length is "
                             f"{expected}")
        return tokens[offset:offset + length], None


def _dataset_item(dataset, i: int):
    """dataset[i], or a ValueError saying how a map-style dataset is read where it has no item i."""
    try:
        return dataset[i]
    except (KeyError, IndexError) as exc:
        raise ValueError(f"dataset[{i}] raised {type(exc).__name__}: WLBStream.from_dataset reads items by index, "
                         f"0 .. len(dataset) - 1 = {len(dataset) - 1}") from exc


class Step:
    """One training step: `index` (the packer's step; a step that would place nothing is not
    yielded, so indices may skip), `plan` (PackPlan), `shards` (one ShardPlan per micro-batch,
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
        return check_index("micro-batch index", j, len(self.plan.micro_batches))

    def tokens(self, j: int):
        """The packed token ids of micro-batch j (all CP ranks), as a LongTensor."""
        from .batch import pack_micro_batch  # torch, imported only when tensors are asked for

        return pack_micro_batch(self.plan, self._check_micro(j), self)[0]

    def inputs(self, j: int, cp_rank: int = 0) -> dict:
        """One rank's tensors of micro-batch j, rows in `shards[j].rank_indices[cp_rank]` order:
        `input_ids`, `labels` (pre-shifted: the next token within the piece, -100 at each
        piece's last token and where the loss mask is False), `position_ids` (within each
        document, continuing across its pieces) and `segments` (int32 [n, 4], the rank's
        segment table for `doc_attention`)."""
        import torch

        from .batch import pack_micro_batch, rank_inputs  # torch, imported only when tensors are asked for

        j = self._check_micro(j)
        cp_rank = check_index("cp_rank", cp_rank, self._cp)
        mb = self.plan.micro_batches[j]
        if not len(mb):
            empty = torch.zeros(0, dtype=torch.long)
            return {"input_ids": empty, "labels": empty.clone(), "position_ids": empty.clone(),
                    "segments": torch.zeros((0, 4), dtype=torch.int32)}
        shard = self.shards[j]
        rows = rank_inputs(*pack_micro_batch(self.plan, j, self), shard, cp_rank)  # positions: shard.positions
        segments = torch.from_numpy(np.array(shard.segments[cp_rank], dtype=np.int32).reshape(-1, 4))
        return {"input_ids": rows.tokens, "labels": rows.labels, "position_ids": rows.positions, "segments": segments}

    def local(self, dp_rank: int = 0, cp_rank: int = 0) -> list[int]:
        """Indices of the micro-batches DP replica `dp_rank` runs, in order (every CP rank of
        the replica runs all of them, each on its own tokens: `inputs(j, cp_rank)`)."""
        check_index("cp_rank", cp_rank, self._cp)
        return self.plan.replica_micro_batches(check_index("dp_rank", dp_rank, self.plan.dp))

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
        if self._reader is not None:  # the step's placed pieces travel, not the dataset they are read from
            plan = self.plan
            d["_pieces"] = {(int(plan.doc_ids[i]), int(plan.offsets[i])):
                            self._reader(int(plan.doc_ids[i]), int(plan.offsets[i]), int(plan.lengths[i]))
                            for i in self._placed()}
            d["_reader"] = None
        return d


class WLBStream:
    """Documents in, training steps out (see the module docstring).

    Args:
        documents: an iterable of `(doc_id, tokens)` or `(doc_id, tokens, loss_mask)`: tokens
            a 1-D integer list, numpy array or tensor; the mask True where a token is a
            target. Re-iterable (a list, a dataset) if the stream is to be resumed or run in a
            DataLoader worker. Ids are unique integers.
        packer: a `WLBPacker`; `tokens_per_step` must fit its capacity (dp x n_micro x max_tokens).
            Equal to it works where the pieces can fill the micro-batches; where they cannot
            (three 8-token pieces a step for two micro-batches of 12), the carry grows each step
            until the packer refuses the backlog (ValueError naming max_backlog_tokens).
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
        if packer.arrival_step:
            raise ValueError(f"packer has already been given {packer.arrival_step} batches: a stream plans from a "
                             "fresh packer (its pieces are the stream's); to resume a stream, give it a fresh packer "
                             "and load the stream's state (WLBStream.load_state_dict)")
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
        self._draining = False  # no more reads from the source: feed what was read, then drain the packer
        self._finished = False  # this process has yielded the last step
        self._broken: Exception | None = None  # the source raised: the stream cannot go on
        self._source_iter = None  # one reader of the source for every iter() of this stream
        self._generation = 0  # which iter() is current (an older one raises when advanced)
        self._fingerprint = SourceFingerprint()
        self._handed_out = False  # given to a DataLoader (as_dataset): a worker's copy plans, this one does not

    # ------------------------------------------------------------------ reading
    def _items(self) -> Iterator[tuple[int, int, np.ndarray | None, np.ndarray | None, int]]:
        """(source index, doc id, tokens or None, mask or None, length), from position
        `_consumed` (earlier items of an iterable are read again and only fingerprinted)."""
        start = self._consumed
        if self._skip_offset is not None:
            start -= 1  # the partly fed document is read again; its fed pieces are dropped
        if self._dataset is not None:
            for i in range(start, len(self._dataset)):
                if self._lengths is not None:
                    yield i, i, None, None, int(self._lengths[i])
                else:
                    tokens = as_tokens(i, _dataset_item(self._dataset, i))
                    yield i, i, tokens, None, len(tokens)
            return
        n_read = 0
        for i, item in enumerate(self._documents):
            n_read = i + 1
            if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
                raise ValueError(f"item {i} of documents must be (doc_id, tokens) or (doc_id, tokens, loss_mask), "
                                 f"got {type(item).__name__}")
            doc_id = _doc_id(item[0])
            if i < start:  # before the checkpoint: only its (id, length) counts, for the fingerprint
                self._fingerprint.skip(i, doc_id, len(item[1]))
                continue
            tokens = as_tokens(doc_id, item[1])
            mask = None
            if len(item) == 3 and item[2] is not None:
                mask = as_mask(doc_id, item[2], len(tokens))
            yield i, doc_id, tokens, mask, len(tokens)
        if n_read < start:
            raise ValueError(f"the source ended after {n_read} documents, but the state being resumed had read "
                             f"{self._consumed}: resume over the source the state was saved with")

    def _read_one(self) -> bool:
        """Read the next document into `_pending`; False at the end of the source. An error
        while reading breaks the stream: a later iter() raises rather than take the dead
        reader for the end of data."""
        if self._source_iter is None:
            self._source_iter = self._items()
        try:
            return self._read_next()
        except Exception as exc:
            self._broken = exc
            raise

    def _read_next(self) -> bool:
        for i, doc_id, tokens, mask, length in self._source_iter:
            if length == 0:
                raise ValueError(f"document {doc_id} (item {i}) has no tokens; drop empty documents before the stream")
            pieces, _, offsets = split_documents([length], self.window)
            skip, self._skip_offset = self._skip_offset, None
            if skip is not None and skip not in set(offsets.tolist()):
                raise ValueError(f"document {doc_id} (item {i}) of {length} tokens has no piece at offset {skip}, "
                                 f"where the state being resumed says it was fed up to: resume over the source the "
                                 "state was saved with")
            self._fingerprint.read(i, doc_id, length, tokens, mask, offsets.tolist(), resumed_at=skip)
            for n, off in zip(pieces.tolist(), offsets.tolist()):
                if skip is not None and off < skip:
                    continue
                tok = None if tokens is None else tokens[off:off + n]
                msk = None if mask is None else mask[off:off + n]
                self._pending.append((doc_id, off, n, tok, msk))
            self._consumed = i + 1
            return True
        return False

    def _next_batch(self) -> int:
        """How many pending pieces (data order, read as needed) make the next step's batch
        within `tokens_per_step`; 0 when nothing is left. Nothing is taken from `_pending`
        until the packer has accepted the batch."""
        k, used = 0, 0
        while True:
            if k == len(self._pending) and (self._draining or not self._read_one()):
                break
            piece = self._pending[k]
            if used + piece[2] > self.tokens_per_step:
                break
            used += piece[2]
            k += 1
        return k

    # ------------------------------------------------------------------ steps
    def _emit(self, plan, started: float) -> Step:
        placed = {(int(plan.doc_ids[i]), int(plan.offsets[i])) for mb in plan.micro_batches for i in mb}
        pieces = None
        if self._dataset is None or self._lengths is None:
            pieces = {key: self._cache.pop(key) for key in placed}
        shards = solve_shards(plan, self.cp, self.strategy, self.packer.cost)
        index = self._step
        self._step += 1
        snapshot = self._snapshot()
        reader = None if pieces is not None else _DatasetReader(self._dataset, self._lengths)
        step = Step(index, plan, shards, pieces, reader, self.cp, snapshot)
        step.planning_s = time.perf_counter() - started  # packing + CP sharding of this step
        return step

    def _feed(self, n: int):
        """Give the first `n` pending pieces to the packer; they leave `_pending` only once it
        has accepted them (a refused batch leaves the stream as it was)."""
        batch = [self._pending[k] for k in range(n)]
        lengths = np.array([p[2] for p in batch], dtype=np.int64)
        ids = np.array([p[0] for p in batch], dtype=np.int64)
        offsets = np.array([p[1] for p in batch], dtype=np.int64)
        for doc_id, off, _, tok, msk in batch:
            if (doc_id, off) in self._cache:
                raise ValueError(f"document id {doc_id} (offset {off}) is already held by the stream: ids must be "
                                 "unique")
        plan = self.packer.pack(lengths, ids, offsets)  # raises with its state unchanged
        for _ in range(n):
            self._pending.popleft()
        if self._dataset is None or self._lengths is None:
            for doc_id, off, _, tok, msk in batch:
                self._cache[(doc_id, off)] = (tok, msk)
        return plan

    def _next_step(self) -> Step | None:
        """Plan and commit the next step; None when the stream has nothing left."""
        if self._skip_offset is not None and not self._read_one():  # the document in flight at the checkpoint
            raise ValueError(f"the source ended after {self._consumed - 1} documents, but the state being resumed "
                             f"had read {self._consumed}: resume over the source the state was saved with")
        while True:
            started = time.perf_counter()
            n = self._next_batch()
            if n:
                plan = self._feed(n)
                if plan is not None and self._trains_any(plan):  # with lookahead None while it fills
                    return self._emit(plan, started)
                continue
            if not self._draining:
                self._draining = True  # the source has ended
                continue
            if self._pending:  # cannot happen: a piece fits a step (window <= tokens_per_step)
                raise AssertionError("a pending piece does not fit an empty step")
            plan = self.packer._drain_step()  # one step at a time, so each step's state is exact
            if plan is None:
                return None
            if self._trains_any(plan):
                return self._emit(plan, started)

    def _trains_any(self, plan) -> bool:
        """Whether `plan` holds a target to train. One that places nothing (a batch of
        outliers alone, all queued, or with lookahead an empty buffered batch), or only pieces
        without a target (pieces of one token, such as the last token of a document one past a
        multiple of `window`, or pieces whose targets are all masked out), is not yielded:
        nothing would train in it, and `train_step` refuses a global batch without targets.
        Its index is skipped, its pieces leave the cache, and its state (committed by the
        packer) travels with the next step yielded."""
        placed = [i for mb in plan.micro_batches for i in mb]
        for i in placed:
            length = int(plan.lengths[i])
            if length < 2:
                continue
            hit = self._cache.get((int(plan.doc_ids[i]), int(plan.offsets[i])))
            if hit is None or hit[1] is None or np.count_nonzero(hit[1][1:]):  # Step.target_tokens' count
                return True
        for i in placed:
            self._cache.pop((int(plan.doc_ids[i]), int(plan.offsets[i])), None)
        self._step += 1
        return False

    def _run(self, generation: int) -> Iterator[Step]:
        while True:
            if generation != self._generation:
                raise ValueError("this iterator of the stream was superseded by a later iter(), drain() or "
                                 "as_dataset(), which continues after the last step this one yielded; use that one")
            step = self._next_step()
            if step is None:
                self._finished = True
                return
            yield step

    def _check_not_handed_out(self, what: str) -> None:
        if self._handed_out:
            raise ValueError(f"{what}: this stream was given to a DataLoader (as_dataset()), whose worker plans the "
                             "steps on its own copy; this one does not advance. Checkpoint the state of the last step "
                             "received (step.state: the worker sends it with the step), and resume in a fresh stream")

    def _start(self, draining: bool = False) -> Iterator[Step]:
        """A new iterator after the last step yielded (`draining`: the stream ends now); the
        checks come first, so a refused call changes nothing."""
        self._check_not_handed_out("drain()" if draining else "iter()")
        if self._broken is not None:
            raise ValueError(f"this stream stopped on an error of its source ({self._broken}); nothing after the last "
                             "step yielded was trained: resume from that step's state over a corrected source") \
                from self._broken
        if self._finished:
            raise ValueError("this stream has ended: every step has been yielded. Build a new stream to train "
                             "again (a stream resumed from its final state yields nothing)")
        if draining:
            self._draining = True
        self._generation += 1
        return self._run(self._generation)

    def __iter__(self) -> Iterator[Step]:
        """Steps until the source ends, then the packer's remaining steps (nothing is lost).

        A later `iter()` on the same stream continues exactly after the last step yielded
        (the earlier iterator then raises if advanced); `iter()` after the last step has been
        yielded raises ValueError. A stream resumed from the state of its last step yields
        nothing."""
        return self._start()

    def drain(self) -> Iterator[Step]:
        """End the stream now: feed what was read and not yet fed (the rest of a document in
        flight included), then yield the packer's remaining steps. Documents not yet read stay
        unread. Like `iter()`, it continues after the last step yielded, and raises where
        `iter()` raises (the stream is then unchanged)."""
        return self._start(draining=True)

    # ------------------------------------------------------------------ accounting
    @property
    def cached_tokens(self) -> int:
        """Tokens the stream holds for pieces the packer still holds (plus, while a step is
        assembled, that step's pieces): at most the packer's held tokens + tokens_per_step +
        window, where held tokens include, with `lookahead=K`, the K batches seen ahead (so the
        bound over queued and carried tokens grows by K x tokens_per_step). The unfed rest of
        a document longer than a step is the source's, not counted."""
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
        source = self._fingerprint.state(position["pending_from"])

        def build() -> dict:
            items = sorted(cache.items())
            state = {"version": STREAM_STATE_VERSION, "config": config, "packer": packer_state, **position,
                     "fingerprint": {**source, "cached_tokens": cache_digest(items)},
                     "cache": [[k[0], k[1], t.tolist() if t is not None else None,
                                m.tolist() if m is not None else None] for k, (t, m) in items]}
            state["integrity"] = integrity(state)
            return state
        return build

    def _position(self) -> dict:
        pending_from = int(self._pending[0][1]) if self._pending else None
        if self._skip_offset is not None:  # resumed, the document in flight not read again yet
            pending_from = self._skip_offset
        if self._pending and self._pending[0][0] != self._pending[-1][0]:
            raise ValueError("the stream has no consistent state now: the packer refused the last batch, whose "
                             "pieces span two documents; resume from the state of the last step yielded "
                             "(step.state)")
        # ended: nothing pending, held or buffered ahead (a lookahead packer still plans a step for
        # each buffered batch, an empty one too)
        ended = (self._draining and pending_from is None and not self.packer.held_pieces()
                 and self.packer.arrival_step == self.packer.step)
        return {"step": self._step, "consumed": self._consumed, "pending_from": pending_from,
                "draining": self._draining, "ended": ended}

    def _config(self) -> dict:
        return {"tokens_per_step": self.tokens_per_step, "window": self.window, "cp": self.cp,
                "strategy": self.strategy, "lengths_only": self._lengths is not None}

    def state_dict(self) -> dict:
        """The stream's state now (JSON-serialisable)."""
        self._check_not_handed_out("state_dict()")
        return self._snapshot()()

    def load_state_dict(self, state: dict, max_backlog_tokens: int | None = None) -> None:
        """Continue from `state` (from `state_dict()` or `step.state`). The stream must be
        fresh and built over the same source with the same settings; it re-reads the source
        from the start and skips what the state had consumed. `max_backlog_tokens` raises the
        packer's limit on reload (`WLBPacker.load_state_dict`), to resume a stream that
        overloaded.

        Every field is checked before anything changes (ValueError naming the field), as is
        the state's consistency with the packer state it carries (the cached pieces are the
        pieces the packer holds, with their lengths) and the digest of the cached tokens.
        The source is checked against the state's fingerprint: eagerly for a dataset with
        `lengths`; for an iterable when the skipped prefix has been read again (before the
        first step is yielded); the document in flight at the checkpoint is compared with
        the digest of its fed prefix when it is read again. A map-style dataset without
        `lengths` is not re-read before the checkpoint, so only its size and the document in
        flight are checked."""
        if not isinstance(state, dict):
            raise ValueError(f"a WLBStream state is a dict (state_dict()), got {type(state).__name__}")
        if state.get("version") != STREAM_STATE_VERSION:
            raise ValueError(f"not a WLBStream state of version {STREAM_STATE_VERSION} (got version "
                             f"{state.get('version')!r}); states of other versions cannot be resumed")
        if self._step or self._consumed or self._generation:
            raise ValueError("load_state_dict needs a fresh stream (this one has already produced steps)")
        fields = check_state_fields(state)
        if state["config"] != self._config():
            ours = self._config()
            differ = [k for k in sorted(set(ours) | set(state["config"])) if state["config"].get(k) != ours.get(k)]
            raise ValueError("the state was saved by a stream with other settings: "
                             + ", ".join(f"{k}={state['config'].get(k)!r} there, {ours.get(k)!r} here" for k in differ)
                             + "; build the stream with the state's settings")
        consumed, pending_from = fields["consumed"], fields["pending_from"]
        if self._documents is not None and iter(self._documents) is self._documents and consumed:
            raise ValueError("documents is a one-shot iterator: a stream can only resume over a re-iterable "
                             "source (a list, a dataset, or an object whose __iter__ starts again)")
        if self._dataset is not None and consumed > len(self._dataset):
            raise ValueError(f"state field consumed={consumed} is past the end of the dataset ({len(self._dataset)} "
                             "documents): resume over the source the state was saved with")
        cache = decode_cache(state["cache"], lengths_only=self._lengths is not None)
        fingerprint = SourceFingerprint.from_state(state["fingerprint"], consumed, pending_from)
        digest = cache_digest(sorted(cache.items()))
        if digest != state["fingerprint"]["cached_tokens"]:
            raise ValueError(f"state field cache holds tokens that differ from those the state was saved with "
                             f"(digest {digest}, fingerprint.cached_tokens says {state['fingerprint']['cached_tokens']!r})")
        if self._lengths is not None:
            fingerprint.check_lengths(self._lengths, consumed)
        scratch = copy.deepcopy(self.packer)  # checked on a copy: a refused state changes nothing
        try:
            scratch.load_state_dict(state["packer"], max_backlog_tokens)  # checks its own fields
        except ValueError as exc:
            raise ValueError(f"state field packer (the packer's state): {exc}") from None
        self._check_against_packer(scratch, cache, fields)
        check_integrity(state)
        self.packer.load_state_dict(state["packer"], max_backlog_tokens)
        self._cache = cache
        self._step, self._consumed = fields["step"], consumed
        self._draining = fields["draining"]
        self._skip_offset = pending_from
        self._pending.clear()
        self._fingerprint = fingerprint
        if self._dataset is not None:  # indices are ids: the prefix is not read again
            self._fingerprint.adopt_prefix()

    def _check_against_packer(self, packer, cache: dict, fields: dict) -> None:
        held = {piece.key: piece.length for piece in packer.held_pieces()}
        if packer.step != fields["step"]:
            raise ValueError(f"state field step={fields['step']} does not match its packer state's step "
                             f"{packer.step}")
        if self._lengths is not None:  # the pieces the packer holds are pieces of the dataset's documents
            for (doc_id, off), length in held.items():
                n = int(self._lengths[doc_id]) if 0 <= doc_id < len(self._lengths) else None
                if n is None or off % self.window or off + length != min(n, off + self.window):
                    raise ValueError(f"state field packer holds piece (id {doc_id}, offset {off}, {length} tokens), "
                                     f"which is not a piece of the dataset's documents (ids 0..{len(self._lengths) - 1} "
                                     f"cut at window={self.window}): resume over the source the state was saved with")
        if self._lengths is None:
            missing = sorted(set(held) - set(cache))
            extra = sorted(set(cache) - set(held))
            if missing or extra:
                what = (f"no tokens for held piece (id, offset) {missing[0]}" if missing
                        else f"tokens for piece (id, offset) {extra[0]}, which its packer state does not hold")
                raise ValueError(f"state field cache is inconsistent with its packer state: it has {what}")
            for key, (tokens, _) in cache.items():
                if tokens is not None and len(tokens) != held[key]:
                    raise ValueError(f"state field cache: piece (id {key[0]}, offset {key[1]}) has {len(tokens)} "
                                     f"tokens, its packer state holds it with {held[key]}")
        # (empty batches still buffered ahead are harmless: their steps place nothing and are not
        # yielded; earlier versions of the stream wrote ended=True with them)
        if fields["ended"] and (held or fields["pending_from"] is not None or not fields["draining"]):
            raise ValueError("state field ended=True, but the state still holds pieces (pending, held by the packer "
                             "or not draining): an ended stream holds nothing")

    def __getstate__(self):
        if self._source_iter is not None:
            raise TypeError("a WLBStream that has started reading its source cannot be pickled or copied (a reader "
                            "is in flight); checkpoint it with state_dict() and load that into a fresh stream")
        return dict(self.__dict__)

    # ------------------------------------------------------------------ DataLoader
    def as_dataset(self):
        """A `torch.utils.data.IterableDataset` that yields this stream's steps, so planning
        runs in a DataLoader worker: `DataLoader(stream.as_dataset(), batch_size=None,
        num_workers=1)`. More than one worker is refused (the stream is sequential).

        The worker plans on its own copy of the stream: from then on this stream's
        `state_dict()` and `iter()` raise (they would give the state it had when handed out),
        and so does an iterator of it taken before (it would yield the worker's steps again);
        checkpoint `step.state` of the last step received. With `num_workers=0` the DataLoader
        iterates this very stream, which then advances as usual. A worker that is not
        persistent starts again from the stream as it was handed out at each pass over the
        DataLoader: make one pass, or pass `persistent_workers=True`."""
        from ._stream_dataset import StepDataset  # torch, imported only here

        self._check_not_handed_out("as_dataset()")
        self._handed_out = True
        self._generation += 1  # an iterator taken before would train the worker's steps again: it raises
        return StepDataset(self)


def cache_bound(stream: WLBStream) -> int:
    """The documented bound on `stream.cached_tokens` right now."""
    return stream.held_tokens + stream.tokens_per_step + stream.window


__all__ = ["Step", "WLBStream", "STREAM_STATE_VERSION", "cache_bound"]
