"""What a `WLBPacker` holds between steps, and its JSON form (`state_dict` / `load_state_dict`).

A held piece (queued in an outlier queue, or carried to the next step) is a `HeldPiece`
record. The JSON state writes each as a list of 4 ints [id, offset, length, arrival]. A state
records a fingerprint of what planning reads from the cost model (its coefficients, kernel
model and layout; not its labels or provenance), so a state saved under other costs is
refused (`config.cost_fingerprint`). The config section holds the layout, the limits and every
field of the packer's `PackerConfig` (the thresholds in a field of their own); a state loads
only into a packer configured alike. `max_id`, the largest id any batch has brought, lets a
loaded `next_auto_id` be checked to be past every id the packer has issued (not only past the
pieces it holds). STATE_VERSION 5 added `config.delay_budget`; older states are refused with
a version error.

`state_dict()` is JSON-serialisable and a packer built with the same configuration that
loads it emits the same plans as the one that wrote it. The state does not remember the
pieces already emitted, so an emitted id sent again later is not detected.

This module checks a state against the loading packer's configuration and parses it into
a `LoadedState` without touching the packer; the packer adopts it only when all of it is
valid, so a rejected state leaves the packer as it was.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections import deque
from itertools import chain
from operator import itemgetter
from typing import NamedTuple

import numpy as np

from .._validate import check_unique_pieces
from ..cost import CostModel
from .stats import StreamStats

STATE_VERSION = 5
CONFIG_FIELDS = ("n_micro", "max_tokens", "dp", "n_queues", "max_delay", "seed", "max_backlog_tokens", "backlog_burst",
                 "pp", "method", "release", "balance_tolerance", "delay_budget", "lookahead", "cost_fingerprint")
"""The packer's configuration a state records; a packer loads only a state of its own
(`backlog_burst`: whether the backlog limit is the default one, which a batch may pass by its
own tokens beyond a step, or an explicit one, which is strict; a state written before it was
recorded is taken as of either)."""


class HeldPiece(NamedTuple):
    """A piece the packer holds: tokens [offset, offset + length) of document `id`, which
    arrived in global batch `arrival` (a step index)."""

    id: int
    offset: int
    length: int
    arrival: int

    @property
    def key(self) -> tuple[int, int]:
        """(id, offset): what identifies a piece; a batch may not repeat one the packer holds."""
        return self.id, self.offset


_ID_OFFSET = itemgetter(0, 1)
"""(id, offset) of a HeldPiece: its identity (`HeldPiece.key`)."""
_LENGTH = itemgetter(2)
"""HeldPiece.length, as a function (C-level `map`s and sort keys)."""
_ARRIVAL = itemgetter(3)
"""HeldPiece.arrival, as a function."""
_LENGTH_ARRIVAL = itemgetter(2, 3)
"""(HeldPiece.length, HeldPiece.arrival): the order in which a step forms its candidate groups."""


def ids_of(group) -> frozenset:
    """The ids of a list of pieces or of a `piece_table`."""
    return frozenset(group[0].tolist()) if isinstance(group, np.ndarray) else frozenset(map(itemgetter(0), group))


class LazyIds:
    """The ids of a list of pieces or of a `piece_table` (`ids_of`), made when first asked for
    (`get`), once. A stream whose ids grow never asks: a batch of larger ids than any seen
    cannot repeat a held piece (`WLBPacker` checks that first)."""

    __slots__ = ("_group", "_ids")

    def __init__(self, group):
        self._group, self._ids = group, None

    def get(self) -> frozenset:
        if self._ids is None:
            self._ids, self._group = ids_of(self._group), None
        return self._ids


class KeySets:
    """A few groups of pieces (held pieces, each batch buffered ahead) that a new batch is
    checked against, without building their union. Each group's ids are made once, when a
    batch is first checked against them (`ids`, or from its pieces); its pieces are read only
    when a batch shares an id with it, which a stream of whole documents never does."""

    def __init__(self, *groups, ids=None):
        """`groups`: lists of pieces, or `piece_table`s (4 x n int64 arrays: the lookahead
        buffer's batches); `ids`, if given: for each, its `LazyIds` (None: made from its
        pieces when needed)."""
        ids = [None] * len(groups) if ids is None else ids
        sizes = [g.shape[1] if isinstance(g, np.ndarray) else len(g) for g in groups]
        self._groups = [g for g, n in zip(groups, sizes) if n]
        self._ids = [LazyIds(g) if i is None else i for g, i, n in zip(groups, ids, sizes) if n]

    def __bool__(self) -> bool:
        return bool(self._groups)

    def first_clash(self, ids: list[int], offsets: np.ndarray, lengths: np.ndarray):
        """A batch's piece that is one of these or shares a token with one (the same id,
        overlapping [offset, offset + length)), as (position in the batch, held offset, held
        length), or None if none does. Only the groups that share an id with the batch are
        read, first on the ids alone (sets of ints): a stream of whole documents reads none.
        The held pieces with a batch's id and the batch's pieces are sorted by (id, offset)
        together: neither the held pieces nor the batch's overlap among themselves, so where a
        batch piece overlaps a held one, some batch piece overlaps its neighbour in that order
        (of the clashes between neighbours, the one of the lowest batch position is given)."""
        batch_ids = set(ids)
        shared = [k for k, group_ids in enumerate(self._ids) if not group_ids.get().isdisjoint(batch_ids)]
        if not shared:
            return None
        ids_arr = np.asarray(ids, dtype=np.int64)
        held = []
        for k in shared:
            group = self._groups[k]
            table = (group[:3] if isinstance(group, np.ndarray) else
                     np.fromiter(chain.from_iterable(group), dtype=np.int64, count=4 * len(group)).reshape(-1, 4).T[:3])
            held.append(table[:, np.isin(table[0], ids_arr)])
        held = np.concatenate(held, axis=1)
        n = len(ids_arr)
        all_ids = np.concatenate([ids_arr, held[0]])
        starts = np.concatenate([np.asarray(offsets, dtype=np.int64), held[1]])
        ends = starts + np.concatenate([np.asarray(lengths, dtype=np.int64), held[2]])
        order = np.lexsort((starts, all_ids))
        a, b = order[:-1], order[1:]  # neighbours in (id, offset) order
        clash = (all_ids[a] == all_ids[b]) & (ends[a] > starts[b]) & ((a < n) != (b < n))
        if not clash.any():
            return None
        batch_side = np.where(a[clash] < n, a[clash], b[clash])
        held_side = np.where(a[clash] < n, b[clash], a[clash])
        first = int(np.argmin(batch_side))
        h = int(held_side[first])
        return int(batch_side[first]), int(starts[h]), int(ends[h] - starts[h])
        spans: dict[int, list[tuple[int, int]]] = {}
        for k in shared:
            group = self._groups[k]
            rows = (zip(*group[:3].tolist()) if isinstance(group, np.ndarray)
                    else ((p.id, p.offset, p.length) for p in group))
            for i, offset, length in rows:
                if i in batch_ids:
                    spans.setdefault(i, []).append((offset, length))
        for position, (i, offset, length) in enumerate(zip(ids, offsets.tolist(), lengths.tolist())):
            for held_offset, held_length in spans.get(i, ()):
                if offset < held_offset + held_length and held_offset < offset + length:
                    return position, held_offset, held_length
        return None


def held_tokens(queues, carry) -> int:
    """Tokens of every piece in `queues` and `carry` (what the backlog guard bounds)."""
    return sum(piece.length for q in queues for piece in q) + sum(piece.length for piece in carry)


_PLANNING_FIELDS = ("coef", "attn_flops_per_pair", "attn_bwd_ratio", "attn_peak_flops", "tile", "eff_q_len",
                    "eff_scale", "parallel")


def cost_fingerprint(cost: CostModel) -> str:
    """Short hash of what planning reads from the cost model (coefficients, kernel model,
    layout), so that a state is not resumed under other costs."""
    d = cost.to_dict()
    return hashlib.sha256(json.dumps({k: d[k] for k in _PLANNING_FIELDS}, sort_keys=True).encode()).hexdigest()[:16]


def check_thresholds(thresholds, high: int | None = 2**63 - 1) -> list[int]:
    """Strictly increasing positive integer token counts, as ints (at most `high`; None: no
    bound, for a config whose bound is the packer's max_tokens)."""
    try:
        values = [v for v in thresholds]
    except TypeError:
        raise ValueError(f"thresholds must be 'auto' or an increasing list of positive token counts, "
                         f"got {thresholds!r}") from None
    out = []
    for i, v in enumerate(values):
        if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
            ok = 0 < v and (high is None or v <= high)  # no float test: an int beyond float range would overflow it
        else:
            ok = (isinstance(v, (float, np.floating)) and math.isfinite(v) and v == int(v) and 0 < v <= 2**63 - 1)
        if not ok:
            raise ValueError(f"thresholds[{i}] must be a positive integer token count, got {v!r}")
        out.append(int(v))
    if any(b <= a for a, b in zip(out, out[1:])):
        raise ValueError(f"thresholds must be strictly increasing, got {out}")
    return out


def _pieces_to_json(pieces) -> list[list[int]]:
    return [list(piece) for piece in pieces]


def encode_state(*, config: dict, auto: bool, thresholds: list[int] | None, step: int, next_auto_id: int,
                 max_id: int | None, queues, carry, calibration: dict | None, stats: StreamStats) -> dict:
    """The JSON state of a packer (see the module docstring)."""
    return dict(
        version=STATE_VERSION, config=config, auto=auto,
        thresholds=None if thresholds is None else list(thresholds),
        step=step, next_auto_id=next_auto_id, max_id=max_id,
        queues=[_pieces_to_json(q) for q in queues], carry=_pieces_to_json(carry),
        calibration=calibration, **stats.state(),
    )


class LoadedState(NamedTuple):
    """A parsed state, ready for the packer to adopt."""

    thresholds: list[int] | None
    queues: list[deque]
    carry: list[HeldPiece]
    step: int
    next_auto_id: int
    max_id: int | None
    calibration: dict | None
    stats: StreamStats


_INT64_MAX = 2**63 - 1
_STATE_FIELDS = ("config", "auto", "thresholds", "step", "next_auto_id", "max_id", "queues", "carry", "calibration",
                 "imbalance", "accumulators")


def _state_int(field: str, value, low: int = 0, high: int = _INT64_MAX) -> int:
    """An integer of the state in [low, high] (JSON ints only: no bool, float or string)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise ValueError(f"state_dict field {field} must be an integer in [{low}, {high}], got {value!r}")
    return int(value)


def _pieces_from_json(rows, field: str, *, max_tokens: int, step: int, lookahead: int = 0) -> list[HeldPiece]:
    """Held pieces of a state, each checked: [id, offset, length, arrival] integers with
    0 < length <= max_tokens, offset >= 0 and an arrival step before the state's step (with
    `lookahead` K: before step + K, since outliers of the batches seen ahead queue on arrival)."""
    if not isinstance(rows, (list, tuple)):
        raise ValueError(f"state_dict field {field} must be a list of [id, offset, length, arrival], got {rows!r}")
    if rows and step + lookahead == 0:
        raise ValueError(f"state_dict field {field} holds pieces at step 0 (before any step); got {list(rows)!r}")
    out = []
    for k, row in enumerate(rows):
        where = f"{field}[{k}]"
        if not isinstance(row, (list, tuple)) or len(row) != 4:
            raise ValueError(f"state_dict field {where} must be [id, offset, length, arrival], got {row!r}")
        out.append(HeldPiece(
            id=_state_int(f"{where} id", row[0], -2**63),
            offset=_state_int(f"{where} offset", row[1]),
            length=_state_int(f"{where} length", row[2], 1, max_tokens),
            arrival=_state_int(f"{where} arrival (a step before the state's step {step} + lookahead {lookahead})",
                               row[3], 0, step + lookahead - 1)))
    return out


def _check_held(queues: list[list[HeldPiece]], carry: list[HeldPiece], thresholds: list[int] | None) -> None:
    """No piece held twice; each queued outlier in the queue its length belongs to."""
    seen: set[tuple[int, int]] = set()
    for where, pieces in [(f"queues[{i}]", q) for i, q in enumerate(queues)] + [("carry", carry)]:
        for piece in pieces:
            if piece.key in seen:
                raise ValueError(f"state_dict holds piece (id {piece.id}, offset {piece.offset}) twice "
                                 f"(again in {where}); every piece is held once")
            seen.add(piece.key)
    for level, q in enumerate(queues):
        low = thresholds[level] if thresholds else None
        high = thresholds[level + 1] if thresholds and level + 1 < len(thresholds) else None
        for piece in q:
            if (low is not None and piece.length < low) or (high is not None and piece.length >= high):
                raise ValueError(f"state_dict field queues[{level}] holds a piece of {piece.length} tokens, outside "
                                 f"its queue's range [{low}, {high if high is not None else 'inf'})")


def decode_state(state, *, config: dict, auto: bool, thresholds: list[int] | None, n_queues: int,
                 lookahead: int = 0) -> LoadedState:
    """Check `state` against the loading packer and parse it.

    `config`, `auto`, `thresholds`, `n_queues` and `lookahead` describe the loading packer. Raises
    ValueError naming the field if the state comes from another format version or a packer
    configured differently, or if it is malformed.
    """
    if not isinstance(state, dict):
        raise ValueError(f"state must be the dict that WLBPacker.state_dict() returns, got {type(state).__name__}")
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"state version {state.get('version')!r} is not supported; expected {STATE_VERSION}")
    theirs = state.get("config", {})
    if not isinstance(theirs, dict):
        raise ValueError(f"state_dict field config must be a dict, got {type(theirs).__name__}")
    for name in CONFIG_FIELDS:
        if name == "n_queues" and auto and thresholds is None:
            continue  # an uncalibrated "auto" packer adopts the state's thresholds
        if name == "backlog_burst" and name not in theirs:
            continue  # written before the mode was recorded
        if theirs.get(name) != config[name]:
            raise ValueError(f"state_dict field config.{name}={theirs.get(name)!r} does not match this "
                             f"packer's {name}={config[name]!r}; build the packer with the same configuration")
    missing = [k for k in _STATE_FIELDS if k not in state]
    if missing:
        raise ValueError(f"state_dict is malformed: it has no field {missing[0]!r} (a packer state has "
                         f"{', '.join(_STATE_FIELDS)})")
    if not isinstance(state["auto"], bool):
        raise ValueError(f"state_dict field auto must be true or false, got {state['auto']!r}")
    if state["calibration"] is not None and not isinstance(state["calibration"], dict):
        raise ValueError("state_dict field calibration must be a dict or null, got "
                         f"{type(state['calibration']).__name__}")
    state_thresholds = state.get("thresholds")
    if not auto and state_thresholds != thresholds:
        raise ValueError(f"state_dict field thresholds={state_thresholds!r} does not match this packer's "
                         f"thresholds={thresholds!r} (a packer calibrated before the state was taken: build "
                         f"this one with config.replace(thresholds={state_thresholds!r}))")
    if auto and state.get("auto") is False:
        raise ValueError("state_dict field auto=False: the state has explicit thresholds "
                         f"{state_thresholds!r}; build the packer with thresholds={state_thresholds!r}")
    try:
        loaded_thresholds = None if state_thresholds is None else check_thresholds(state_thresholds)
        if loaded_thresholds is not None:
            n_queues = len(loaded_thresholds)
        step = _state_int("step", state["step"])
        # an id of 2**63 - 1 makes the next automatic id 2**63 (refused when used, not when loaded)
        next_auto_id = _state_int("next_auto_id", state["next_auto_id"], 0, _INT64_MAX + 1)
        max_id = None if state["max_id"] is None else _state_int("max_id", state["max_id"], -2**63)
        if not isinstance(state["queues"], (list, tuple)) or len(state["queues"]) != n_queues:
            raise ValueError(f"state_dict field queues must be a list of {n_queues} queues, got {state['queues']!r}")
        queues = [_pieces_from_json(q, f"queues[{i}]", max_tokens=config["max_tokens"], step=step,
                                  lookahead=lookahead)
                  for i, q in enumerate(state["queues"])]
        carry = _pieces_from_json(state["carry"], "carry", max_tokens=config["max_tokens"], step=step,
                                  lookahead=lookahead)
        _check_held(queues, carry, loaded_thresholds)
        stats = StreamStats.from_state(state)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"state_dict is malformed: {exc}") from None
    return LoadedState(
        thresholds=loaded_thresholds, queues=[deque(q) for q in queues], carry=carry,
        step=step, next_auto_id=next_auto_id, max_id=max_id, calibration=state.get("calibration"), stats=stats)


def check_ids_issued(loaded: LoadedState, buffered: list[HeldPiece], max_tokens: int) -> None:
    """The pieces of the lookahead buffer are valid and held once, and the id record is
    consistent: every held piece's id is at most `max_id`, and `next_auto_id` is past it (an
    automatic id must never repeat one the packer was given)."""
    seen = {piece.key for q in loaded.queues for piece in q} | {piece.key for piece in loaded.carry}
    for k, piece in enumerate(buffered):
        where = f"lookahead_buffer piece {k} (id {piece.id}, offset {piece.offset})"
        if not -2**63 <= piece.id <= _INT64_MAX:
            raise ValueError(f"state_dict field {where} has an id outside int64")
        if piece.length > max_tokens:
            raise ValueError(f"state_dict field {where} has {piece.length} tokens > max_tokens={max_tokens}")
        if piece.key in seen:
            raise ValueError(f"state_dict holds piece (id {piece.id}, offset {piece.offset}) twice (again in the "
                             "lookahead buffer); every piece is held once")
        seen.add(piece.key)
    held = [piece for q in loaded.queues for piece in q] + list(loaded.carry) + list(buffered)
    if len(held) > 1:  # nor two pieces of one document that overlap: their shared tokens would train twice
        ids, offsets, lengths = (np.array(column, dtype=np.int64) for column in zip(*((p.id, p.offset, p.length)
                                                                                      for p in held)))
        check_unique_pieces(ids, offsets, "in the state", lengths=lengths)
    if loaded.max_id is None:
        if held:
            raise ValueError(f"state_dict field max_id is null (no batch given yet) but the state holds "
                             f"{len(held)} pieces")
        return
    top = max((piece.id for piece in held), default=None)
    if top is not None and top > loaded.max_id:
        raise ValueError(f"state_dict holds a piece of id {top} above max_id={loaded.max_id}, the largest id "
                         "given to the packer")
    if loaded.next_auto_id <= loaded.max_id:
        raise ValueError(f"state_dict field next_auto_id={loaded.next_auto_id} is not past max_id={loaded.max_id}: "
                         "automatic ids would repeat an id the packer was given")
