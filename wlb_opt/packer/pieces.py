"""A step's pieces as arrays, and as sequences that make `HeldPiece`s only where one is read.

A step of 32 micro-batches brings thousands of fresh documents (about 3,100 pieces on the
`heavy` stream). The step's packings read them as arrays (`piece_table`): lengths, costs,
placement orders. As Python objects the release policies read only a few of them: the
pieces a plan defers, those the trim and the shedding weigh. Making every fresh piece a
`HeldPiece` cost about a tenth of such a step, so the packer hands its policies the fresh
pieces as a `FreshPieces` (the table; a piece is made when read, and kept) and the policies
and the step solver join them to the held pieces as a `PieceChain` (a concatenation that
copies nothing). Both behave as read-only lists of HeldPieces: indexing, slicing, `len`,
iteration, `+` with a list, and equality with a list compare as the list they stand for.

A large carry stays a table too (`take`): the thousands of short pieces a step sheds are
found by position in the next step, compared and sliced part by part in its chains
(`common_prefix`), and summed as arrays (`arrived_sums`).
"""
from __future__ import annotations

import contextlib
import gc
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate, chain, compress, repeat
from operator import mul

import numpy as np

from .state import _ARRIVAL, _LENGTH, HeldPiece


def piece_table(pieces) -> np.ndarray:
    """(ids, offsets, lengths, arrival steps) of `pieces`: a 4 x n int64 array."""
    if isinstance(pieces, FreshPieces):
        return pieces.table
    if isinstance(pieces, PieceChain):
        return np.concatenate([piece_table(part) for part in pieces.parts] or [np.zeros((4, 0), np.int64)], axis=1)
    return np.fromiter(chain.from_iterable(pieces), dtype=np.int64, count=4 * len(pieces)).reshape(-1, 4).T


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off within the block, and back on after it if it was
    on. A step makes thousands of short-lived objects (pieces, candidate lists) that reference
    counting frees; a collection in the middle of it would walk them all (a list of a step's
    pieces, and each piece: a tuple subclass is never untracked) only to free nothing. The
    allocation count goes on meanwhile, so a collection that is due runs after the block, on
    what is still alive then."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def pieces_from_table(table: np.ndarray) -> list[HeldPiece]:
    """The pieces of a `piece_table` (4 x n int64: ids, offsets, lengths, arrival steps),
    made with the garbage collector paused (`gc_paused`)."""
    with gc_paused():
        # tuple.__new__ makes each piece in C (HeldPiece(*row) runs a Python __new__ per piece)
        return list(map(tuple.__new__, repeat(HeldPiece, table.shape[1]), zip(*table.tolist())))


LAZY_MIN_PIECES = 1024
"""A step's fresh pieces are a `FreshPieces` from this many on (`fresh_pieces`). Fewer are made
HeldPieces at once: a step of 4 micro-batches (a few hundred pieces) packs many candidates
and reads its pieces often, and chaining them cost more than making them (about 12% more
instructions a step on `real`, against 3-13% fewer at 32 micro-batches)."""


def fresh_pieces(table: np.ndarray) -> FreshPieces | list[HeldPiece]:
    """A step's fresh pieces of the `piece_table` `table`: a `FreshPieces` from
    `LAZY_MIN_PIECES` pieces, else a list."""
    return FreshPieces(table) if table.shape[1] >= LAZY_MIN_PIECES else pieces_from_table(table)


def arrived_sums(pieces, step: int) -> tuple[int, int]:
    """(tokens, sum of arrival step x tokens) of the `pieces` (any iterable of them) that
    arrived by `step`; a `FreshPieces` or a chain's `FreshPieces` parts are read as arrays,
    without making them."""
    if isinstance(pieces, PieceChain):
        sums = [arrived_sums(part, step) for part in pieces.parts]
        return sum(t for t, _ in sums), sum(w for _, w in sums)
    if isinstance(pieces, FreshPieces):
        _, _, lengths, arrival = pieces.table
        if len(arrival) and arrival.max() <= step:  # a carry: every piece arrived
            return int(np.add.reduce(lengths)), int(np.dot(arrival, lengths))
        arrived = arrival <= step
        return int(np.add.reduce(lengths[arrived])), int(np.dot(arrival[arrived], lengths[arrived]))
    pieces = pieces if isinstance(pieces, list) else list(pieces)
    if not pieces:
        return 0, 0
    arrivals = list(map(_ARRIVAL, pieces))
    arrived = list(map(step.__ge__, arrivals))
    lengths = list(compress(map(_LENGTH, pieces), arrived))
    return sum(lengths), sum(map(mul, compress(arrivals, arrived), lengths))


def as_carry(pieces):
    """A carry loaded as a list (`WLBPacker.load_state_dict`) held as a step leaves it
    (`take`): from `LAZY_MIN_PIECES` pieces, a `FreshPieces` of their table."""
    return FreshPieces(piece_table(pieces)) if len(pieces) >= LAZY_MIN_PIECES else pieces


def owned(pieces):
    """A caller's own copy of a step's pieces: a list copied, a `FreshPieces` (read-only) as is."""
    return pieces if isinstance(pieces, FreshPieces) else list(pieces)


def lengths_of(pieces) -> np.ndarray:
    """Tokens of each of `pieces` (a list, a `FreshPieces` or a `PieceChain`), int64, without
    making the pieces of a `FreshPieces`."""
    if isinstance(pieces, FreshPieces):
        return pieces.lengths
    if isinstance(pieces, PieceChain):
        return np.concatenate([lengths_of(part) for part in pieces.parts] or [np.zeros(0, np.int64)])
    return np.fromiter(map(_LENGTH, pieces), dtype=np.int64, count=len(pieces))


class _Made:
    """The HeldPieces made so far from one table: each one at most once, so that a piece read
    twice (or read, then met again in the whole list) is the same object."""

    __slots__ = ("table", "pieces", "some")

    def __init__(self, table: np.ndarray):
        self.table = table
        self.pieces: list[HeldPiece] | None = None  # all of them, once iterated
        self.some: dict[int, HeldPiece] = {}  # those read one by one before that

    def all(self) -> list[HeldPiece]:
        if self.pieces is None:
            pieces = pieces_from_table(self.table)
            for i, piece in self.some.items():
                pieces[i] = piece
            self.pieces, self.some = pieces, {}
        return self.pieces

    def many(self, idx: list[int]) -> list[HeldPiece]:
        """The pieces at `idx`, those not made yet made together."""
        if self.pieces is not None:
            return [self.pieces[i] for i in idx]
        made = pieces_from_table(self.table[:, idx])
        some = self.some
        return [some.setdefault(i, piece) for i, piece in zip(idx, made)]

    def one(self, i: int) -> HeldPiece:
        if self.pieces is not None:
            return self.pieces[i]
        piece = self.some.get(i)
        if piece is None:
            piece = self.some[i] = tuple.__new__(HeldPiece, self.table[:, i].tolist())
        return piece


def take(pieces, positions: list[int]):
    """`[pieces[i] for i in positions]`, the pieces of a `FreshPieces` (in a chain or not)
    made together rather than one by one (a step may defer thousands of its fresh pieces).
    From `LAZY_MIN_PIECES` positions in a table or a chain that holds one, a `FreshPieces` of
    their own table: a step's carry, which the next step reads as arrays."""
    if len(positions) >= LAZY_MIN_PIECES and isinstance(pieces, (FreshPieces, PieceChain)):
        if isinstance(pieces, FreshPieces) or any(isinstance(part, FreshPieces) for part in pieces.parts):
            return FreshPieces(_taken_table(pieces, np.asarray(positions, dtype=np.int64)))
    if isinstance(pieces, FreshPieces):
        return pieces._made.many([pieces._start + i for i in positions])
    if not isinstance(pieces, PieceChain) or len(positions) < 8:
        return [pieces[i] for i in positions]
    out: list = [None] * len(positions)
    for where, part, local in _by_part(pieces, np.asarray(positions, dtype=np.int64)):
        for j, piece in zip(where.tolist(), take(part, local.tolist())):
            out[j] = piece
    return out


def _taken_table(pieces, at: np.ndarray) -> np.ndarray:
    """The `piece_table` of `pieces[i] for i in at`, read from the parts' tables."""
    if isinstance(pieces, FreshPieces):
        return pieces._made.table[:, pieces._start + at]
    out = np.empty((4, len(at)), dtype=np.int64)
    for where, part, local in _by_part(pieces, at):
        out[:, where] = (_taken_table(part, local) if isinstance(part, FreshPieces)
                         else piece_table([part[i] for i in local.tolist()]))
    return out


def _by_part(pieces: PieceChain, at: np.ndarray):
    """For each part of the chain `pieces` that holds some of the positions `at`: (where they
    are in `at`, the part, their positions in the part)."""
    part_of = np.searchsorted(pieces._starts, at, side="right") - 1
    for k, (part, start) in enumerate(zip(pieces.parts, pieces._starts)):
        where = (part_of == k).nonzero()[0]
        if len(where):
            yield where, part, at[where] - start


class _PieceSequence(Sequence):
    """What `FreshPieces` and `PieceChain` share: a read-only list of HeldPieces."""

    __slots__ = ()
    __hash__ = None  # as a list

    def __add__(self, other):
        if isinstance(other, (list, _PieceSequence)):
            return PieceChain((self, other))
        return NotImplemented

    def __radd__(self, other):
        if isinstance(other, (list, _PieceSequence)):
            return PieceChain((other, self))
        return NotImplemented

    def __eq__(self, other):
        if other is self:
            return True
        if isinstance(other, (list, _PieceSequence)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"

    def index(self, value, *args) -> int:  # Sequence's would read the pieces one by one
        return list(self).index(value, *args)

    def count(self, value) -> int:
        return list(self).count(value)


class FreshPieces(_PieceSequence):
    """Pieces held as a `piece_table` (4 x n int64), read as a list of HeldPieces: a piece is
    made when it is first read (and kept), all of them when the sequence is iterated. A slice
    is a view of the same table and the same pieces made. `table` holds the columns of these
    pieces (a view when this is a slice)."""

    __slots__ = ("_made", "_start", "_stop")

    def __init__(self, table: np.ndarray, *, _made: _Made | None = None, _start: int = 0, _stop: int | None = None):
        self._made = _Made(table) if _made is None else _made
        self._start = _start
        self._stop = self._made.table.shape[1] if _stop is None else _stop

    @property
    def table(self) -> np.ndarray:
        table = self._made.table
        return table if self._start == 0 and self._stop == table.shape[1] else table[:, self._start:self._stop]

    @property
    def lengths(self) -> np.ndarray:
        return self._made.table[2, self._start:self._stop]

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return list(self)[i]
            stop = max(start, stop)
            if start == 0 and stop == len(self):
                return self
            return FreshPieces(None, _made=self._made, _start=self._start + start, _stop=self._start + stop)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"piece {i} of {n}")
        return self._made.one(self._start + i)

    def __iter__(self):
        if self._start == self._stop:  # an empty view: nothing to make
            return iter(())
        pieces = self._made.all()
        if self._start == 0 and self._stop == len(pieces):
            return iter(pieces)
        return iter(pieces[self._start:self._stop])

    def __eq__(self, other):
        if type(other) is FreshPieces and other._made is self._made:  # views of one table: their ranges
            return (other._start, other._stop) == (self._start, self._stop) or len(self) == len(other) == 0
        return super().__eq__(other)

    __hash__ = None


class PieceChain(_PieceSequence):
    """Lists of pieces and `FreshPieces` read as one list, in order, without copying them.
    Its parts are kept as given: they are not changed afterwards (every list the packer
    joins is a new one)."""

    __slots__ = ("parts", "_starts", "_len")

    def __init__(self, parts):
        flat = []
        for part in parts:
            if type(part) is PieceChain:
                flat.extend(part.parts)
            elif part:
                flat.append(part)
        self.parts: tuple = tuple(flat)
        self._starts = list(accumulate(map(len, flat), initial=0))
        self._len = self._starts.pop()

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self._len)
            if step != 1:
                return list(self)[i]
            if start == 0 and stop >= self._len:
                return self
            out = []
            for part, at in zip(self.parts, self._starts):
                lo, hi = max(start - at, 0), min(stop - at, len(part))
                if lo < hi:
                    out.append(part if lo == 0 and hi == len(part) else part[lo:hi])
            return PieceChain(out)
        n = self._len
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"piece {i} of {n}")
        k = bisect_right(self._starts, i) - 1
        return self.parts[k][i - self._starts[k]]

    def __iter__(self):
        return chain.from_iterable(self.parts)

    def fresh_ranges(self) -> list[tuple[int, int]]:
        """(start, stop) of each `FreshPieces` part (the fresh pieces, a carry held as a table)."""
        return [(at, at + len(part)) for part, at in zip(self.parts, self._starts) if isinstance(part, FreshPieces)]

    def before(self, tail):
        """The pieces before `tail` (a list, or a chain of the parts that hold a `FreshPieces`),
        if the chain's last part is `tail` itself; else None."""
        if not self.parts or self.parts[-1] is not tail:
            return None
        parts = self.parts[:-1]
        if any(isinstance(part, FreshPieces) for part in parts):
            return PieceChain(parts)
        return list(chain.from_iterable(parts))

    def __eq__(self, other):
        if (type(other) is PieceChain and len(other.parts) == len(self.parts)
                and all(len(a) == len(b) for a, b in zip(self.parts, other.parts))):  # part by part
            return all(a is b or a == b for a, b in zip(self.parts, other.parts))
        return super().__eq__(other)

    __hash__ = None


def common_prefix(a, b) -> int:
    """How many leading pieces `a` and `b` (lists or `PieceChain`s) hold as the same objects,
    or fewer: parts the two share are counted whole, and the first parts they do not share
    are compared piece by piece only if both are lists (a `FreshPieces` is not read)."""
    n = 0
    for part_a, part_b in zip(a.parts if type(a) is PieceChain else (a,), b.parts if type(b) is PieceChain else (b,)):
        if part_a is part_b:
            n += len(part_a)
            continue
        if isinstance(part_a, list) and isinstance(part_b, list):
            for x, y in zip(part_a, part_b):
                if x is not y:
                    break
                n += 1
        break
    return n
