"""The JSON state of a `WLBStream`: its source fingerprint, its integrity digests, and the
checks `WLBStream.load_state_dict` runs on every field before anything changes.

- `SourceFingerprint`: a running digest of the (id, length) pairs the stream has read, and,
  for the document in flight (cut across steps, partly fed), its id, length and a digest of
  the tokens fed so far; compared with the source when it is read again.
- `cache_digest`: a digest of the cached tokens.
- `integrity` / `check_integrity`: one digest per section of the state, so that a value
  changed after the state was saved is caught even where it is valid on its own.
- `check_state_fields` / `decode_cache`: presence, type and range of every field.
"""
from __future__ import annotations

import hashlib
import json
import struct

import numpy as np

from .tokens import _INT64_MAX, as_mask, as_tokens

_DIGEST_BYTES = 16
_EMPTY_DIGEST = bytes(_DIGEST_BYTES)


def _hash(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for part in parts:
        h.update(part)
    return h.digest()


def cache_digest(items) -> str:
    """Digest of the cached pieces, (id, offset) sorted: their tokens and loss masks."""
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for (doc_id, off), (tokens, mask) in items:
        h.update(struct.pack("<qq", doc_id, off))
        h.update(b"-" if tokens is None else np.ascontiguousarray(tokens, dtype="<i8").tobytes())
        h.update(b"|" if mask is None else b"m" + np.ascontiguousarray(mask, dtype=bool).tobytes())
    return h.hexdigest()


class SourceFingerprint:
    """Which source a stream has read: a running digest of the (id, length) pairs of the
    documents read (O(1) per document), and, for the document in flight (cut across steps,
    partly fed), its id, length and a digest of the tokens fed so far.

    The state holds the digest of the documents before the one in flight (all of them when
    none is in flight); on resume it is compared when the skipped prefix has been read again
    (`skip`), or at load from `lengths` (`check_lengths`); the document in flight is compared
    when it is read again (`read`)."""

    def __init__(self) -> None:
        self.digest = _EMPTY_DIGEST  # over every document read
        self._before_last = _EMPTY_DIGEST  # over every document read but the last
        self._last: tuple | None = None  # (id, length, {piece offset: digest of the tokens before it})
        self._expect: tuple[int, bytes] | None = None  # (documents before the one in flight, their digest)
        self._in_flight: dict | None = None  # the state's record of the document in flight
        self._loaded: dict | None = None  # the fingerprint of the state loaded, as it was

    @staticmethod
    def _next(digest: bytes, doc_id: int, length: int) -> bytes:
        return _hash(digest, struct.pack("<qq", doc_id, length))

    def _verify(self, n: int) -> None:
        if self._expect is not None and self._expect[0] == n:
            if self.digest != self._expect[1]:
                raise ValueError(f"the source differs from the one the state was saved with: the (id, length) "
                                 f"pairs of its first {n} documents do not match the state's fingerprint "
                                 f"(digest {self.digest.hex()}, the state says {self._expect[1].hex()})")
            self._expect = None

    def skip(self, index: int, doc_id: int, length: int) -> None:
        """A document before the checkpoint, read again (an iterable source)."""
        self.digest = self._next(self.digest, doc_id, length)
        self._verify(index + 1)

    def read(self, index: int, doc_id: int, length: int, tokens, mask, offsets: list[int], resumed_at) -> None:
        """A document read for training; `resumed_at` is the offset it had been fed up to
        when it was in flight at the checkpoint (None otherwise)."""
        self._verify(index)
        prefixes = {0: _EMPTY_DIGEST}
        if len(offsets) > 1 and tokens is not None:  # a document in one piece is never in flight part-fed
            h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
            for lo, hi in zip(offsets, offsets[1:] + [length]):
                h.update(np.ascontiguousarray(tokens[lo:hi], dtype="<i8").tobytes())
                if mask is not None:
                    h.update(np.ascontiguousarray(mask[lo:hi], dtype=bool).tobytes())
                prefixes[hi] = h.digest()
        if resumed_at is not None and self._in_flight is not None:
            record, self._in_flight = self._in_flight, None
            prefix = prefixes.get(resumed_at)
            if (record["id"], record["length"]) != (doc_id, length):
                raise ValueError(f"the source differs from the one the state was saved with: the document in flight "
                                 f"at the checkpoint (item {index}) was id {record['id']} of {record['length']} "
                                 f"tokens, the source now gives id {doc_id} of {length} tokens")
            if record["prefix"] is not None and tokens is not None and (
                    prefix is None or prefix.hex() != record["prefix"]):
                raise ValueError(f"the source differs from the one the state was saved with: document {doc_id}'s "
                                 f"tokens before offset {resumed_at} (trained before the checkpoint) have changed; "
                                 "it would be trained as a mix of two sources")
        self._before_last = self.digest
        self.digest = self._next(self.digest, doc_id, length)
        self._last = (doc_id, length, prefixes if tokens is not None else None)

    def state(self, pending_from: int | None) -> dict:
        if self._loaded is not None and (self._expect is not None or self._in_flight is not None):
            return self._loaded  # resumed, and the source not read up to the checkpoint yet
        if pending_from is None or self._last is None:
            return {"documents": self.digest.hex(), "in_flight": None}
        doc_id, length, prefixes = self._last
        prefix = None if prefixes is None else prefixes[pending_from].hex()
        return {"documents": self._before_last.hex(),
                "in_flight": {"id": doc_id, "length": length, "prefix": prefix}}

    @classmethod
    def from_state(cls, source, consumed: int, pending_from: int | None) -> "SourceFingerprint":
        """Parse and check the state's fingerprint; it is verified against the source later."""
        if not isinstance(source, dict) or set(source) != {"documents", "in_flight", "cached_tokens"}:
            raise ValueError(f"state field fingerprint must be a dict with keys 'documents', 'in_flight' and "
                             f"'cached_tokens', got {source!r}")
        digest = _hex_digest("fingerprint.documents", source["documents"])
        _hex_digest("fingerprint.cached_tokens", source["cached_tokens"])
        record = source["in_flight"]
        if (record is None) != (pending_from is None):
            raise ValueError(f"state field fingerprint.in_flight={record!r} does not match pending_from={pending_from!r} "
                             "(a document is in flight exactly when pieces of it are pending)")
        if record is not None:
            if not isinstance(record, dict) or set(record) != {"id", "length", "prefix"}:
                raise ValueError(f"state field fingerprint.in_flight must be a dict with keys 'id', 'length' and "
                                 f"'prefix', got {record!r}")
            _state_int("fingerprint.in_flight.id", record["id"], -2**63)
            _state_int("fingerprint.in_flight.length", record["length"], pending_from + 1)
            if record["prefix"] is not None:
                _hex_digest("fingerprint.in_flight.prefix", record["prefix"])
        before = consumed - (record is not None)
        if before == 0 and digest != _EMPTY_DIGEST:
            raise ValueError(f"state field fingerprint.documents={source['documents']!r} is not the fingerprint of an empty "
                             "prefix, but the state had read no document before the one in flight")
        out = cls()
        out._expect = (before, digest) if before else None
        out._in_flight = record
        out._saved = digest
        out._loaded = {"documents": source["documents"], "in_flight": None if record is None else dict(record)}
        return out

    def check_lengths(self, lengths: np.ndarray, consumed: int) -> None:
        """Verify the prefix at load from the dataset's lengths (ids are the indices)."""
        if self._expect is None:
            return
        n, expected = self._expect
        digest = _EMPTY_DIGEST
        for i, length in enumerate(lengths[:n].tolist()):
            digest = self._next(digest, i, length)
        self.digest = digest
        self._verify(n)

    def adopt_prefix(self) -> None:
        """A dataset is not read before the checkpoint: start from the state's digest (checked
        by `check_lengths` when the lengths are known)."""
        if self._expect is not None:
            self.digest, self._expect = self._saved, None


def _hex_digest(field: str, value) -> bytes:
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else None
    except ValueError:
        raw = None
    if raw is None or len(raw) != _DIGEST_BYTES:
        raise ValueError(f"state field {field} must be a digest of {2 * _DIGEST_BYTES} hex digits, got {value!r}")
    return raw


def _state_int(field: str, value, low: int = 0, high: int = _INT64_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise ValueError(f"state field {field} must be an integer in [{low}, {high}], got {value!r}")
    return int(value)


_STATE_FIELDS = {"config": dict, "packer": dict, "step": int, "consumed": int, "pending_from": (int, type(None)),
                 "draining": bool, "ended": bool, "fingerprint": dict, "cache": list,
                 "integrity": dict}
# What the integrity digest covers, section by section (the cache has its own digest).
_SECTIONS = {"position": ("step", "consumed", "pending_from", "draining", "ended"), "packer": ("packer",),
             "fingerprint": ("fingerprint",)}


def integrity(state: dict) -> dict:
    """One digest per section of the state: a value changed after the state was saved is
    caught even where it is valid on its own (a counter moved within its range, a held piece
    deleted)."""
    out = {}
    for name, keys in _SECTIONS.items():
        # through JSON first, so that the digest is that of the saved form (int keys become strings)
        plain = json.loads(json.dumps([state[k] for k in keys]))
        text = json.dumps(plain, sort_keys=True, separators=(",", ":"))
        out[name] = hashlib.blake2b(text.encode(), digest_size=_DIGEST_BYTES).hexdigest()
    return out


def check_integrity(state: dict) -> None:
    saved = state["integrity"]
    if set(saved) != set(_SECTIONS):
        raise ValueError(f"state field integrity must hold the digests of {sorted(_SECTIONS)}, got {sorted(saved)}")
    now = integrity(state)
    for name, keys in _SECTIONS.items():
        if now[name] != saved[name]:
            fields = ", ".join(keys)
            raise ValueError(f"state section {name!r} ({fields}) was changed after the state was saved: its digest is "
                             f"{now[name]}, the state says {saved[name]!r}; resume from an unaltered state")


def check_state_fields(state: dict) -> dict:
    """Every field present, of its type and range (ValueError naming the field)."""
    for name, kind in _STATE_FIELDS.items():
        if name not in state:
            raise ValueError(f"state has no field {name!r} (a WLBStream state has {', '.join(_STATE_FIELDS)})")
        value = state[name]
        if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
            raise ValueError(f"state field {name} must be of type {getattr(kind, '__name__', 'int or null')}, got "
                             f"{value!r}")
    fields = {"step": _state_int("step", state["step"]), "consumed": _state_int("consumed", state["consumed"]),
              "draining": state["draining"], "ended": state["ended"], "pending_from": state["pending_from"]}
    if fields["pending_from"] is not None:
        _state_int("pending_from", fields["pending_from"])
        if fields["consumed"] == 0:
            raise ValueError(f"state field pending_from={fields['pending_from']} needs a document in flight, but "
                             "consumed=0")
    return fields


def decode_cache(rows: list, *, lengths_only: bool) -> dict:
    """The cached pieces of a state, each checked: [id, offset, tokens, loss mask or null]."""
    if lengths_only and rows:
        raise ValueError(f"state field cache holds {len(rows)} pieces, but a stream over a dataset with lengths "
                         "caches no tokens")
    cache = {}
    for k, row in enumerate(rows):
        where = f"cache[{k}]"
        if not isinstance(row, list) or len(row) != 4:
            raise ValueError(f"state field {where} must be [id, offset, tokens, loss mask or null], got {row!r}")
        doc_id = _state_int(f"{where} id", row[0], -2**63)
        off = _state_int(f"{where} offset", row[1])
        if not isinstance(row[2], list) or not row[2]:
            raise ValueError(f"state field {where} tokens must be a non-empty list of token ids, got {row[2]!r}")
        tokens = as_tokens(doc_id, row[2], f"state field {where} tokens")
        mask = None
        if row[3] is not None:
            if not isinstance(row[3], list) or not all(isinstance(x, bool) for x in row[3]):
                raise ValueError(f"state field {where} loss mask must be a list of booleans or null, got {row[3]!r}")
            mask = as_mask(doc_id, row[3], len(tokens))
        if (doc_id, off) in cache:
            raise ValueError(f"state field {where} repeats piece (id {doc_id}, offset {off})")
        cache[(doc_id, off)] = (tokens, mask)
    return cache
