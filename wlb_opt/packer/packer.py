"""`WLBPacker`: one global batch in, one PackPlan out, with the stream's state in between.

This module owns a step: queue the fresh outliers, let the release policy (release.py)
choose what leaves the queues, pack it (`_solve`: `solve_pack`, Algorithm 1 by default,
carried pieces first), deal the micro-batches to DP replicas, and commit the new queues
and carry. What the paper leaves open about a training job is settled here:

- overload: pieces that do not fit are carried to the next step. The backlog guard counts
  everything the packer holds, queued and carried: a `pack` after which the packer would
  hold more than `max_backlog_tokens` (default (2 + n_queues) x dp x n_micro x max_tokens:
  two steps of carry plus one full release per queue; with the default, a batch larger than
  a step's capacity may exceed it by that excess, since a long document arrives whole)
  and more than it held before raises
  a ValueError that names the bound and the fixes, and leaves the state as it was before
  the call (calibration included). Releasing a queued outlier only moves it from a queue to
  the carry, so a release never trips the guard, and a step without new input never holds
  more than the one before: `pack([])` and `drain()` always make progress. This is also the
  bound of the queues with `max_delay=None`, which would otherwise grow without limit
  under a stream of outliers. The limit can be raised on reload
  (`load_state_dict(state, max_backlog_tokens=...)`).
- `drain()`: at the end of the data, emits plans until queues and carry are empty.
- DP refinement: the dp x n_micro micro-batches are dealt to replicas by the modelled 1F1B
  time of each replica, not by the sum of loads (`wlb_opt.solvers.deal.deal_to_replicas`).
  The model is a closed form (no simulator): with pp equal stages, a replica whose
  micro-batches cost c_j (forward + backward, all stages) runs for about
  (sum_j c_j + (pp - 1) max_j c_j) / pp: the heaviest micro-batch crosses every stage once,
  the others pass the first stage (paper §1.3 / §2.3); p2p ignored.
- identity: a piece is (id, offset). Ids repeated within a batch, or a piece equal to or
  overlapping (the same id, a token in common) one the packer still holds (queued, carried
  or buffered ahead), raise ValueError. The packer does not remember
  pieces it has already emitted, so re-sending an emitted id later is not detected.
- delay of a piece = `plan.step` where it is placed - the step it arrived; every plan
  records the arrival step of each of its pieces in `plan.arrival_step`.
- lookahead (`lookahead=K`, beyond the paper): `pack(batch s)` returns the plan of step
  s - K (None for the first K batches); outliers join the queues on arrival, so a step may
  train them up to K steps early (displacement in [-K, max_delay]; with release="marginal",
  the default, up to `defaults.MAX_LEAD` = 2 steps); see lookahead.py.

Plans are frozen: each step's plan is built once, from `solve_pack`'s, with `plan.replace`.
"""
from __future__ import annotations

import dataclasses
import heapq
import logging
import time
import warnings
from collections import deque
from itertools import chain
from typing import Literal

import numpy as np

from .._validate import (INT64_MAX, check_int, check_max_tokens, check_unique_pieces, validate_ids, validate_lengths,
                         validate_offsets)
from ..cost import CostModel, default_cost
from ..cost_memory import resolve_max_tokens
from ..plan import PackPlan
from ..solvers.deal import deal_to_replicas
from ..solvers.exact_common import SEED_MAX
from ..step_pack import solve_pack
from .calibrate import CALIBRATION_BUDGET, calibrate_thresholds, candidate_thresholds
from .config import PackerConfig, queue_thresholds
from .defaults import (EARLY_CREDIT, HELD_GROUP_STEPS, MARGINAL_PRICE, MARGINAL_TOLERANCE_HIGH, MAX_LEAD, REPAIR_FROM,
                       SHED_SHORT_PIECES, TARGET_SHARE, TOLERANCE_HIGH, TOLERANCE_LOW, TRIM_WITHOUT_GROUPS,
                       adaptive_tolerance, running_displacement)
from .fill_trial import FillStepSolver
from .lookahead import STATE_KEY as LOOKAHEAD_STATE_KEY
from .lookahead import LookaheadBuffer
from .pieces import (FreshPieces, PieceChain, arrived_sums, as_carry, fresh_pieces, gc_paused, owned, piece_table,
                     pieces_from_table, take)
from .release import MAX_PACKED, MAX_STEP_PACKED, SPARSE_MIN_BINS, DrainRelease, ReleasePolicy, make_release_policy
from .state import HeldPiece, KeySets, check_ids_issued, cost_fingerprint, decode_state, encode_state, held_tokens
from .stats import StreamStats
from .trial import COARSE_MIN_BINS, StepSolver, as_pack_plan

_log = logging.getLogger("wlb_opt")

_POLICY_KEYWORDS = tuple(field.name for field in dataclasses.fields(PackerConfig))
"""The policy keywords `WLBPacker` still accepts, deprecated, in place of `config=`."""

# Rounds of 1F1B-priced pairwise swaps when dealing micro-batches to replicas, ended by a round
# that lowers the slowest replica's modelled time by less than this share of it: the packer's
# micro-batches are balanced already, so later rounds win little for much planning time
# (docs/tuning.md, "Dealing micro-batches to replicas").
_DEAL_PASSES = 50
_DEAL_MIN_GAIN = 1e-4


def _config_from_keywords(config: PackerConfig | None, policy: dict) -> PackerConfig:
    """The packer's config: `config`, or one built from the deprecated policy keywords
    (`WLBPacker(..., thresholds=..., max_delay=...)`), with a DeprecationWarning."""
    unknown = sorted(set(policy) - set(_POLICY_KEYWORDS))
    if unknown:
        raise TypeError(f"WLBPacker() got an unexpected keyword argument {unknown[0]!r}")
    if config is not None and not isinstance(config, PackerConfig):
        raise ValueError(f"config must be a wlb_opt.PackerConfig, got {type(config).__name__}")
    if not policy:
        return config if config is not None else PackerConfig()
    if config is not None:
        raise TypeError(f"WLBPacker got config= and the policy keywords {sorted(policy)}; put them in the "
                        "config: config=PackerConfig(...) or config.replace(...)")
    given = ", ".join(f"{name}={policy[name]!r}" for name in _POLICY_KEYWORDS if name in policy)
    warnings.warn(f"WLBPacker's policy keywords are deprecated and will be removed: pass "
                  f"config=wlb_opt.PackerConfig({given}) instead", DeprecationWarning, stacklevel=3)
    return PackerConfig(**policy)


class WLBPacker:
    """Streaming WLB-LLM packer with multi-level outlier queues (paper §3.2, Algorithm 1;
    see `wlb_opt.packer` for the rules).

    Args:
        n_micro: micro-batches per DP replica (N).
        max_tokens: token cap of one micro-batch, inclusive (S_max), or "auto": the largest
            whose worst case fits in `memory_bytes` under the cost model's memory model
            (`wlb.max_tokens_for`; as `solve_pack(max_tokens="auto")`, which says how to count
            the interleaved schedule's in-flight micro-batches).
        cost: the cost model that weighs documents (default: `default_cost()`).
        dp: data-parallel replicas; dp x n_micro micro-batches are packed jointly (None: the
            cost model's `parallel.dp`, 1 without a layout; a disagreeing value raises).
        config: the policy (`PackerConfig`: thresholds, queues, release, max_delay, tolerance,
            delay budget, method, lookahead); default `PackerConfig()`, the no-tuning defaults.
            Its rules that depend on this layout (thresholds <= max_tokens) are checked here.
        seed: seeds the calibration's bootstrap stream (planning is otherwise deterministic).
        pp: pipeline stages for the DP refinement's 1F1B model (None: the cost model's
            `parallel.pp`, 1 without a layout; a disagreeing value raises).
        max_backlog_tokens: held tokens (queued + carried) above which `pack` raises (default
            (2 + n_queues) x dp x n_micro x max_tokens: two steps' capacity of carry plus one
            full release per queue; a batch with more tokens than one step's capacity may
            exceed the default by that excess, since a long document cut into pieces arrives
            whole; an explicit limit is strict).
        memory_bytes: bytes of memory per GPU, read with max_tokens="auto" only.
        **policy: deprecated: the fields of `PackerConfig` as keywords (`thresholds=`,
            `max_delay=`, ...), accepted with a DeprecationWarning; not together with `config`.
    """

    def __init__(self, n_micro: int, max_tokens: int | Literal["auto"], cost: CostModel | None = None,
                 dp: int | None = None, *, config: PackerConfig | None = None, seed: int = 0, pp: int | None = None,
                 max_backlog_tokens: int | None = None, memory_bytes: float | None = None, **policy):
        self.config = _config_from_keywords(config, policy)
        self.n_micro = check_int("n_micro", n_micro, 1)
        self.cost = cost if cost is not None else default_cost()
        if not isinstance(self.cost, CostModel):
            raise ValueError(f"cost must be a wlb_opt.CostModel, got {type(self.cost).__name__}")
        self.dp = self.cost.degree("dp", dp)
        # the exact methods' solvers take 32-bit seeds
        self.seed = check_int("seed", seed, 0, SEED_MAX if self.config.method in ("cpsat", "milp") else INT64_MAX)
        self.pp = self.cost.degree("pp", pp)
        # "auto": the largest max_tokens whose worst case fits in memory_bytes (cost_memory.py),
        # for the pipeline and replicas this packer plans (given, else the cost model's; the
        # memory model's own layout where neither says)
        known = self.cost.parallel is not None
        self.max_tokens = check_max_tokens(resolve_max_tokens(
            max_tokens, self.cost, memory_bytes, pp=self.pp if known or pp is not None else None,
            dp=self.dp if known or dp is not None else None))
        self.thresholds, self.n_queues = queue_thresholds(self.config, self.max_tokens)
        self._auto = self.thresholds is None
        # The notice advises other thresholds; the default pool is meant to hold a majority of
        # outliers when the data has them (docs/tuning.md: prose).
        self._warned_outliers = self.config.thresholds is None
        self._fingerprint = cost_fingerprint(self.cost)
        # With the default limit a batch may exceed it by its own tokens beyond one step's
        # capacity (a long document arrives whole; see `pack`); an explicit limit is strict.
        self._burst_allowed = max_backlog_tokens is None
        self._step_solver: StepSolver | None = None  # set inside a step (`_plan_step`)
        if max_backlog_tokens is None:
            # release="group" / "marginal" keep reading the carry limit "group" was tuned with (two steps)
            self._set_backlog_limit((2 + self.n_queues) * self.capacity_tokens, carry_limit=2 * self.capacity_tokens)
        else:
            self._set_backlog_limit(check_int("max_backlog_tokens", max_backlog_tokens, 0))
        self._reset_stream()

    # ------------------------------------------------------------------ policy (PackerConfig)
    @property
    def release(self) -> str:
        """The release policy this packer runs (`PackerConfig.resolved_release`)."""
        return self.config.resolved_release

    @property
    def max_delay(self) -> int | None:
        return self.config.max_delay

    @property
    def balance_tolerance(self) -> float | str:
        return self.config.balance_tolerance

    @property
    def delay_budget(self) -> float:
        return self.config.delay_budget

    @property
    def method(self) -> str:
        return self.config.method

    @property
    def lookahead(self) -> int:
        return self.config.lookahead

    def _set_backlog_limit(self, max_backlog_tokens: int, carry_limit: int | None = None) -> None:
        """Adopt the backlog limit and build the release policies; `carry_limit` (default:
        the limit) is what release="group" / "marginal" bound their deferrals by (half of it)."""
        self.max_backlog_tokens = max_backlog_tokens
        tolerance = TOLERANCE_LOW if self.balance_tolerance == "auto" else self.balance_tolerance
        sparse = self.method == "wlb_phases" and self.dp * self.n_micro >= SPARSE_MIN_BINS
        rules = dict(need=self.dp * self.n_micro, max_delay=self.max_delay, balance_tolerance=tolerance,
                     max_backlog_tokens=max_backlog_tokens if carry_limit is None else carry_limit,
                     lookahead=self.lookahead, piece_cost=self.cost._doc_cost_valid, bin_const=self.cost.mb_const(),
                     max_tokens=self.max_tokens,
                     room_bounds=not (self.method == "wlb_phases" and self.dp * self.n_micro >= COARSE_MIN_BINS),
                     sparse_windows=sparse, max_packed=MAX_PACKED if sparse else None,
                     max_step_packed=MAX_STEP_PACKED if sparse else None)
        marginal = {}
        if self.release == "marginal":  # the price of a group's tokens, per step of capacity
            marginal = dict(price=MARGINAL_PRICE, capacity_tokens=self.capacity_tokens, max_lead=MAX_LEAD,
                            early_credit=EARLY_CREDIT, shed=SHED_SHORT_PIECES,
                            trim_without_groups=TRIM_WITHOUT_GROUPS, held_group_steps=HELD_GROUP_STEPS,
                            repair_from=REPAIR_FROM if (self.method in ("wlb", "wlb_phases")
                                                        and self.dp * self.n_micro < COARSE_MIN_BINS) else None)
        self._release: ReleasePolicy = make_release_policy(self.release, **rules, **marginal)
        self._drain_release: ReleasePolicy = DrainRelease(**rules)

    # ------------------------------------------------------------------ state
    def _reset_stream(self) -> None:
        self._queues: list[deque[HeldPiece]] = [deque() for _ in range(self.n_queues)]
        self._carry: list[HeldPiece] = []
        self._held = KeySets()  # identities a new batch may not repeat (held, buffered ahead)
        self._step = 0
        self._next_auto_id = 0
        self._max_id: int | None = None  # the largest id any batch has brought (None before the first)
        self._calibration: dict | None = None
        self._stats = StreamStats()
        self._ahead = LookaheadBuffer()

    @property
    def step(self) -> int:
        """Index of the next plan `pack` or `drain` will emit."""
        return self._step

    @property
    def capacity_tokens(self) -> int:
        """Tokens one step can place: dp x n_micro x max_tokens."""
        return self.dp * self.n_micro * self.max_tokens

    def _config(self) -> dict:
        """The state's config section: the layout, the limits and the policy (the thresholds
        are a field of their own, with whether they were calibrated)."""
        return dict(n_micro=self.n_micro, max_tokens=self.max_tokens, dp=self.dp, n_queues=self.n_queues,
                    max_delay=self.max_delay, seed=self.seed, max_backlog_tokens=self.max_backlog_tokens,
                    backlog_burst=self._burst_allowed, pp=self.pp, method=self.method, release=self.release,
                    balance_tolerance=self.balance_tolerance, delay_budget=self.delay_budget,
                    lookahead=self.lookahead, cost_fingerprint=self._fingerprint)

    @property
    def held_tokens(self) -> int:
        """Tokens the packer holds between steps: queued outliers plus carried pieces (what
        `max_backlog_tokens` bounds)."""
        return held_tokens(self._queues, self._carry)

    def queued_ids(self) -> np.ndarray:
        """Ids of the pieces held in outlier queues (neither placed nor deferred), queue by
        queue, FIFO order inside each."""
        return np.array([piece.id for q in self._queues for piece in q], dtype=np.int64)

    def held_pieces(self) -> list[HeldPiece]:
        """Every piece the packer holds: queued, carried, then (with `lookahead`) the regular
        documents of the batches seen ahead, oldest first."""
        return [piece for q in self._queues for piece in q] + list(self._carry) + list(self._ahead.pieces())

    def carried_ids(self) -> np.ndarray:
        """Ids of the pieces deferred by the last plan (placed first in the next)."""
        return np.array([piece.id for piece in self._carry], dtype=np.int64)

    def buffered_ids(self) -> np.ndarray:
        """Ids of the regular documents of the batches seen ahead (`lookahead`), not yet
        planned, oldest batch first (empty when lookahead=0)."""
        return np.concatenate([np.zeros(0, dtype=np.int64)] + [table[0] for table in self._ahead.tables()])

    @property
    def arrival_step(self) -> int:
        """Step index the next batch given to `pack` arrives at (= `step` + buffered batches)."""
        return self._step + len(self._ahead)

    # ------------------------------------------------------------------ input
    def _validate_batch(self, lengths, ids, offsets):
        lengths = validate_lengths(lengths)
        n = len(lengths)
        if ids is None:
            if self._next_auto_id + n - 1 > INT64_MAX:
                raise ValueError(f"ids: automatic ids would pass 2**63 - 1 (the next is {self._next_auto_id}, after "
                                 f"the largest id given); pass ids explicitly")
            ids = np.arange(self._next_auto_id, self._next_auto_id + n, dtype=np.int64)
        else:
            ids = validate_ids(ids, n)
        offsets = validate_offsets(offsets, n)
        if n and lengths.max() > self.max_tokens:
            i = int(np.argmax(lengths))
            raise ValueError(f"document {int(ids[i])} (position {i}) has {int(lengths[i])} tokens > "
                             f"max_tokens={self.max_tokens}; cut documents with wlb_opt.split_documents first")
        check_unique_pieces(ids, offsets, "within the batch", lengths=lengths)
        # every held or buffered piece has an id <= _max_id: a batch of larger ids (a stream
        # whose ids grow, as automatic ones do) cannot repeat one, and is not compared piece by piece
        fresh_ids = self._max_id is not None and n and int(ids.min()) > self._max_id
        clash = None if not self._held or fresh_ids else \
            self._held.first_clash(ids.tolist(), offsets, lengths)
        if clash is not None:  # the same tokens of a document twice
            k, held_offset, held_length = clash
            key = (int(ids[k]), int(offsets[k]))
            if held_offset == key[1]:
                raise ValueError(f"ids: id {key[0]} (offset {key[1]}, position {k}) is already held by the "
                                 "packer (queued or carried from an earlier step, or buffered ahead)")
            start, end = key[1], key[1] + int(lengths[k])
            raise ValueError(f"ids: id {key[0]} [{start}, {end}) (position {k}) overlaps the piece "
                             f"[{held_offset}, {held_offset + held_length}) the packer still holds (queued or "
                             "carried from an earlier step, or buffered ahead): its tokens would train twice")
        return lengths, ids, offsets

    # ------------------------------------------------------------------ one step
    def _queue_outliers(self, table: np.ndarray, queues: list[deque]) -> np.ndarray | None:
        """Append each outlier of the batch `table` (a `piece_table`) to its queue (the last
        threshold <= its length), in the batch's order; returns which pieces are regular
        documents (a boolean mask), or None when all are. One vectorised lookup per batch
        rather than one per piece (a batch holds hundreds of pieces, few outliers), and only
        the outliers become `HeldPiece`s here."""
        if not self.thresholds or not table.shape[1]:
            return None
        levels = np.searchsorted(np.asarray(self.thresholds, dtype=np.int64), table[2], side="right") - 1
        outliers = np.flatnonzero(levels >= 0)
        if not len(outliers):
            return None
        for piece, level in zip(pieces_from_table(table[:, outliers]), levels[outliers].tolist()):
            queues[level].append(piece)
        return levels < 0

    def _plan_step(self, fresh: list[HeldPiece], queues: list[deque], carry: list[HeldPiece], step: int,
                   policy: ReleasePolicy, started: float,
                   table: np.ndarray | None = None) -> tuple[PackPlan, list[HeldPiece]]:
        """Release by `policy`, pack `fresh` (the step's regular documents; its outliers are
        queued already) with what it releases and `carry`, and deal to replicas. Mutates only
        the given queues (copies); returns (plan, new carry). `started` (perf_counter seconds)
        is when the step began, for `plan.info.wall_s`. `table`: `fresh`'s `piece_table`, if
        the caller has it."""
        self._step_solver = self._make_step_solver(carry + [piece for q in queues for piece in q], fresh, table)
        try:
            pending, plan, arrival, released, n_early = policy.plan_step(fresh, queues, carry, step, self._solve)
        finally:
            self._step_solver = None
        plan = as_pack_plan(plan)
        extra = {**plan.info.extra, "released": len(released), "released_early": n_early,
                 "carried_in": len(carry), "thresholds": list(self.thresholds or []),
                 "balance_tolerance": policy.balance_tolerance,
                 "queue_wait_max": max((step - piece.arrival for piece in released), default=0)}
        plan = plan.replace(
            replica_of=deal_to_replicas(plan.loads, self.dp, self.n_micro, self.pp, max_passes=_DEAL_PASSES,
                                        min_gain=_DEAL_MIN_GAIN),
            step=step, arrival_step=arrival,
            info=dataclasses.replace(plan.info, extra=extra, wall_s=time.perf_counter() - started))
        return plan, take(pending, plan.deferred.tolist())

    def _step_policy(self) -> ReleasePolicy:
        """The release policy of the next step: with balance_tolerance="auto" its tolerance
        follows the stream's displacement so far (defaults.py), up to TOLERANCE_HIGH
        (MARGINAL_TOLERANCE_HIGH for release="marginal")."""
        if self.balance_tolerance != "auto":
            return self._release
        held = _held(self._queues, self._carry)
        shown = running_displacement(self._stats.totals, held, self._step, self.capacity_tokens,
                                     TARGET_SHARE * self.delay_budget)
        high = MARGINAL_TOLERANCE_HIGH if self.release == "marginal" else TOLERANCE_HIGH
        # the policy with its tolerance changed: its fields copied as they are (`dataclasses.replace`
        # would run __init__ over every field, each step; no field derives from the tolerance)
        policy = object.__new__(type(self._release))
        policy.__dict__.update(self._release.__dict__)
        object.__setattr__(policy, "balance_tolerance", adaptive_tolerance(shown, self.delay_budget, high))
        return policy

    def _make_step_solver(self, held: list[HeldPiece], fresh: list[HeldPiece],
                          fresh_table: np.ndarray | None = None) -> StepSolver | None:
        """The step's candidate packer: trial.py's for methods "wlb" and "wlb_phases" (the
        plans of `solve_pack`; for "wlb_phases" the candidates are Algorithm 1's packings and
        the kept one is packed with the phases balanced apart), fill_trial.py's for
        "wlb_fill" (candidates scored from their large pieces, the kept one packed by
        `wlb_fill`); None for the other methods, which go through `solve_pack` for every
        candidate."""
        if self.method not in ("wlb", "wlb_fill", "wlb_phases"):
            return None
        table = piece_table(held + fresh) if fresh_table is None else np.concatenate([piece_table(held), fresh_table], 1)
        parts = held.parts if type(held) is PieceChain else ()
        carry = parts[0] if parts and isinstance(parts[0], FreshPieces) else None  # a carry held as a table leads
        lengths = table[2]  # validated on arrival (`_validate_batch`)
        if self.method == "wlb_phases":
            weights, fwd, bwd = self.cost._phase_costs_valid(lengths)
        else:
            weights = self.cost._doc_cost_valid(lengths)
        if self.method == "wlb_fill":
            return FillStepSolver(None, weights, fresh, n_micro=self.n_micro, dp=self.dp,
                                  max_tokens=self.max_tokens, bin_const=self.cost.mb_const(), method=self.method,
                                  table=table, fresh_at=len(held))
        phases = None
        if self.method == "wlb_phases":
            phases = (fwd, bwd, self.cost.mb_const("fwd"), self.cost.mb_const("bwd"))
        return StepSolver(None, weights, fresh, n_micro=self.n_micro, dp=self.dp, max_tokens=self.max_tokens,
                          bin_const=self.cost.mb_const(), method=self.method, phases=phases, table=table,
                          fresh_at=len(held), carry=carry)

    def _solve(self, first: list[HeldPiece], rest: list[HeldPiece]):
        """Pack `first` (placed first) then `rest`; returns (pending, plan, arrival steps).
        Inside a step with method "wlb", "wlb_phases" or "wlb_fill" the step's solver packs or scores
        (pieces validated and weighed once per step); otherwise `solve_pack`."""
        if self._step_solver is not None:
            return self._step_solver.solve(first, rest)
        pending = first + rest
        if pending:  # fromiter: 4x faster than np.array on a list of tuples (called per candidate)
            ids, offsets, lengths, arrival = np.fromiter(chain.from_iterable(pending), dtype=np.int64,
                                                         count=4 * len(pending)).reshape(-1, 4).T
        else:
            ids = offsets = lengths = arrival = np.zeros(0, dtype=np.int64)
        # the exact models place every piece unless told they may defer: a step can hold more
        # than its capacity (carried pieces, released outliers), and the packer carries what waits
        carried = len(first)
        options = {}
        if self.method in ("cpsat", "milp"):
            # ... and they must place every carried piece: only those that surely fit are carried
            # (a drain, or a carry past one step, would fail on every later call), the others
            # are placed as the model can
            options, carried = dict(allow_defer=True), _fitting_prefix(lengths[:carried], self.dp * self.n_micro,
                                                                       self.max_tokens)
        plan = solve_pack(lengths, self.n_micro, self.max_tokens, self.cost, self.method, ids=ids, offsets=offsets,
                          dp=self.dp, carried=carried, seed=self.seed, **options)
        return pending, plan, arrival

    def _commit(self, plan: PackPlan, queues: list[deque], carry: list[HeldPiece]) -> None:
        self._queues, self._carry = queues, carry
        self._held = _held_keys(queues, carry, self._ahead)
        self._step += 1
        self._stats.add(plan, self.max_delay, plan.info.extra["queue_wait_max"])

    @gc_paused()  # a step's temporaries are freed by reference counting (`pieces.gc_paused`)
    def pack(self, lengths, ids=None, offsets=None) -> PackPlan | None:
        """Pack one global batch; returns the step's PackPlan (with `lookahead=K`: the plan
        of the step K batches back, None while the first K batches arrive).

        `lengths` are pieces no longer than max_tokens (see `split_documents`), `ids` their
        document ids (default: consecutive ids continuing across calls), `offsets` the start
        of each piece in its document (default 0; needed when pieces share an id).
        `plan.doc_ids` holds everything placed or deferred this step, including documents
        released from queues and carried from earlier steps. Raises ValueError (state
        unchanged) if the packer would then hold (queued + carried) more than
        `max_backlog_tokens` and more than before the call. An empty batch is never refused:
        `pack([])` always makes progress (with lookahead too, where the step planned holds the
        pieces of the batch K calls back, which the call's own batch cannot change).

        Python's cyclic garbage collector is paused during the call and turned back on after
        it (if it was on): the step's short-lived objects are freed by reference counting.
        """
        started = time.perf_counter()
        lengths, ids, offsets = self._validate_batch(lengths, ids, offsets)
        before = None
        if self._auto and self.thresholds is None and len(lengths):
            before = (self.thresholds, self.n_queues, self._queues, self._calibration)
            self.calibrate(lengths)  # on the first non-empty global batch
        self._notice_if_mostly_outliers(lengths)
        step = self._step
        arrival = self.arrival_step
        table = np.stack([ids, offsets, lengths, np.full(len(lengths), arrival, dtype=np.int64)])  # piece_table
        queues = [deque(q) for q in self._queues]
        # Outliers queue on arrival (with lookahead they may leave early); regular documents
        # are fresh at their own step: this one, or with lookahead K steps on, from the buffer
        # (see lookahead.py).
        regular = self._queue_outliers(table, queues)
        if regular is not None:
            table = table[:, regular]
        if self.lookahead:
            ahead = self._ahead.with_batch(table)
            if len(ahead) <= self.lookahead:  # step s - K does not exist yet
                self._record_ids(ids)
                self._queues, self._ahead = queues, ahead
                self._held = _held_keys(queues, self._carry, ahead)
                return None
            fresh, table = ahead.pop_oldest()
        else:
            ahead = self._ahead
            fresh = fresh_pieces(table)
        plan, carry = self._plan_step(fresh, queues, owned(self._carry), step, self._step_policy(), started, table)
        # A step that holds no more than the one before always passes (pack([]) makes
        # progress even from a state above the limit, e.g. one loaded with a lower limit).
        # What was seen ahead is not counted (the buffer, and outliers queued before their
        # step: arrival > step): it is at most K batches by construction. With lookahead the
        # step planned is the batch of K calls ago, which this call's batch cannot change: an
        # empty batch then always passes, so that a stream over the limit still progresses.
        held_after = self._tokens_due(queues, carry, step)
        # Default limit: a burst (step's batch above a step's capacity, e.g. a 2.1M-token document
        # cut into 17 pieces that arrive together) may exceed it by its own excess; a stream
        # that keeps bringing more than the capacity still grows past the limit and raises.
        # (The burst and the tokens held before are only needed past the limit itself.)
        over = held_after > self.max_backlog_tokens
        burst = 0
        if over and self._burst_allowed:
            burst = max(0, self._arrived_tokens(plan, queues, step) - self.capacity_tokens)
        if (len(lengths) and held_after > self.max_backlog_tokens + burst
                and held_after > self._tokens_due(self._queues, self._carry, step - 1)):
            if before is not None:  # leave the state exactly as it was, calibration included
                self.thresholds, self.n_queues, self._queues, self._calibration = before
            queued = held_after - sum(piece.length for piece in carry if piece.arrival <= step)
            hint = ("; with max_delay=None a queue waits for dp x n_micro outliers however long that takes: "
                    "set max_delay to bound the wait") if self.max_delay is None and queued else ""
            allowance = f" + {burst} (the batch's tokens beyond one step's capacity)" if burst else ""
            raise ValueError(
                f"overload at step {step}: the packer would hold {held_after} tokens ({queued} queued, "
                f"{held_after - queued} carried), more than max_backlog_tokens={self.max_backlog_tokens}{allowance}; the "
                f"stream brings more tokens per step than {self.dp} x {self.n_micro} micro-batches of "
                f"max_tokens={self.max_tokens} can place{hint}. Use a larger max_tokens or fewer tokens per global "
                "batch, or raise max_backlog_tokens (also on reload: load_state_dict(state, max_backlog_tokens=...)); "
                "the state is unchanged and pack([]) or drain() still empty it")
        self._record_ids(ids)
        self._ahead = ahead
        self._commit(plan, queues, carry)
        return plan

    def _record_ids(self, ids: np.ndarray) -> None:
        """Remember the largest id given so far; automatic ids continue past it."""
        if len(ids):
            top = int(ids.max())
            self._max_id = top if self._max_id is None else max(self._max_id, top)
            self._next_auto_id = max(self._next_auto_id, top + 1)

    @staticmethod
    def _tokens_due(queues, carry, step: int) -> int:
        """Tokens of the queued and carried pieces that arrived by `step` (what the backlog
        guard counts), in one pass over them."""
        return arrived_sums(_held(queues, carry), step)[0]

    @staticmethod
    def _arrived_tokens(plan: PackPlan, queues, step: int) -> int:
        """Tokens of step `step`'s batch still in the stream after its plan: placed or deferred
        by the plan, or still queued (with lookahead, pieces trained early are gone)."""
        in_plan = int(plan.lengths[plan.arrival_step == step].sum()) if len(plan.lengths) else 0
        return in_plan + sum(piece.length for q in queues for piece in q if piece.arrival == step)

    def _notice_if_mostly_outliers(self, lengths: np.ndarray) -> None:
        """Log once (logger "wlb_opt", WARNING) when more than half of a batch's tokens are
        outliers: the thresholds are then too low for the data (e.g. a bare window // 2), and
        most tokens would wait. Not with the default pool (thresholds=None), which suits such
        data."""
        if self._warned_outliers or not self.thresholds or not len(lengths):
            return
        share = float(lengths[lengths >= self.thresholds[0]].sum()) / float(lengths.sum())
        if share > 0.5:
            self._warned_outliers = True
            hint = ("use the default pool (thresholds=None), which suits such data" if self._auto
                    else "use thresholds='auto', the default pool (thresholds=None) or higher thresholds")
            _log.warning("step %d: %.0f%% of the batch's tokens are in outliers (length >= %d, thresholds %s), so "
                         "most tokens wait in queues; %s", self._step, 100 * share, self.thresholds[0],
                         self.thresholds, hint)

    def drain(self) -> list[PackPlan]:
        """End of data: plan the batches seen ahead (their steps, by the release policy),
        then release every queue and emit plans until nothing is held."""
        plans = []
        while (plan := self._drain_step()) is not None:
            plans.append(plan)
        return plans

    @gc_paused()
    def _drain_step(self) -> PackPlan | None:
        """One step of `drain`, committed (None when nothing is held): a caller that
        checkpoints per step (`WLBStream`) takes the state between two of them."""
        if len(self._ahead):
            queues = [deque(q) for q in self._queues]
            ahead = self._ahead.copy()
            entries, table = ahead.pop_oldest()
            plan, carry = self._plan_step(entries, queues, list(self._carry), self._step, self._step_policy(),
                                          time.perf_counter(), table=table)
            self._ahead = ahead
        elif self._carry or any(self._queues):
            queues = [deque(q) for q in self._queues]
            plan, carry = self._plan_step([], queues, list(self._carry), self._step, self._drain_release,
                                          time.perf_counter())
        else:
            return None
        self._commit(plan, queues, carry)
        return plan

    # ------------------------------------------------------------------ statistics
    def stats(self) -> dict:
        """Delay and balance of the stream so far (steps emitted by pack and drain): placed
        pieces and tokens, delay per piece and per token, `queue_wait_max`, `late_pieces`,
        imbalance mean / p50 / p90 / max, what is still queued and carried, the thresholds.
        See `wlb_opt.packer.stats` for the definitions."""
        out = self._stats.summary(steps=self._step, queues=self._queues, carry=self._carry,
                                  thresholds=self.thresholds)
        out.update(lookahead=self.lookahead, buffered_pieces=sum(table.shape[1] for table in self._ahead.tables()),
                   buffered_tokens=self._ahead.tokens())
        return out

    # ------------------------------------------------------------------ calibration
    def candidate_thresholds(self, sample, tokens_per_batch: int) -> list[int]:
        """Candidate thresholds for `sample` in global batches of `tokens_per_batch` tokens:
        lengths at fractions of a micro-batch's fair share of modelled cost, and quantiles of
        the sample's outlier lengths; candidates within 5% of a shorter one are merged (see
        `wlb_opt.packer.calibrate`)."""
        sample = validate_lengths(sample, "sample")
        if not len(sample):
            raise ValueError("sample is empty; candidate thresholds need at least one document length")
        if sample.max() > self.max_tokens:
            raise ValueError(f"sample holds {int(sample.max())} tokens > max_tokens={self.max_tokens}; cut documents "
                             "with wlb_opt.split_documents first")
        tokens_per_batch = check_int("tokens_per_batch", tokens_per_batch, 1)
        return candidate_thresholds(self.cost, sample, tokens_per_batch, self.dp * self.n_micro, self.max_tokens)

    def calibrate(self, sample_lengths, tokens_per_batch: int | None = None, n_batches: int = 32,
                  budget: float | None = CALIBRATION_BUDGET) -> list[int]:
        """Choose n_queues thresholds by running this packer on a bootstrap stream.

        The stream is `n_batches` global batches of `tokens_per_batch` tokens (default: the
        sample's tokens, capped at dp x n_micro x max_tokens / 1.25) resampled from the sample
        with this packer's seed. The increasing n_queues-subsets of `candidate_thresholds`
        are run (same max_delay, then drained), once per group of subsets that queue the
        bootstrap stream alike, within `budget` units of work (solver calls, so every rank
        chooses alike; None: no bound; past it the worse half of the groups is dropped at
        checkpoints, see `calibrate.py`). The choice minimises mean imbalance among
        candidates whose displacement per token is within `delay_budget` (ties within 0.002:
        less displacement), else the least displacement. Resets the stream; call before the first `pack`.
        Returns the thresholds (also recorded in `state_dict()`). Thresholds given in the config
        are replaced (logged as a warning): a checkpoint then carries the calibrated ones.
        """
        # with lookahead a packer holds pieces from its first call on, at step 0: new queues would
        # drop them (empty batches buffered ahead hold none)
        holding = bool(self._held) or any(table.shape[1] for table in self._ahead.tables())
        if holding or (self._step and (self._stats.totals["pieces"] or self.thresholds is not None)):
            raise ValueError(f"calibrate must be called before the first step; this packer is at step {self._step}"
                             + (" and holds pieces (queued, carried or buffered ahead)" if holding else ""))
        configured = self.config.thresholds
        record = calibrate_thresholds(self, sample_lengths, tokens_per_batch, n_batches, budget)
        chosen = [] if record is None else record["thresholds"]
        if isinstance(configured, tuple) and list(configured) != chosen:
            _log.warning("calibrate() replaces the configured thresholds %s by %s (thresholds='auto' asks for "
                         "calibration)", list(configured), chosen)
        if record is None:  # no queues, or no outlier in the sample: nothing to choose, no queues
            self.thresholds, self.n_queues, self._queues = [], 0, []
            return []
        self.thresholds = record["thresholds"]
        self.n_queues = len(self.thresholds)
        self._queues = [deque() for _ in range(self.n_queues)]
        self._calibration = record
        return list(self.thresholds)

    def _trial(self, thresholds: list[int]) -> "WLBPacker":
        """A fresh packer configured like this one, with explicit `thresholds` (calibration)."""
        config = self.config.replace(thresholds=thresholds, n_queues=None, release=self.release)
        trial = WLBPacker(self.n_micro, self.max_tokens, self.cost, self.dp, config=config, seed=self.seed,
                          max_backlog_tokens=self.max_backlog_tokens, pp=self.pp)
        trial._warned_outliers = True  # trying low thresholds is calibration's job, not a user's mistake
        return trial

    @property
    def calibration(self) -> dict | None:
        """What `calibrate` measured (candidates with imbalance and delay), or None."""
        return self._calibration

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """JSON-serialisable state; `load_state_dict` on an equally configured packer resumes
        the stream exactly. Does not hold ids already emitted (see `wlb_opt.packer.state`)."""
        state = encode_state(config=self._config(), auto=self._auto, thresholds=self.thresholds, step=self._step,
                             next_auto_id=self._next_auto_id, max_id=self._max_id, queues=self._queues, carry=self._carry,
                             calibration=self._calibration, stats=self._stats)
        state[LOOKAHEAD_STATE_KEY] = self._ahead.to_json()
        return state

    def load_state_dict(self, state: dict, max_backlog_tokens: int | None = None) -> None:
        """Restore a `state_dict()`. Raises ValueError naming the field if the state comes from
        another format version or a packer configured differently, or if what it holds is
        invalid (the packer is then unchanged). `max_backlog_tokens`: None (the state's limit
        must equal this packer's), or a new limit that this packer adopts whatever the
        state's (e.g. to resume a stream that overloaded; any state loads under it, and a
        step above it passes as long as it holds no more than the step before). The packer
        then runs as one built with `max_backlog_tokens` = that limit: strict, and release
        "group" / "marginal" defer at most half of it per step (the default limit bounds
        their deferrals by one step's capacity instead), so its plans may differ from the
        packer's before."""
        config = self._config()
        theirs = state.get("config") if isinstance(state, dict) else None
        theirs = theirs if isinstance(theirs, dict) else {}  # a malformed state fails in decode_state
        if max_backlog_tokens is not None:
            max_backlog_tokens = check_int("max_backlog_tokens", max_backlog_tokens, 0)
            config["max_backlog_tokens"] = theirs.get("max_backlog_tokens")
            config["backlog_burst"] = theirs.get("backlog_burst")
        # checked first: a state of another lookahead also fails decode_state's arrival checks
        if theirs and theirs.get("lookahead", 0) != self.lookahead:
            raise ValueError(f"state_dict field config.lookahead={theirs.get('lookahead', 0)!r} does not match this "
                             f"packer's lookahead={self.lookahead!r}; build the packer with the same configuration")
        loaded = decode_state(state, config=config, auto=self._auto, thresholds=self.thresholds,
                              n_queues=self.n_queues, lookahead=self.lookahead)
        ahead = self._decode_lookahead(state, loaded.step)
        try:
            check_ids_issued(loaded, ahead.pieces(), self.max_tokens)
        except ValueError as exc:
            raise ValueError(f"state_dict is malformed: {exc}") from None
        if max_backlog_tokens is not None:
            self._set_backlog_limit(max_backlog_tokens)
            self._burst_allowed = False
        self.thresholds = loaded.thresholds
        if loaded.thresholds is not None:
            self.n_queues = len(loaded.thresholds)
        self._queues, self._carry = loaded.queues, as_carry(loaded.carry)
        self._step, self._next_auto_id, self._max_id = loaded.step, loaded.next_auto_id, loaded.max_id
        self._calibration = loaded.calibration
        self._stats = loaded.stats
        self._ahead = ahead
        self._held = _held_keys(loaded.queues, loaded.carry, ahead)

    def _decode_lookahead(self, state: dict, step: int) -> LookaheadBuffer:
        """The lookahead part of a state (lookahead.py; its config.lookahead is checked by
        `load_state_dict`); a state written before lookahead existed has none and loads into a
        packer with lookahead=0."""
        try:
            return LookaheadBuffer.from_json(state.get(LOOKAHEAD_STATE_KEY, []), lookahead=self.lookahead,
                                             next_step=step)
        except ValueError as exc:
            raise ValueError(f"state_dict is malformed: {exc}") from None

    def __repr__(self) -> str:
        return (f"WLBPacker(n_micro={self.n_micro}, max_tokens={self.max_tokens}, dp={self.dp}, "
                f"thresholds={self.thresholds if self.thresholds is not None else 'auto'}, "
                f"max_delay={self.max_delay}, lookahead={self.lookahead}, step={self._step})")


def _held(queues, carry):
    """The queued and carried pieces, one list, or a chain of the queued ones and a carry held
    as a table (read as arrays where summed: `pieces.arrived_sums`)."""
    queued = [piece for q in queues for piece in q]
    return PieceChain((queued, carry)) if isinstance(carry, FreshPieces) else queued + carry


def _held_keys(queues, carry, ahead: LookaheadBuffer) -> KeySets:
    """What a new batch is checked against: the queued and carried pieces (`_held`; a carry
    held as a table as its table) and the batches buffered ahead."""
    held = _held(queues, carry)
    if isinstance(held, list):
        groups = [held]
    else:  # the queued pieces, if any, and the carry's table
        groups = [part if isinstance(part, list) else part.table for part in held.parts]
    return KeySets(*groups, *ahead.tables(), ids=[None] * len(groups) + list(ahead.id_sets()))


def _fitting_prefix(lengths: np.ndarray, n_bins: int, max_tokens: int) -> int:
    """How many of `lengths`, from the first, surely fit `n_bins` bins of `max_tokens` tokens
    together: each placed in turn on the bin of fewest tokens, up to the first that does not
    fit there (a packing of them that exists)."""
    room = [0] * n_bins  # tokens per bin, as a heap
    for k, length in enumerate(lengths.tolist()):
        if room[0] + length > max_tokens:
            return k
        heapq.heapreplace(room, room[0] + length)
    return len(lengths)
