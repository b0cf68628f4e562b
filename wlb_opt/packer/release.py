"""When held outliers leave their queues: the release policies of `WLBPacker`.

Outlier documents (length >= L1) wait in multi-level FIFO queues (queue i holds
L_i <= d < L_{i+1}; the last queue is open above). Each step a policy decides which held
outliers join the step's fresh documents and the carried ones, and packs them through the
packer's `solve` callback (Algorithm 1 by default: carried first, the rest longest first).

- "paper" (default, paper §3.2 / Algorithm 1): a queue that holds dp x n_micro outliers
  releases exactly that many, FIFO, once per step, so that every micro-batch gets one
  outlier of similar length.
- `max_delay=K` (every policy): a queue whose head has waited K steps is released even if
  it holds fewer than dp x n_micro outliers (topped up with the heads of the nearest other
  queues, so each micro-batch still gets one outlier), and pieces at their deadline
  (released or carried) are placed before anything else, longest first. No piece waits in
  a queue more than K steps; one is placed more than K steps late only if the due pieces of
  a step exceed its capacity (`stats()["late_pieces"]`). With `max_delay=None` the packer
  is paper-faithful.
- "balance" (beyond the paper, opt-in): after the paper's releases, a step also takes held
  outliers early (FIFO heads of a queue, a whole queue, or a queue topped up to one outlier
  per micro-batch from the nearest levels) whenever the packed step's predicted imbalance
  stays within max(`balance_tolerance`, its imbalance without them) and no more tokens are
  deferred. An outlier that the step's short documents can balance then waits for nothing.
- "group" (beyond the paper, opt-in): all held outliers form one pool (the queues only
  store them). Each step the pool's pieces at max_delay leave; then, greedily, the step
  takes groups of 1 to dp x n_micro held outliers adjacent in (length, arrival) order
  (similar cost; FIFO among equal lengths) while its predicted imbalance stays within
  max(`balance_tolerance`, its imbalance without them) and the short documents this pushes
  to the next step are fewer tokens than the group brings. Long outliers then leave in
  groups of similar ones from any level, a cheap one alone, at the cost of carrying some
  short documents one step; a group leaves only if the step places all of it (an outlier
  deferred by the packing would be carried and placed first, often alone, next step).
  Candidates whose imbalance is surely above the limit (the group's heaviest piece against
  the largest possible mean load) are not packed at all: the same plans, about half the
  planning time. Tolerance ~1.3 (fwd + bwd loads) suits the default stream.
- `drain()` (end of data) releases every queue whatever the policy (`DrainRelease`).
- lookahead (`WLBPacker(..., lookahead=K)`, lookahead.py): the queues also hold outliers that
  arrive up to K steps later. A group (a full queue's dp x n_micro, a "balance" or "group"
  candidate) leaves early only if at most half of it is early (arrival after the step): a
  group then trains at or after the median of its arrival steps, which minimises its total
  displacement |step - arrival|; leaving as soon as the last member is visible would train
  most of it early.

Every policy is a `ReleasePolicy`: `plan_step(fresh, queues, carry, step, solve)` pops what
it releases from `queues` (the packer's copies) and returns a `StepRelease`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Callable, Literal, NamedTuple

import numpy as np

from ..plan import PackPlan
from .state import HeldPiece

ReleaseName = Literal["paper", "balance", "group"]

SolveStep = Callable[[list[HeldPiece], list[HeldPiece]], tuple[list[HeldPiece], PackPlan, np.ndarray]]
"""The packer's `solve(first, rest)`: packs `first` (placed first) then `rest`; returns
(pending = first + rest, plan, arrival step of each pending piece)."""

# Slack on the imbalance limit, so that a candidate equal to it in exact arithmetic is kept.
_TOLERANCE_SLACK = 1e-12


class StepRelease(NamedTuple):
    """What a policy decided for one step."""

    pending: list[HeldPiece]
    """Every piece the plan holds, in the plan's positions (placed or deferred)."""
    plan: PackPlan
    arrival: np.ndarray
    """int64 arrival step of each pending piece."""
    released: list[HeldPiece]
    """Outliers taken out of the queues this step."""
    n_early: int
    """How many of `released` left before the paper's rule (full queue or max_delay) sent them."""


def split_due(carry: list[HeldPiece], released: list[HeldPiece], fresh: list[HeldPiece], step: int,
              max_delay: int | None) -> tuple[list[HeldPiece], list[HeldPiece]]:
    """(first, rest) of a step: the pieces at their deadline (carried or released) first,
    longest first, then the other carried pieces; the other released outliers and the
    fresh documents after. Without max_delay: the carried pieces first."""
    if max_delay is None:
        return list(carry), released + fresh
    due = [piece for piece in carry + released if step - piece.arrival >= max_delay]
    due.sort(key=lambda piece: -piece.length)  # stable: longest first among the due ones
    due_keys = {piece.key for piece in due}
    first = due + [piece for piece in carry if piece.key not in due_keys]
    return first, [piece for piece in released if piece.key not in due_keys] + fresh


def displacement_relief(group, step: int) -> int:
    """Token-steps of displacement that training `group` at `step` saves: a piece that has
    arrived saves at least one step of waiting (its tokens); an early one (lookahead) adds
    its lead, (arrival - step) x tokens. Without lookahead this is the group's tokens. With
    lookahead, ranking groups by tokens took early pieces as readily as waiting ones, and
    the displacement feedback (which raises the tolerance when the stream is over its
    target) then released still more early ones (issue 16, prose calibration seeds, K = 4:
    0.79 displacement per token against a target of 0.45; ranked by relief, 0.45)."""
    return sum(piece.length if piece.arrival <= step else -piece.length * (piece.arrival - step)
               for piece in group)


def nearest_levels(queues: list[deque], level: int) -> list[int]:
    """The other queue levels, nearest to `level` first (ties: the lower level)."""
    return [k for k in sorted(range(len(queues)), key=lambda k: (abs(k - level), k)) if k != level]


@dataclass(frozen=True, kw_only=True)
class ReleasePolicy(ABC):
    """Decides which held outliers a step takes (see the module docstring)."""

    need: int
    """dp x n_micro: outliers a full release sends, one per micro-batch."""
    max_delay: int | None
    """Most steps a piece may wait in a queue, or None (no deadline)."""
    balance_tolerance: float
    """Predicted max / mean load a step may reach by taking outliers early."""
    max_backlog_tokens: int
    """Carry limit: "group" defers at most half of it (the packer's max_backlog_tokens, or two
    steps' capacity when that is the default)."""
    lookahead: int = 0
    """Batches the queues see ahead (lookahead.py); 0: no held piece is early."""
    piece_cost: Callable[[np.ndarray], np.ndarray] | None = None
    """Cost of pieces by length, as the packing weighs them (the packer's `cost.doc_cost`);
    with `bin_const`, lets "group" skip candidates that cannot pass the tolerance (None: try
    every candidate; the plans are the same)."""
    bin_const: float = 0.0
    """Cost every micro-batch adds (`cost.mb_const()`)."""

    @abstractmethod
    def plan_step(self, fresh: list[HeldPiece], queues: list[deque], carry: list[HeldPiece], step: int,
                  solve: SolveStep) -> StepRelease:
        """Release from `queues` (mutated), then pack carry + released + fresh."""

    def _is_due(self, piece: HeldPiece, step: int) -> bool:
        return self.max_delay is not None and step - piece.arrival >= self.max_delay

    def _not_too_early(self, group, step: int) -> bool:
        """With lookahead: at most half of `group` arrives after `step` (see the module
        docstring); always true without lookahead."""
        return not self.lookahead or 2 * sum(piece.arrival > step for piece in group) <= len(group)


class PaperRelease(ReleasePolicy):
    """release="paper": full queues leave (dp x n_micro, FIFO); max_delay forces the rest."""

    def plan_step(self, fresh, queues, carry, step, solve) -> StepRelease:
        return self._scheduled_step(fresh, queues, carry, step, solve)[2]

    def _scheduled_step(self, fresh, queues, carry, step, solve):
        """(first, rest, StepRelease) of the paper's releases alone."""
        released = self._scheduled_releases(queues, step)
        first, rest = split_due(carry, released, fresh, step, self.max_delay)
        pending, plan, arrival = solve(first, rest)
        return first, rest, StepRelease(pending, plan, arrival, released, n_early=0)

    def _scheduled_releases(self, queues: list[deque], step: int) -> list[HeldPiece]:
        released: list[HeldPiece] = []
        for level, q in enumerate(queues):
            if len(q) >= self.need and self._not_too_early([q[j] for j in range(self.need)], step):
                # paper §3.2: exactly dp x n_micro, FIFO, once per step
                released.extend(q.popleft() for _ in range(self.need))
            elif q and self._is_due(q[0], step):
                # Forced release of a queue that did not fill: top it up to one outlier per
                # micro-batch with the FIFO heads of the nearest other levels, so that no
                # micro-batch is left without one (they are the most alike documents held).
                group = [q.popleft() for _ in range(len(q))]
                for k in nearest_levels(queues, level):
                    while queues[k] and len(group) < self.need:
                        group.append(queues[k].popleft())
                released.extend(group)
            while q and self._is_due(q[0], step):  # anything still at its deadline goes too
                released.append(q.popleft())
        return released


class DrainRelease(PaperRelease):
    """End of data (`drain`): every queue leaves, whatever the policy."""

    def _scheduled_releases(self, queues: list[deque], step: int) -> list[HeldPiece]:
        released = [piece for q in queues for piece in q]
        for q in queues:
            q.clear()
        return released


class BalanceRelease(PaperRelease):
    """release="balance": the paper's releases, then held outliers (queue heads, FIFO)
    while the step stays balanced. Among admissible groups the one with the lowest
    imbalance wins (ties: more tokens, lower queue); repeats until none is admissible."""

    def plan_step(self, fresh, queues, carry, step, solve) -> StepRelease:
        first, rest, result = self._scheduled_step(fresh, queues, carry, step, solve)
        if not any(queues):
            return result
        pending, plan, arrival = result.pending, result.plan, result.arrival
        early: list[HeldPiece] = []
        base_deferred = plan.deferred_tokens
        for _ in range(self.need + len(queues)):
            limit = max(self.balance_tolerance, plan.imbalance) + _TOLERANCE_SLACK
            # a step that would train nothing takes its most balanced group whatever the tolerance
            idle = not any(len(mb) for mb in plan.micro_batches)
            best = None
            for group in self._early_candidates(queues):
                entries = [queues[level][j] for level, count in group for j in range(count)]
                if not self._not_too_early(entries, step):
                    continue
                t_pending, t_plan, t_arrival = solve(first, rest + early + entries)
                tokens = sum(piece.length for piece in entries)
                if t_plan.imbalance > limit or t_plan.deferred_tokens > base_deferred:
                    continue
                key = (t_plan.imbalance, -tokens, sorted(group))
                if best is None or key < best[0]:
                    best = (key, group, entries, t_pending, t_plan, t_arrival)
            if best is None:
                break
            _, group, entries, pending, plan, arrival = best
            base_deferred = plan.deferred_tokens
            for level, count in group:
                for _ in range(count):
                    queues[level].popleft()
            early.extend(entries)
        return StepRelease(pending, plan, arrival, result.released + early, n_early=len(early))

    def _early_candidates(self, queues: list[deque]) -> list[list[tuple[int, int]]]:
        """FIFO-respecting groups of held outliers a step may take early, as [(queue, count)]:
        the head of each queue, each whole queue, and each queue topped up to one outlier per
        micro-batch with the heads of the nearest levels (the most alike documents held)."""
        out: list[list[tuple[int, int]]] = []
        for level, q in enumerate(queues):
            if not q:
                continue
            out.append([(level, 1)])
            if 1 < len(q) <= self.need:
                out.append([(level, len(q))])
            if len(q) < self.need:
                group, room = [(level, len(q))], self.need - len(q)
                for k in nearest_levels(queues, level):
                    if queues[k] and room:
                        take = min(room, len(queues[k]))
                        group.append((k, take))
                        room -= take
                if len(group) > 1:
                    out.append(group)
        seen, unique = set(), []
        for group in out:
            key = tuple(sorted(group))
            if key not in seen:
                seen.add(key)
                unique.append(group)
        return unique


class GroupRelease(ReleasePolicy):
    """release="group": one pool of held outliers. The pool's pieces at max_delay leave;
    then, greedily, the step takes a group of held outliers adjacent in (length, arrival)
    order (1 to dp x n_micro of them) whenever the packed step's predicted imbalance stays
    within max(balance_tolerance, the imbalance without them) and the group brings more
    tokens than it pushes to the next step. Among admissible groups the one that relieves the
    most displacement wins (`displacement_relief`: its tokens, less the early ones' lead;
    ties: lower imbalance, then the earliest arrival); repeats until none is admissible.

    A group leaves only if the step places all of it. A released outlier that the packing
    defers would be carried, and a carried piece is placed first in the next step whatever
    joins it: often alone, one window among short documents (imbalance ~2). It stays in the
    pool instead, to leave with similar ones (issue 16: real calibration streams 1.044 ->
    1.036 mean imbalance at the same displacement)."""

    def _costs(self, pieces: list[HeldPiece]) -> dict:
        """Cost of each piece by key (empty without `piece_cost`)."""
        if self.piece_cost is None or not pieces:
            return {}
        weights = self.piece_cost(np.array([piece.length for piece in pieces], dtype=np.int64)).tolist()
        return {piece.key: w for piece, w in zip(pieces, weights)}

    def _cannot_pass(self, group, costs: dict, base_cost: float, limit: float) -> bool:
        """True when the step with `group` is surely above `limit`: a group is kept only if all
        of it is placed, so the heaviest micro-batch costs at least the group's heaviest piece
        plus `bin_const`, and the mean is at most (every pending piece + need x bin_const) /
        need; their ratio bounds the imbalance from below (margin for rounding)."""
        heaviest = max(costs[piece.key] for piece in group) + self.bin_const
        mean_at_most = (base_cost + sum(costs[piece.key] for piece in group)) / self.need + self.bin_const
        return heaviest > (limit + 1e-9) * mean_at_most

    @staticmethod
    def _defers_any(group, pending, plan) -> bool:
        """Whether the packed step defers a piece of `group` (see the class docstring)."""
        keys = {piece.key for piece in group}
        return any(pending[i].key in keys for i in plan.deferred.tolist())

    def plan_step(self, fresh, queues, carry, step, solve) -> StepRelease:
        pool = sorted((piece for q in queues for piece in q), key=lambda piece: piece.arrival)  # FIFO among equals
        released = [piece for piece in pool if self._is_due(piece, step)]
        taken = {piece.key for piece in released}
        n_forced = len(released)
        pending, plan, arrival = solve(*split_due(carry, released, fresh, step, self.max_delay))
        base_deferred = plan.deferred_tokens
        costs = self._costs(carry + fresh + pool)
        base_cost = sum(costs[piece.key] for piece in carry + fresh + released) if costs else 0.0
        while True:
            remaining = sorted((piece for piece in pool if piece.key not in taken),
                               key=lambda piece: (piece.length, piece.arrival))
            if not remaining:
                break
            limit = max(self.balance_tolerance, plan.imbalance) + _TOLERANCE_SLACK
            # a step that would train nothing takes its most balanced group whatever the tolerance
            idle = not any(len(mb) for mb in plan.micro_batches)
            best = None
            for size in range(1, min(self.need, len(remaining)) + 1):
                for i in range(len(remaining) - size + 1):
                    group = remaining[i:i + size]
                    if not self._not_too_early(group, step):
                        continue
                    if costs and not idle and self._cannot_pass(group, costs, base_cost, limit):
                        continue
                    t_pending, t_plan, t_arrival = solve(*split_due(carry, released + group, fresh, step,
                                                                    self.max_delay))
                    tokens = sum(piece.length for piece in group)
                    relief = displacement_relief(group, step)
                    t_deferred = t_plan.deferred_tokens
                    if ((t_plan.imbalance > limit and not idle) or t_deferred - base_deferred >= tokens
                            or t_deferred > self.max_backlog_tokens // 2
                            or self._defers_any(released[n_forced:] + group, t_pending, t_plan)):
                        continue
                    first = min(piece.arrival for piece in group)
                    key = (t_plan.imbalance, -relief, first, i) if idle else (-relief, t_plan.imbalance, first, i)
                    if best is None or key < best[0]:
                        best = (key, group, t_pending, t_plan, t_arrival)
            if best is None:
                break
            _, group, pending, plan, arrival = best
            base_deferred = plan.deferred_tokens
            released = released + group
            base_cost += sum(costs[piece.key] for piece in group) if costs else 0.0
            taken |= {piece.key for piece in group}
        for q in queues:  # keep each queue's FIFO order for what stays
            kept = [piece for piece in q if piece.key not in taken]
            q.clear()
            q.extend(kept)
        return StepRelease(pending, plan, arrival, released, n_early=len(released) - n_forced)


_POLICIES: dict[str, type[ReleasePolicy]] = {"paper": PaperRelease, "balance": BalanceRelease,
                                             "group": GroupRelease}
RELEASE_POLICIES: tuple[str, ...] = tuple(_POLICIES)


def make_release_policy(name: ReleaseName, **rules) -> ReleasePolicy:
    """The policy object for `release=name`; `rules` are ReleasePolicy's fields."""
    return _POLICIES[name](**rules)
