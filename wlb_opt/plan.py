"""Plans and their checks: PackPlan (PP/DP level), SolveInfo, imbalance, check_pack.

A PackPlan says which documents (or pieces of documents) go into which micro-batch of one
training step, which DP replica runs each micro-batch, and which documents are deferred to
the next step. `check_pack` verifies a plan against the input it was made from without
trusting any solver code: it only counts tokens.
"""
from __future__ import annotations

import bisect
import copy
import dataclasses
import functools
import hashlib
import json
import numbers
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from ._validate import (check_index, check_int, check_unique_pieces, exact_integers, read_only, validate_ids,
                        validate_lengths, validate_offsets)

PLAN_FORMAT_VERSION = 2  # 2: arrival_step is a field; 1 still loads (arrival in info.extra)


def _loads_field(loads) -> np.ndarray:
    """A plan dict's `loads` as float64 seconds, or ValueError naming the field."""
    try:
        return np.asarray(loads, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"PackPlan.from_dict: loads must be numbers (seconds per micro-batch), got "
                         f"{loads!r:.80}") from None


def _freeze(obj, name: str, dtype) -> None:
    value = getattr(obj, name)
    if _frozen_already(value, dtype):
        return
    if np.dtype(dtype).kind in "iu":  # a cast would truncate 990.9 to 990 and change the plan silently
        value = exact_integers(value, f"plan field {name}")
    object.__setattr__(obj, name, read_only(value, dtype))


def _frozen_tuple(arrays, dtype, name: str = "micro_batches") -> tuple:
    return tuple(a if _frozen_already(a, dtype) else
                 read_only(exact_integers(a, f"plan field {name}") if np.dtype(dtype).kind in "iu" else a, dtype)
                 for a in arrays)


def _frozen_already(a, dtype) -> bool:
    """Whether `a` is as good as what `read_only` makes of it: a read-only contiguous array of
    `dtype` that owns its data, or a view of a read-only array that does (a changed copy of a
    plan shares it, as it shares the fields it leaves unchanged; the packer's own plans are
    made of such arrays, not copied again)."""
    if type(a) is not np.ndarray or a.dtype != dtype or a.flags.writeable or not a.flags.c_contiguous:
        return False
    base = a.base
    return a.flags.owndata or (type(base) is np.ndarray and base.flags.owndata and not base.flags.writeable)


def imbalance(loads) -> float:
    """max / mean of `loads` (1.0 is perfect; 1.0 for empty or all-zero loads): the costs of a
    step's micro-batches, finite numbers >= 0 (else a ValueError naming the first bad one)."""
    if loads is None or isinstance(loads, (str, bytes)):
        raise ValueError(f"loads must be a sequence of finite numbers >= 0 (one per micro-batch), got {loads!r}")
    try:
        arr = np.asarray(loads, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"loads must be a sequence of finite numbers >= 0 (one per micro-batch): {exc}") from None
    bad = ~np.isfinite(arr) | (arr < 0)
    if bad.any():
        i = int(np.argmax(bad.reshape(-1)))
        raise ValueError(f"loads must be finite numbers >= 0 (one per micro-batch), got {arr.reshape(-1)[i]} at "
                         f"index {i}")
    return _imbalance(arr)


def _imbalance(loads) -> float:
    """`imbalance` without the checks, for loads the library computed itself."""
    arr = np.asarray(loads, dtype=np.float64)
    if arr.size == 0:
        return 1.0
    if arr.ndim == 1:  # arr.mean() and arr.max() without their overhead (the same sum over the count)
        mean, top = np.add.reduce(arr) / arr.size, np.maximum.reduce(arr)
    else:
        mean, top = arr.mean(), arr.max()
    return float(top / mean) if mean > 0 else 1.0


@dataclass(frozen=True)
class SolveInfo:
    """How a plan was found. Times in seconds; objective and bound in cost seconds.

    Frozen: change a copy with ``dataclasses.replace(info, wall_s=...)``. `extra` is a
    read-only mapping of method-specific details (JSON values).
    """

    method: str
    status: str = "heuristic"
    """"optimal", "feasible", "heuristic", "infeasible", ... (solver-specific detail appended).

    An exact method's "optimal" is optimal up to its solver's resolution: CP-SAT's costs are
    integers of 1e-7 of the start's largest cost, and HiGHS's and CBC's rows hold to about 1e-6
    relative, so a plan another one beats by less than that (near-tied costs) may be called
    optimal. `bound` stays below every plan."""
    objective: float | None = None
    """Largest micro-batch cost of the plan (seconds)."""
    bound: float | None = None
    """Proven lower bound on the optimal largest cost (seconds), where known."""
    gap: float | None = None
    """(objective - bound) / objective, where both are known."""
    scale: float | None = None
    """Integer scaling of costs used by an exact model (cost units per second)."""
    build_s: float = 0.0
    solve_s: float = 0.0
    wall_s: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))

    def __reduce__(self):  # picklable (DataLoader workers, multiprocessing): the mapping goes as a dict
        return (_solve_info_from_fields, (self.to_dict(),))

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["extra"] = dict(self.extra)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SolveInfo":
        return cls(**d)


@dataclass(frozen=True)
class PackPlan:
    """One step's packing. Piece indices index the plan's own arrays (doc_ids, lengths, offsets).

    - `doc_ids[i]`, `lengths[i]`, `offsets[i]`: piece i is tokens [offsets[i], offsets[i] +
      lengths[i]) of document doc_ids[i]. Pieces of one document share its id.
    - `micro_batches[j]`: piece indices of micro-batch j, in packed order
      (dp * n_micro of them; `replica_of[j]` is the DP replica that runs it).
    - `deferred`: piece indices not placed this step (carried to the next).
    - `loads[j]`: modelled seconds of micro-batch j (cost.micro_batch_cost), `tokens[j]` its
      token count; `imbalance` = max / mean of loads.
    - `step`: the training step the plan is for (set by `WLBPacker`), `arrival_step[i]`: the
      step piece i arrived in (None: every piece arrived at `step`); its delay is
      step - arrival_step[i].

    Frozen: arrays are read-only and `micro_batches` is a tuple, so `digest()` cannot change
    after the plan is built. Make a changed copy with `plan.replace(replica_of=...)`.
    """

    doc_ids: np.ndarray
    lengths: np.ndarray
    offsets: np.ndarray
    micro_batches: tuple
    replica_of: np.ndarray
    deferred: np.ndarray
    loads: np.ndarray
    tokens: np.ndarray
    n_micro: int
    dp: int = 1
    max_tokens: int = 0
    info: SolveInfo = field(default_factory=lambda: SolveInfo(method="unknown"))
    step: int | None = None
    arrival_step: np.ndarray | None = None

    def __post_init__(self) -> None:
        self._freeze_fields(_PLAN_FIELDS)

    def _freeze_fields(self, names) -> None:
        """Copy the array fields among `names` into read-only arrays and check them."""
        for name in ("doc_ids", "lengths", "offsets", "replica_of", "deferred", "tokens"):
            if name in names:
                _freeze(self, name, np.int64)
        if "loads" in names:
            _freeze(self, "loads", np.float64)
        if "micro_batches" in names:
            object.__setattr__(self, "micro_batches", _frozen_tuple(self.micro_batches, np.int64))
        if self.arrival_step is not None and ("arrival_step" in names or "doc_ids" in names):
            if "arrival_step" in names:
                _freeze(self, "arrival_step", np.int64)
            if len(self.arrival_step) != len(self.doc_ids):
                raise ValueError(f"arrival_step needs one entry per piece ({len(self.doc_ids)}), "
                                 f"got {len(self.arrival_step)}")
        if self.step is not None and "step" in names:
            object.__setattr__(self, "step", check_int("step", self.step, 0))

    def replace(self, **changes) -> "PackPlan":
        """A copy with `changes` applied, frozen too: the changed fields are copied and checked
        as by the constructor, the others (read-only already) are shared. A change of dp,
        n_micro or replica_of must still give each replica n_micro micro-batches
        (`check_replicas`), and changed token counts must be the sums of their micro-batches
        (PlanError otherwise)."""
        unknown = sorted(set(changes) - set(_PLAN_FIELDS))
        if unknown:
            raise TypeError(f"PackPlan.replace() got unknown fields {unknown}; the fields are {list(_PLAN_FIELDS)}")
        new = copy.copy(self)
        for name, value in changes.items():
            object.__setattr__(new, name, value)
        new._freeze_fields(changes)
        for name in ("dp", "n_micro"):
            if name in changes:
                object.__setattr__(new, name, check_int(name, getattr(new, name), 1))
        if changes.keys() & {"dp", "n_micro", "replica_of"}:
            if len(new.replica_of) != len(new.micro_batches):
                raise PlanError(f"plan.replica_of needs one replica per micro-batch ({len(new.micro_batches)}), "
                                f"got {len(new.replica_of)}")
            check_replicas(new)
        if "tokens" in changes:
            held = _held_tokens(new)
            if new.tokens.tolist() != held:
                raise PlanError(f"plan.tokens must be each micro-batch's tokens {held[:8]}, got "
                                f"{new.tokens.tolist()[:8]}")
        return new

    @property
    def imbalance(self) -> float:
        return _imbalance(self.loads)

    def delays(self) -> np.ndarray:
        """Steps each piece waited: step - arrival_step (zeros without arrival steps or step)."""
        if self.arrival_step is None or self.step is None:
            return np.zeros(len(self.doc_ids), np.int64)
        return self.step - self.arrival_step

    @property
    def n_micro_batches(self) -> int:
        return len(self.micro_batches)

    @property
    def placed_tokens(self) -> int:
        return int(self.tokens.sum())

    @property
    def deferred_tokens(self) -> int:
        return int(self.lengths[self.deferred].sum())

    def micro_batch_lengths(self, j: int) -> np.ndarray:
        """Piece lengths of micro-batch j in packed order."""
        return self.lengths[self.micro_batches[check_index("j", j, len(self.micro_batches), "a micro-batch index")]]

    def replica_micro_batches(self, replica: int) -> list[int]:
        """Indices of the micro-batches run by DP replica `replica`, in order."""
        return [int(j) for j in np.flatnonzero(self.replica_of == check_index("replica", replica, self.dp))]

    def deferred_ids(self) -> np.ndarray:
        return self.doc_ids[self.deferred]

    def placed_ids(self) -> np.ndarray:
        if not self.micro_batches:
            return np.empty(0, np.int64)
        return self.doc_ids[np.concatenate(self.micro_batches)]

    # ------------------------------------------------------------- serialisation
    def to_dict(self) -> dict:
        return {
            "format_version": PLAN_FORMAT_VERSION,
            "doc_ids": self.doc_ids.tolist(),
            "lengths": self.lengths.tolist(),
            "offsets": self.offsets.tolist(),
            "micro_batches": [mb.tolist() for mb in self.micro_batches],
            "replica_of": self.replica_of.tolist(),
            "deferred": self.deferred.tolist(),
            "loads": self.loads.tolist(),
            "tokens": self.tokens.tolist(),
            "n_micro": self.n_micro,
            "dp": self.dp,
            "max_tokens": self.max_tokens,
            "step": self.step,
            "arrival_step": None if self.arrival_step is None else self.arrival_step.tolist(),
            "info": self.info.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "PackPlan":
        """Inverse of `to_dict`. Raises ValueError naming the field if `d` is malformed (a
        missing field, a float where an integer belongs: nothing is truncated), and PlanError
        (a ValueError) if the plan it describes is not one (`check_structure`: a piece
        dropped or used twice, an index out of range, fields of the wrong size)."""
        if not isinstance(d, Mapping):
            raise ValueError(f"PackPlan.from_dict needs a dict (PackPlan.to_dict()), got {type(d).__name__}")
        version = d.get("format_version")
        if version not in (1, PLAN_FORMAT_VERSION):
            raise ValueError(f"PackPlan format_version {version!r} is not supported; expected 1 or "
                             f"{PLAN_FORMAT_VERSION}")
        i64 = lambda x: np.asarray(x) if len(x) else np.zeros(0, np.int64)  # noqa: E731  (_exact checks)
        try:
            info = dict(d["info"])
            arrival = d.get("arrival_step")
            if version == 1:  # format 1 kept the arrival steps in info.extra
                extra = dict(info.get("extra") or {})
                arrival = extra.pop("arrival_step", None)
                info["extra"] = extra
            step = d.get("step")
            plan = cls(
                doc_ids=i64(d["doc_ids"]), lengths=i64(d["lengths"]), offsets=i64(d["offsets"]),
                micro_batches=[i64(mb) for mb in d["micro_batches"]], replica_of=i64(d["replica_of"]),
                deferred=i64(d["deferred"]), loads=_loads_field(d["loads"]),
                tokens=i64(d["tokens"]), n_micro=check_int("n_micro", d["n_micro"], 1),
                dp=check_int("dp", d["dp"], 1), max_tokens=check_int("max_tokens", d["max_tokens"], 0),
                step=None if step is None else check_int("step", step, 0), info=SolveInfo.from_dict(info),
                arrival_step=None if arrival is None else i64(arrival),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"PackPlan.from_dict: malformed plan dict ({type(exc).__name__}: {exc})") from None
        check_structure(plan)
        return plan

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def digest(self) -> str:
        """SHA-256 of the assignment (ids, lengths, offsets, micro-batches, replicas, deferred).

        Excludes `info` (timings differ between ranks) and loads (derived). Ranks compare
        digests before a step to make sure they execute the same plan.
        """
        h = hashlib.sha256()
        for arr in (self.doc_ids, self.lengths, self.offsets, self.replica_of, self.deferred):
            h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
            h.update(b"|")
        for mb in self.micro_batches:
            h.update(np.ascontiguousarray(mb, dtype=np.int64).tobytes())
            h.update(b";")
        return h.hexdigest()

    def summary_rows(self) -> list[dict[str, Any]]:
        """One dict per micro-batch: replica, documents, tokens, modelled ms, share of the step."""
        total = float(self.loads.sum()) or 1.0
        rows = []
        for j, mb in enumerate(self.micro_batches):
            rows.append(dict(micro_batch=j, replica=int(self.replica_of[j]), documents=int(len(mb)),
                             tokens=int(self.tokens[j]), ms=1e3 * float(self.loads[j]),
                             share=float(self.loads[j]) / total))
        return rows


_PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(PackPlan))


class PlanError(ValueError):
    """A plan violates its input or its capacity (raised by check_pack)."""


def check_replicas(plan: PackPlan) -> None:
    """Raise PlanError unless `plan.replica_of` gives each of the plan's dp replicas n_micro
    micro-batches (values in 0 .. dp - 1)."""
    replica_of = np.asarray(plan.replica_of, dtype=np.int64)
    if replica_of.size and (replica_of.min() < 0 or replica_of.max() >= plan.dp
                            or np.any(np.bincount(replica_of, minlength=plan.dp) != plan.n_micro)):
        raise PlanError(f"plan.replica_of must give each of the plan's dp={plan.dp} replicas n_micro={plan.n_micro} "
                        f"micro-batches (values in 0 .. {plan.dp - 1}), got {replica_of.tolist()}")


def _held_tokens(plan: PackPlan) -> list[int]:
    """Tokens of each micro-batch, summed from its pieces in Python ints (an int64 sum could wrap)."""
    return [sum(plan.lengths[mb].tolist()) for mb in plan.micro_batches]


def check_structure(plan: PackPlan) -> None:
    """Raise PlanError unless `plan` is a plan in itself, whatever its input: as many doc_ids,
    lengths and offsets, lengths > 0 and offsets >= 0; dp x n_micro micro-batches, n_micro per
    replica (`check_replicas`), each a 1-D list of piece indices; every piece in exactly one
    micro-batch or in `deferred`; one load (finite, >= 0) and one token count per micro-batch,
    each count the sum of its pieces' lengths. What `PackPlan.from_dict` checks."""
    n = len(plan.doc_ids)
    if not len(plan.lengths) == len(plan.offsets) == n:
        raise PlanError(f"plan.doc_ids, lengths and offsets must have one entry per piece, got {n}, "
                        f"{len(plan.lengths)} and {len(plan.offsets)}")
    for name in ("doc_ids", "lengths", "offsets", "replica_of", "deferred", "tokens", "loads", "arrival_step"):
        value = getattr(plan, name)
        if value is not None and value.ndim != 1:
            raise PlanError(f"plan.{name} must be a list, got an array of shape {value.shape}")
    if n and (plan.lengths.min() <= 0 or plan.offsets.min() < 0):
        raise PlanError("plan.lengths must be > 0 and plan.offsets >= 0, got lengths "
                        f"{plan.lengths.tolist()[:8]} and offsets {plan.offsets.tolist()[:8]}")
    try:  # a piece is (document id, offset): the same one twice, or overlapping pieces, train tokens twice
        check_unique_pieces(plan.doc_ids, plan.offsets, "in the plan", lengths=plan.lengths)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    n_mbs = plan.dp * plan.n_micro
    if len(plan.micro_batches) != n_mbs:
        raise PlanError(f"plan has {len(plan.micro_batches)} micro-batches; dp x n_micro = {n_mbs}")
    if len(plan.replica_of) != n_mbs:
        raise PlanError(f"plan.replica_of needs one replica per micro-batch ({n_mbs}), got {len(plan.replica_of)}")
    check_replicas(plan)
    for j, mb in enumerate(plan.micro_batches):
        if mb.ndim != 1:
            raise PlanError(f"plan.micro_batches[{j}] must be a list of piece indices, got an array of shape {mb.shape}")
    if plan.deferred.ndim != 1:
        raise PlanError(f"plan.deferred must be a list of piece indices, got an array of shape {plan.deferred.shape}")
    used = np.concatenate([*plan.micro_batches, plan.deferred]) if n_mbs else plan.deferred
    if len(used) and (used.min() < 0 or used.max() >= n):
        bad = used[(used < 0) | (used >= n)]
        raise PlanError(f"plan refers to pieces {bad.tolist()[:8]} out of range (it has {n} pieces)")
    counts = np.bincount(used, minlength=n) if len(used) else np.zeros(n, dtype=np.int64)
    if np.any(counts != 1):
        missing, twice = np.flatnonzero(counts == 0), np.flatnonzero(counts > 1)
        parts = ([f"pieces {missing.tolist()[:8]} are in none"] if len(missing) else []) + \
            ([f"pieces {twice.tolist()[:8]} in several"] if len(twice) else [])
        raise PlanError(f"every piece must be in exactly one micro-batch or in deferred: {', '.join(parts)}")
    if len(plan.loads) != n_mbs or len(plan.tokens) != n_mbs:
        raise PlanError(f"plan needs one load and one token count per micro-batch ({n_mbs}), got "
                        f"{len(plan.loads)} and {len(plan.tokens)}")
    if n_mbs and (not np.all(np.isfinite(plan.loads)) or plan.loads.min() < 0):
        raise PlanError(f"plan.loads must be finite seconds >= 0, got {plan.loads.tolist()[:8]}")
    for j, held in enumerate(_held_tokens(plan)):
        if held != int(plan.tokens[j]):
            raise PlanError(f"plan.tokens[{j}] = {int(plan.tokens[j])}, but micro-batch {j}'s pieces hold {held}")
        if plan.max_tokens and held > plan.max_tokens:
            raise PlanError(f"micro-batch {j} holds {held} tokens, over the plan's own max_tokens={plan.max_tokens}")


def check_pack(plan: PackPlan, lengths, max_tokens: int, ids=None, offsets=None, cost=None) -> None:
    """Check `plan` against the input it was made from; raise PlanError on any violation.

    Independent of every solver: it only counts tokens (in exact integers). It checks that
    - micro-batch and deferred piece indices are valid, and every piece is used exactly once;
    - there are dp * n_micro micro-batches, n_micro per replica;
    - no micro-batch holds more than `max_tokens` tokens, and `plan.tokens` matches;
    - the plan's pieces are the input's pieces, (id, offset, length) for (id, offset, length):
      merging two adjacent pieces of a split document or splitting one would change what
      attention sees. Only a plan of `method="original"` (plain 4D, which cuts documents at
      sequence boundaries by design) may cut pieces; its pieces with each id must tile the
      input's [offset, offset + length) exactly, with no gap and no overlap;
    - no piece belongs to a document that was not in the input;
    - if `cost` is given, plan.loads[j] == cost.micro_batch_cost(lengths of micro-batch j).
    """
    if not isinstance(plan, PackPlan):
        raise ValueError(f"plan must be a wlb_opt.PackPlan, got {type(plan).__name__}")
    if cost is not None and not callable(getattr(cost, "micro_batch_cost", None)):
        raise TypeError(f"cost must be a wlb_opt.CostModel or None, got {type(cost).__name__}")
    lengths = validate_lengths(lengths)
    ids = validate_ids(ids, len(lengths))
    offsets = validate_offsets(offsets, len(lengths))
    max_tokens = check_int("max_tokens", max_tokens, 1)
    check_structure(plan)  # sizes, indices, every piece once, tokens that sum their pieces
    for j, mb in enumerate(plan.micro_batches):
        tok = int(plan.tokens[j])
        if tok > max_tokens:
            raise PlanError(f"micro-batch {j} holds {tok} tokens > max_tokens={max_tokens}")
        if cost is not None:
            expect = cost.micro_batch_cost(plan.lengths[mb])
            if not np.isclose(plan.loads[j], expect, rtol=1e-9, atol=1e-12):
                raise PlanError(f"micro-batch {j}: load {plan.loads[j]} != micro_batch_cost {expect}")

    # Token coverage per document: sort both sides by (id, offset) and compare intervals.
    expected: dict[int, list[tuple[int, int]]] = {}
    for i, o, n in zip(ids.tolist(), offsets.tolist(), lengths.tolist()):
        expected.setdefault(i, []).append((o, o + n))
    for i, want in expected.items():
        if _merge(sorted(want)) == [(-1, -1)]:
            raise PlanError(f"the input itself has overlapping pieces of document {i}: {sorted(want)}")
    given = sorted(zip(ids.tolist(), offsets.tolist(), lengths.tolist()))
    held = sorted(zip(plan.doc_ids.tolist(), plan.offsets.tolist(), plan.lengths.tolist()))
    if plan.info.method != "original" and given != held:
        raise PlanError(f"the plan's pieces are not the input's (id, offset, length): missing "
                        f"{sorted(set(given) - set(held))[:3]}, not in the input "
                        f"{sorted(set(held) - set(given))[:3]}; only method='original' may cut pieces")

    got: dict[int, list[tuple[int, int]]] = {}
    for i, o, n in zip(plan.doc_ids.tolist(), plan.offsets.tolist(), plan.lengths.tolist()):
        got.setdefault(i, []).append((o, o + n))
    if set(got) != set(expected):
        missing = sorted(set(expected) - set(got))[:5]
        extra = sorted(set(got) - set(expected))[:5]
        raise PlanError(f"documents missing from the plan: {missing}; not in the input: {extra}")
    for i, want in expected.items():
        if _merge(sorted(got[i])) != _merge(sorted(want)):
            raise PlanError(f"document {i}: pieces {sorted(got[i])} do not tile the input {sorted(want)} exactly")
        if _total(got[i]) != _total(want):
            raise PlanError(f"document {i}: pieces hold {_total(got[i])} tokens, input has {_total(want)}")
        # "original" may cut the input's pieces, never join two: each piece lies inside one
        cuts = sorted(want)
        starts = [a for a, _ in cuts]
        for a, b in got[i]:
            k = bisect.bisect_right(starts, a) - 1
            if k < 0 or b > cuts[k][1]:
                raise PlanError(f"document {i}: the plan's piece [{a}, {b}) joins pieces of the input {cuts}; "
                                "a plan may cut the input's pieces (method='original'), never join them")


def _total(intervals) -> int:
    return sum(b - a for a, b in intervals)


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in intervals:
        if out and a == out[-1][1]:
            out[-1] = (out[-1][0], b)
        elif out and a < out[-1][1]:
            return [(-1, -1)]  # overlap: never equal to a valid tiling
        else:
            out.append((a, b))
    return out


# ---------------------------------------------------------------------------------------------
# CP level: ShardPlan (which tokens of one micro-batch each context-parallel rank holds)
# ---------------------------------------------------------------------------------------------
SHARD_FORMAT_VERSION = 1
CHUNK_COLUMNS = ("rank", "doc", "start", "length")


def merge_chunks(lengths, rank, doc, start, length) -> np.ndarray:
    """Canonical chunk table: rows (rank, doc, start, length) sorted by rank, then packed
    position, empty rows dropped, and contiguous rows of one document on one rank merged
    (rank CP-1 holds chunks CP-1 and CP of a document back to back: one segment, not two).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    rank, doc, start, length = (np.asarray(x, dtype=np.int64) for x in (rank, doc, start, length))
    columns = _merged(lengths, None, None, rank, doc, start, length)[1:]
    return np.stack(columns, axis=1) if len(columns[0]) else np.zeros((0, 4), np.int64)


def merge_chunk_rows(lengths: np.ndarray, counts: np.ndarray, mb: np.ndarray, rank: np.ndarray, doc: np.ndarray,
                     start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """`merge_chunks` of consecutive micro-batches (`counts` documents each of `lengths`) at
    once: int64 rows (micro-batch, rank, doc, start, length), `doc` numbered inside its
    micro-batch, sorted by micro-batch, then rank, then packed position, empty rows dropped
    and contiguous rows of one document on one rank merged. Within each micro-batch these are
    its canonical chunk table's rows, in its order."""
    columns = _merged(lengths, counts, mb, rank, doc, start, length)
    return np.stack(columns, axis=1) if len(columns[0]) else np.zeros((0, 5), np.int64)


def _merged(lengths, counts, mb, rank, doc, start, length) -> tuple:
    """The columns of `merge_chunk_rows` (mb None: one micro-batch, and None for its column)."""
    keep = length > 0
    rank, doc, start, length = rank[keep], doc[keep], start[keep], length[keep]
    local_start = np.cumsum(lengths) - lengths
    if mb is None:
        position = local_start[doc] + start
    else:
        mb = mb[keep]
        first_doc = np.cumsum(counts) - counts
        local_start = local_start - local_start[first_doc][np.repeat(np.arange(len(counts)), counts)]
        position = local_start[first_doc[mb] + doc] + start
    if not len(length):
        return mb, rank, doc, start, length
    if mb is None:
        order = np.lexsort((position, rank))
    else:
        span, ranks = int(position.max()) + 1, int(rank.max()) + 1
        if len(counts) * ranks * span < 2**62:  # one int64 key (micro-batch, rank, position): unique, any sort agrees
            order = np.argsort((mb * ranks + rank) * span + position)
        else:
            order = np.lexsort((position, rank, mb))
    rank, doc, start, length = rank[order], doc[order], start[order], length[order]
    if len(doc) > 1:
        joins = (rank[1:] == rank[:-1]) & (doc[1:] == doc[:-1]) & (start[1:] == start[:-1] + length[:-1])
        if mb is not None:
            mb = mb[order]
            joins &= mb[1:] == mb[:-1]
        if joins.any():
            first = np.flatnonzero(np.concatenate([[True], ~joins]))
            length = np.add.reduceat(length, first)
            rank, doc, start = rank[first], doc[first], start[first]
            mb = None if mb is None else mb[first]
    elif mb is not None:
        mb = mb[order]
    return mb, rank, doc, start, length


def chunk_tokens(chunks: np.ndarray, cp: int) -> np.ndarray:
    """int64 tokens each of `cp` ranks holds under a chunk table."""
    return np.bincount(chunks[:, 0], weights=chunks[:, 3], minlength=cp)[:cp].astype(np.int64)


def shard_layout(lengths, offsets, cp: int, chunks: np.ndarray):
    """(rank_indices, segments, positions) of a canonical chunk table (see `merge_chunks`):
    per rank, read-only views of three arrays made here.

    Rank r's local order is packed order restricted to its tokens. Its segment for chunk
    (doc, start, length) is (q_start, length, doc_start, start + length): the queries see the
    document's prefix up to their own end, aligned bottom-right.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    rank, doc, start, length = (chunks[:, j] for j in range(4))
    doc_start = np.cumsum(lengths) - lengths
    tok_before = np.cumsum(length) - length  # tokens before each row in rank-major order
    bounds = np.searchsorted(rank, np.arange(cp + 1))
    total = int(length.sum())
    rank_tok_start = np.append(tok_before, total)[bounds]
    q_start = tok_before - rank_tok_start[:-1][rank] if len(rank) else tok_before
    seg = np.stack([q_start, length, doc_start[doc], start + length], axis=1).astype(np.int32)
    ar = np.arange(total, dtype=np.int64)
    gidx = np.repeat(doc_start[doc] + start - tok_before, length) + ar
    pos = np.repeat(offsets[doc] + start - tok_before, length) + ar
    for arr in (gidx, pos, seg):
        arr.flags.writeable = False  # views of a read-only array are read-only
    rank_indices = tuple(gidx[rank_tok_start[r]:rank_tok_start[r + 1]] for r in range(cp))
    positions = tuple(pos[rank_tok_start[r]:rank_tok_start[r + 1]] for r in range(cp))
    segments = tuple(seg[bounds[r]:bounds[r + 1]] for r in range(cp))
    return rank_indices, segments, positions


@dataclass(frozen=True)
class ShardPlan:
    """CP sharding of one packed micro-batch (built by `wlb_opt.solve_shard`).

    - `rank_indices[r]`: int64 token positions (in the packed micro-batch) owned by CP rank r,
      in rank r's local order (packed order restricted to its tokens). Concatenated over r
      they give the rank-major layout of an all-gather; `permutation()` returns it.
    - `segments[r]`: int32 (S, 4) rows (q_start, q_len, k_start, k_len): local query rows
      [q_start, q_start + q_len) attend to packed K/V rows [k_start, k_start + k_len),
      causal, bottom-right aligned (docs/architecture.md, "The segment table"). Empty shards give none.
    - `positions[r]`: each local token's position inside its document plus the piece offset.
    - `loads[r]`: rank r's modelled seconds (same units as `CostModel.micro_batch_cost`):
      sum of attention_latency over its segments + the linear work of its tokens + the
      per-document constant once per segment + the per-micro-batch constant (every rank
      launches every layer's kernels). `imbalance` = max / mean of loads.
    - `strategy`: the strategy actually taken ("per_seq", "per_doc", "hybrid" or "cpsat");
      `requested`: the one asked for ("adaptive" may take "per_seq" or "per_doc").
    - `chunks`: the compact description every other field is derived from: int64 rows
      (rank, doc, start, length), tokens [start, start + length) of document `doc`
      (`CHUNK_COLUMNS`; the chunk rules in `wlb_opt.solvers.chunk_rules` use the same order).
    - `tokens[r]`: how many tokens rank r holds.

    `rank_indices`, `segments` and `positions` are derived from the chunk table on first read
    (`shard_layout`), not when the plan is made: the per-token arrays are as long as the
    micro-batch, and a planner that shards every micro-batch of a step ahead of training
    should not pay for them (a CP rank reads its own).

    Frozen like PackPlan: arrays read-only, per-rank lists are tuples.
    """

    cp: int
    strategy: str
    lengths: np.ndarray
    offsets: np.ndarray
    chunks: np.ndarray
    loads: np.ndarray
    tokens: np.ndarray
    requested: str = ""
    info: SolveInfo = field(default_factory=lambda: SolveInfo(method="unknown"))

    def __post_init__(self) -> None:
        for name in ("lengths", "offsets", "chunks", "tokens"):
            _freeze(self, name, np.int64)
        _freeze(self, "loads", np.float64)
        if self.chunks.ndim != 2 or self.chunks.shape[1] != len(CHUNK_COLUMNS):
            raise ValueError(f"chunks must be an (n, 4) table of rows {CHUNK_COLUMNS}, got shape {self.chunks.shape}")

    @functools.cached_property
    def _layout(self) -> tuple[tuple, tuple, tuple]:
        return shard_layout(self.lengths, self.offsets, self.cp, self.chunks)

    def __getstate__(self) -> dict:
        # pickled without the derived layout: as long as the micro-batch, and its arrays would
        # come back writable; the copy derives it again on first read
        return {name: value for name, value in self.__dict__.items() if name != "_layout"}

    @property
    def rank_indices(self) -> tuple:
        """Per rank, its int64 token positions in the packed micro-batch (class docstring)."""
        return self._layout[0]

    @property
    def segments(self) -> tuple:
        """Per rank, its int32 (S, 4) segment rows (class docstring)."""
        return self._layout[1]

    @property
    def positions(self) -> tuple:
        """Per rank, the RoPE position of each of its tokens (class docstring)."""
        return self._layout[2]

    @property
    def imbalance(self) -> float:
        return _imbalance(self.loads)

    @property
    def max_load(self) -> float:
        """Predicted time of the micro-batch under CP (ranks are synchronous): max of loads."""
        return float(np.max(self.loads)) if len(self.loads) else 0.0

    @property
    def n_tokens(self) -> int:
        return int(self.lengths.sum())

    def _check_rank(self, rank: int) -> int:
        return check_index("rank", rank, self.cp)

    def permutation(self) -> np.ndarray:
        """Packed position of each row of the rank-major all-gather (concatenated rank_indices).

        To restore packed order after an all-gather: ``packed[perm] = gathered``.
        """
        return np.concatenate(self.rank_indices) if self.rank_indices else np.zeros(0, np.int64)

    def short_segment_share(self, tile: int = 128) -> float:
        """Share of segments (all ranks) with fewer query rows than one kernel tile."""
        tile = check_int("tile", tile, 1)
        q = np.concatenate([s[:, 1] for s in self.segments]) if self.segments else np.zeros(0)
        return float(np.mean(q < tile)) if len(q) else 0.0

    # ------------------------------------------------------------- adapters
    def position_ids(self, rank: int, as_torch: bool = False, device=None):
        """RoPE position ids of rank `rank`'s local tokens (int64; a torch tensor if asked)."""
        pos = self.positions[self._check_rank(rank)]
        return _to_torch(pos, device) if as_torch or device is not None else pos

    def varlen_args(self, rank: int, as_torch: bool = False, device=None) -> list[dict]:
        """Arguments for FlashAttention's varlen API (``flash_attn_varlen_func``), one dict per call.

        The varlen API takes one packed K tensor whose sequences may not overlap, but two
        segments of one rank may read the same document prefix (chunks r and 2CP-1-r both
        attend to the start of the document). So the segments are split into calls: call j
        holds the j-th segment of every document on this rank (at most two calls under
        per_seq, per_doc and hybrid). Each dict has:

        - ``q_index``: local query rows of the call, ``k_index``: packed K/V rows;
        - ``cu_seqlens_q``, ``cu_seqlens_k`` (int32), ``max_seqlen_q``, ``max_seqlen_k`` (int).

        Usage (FlashAttention >= 2.1 aligns ``causal=True`` bottom-right, as the segments need)::

            for a in shard.varlen_args(rank, device="cuda"):
                out[a["q_index"]] = flash_attn_varlen_func(
                    q[a["q_index"]], k_full[a["k_index"]], v_full[a["k_index"]],
                    a["cu_seqlens_q"], a["cu_seqlens_k"], a["max_seqlen_q"], a["max_seqlen_k"],
                    causal=True)
        """
        seg = self.segments[self._check_rank(rank)].astype(np.int64)
        calls = []
        if len(seg) == 0:
            return calls
        k_start = seg[:, 2]
        # j-th segment of the same document (same k_start) on this rank -> call j
        order = np.lexsort((seg[:, 0], k_start))
        same = np.concatenate([[False], k_start[order][1:] == k_start[order][:-1]])
        nth = np.zeros(len(seg), np.int64)
        run = 0
        for pos, s in enumerate(same.tolist()):
            run = run + 1 if s else 0
            nth[order[pos]] = run
        for j in range(int(nth.max()) + 1):
            rows = seg[np.sort(np.flatnonzero(nth == j), kind="stable")]
            rows = rows[np.argsort(rows[:, 0], kind="stable")]
            q_len, k_len = rows[:, 1], rows[:, 3]
            q_index = _ranges(rows[:, 0], q_len)
            k_index = _ranges(rows[:, 2], k_len)
            args = dict(q_index=q_index, k_index=k_index,
                        cu_seqlens_q=np.concatenate([[0], np.cumsum(q_len)]).astype(np.int32),
                        cu_seqlens_k=np.concatenate([[0], np.cumsum(k_len)]).astype(np.int32),
                        max_seqlen_q=int(q_len.max()), max_seqlen_k=int(k_len.max()))
            if as_torch or device is not None:
                for key in ("q_index", "k_index", "cu_seqlens_q", "cu_seqlens_k"):
                    args[key] = _to_torch(args[key], device)
            calls.append(args)
        return calls

    def cu_seqlens(self, rank: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """(cu_seqlens_q, cu_seqlens_k) per varlen call of rank `rank` (see `varlen_args`)."""
        return [(a["cu_seqlens_q"], a["cu_seqlens_k"]) for a in self.varlen_args(rank)]

    # ------------------------------------------------------------- serialisation
    def to_dict(self) -> dict:
        return {
            "format_version": SHARD_FORMAT_VERSION,
            "cp": self.cp, "strategy": self.strategy, "requested": self.requested,
            "lengths": self.lengths.tolist(), "offsets": self.offsets.tolist(),
            "chunks": self.chunks.tolist(), "loads": self.loads.tolist(), "info": self.info.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "ShardPlan":
        """Inverse of `to_dict`. Raises ValueError naming the field if `d` is malformed: a
        missing field, a float where an integer belongs (nothing is truncated), lengths <= 0,
        offsets < 0, a chunk table that does not tile the pieces (`chunk_table_problem`) or is
        not in its canonical order (`merge_chunks`), or loads that are not one finite number >= 0
        per rank."""
        if not isinstance(d, Mapping):
            raise ValueError(f"ShardPlan.from_dict needs a dict (ShardPlan.to_dict()), got {type(d).__name__}")
        if d.get("format_version") != SHARD_FORMAT_VERSION:
            raise ValueError(f"ShardPlan format_version {d.get('format_version')!r} is not supported; "
                             f"expected {SHARD_FORMAT_VERSION}")
        try:
            lengths = exact_integers(d["lengths"], "ShardPlan lengths").astype(np.int64)
            offsets = exact_integers(d["offsets"], "ShardPlan offsets").astype(np.int64)
            chunks = exact_integers(d["chunks"], "ShardPlan chunks").astype(np.int64)
            cp = check_int("cp", d["cp"], 1)
            loads = d["loads"]
            if (not isinstance(loads, (list, tuple, np.ndarray))
                    or not all(isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_)) for x in loads)):
                raise ValueError(f"ShardPlan.from_dict: loads must be a list of numbers (seconds, one per rank), "
                                 f"got {loads!r:.80}")
            loads = np.asarray(loads, dtype=np.float64)
            strategy, info = d["strategy"], SolveInfo.from_dict(dict(d["info"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"ShardPlan.from_dict: malformed shard dict ({type(exc).__name__}: {exc})") from None
        if lengths.ndim != 1 or offsets.ndim != 1:
            raise ValueError(f"ShardPlan.from_dict: lengths and offsets must be flat lists, got shapes "
                             f"{lengths.shape} and {offsets.shape}")
        if len(offsets) != len(lengths):
            raise ValueError(f"ShardPlan.from_dict: {len(offsets)} offsets for {len(lengths)} pieces")
        if len(lengths) and (lengths.min() <= 0 or offsets.min() < 0):
            raise ValueError(f"ShardPlan.from_dict: lengths must be > 0 and offsets >= 0, got lengths "
                             f"{lengths.tolist()[:8]} and offsets {offsets.tolist()[:8]}")
        if chunks.size % len(CHUNK_COLUMNS):
            raise ValueError(f"ShardPlan.from_dict: chunks must be rows of {CHUNK_COLUMNS}, got {chunks.size} values")
        chunks = chunks.reshape(-1, len(CHUNK_COLUMNS))
        if len(loads) != cp or not np.all(np.isfinite(loads)) or (len(loads) and loads.min() < 0):
            raise ValueError(f"ShardPlan.from_dict: loads must be {cp} finite seconds >= 0 (one per rank), "
                             f"got {loads.tolist()[:8]}")
        if not isinstance(strategy, str):
            raise ValueError(f"ShardPlan.from_dict: strategy must be a string, got {strategy!r}")
        problem = chunk_table_problem(lengths, cp, chunks)
        if problem is not None:
            raise ValueError(f"ShardPlan.from_dict: {problem}")
        if not np.array_equal(merge_chunks(lengths, *chunks.T), chunks):  # the rank layout reads them in this order
            raise ValueError("ShardPlan.from_dict: chunks must be in the order ShardPlan.to_dict writes them (by rank, "
                             "then packed position, a document's contiguous rows on one rank merged into one)")
        return cls(cp=cp, strategy=strategy, lengths=lengths, offsets=offsets, chunks=chunks, loads=loads,
                   tokens=chunk_tokens(chunks, cp), requested=d.get("requested", ""), info=info)

    def digest(self) -> str:
        """SHA-256 of (cp, lengths, offsets, chunks): equal on every rank that holds this plan."""
        h = hashlib.sha256()
        h.update(str(self.cp).encode())
        for arr in (self.lengths, self.offsets, self.chunks):
            h.update(b"|")
            h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
        return h.hexdigest()


def chunk_table_problem(lengths, cp: int, chunks: np.ndarray, tiling: bool = True) -> str | None:
    """What is wrong with a chunk table (rows rank, doc, start, length) for pieces of
    `lengths` over `cp` ranks, or None: each row's rank in [0, cp) and document in range, the
    rows holding as many tokens as the pieces, and (`tiling`, a sort of the rows) each
    document's chunks tiling it exactly (every token held by one rank, none twice)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    chunks = np.asarray(chunks, dtype=np.int64).reshape(-1, 4)
    rank, doc, start, length = chunks.T
    bad = np.flatnonzero((rank < 0) | (rank >= cp) | (doc < 0) | (doc >= len(lengths)) | (length <= 0) | (start < 0))
    if bad.size:
        return (f"chunk row {int(bad[0])} {chunks[bad[0]].tolist()} (rank, doc, start, length) needs rank in "
                f"[0, {cp}), doc in [0, {len(lengths)}), start >= 0 and length >= 1")
    if not tiling:
        held, total = int(length.sum()), int(lengths.sum())
        return None if held == total else f"the chunks hold {held} tokens, the pieces {total}"
    order = np.lexsort((start, doc))
    d, st, ln = doc[order], start[order], length[order]
    first = np.ones(len(d), dtype=bool)
    first[1:] = d[1:] != d[:-1]
    gap = np.where(first, st != 0, st != np.concatenate([[0], (st + ln)[:-1]]))
    last = np.ones(len(d), dtype=bool)
    last[:-1] = d[1:] != d[:-1]
    short = last & (st + ln != lengths[d] if len(d) else last)
    missing = np.setdiff1d(np.flatnonzero(lengths > 0), d)
    if gap.any() or short.any() or missing.size:
        k = int(missing[0]) if missing.size else int(d[np.flatnonzero(gap | short)[0]])
        return (f"the chunks of document {k} do not tile its {int(lengths[k])} tokens exactly (a token held by no "
                f"rank, or by two): {chunks[doc == k].tolist()}")
    return None


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n)."""
    lens = np.asarray(lens, dtype=np.int64)
    before = np.cumsum(lens) - lens
    return np.repeat(np.asarray(starts, dtype=np.int64) - before, lens) + np.arange(int(lens.sum()), dtype=np.int64)


def _to_torch(arr: np.ndarray, device=None):
    from ._optional import require

    torch = require("torch", "ShardPlan torch adapters")
    return torch.tensor(arr, device=device)  # a copy: plan arrays are read-only


def _solve_info_from_fields(fields: dict) -> SolveInfo:
    """Unpickle a SolveInfo (see `SolveInfo.__reduce__`)."""
    return SolveInfo(**fields)
