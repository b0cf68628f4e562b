"""Plans and their checks: PackPlan (PP/DP level), SolveInfo, imbalance, check_pack.

A PackPlan says which documents (or pieces of documents) go into which micro-batch of one
training step, which DP replica runs each micro-batch, and which documents are deferred to
the next step. `check_pack` verifies a plan against the input it was made from without
trusting any solver code: it only counts tokens.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PLAN_FORMAT_VERSION = 1


def imbalance(loads) -> float:
    """max / mean of `loads` (1.0 is perfect; 1.0 for empty or all-zero loads)."""
    arr = np.asarray(loads, dtype=np.float64)
    if arr.size == 0:
        return 1.0
    mean = arr.mean()
    return float(arr.max() / mean) if mean > 0 else 1.0


@dataclass
class SolveInfo:
    """How a plan was found. Times in seconds; objective and bound in cost seconds."""

    method: str
    status: str = "heuristic"
    """"optimal", "feasible", "heuristic", "infeasible", ... (solver-specific detail appended)."""
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
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SolveInfo":
        return cls(**d)


@dataclass
class PackPlan:
    """One step's packing. Positions index the plan's own arrays (doc_ids, lengths, offsets).

    - `doc_ids[i]`, `lengths[i]`, `offsets[i]`: piece i is tokens [offsets[i], offsets[i] +
      lengths[i]) of document doc_ids[i]. Pieces of one document share its id.
    - `micro_batches[j]`: positions of the pieces in micro-batch j, in packed order
      (dp * n_micro of them; `replica_of[j]` is the DP replica that runs it).
    - `deferred`: positions not placed this step (carried to the next).
    - `loads[j]`: modelled seconds of micro-batch j (cost.micro_batch_cost), `tokens[j]` its
      token count; `imbalance` = max / mean of loads.
    """

    doc_ids: np.ndarray
    lengths: np.ndarray
    offsets: np.ndarray
    micro_batches: list
    replica_of: np.ndarray
    deferred: np.ndarray
    loads: np.ndarray
    tokens: np.ndarray
    n_micro: int
    dp: int = 1
    max_tokens: int = 0
    info: SolveInfo = field(default_factory=lambda: SolveInfo(method="unknown"))
    step: int | None = None

    @property
    def imbalance(self) -> float:
        return imbalance(self.loads)

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
        return self.lengths[self.micro_batches[j]]

    def replica_micro_batches(self, replica: int) -> list[int]:
        """Indices of the micro-batches run by DP replica `replica`, in order."""
        return [int(j) for j in np.flatnonzero(self.replica_of == replica)]

    def deferred_ids(self) -> np.ndarray:
        return self.doc_ids[self.deferred]

    def placed_ids(self) -> np.ndarray:
        if not self.micro_batches:
            return np.empty(0, np.int64)
        return self.doc_ids[np.concatenate(self.micro_batches)] if self.micro_batches else np.empty(0, np.int64)

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
            "info": self.info.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "PackPlan":
        if d.get("format_version") != PLAN_FORMAT_VERSION:
            raise ValueError(f"PackPlan format_version {d.get('format_version')!r} is not supported; expected {PLAN_FORMAT_VERSION}")
        i64 = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
        return cls(
            doc_ids=i64(d["doc_ids"]), lengths=i64(d["lengths"]), offsets=i64(d["offsets"]),
            micro_batches=[i64(mb) for mb in d["micro_batches"]], replica_of=i64(d["replica_of"]),
            deferred=i64(d["deferred"]), loads=np.asarray(d["loads"], dtype=np.float64),
            tokens=i64(d["tokens"]), n_micro=int(d["n_micro"]), dp=int(d["dp"]),
            max_tokens=int(d["max_tokens"]), step=d.get("step"), info=SolveInfo.from_dict(d["info"]),
        )

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

    def summary_rows(self, cost=None) -> list[dict[str, Any]]:
        """One dict per micro-batch: replica, documents, tokens, modelled ms, share of the step."""
        total = float(self.loads.sum()) or 1.0
        rows = []
        for j, mb in enumerate(self.micro_batches):
            rows.append(dict(micro_batch=j, replica=int(self.replica_of[j]), documents=int(len(mb)),
                             tokens=int(self.tokens[j]), ms=1e3 * float(self.loads[j]),
                             share=float(self.loads[j]) / total))
        return rows


class PlanError(ValueError):
    """A plan violates its input or its capacity (raised by check_pack)."""


def check_pack(plan: PackPlan, lengths, max_tokens: int, ids=None, offsets=None, cost=None) -> None:
    """Check `plan` against the input it was made from; raise PlanError on any violation.

    Independent of every solver: it only counts tokens. It checks that
    - micro-batch and deferred positions are valid, and every piece is used exactly once;
    - there are dp * n_micro micro-batches, n_micro per replica;
    - no micro-batch holds more than `max_tokens` tokens, and `plan.tokens` matches;
    - for every input document (lengths[i], ids[i] or i, offsets[i] or 0) the plan's pieces
      with that id tile exactly [offset, offset + length) with no gap and no overlap, and
      no piece belongs to a document that was not in the input;
    - if `cost` is given, plan.loads[j] == cost.micro_batch_cost(lengths of micro-batch j).
    """
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    ids = np.arange(len(lengths), dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
    offsets = np.zeros(len(lengths), np.int64) if offsets is None else np.asarray(offsets, dtype=np.int64)
    if not (len(ids) == len(lengths) == len(offsets)):
        raise PlanError("lengths, ids and offsets must have equal sizes")
    n_pieces = len(plan.doc_ids)
    if not (len(plan.lengths) == len(plan.offsets) == n_pieces):
        raise PlanError("plan.doc_ids, plan.lengths and plan.offsets differ in size")
    if np.any(plan.lengths <= 0):
        raise PlanError(f"plan has a piece of non-positive length: {plan.lengths[plan.lengths <= 0][:5]}")

    n_mb = len(plan.micro_batches)
    if n_mb != plan.dp * plan.n_micro:
        raise PlanError(f"plan has {n_mb} micro-batches, expected dp*n_micro = {plan.dp * plan.n_micro}")
    if len(plan.replica_of) != n_mb or len(plan.loads) != n_mb or len(plan.tokens) != n_mb:
        raise PlanError("replica_of, loads and tokens need one entry per micro-batch")
    counts = np.bincount(np.asarray(plan.replica_of, dtype=np.int64), minlength=plan.dp)
    if len(counts) != plan.dp or np.any(counts != plan.n_micro):
        raise PlanError(f"each of the {plan.dp} replicas needs {plan.n_micro} micro-batches, got {counts.tolist()}")

    used = np.zeros(n_pieces, dtype=np.int64)
    for j, mb in enumerate(plan.micro_batches):
        mb = np.asarray(mb, dtype=np.int64)
        if mb.size and (mb.min() < 0 or mb.max() >= n_pieces):
            raise PlanError(f"micro-batch {j} has positions outside [0, {n_pieces})")
        np.add.at(used, mb, 1)
        tok = int(plan.lengths[mb].sum())
        if tok != int(plan.tokens[j]):
            raise PlanError(f"micro-batch {j}: plan.tokens says {int(plan.tokens[j])}, pieces hold {tok}")
        if tok > max_tokens:
            raise PlanError(f"micro-batch {j} holds {tok} tokens > max_tokens={max_tokens}")
        if cost is not None:
            expect = cost.micro_batch_cost(plan.lengths[mb])
            if not np.isclose(plan.loads[j], expect, rtol=1e-9, atol=1e-12):
                raise PlanError(f"micro-batch {j}: load {plan.loads[j]} != micro_batch_cost {expect}")
    deferred = np.asarray(plan.deferred, dtype=np.int64)
    if deferred.size and (deferred.min() < 0 or deferred.max() >= n_pieces):
        raise PlanError(f"deferred has positions outside [0, {n_pieces})")
    np.add.at(used, deferred, 1)
    if np.any(used != 1):
        bad = np.flatnonzero(used != 1)[:5]
        raise PlanError(f"pieces {bad.tolist()} are used {used[bad].tolist()} times (must be exactly once)")

    # Token coverage per document: sort both sides by (id, offset) and compare intervals.
    expected: dict[int, list[tuple[int, int]]] = {}
    for i, o, n in zip(ids.tolist(), offsets.tolist(), lengths.tolist()):
        expected.setdefault(i, []).append((o, o + n))
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
