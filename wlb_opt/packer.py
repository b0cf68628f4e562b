"""`WLBPacker`: the stateful streaming packer of WLB-LLM (paper §3.2, Algorithm 1), made safe
for a training job.

One global batch goes in per step, one PackPlan comes out. Outlier documents (length >= L1)
wait in multi-level FIFO queues (queue i holds L_i <= d < L_{i+1}; the last queue is open
above) until a queue holds dp x n_micro of them, which are then released together so that
every micro-batch gets one outlier of similar length. Algorithm 1 (`solve_pack(method="wlb")`)
then packs the carried documents first and the rest longest-first. What the paper leaves
open is settled here:

- `max_delay=K`: a queue whose head has waited K steps is released even if it holds fewer
  than dp x n_micro documents (topped up with the heads of the nearest other queues, so each
  micro-batch still gets one outlier), and documents at their deadline (released or carried)
  are placed before anything else, longest first. No document waits in a queue more than K
  steps; it is placed more than K steps late only if the due documents of a step exceed its
  capacity (`stats()["late_pieces"]`). With `max_delay=None` the packer is paper-faithful.
- `release="balance"` (beyond the paper, opt-in): after the paper's releases, a step also
  takes held outliers early (FIFO heads of a queue, a whole queue, or a queue topped up to
  one outlier per micro-batch from the nearest levels) whenever the packed step's predicted
  imbalance stays within max(`balance_tolerance`, its imbalance without them) and no more
  tokens are deferred. An outlier that the step's short documents can balance then waits
  for nothing. `release="paper"` (default) keeps the paper's rule.
- `release="group"` (beyond the paper, opt-in): all held outliers form one pool (the queues
  only store them). Each step the pool's pieces at max_delay leave; then, greedily, the step
  takes groups of 1 to dp x n_micro held outliers adjacent in (length, arrival) order
  (similar cost; FIFO among equal lengths) while its predicted imbalance stays within
  max(`balance_tolerance`, its imbalance without them) and the short documents this pushes
  to the next step are fewer tokens than the group brings. Long outliers then leave in
  groups of similar ones from any level, a cheap one alone, at the cost of carrying some
  short documents one step. Tolerance ~1.3 (fwd + bwd loads) suits the default stream.
- overload: documents that do not fit are carried to the next step; once the carry exceeds
  `max_backlog_tokens` (default two steps' capacity) `pack` raises a ValueError and leaves
  the state as it was before the call.
- `drain()`: at the end of the data, emits plans until queues and carry are empty.
- `calibrate(sample)`: chooses the thresholds by running this packer (same release policy)
  on a bootstrap stream resampled from the sample (the paper chose them by hand, offline);
  candidates come from the cost model (fractions of a micro-batch's fair share) and from
  the data (quantiles of the sample's outlier lengths); `thresholds="auto"` calibrates on
  the first global batch.
- DP refinement: the dp x n_micro micro-batches are dealt to replicas by the modelled 1F1B
  time of each replica, not by the sum of loads. The model is a closed form (no simulator):
  with pp equal stages, a replica whose micro-batches cost c_j (forward + backward, all
  stages) runs for about (sum_j c_j + (pp - 1) max_j c_j) / pp: the heaviest micro-batch
  crosses every stage once, the others pass the first stage (paper §1.3 / §2.3); p2p ignored.
- `state_dict()` / `load_state_dict()`: JSON-serialisable; a resumed run emits the same plans.

Identity: a piece is (id, offset). Ids repeated within a batch, or equal to a piece the packer
still holds (queued or carried), raise ValueError. The state does not remember pieces it has
already emitted, so re-sending an emitted id later is not detected.

Delay of a piece = `plan.step` where it is placed - step it arrived; each plan records the
arrival step of its pieces in `plan.info.extra["arrival_step"]`.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from collections import deque
from itertools import combinations

import numpy as np

from .cost import CostModel, default_cost
from .docs import validate_ids, validate_lengths
from .pack import get_method, solve_pack
from .plan import PackPlan, imbalance

STATE_VERSION = 2
RELEASE_POLICIES = ("paper", "balance", "group")
_CONFIG_FIELDS = ("n_micro", "max_tokens", "dp", "n_queues", "max_delay", "seed", "max_backlog_tokens", "pp",
                  "method", "release", "balance_tolerance", "cost_fingerprint")
# Calibration: candidate thresholds are the lengths whose modelled cost is these fractions of a
# micro-batch's fair share of a global batch (cost-based, so they follow the model and layout).
_CALIBRATION_FRACTIONS = (0.25, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
_CALIBRATION_QUANTILES = (0.25, 0.5, 0.75)


# ------------------------------------------------------------------ DP refinement (1F1B closed form)
def one_f_one_b_time(costs, pp: int) -> float:
    """Closed-form 1F1B step time of one replica: (sum + (pp - 1) * max) / pp of the
    micro-batches' forward+backward costs (all stages), p2p ignored."""
    costs = np.asarray(costs, dtype=np.float64)
    if costs.size == 0:
        return 0.0
    return float((costs.sum() + (pp - 1) * costs.max()) / pp)


def deal_by_1f1b(loads, dp: int, n_micro: int, pp: int, max_passes: int = 50) -> np.ndarray:
    """Give n_micro micro-batches to each of dp replicas, minimising the largest modelled 1F1B
    replica time (then the sum of replica times). Greedy heaviest-first start, then pairwise
    swaps between replicas until none improves. Deterministic. Returns replica_of.

    A replica's time needs only its sum and its largest load, so a candidate swap is priced
    in O(1) from each replica's sum and two largest loads, and the largest time among the
    other replicas from the three largest replica times.
    """
    loads = np.asarray(loads, dtype=np.float64)
    n = len(loads)
    if dp == 1:
        return np.zeros(n, dtype=np.int64)
    L = loads.tolist()
    k = float(pp - 1)
    members: list[list[int]] = [[] for _ in range(dp)]
    sums = [0.0] * dp
    tops = [0.0] * dp  # largest load of each replica

    def time_of(total: float, top: float) -> float:
        return (total + k * top) / pp

    for j in np.argsort(-loads, kind="stable").tolist():
        best, best_key = -1, None
        for r in range(dp):
            if len(members[r]) >= n_micro:
                continue
            key = (time_of(sums[r] + L[j], max(tops[r], L[j])), r)
            if best_key is None or key < best_key:
                best, best_key = r, key
        members[best].append(j)
        sums[best] += L[j]
        tops[best] = max(tops[best], L[j])

    def top_two(ms: list[int]) -> tuple[float, float, int]:
        """(largest, second largest, position of the largest) of a replica's loads."""
        first, second, pos = -1.0, -1.0, -1
        for i, m in enumerate(ms):
            v = L[m]
            if v > first:
                first, second, pos = v, first, i
            elif v > second:
                second = v
        return first, second, pos

    stats = [top_two(ms) for ms in members]
    times = [time_of(sums[r], stats[r][0]) if members[r] else 0.0 for r in range(dp)]

    def top_after_swap(r: int, i: int, incoming: float) -> float:
        """Largest load of replica r once its i-th micro-batch is replaced by `incoming`."""
        first, second, pos = stats[r]
        rest = second if i == pos else first
        return max(rest, incoming)

    for _ in range(max_passes):
        improved = False
        for ra in range(dp):
            for rb in range(ra + 1, dp):
                # the other replicas' times do not change while ra and rb swap
                others = max((times[r] for r in range(dp) if r != ra and r != rb), default=0.0)
                old_max, old_sum = max(times), sum(times)
                for ia in range(len(members[ra])):
                    for ib in range(len(members[rb])):
                        a, b = members[ra][ia], members[rb][ib]
                        la, lb = L[a], L[b]
                        if la == lb:
                            continue
                        ta = time_of(sums[ra] - la + lb, top_after_swap(ra, ia, lb))
                        tb = time_of(sums[rb] - lb + la, top_after_swap(rb, ib, la))
                        new_max = max(others, ta, tb)
                        new_sum = old_sum - times[ra] - times[rb] + ta + tb
                        if (new_max, new_sum) < (old_max - 1e-15, old_sum) or (
                                new_max <= old_max and new_sum < old_sum - 1e-15):
                            members[ra][ia], members[rb][ib] = b, a
                            sums[ra] += lb - la
                            sums[rb] += la - lb
                            stats[ra], stats[rb] = top_two(members[ra]), top_two(members[rb])
                            times[ra], times[rb] = ta, tb
                            old_max, old_sum = max(times), sum(times)
                            improved = True
        if not improved:
            break
    replica_of = np.empty(n, dtype=np.int64)
    for r, ms in enumerate(members):
        replica_of[ms] = r
    return replica_of


def _cost_fingerprint(cost: CostModel) -> str:
    return hashlib.sha256(json.dumps(cost.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _check_thresholds(thresholds) -> list[int]:
    try:
        values = [v for v in thresholds]
    except TypeError:
        raise ValueError(f"thresholds must be 'auto' or an increasing list of positive token counts, "
                         f"got {thresholds!r}") from None
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer, float)) or v != int(v) or v <= 0:
            raise ValueError(f"thresholds[{i}] must be a positive integer token count, got {v!r}")
        out.append(int(v))
    if any(b <= a for a, b in zip(out, out[1:])):
        raise ValueError(f"thresholds must be strictly increasing, got {out}")
    return out


class WLBPacker:
    """Streaming WLB-LLM packer with multi-level outlier queues (see the module docstring).

    Args:
        n_micro: micro-batches per DP replica (N).
        max_tokens: token cap of one micro-batch, inclusive (S_max).
        cost: the cost model that weighs documents (default: `default_cost()`).
        dp: data-parallel replicas; dp x n_micro micro-batches are packed jointly.
        thresholds: "auto" (calibrate on the first global batch), or increasing positive
            lengths [L1, L2, ...], one queue each (an empty list disables the queues).
        n_queues: number of queues for "auto" / `calibrate` (default 2); with explicit
            thresholds it must be None or len(thresholds).
        max_delay: the most steps a document may wait (>= 1), or None (paper-faithful: a
            queue waits until it holds dp x n_micro documents).
        seed: seeds the calibration's bootstrap stream (planning is otherwise deterministic).
        max_backlog_tokens: carried tokens above which `pack` raises (default 2 x dp x
            n_micro x max_tokens, two steps' capacity).
        pp: pipeline stages for the DP refinement's 1F1B model (default: the cost model's
            ParallelSpec.pp, else 1).
        delay_budget: calibration's limit on delay per token, in steps (default 0.5, paper §3.2).
        method: the `solve_pack` method that packs each step: "wlb" (Algorithm 1, default)
            or any deterministic heuristic that honours `carried` (e.g. "wlb_ls").
        release: "paper" (default: a queue leaves only when full, or at max_delay) or
            "balance" (beyond the paper: also take held outliers, FIFO heads, into a step
            whenever the step's predicted imbalance stays within `balance_tolerance`), or
            "group" (beyond the paper: one pool of outliers; groups of similar ones, or a
            single one, leave as soon as the step stays within `balance_tolerance`, even if
            short documents move to the next step; see the module docstring).
        balance_tolerance: the predicted max / mean load a "balance" or "group" step may reach by
            taking outliers early (>= 1.0; default 1.02). `calibrate` may choose it.
    """

    def __init__(self, n_micro: int, max_tokens: int, cost: CostModel | None = None, dp: int = 1,
                 thresholds="auto", n_queues: int | None = None, max_delay: int | None = 8, seed: int = 0,
                 *, max_backlog_tokens: int | None = None, pp: int | None = None, delay_budget: float = 0.5,
                 method: str = "wlb", release: str = "paper", balance_tolerance: float = 1.02):
        self.n_micro = _check_int("n_micro", n_micro, 1)
        self.max_tokens = _check_int("max_tokens", max_tokens, 1)
        self.dp = _check_int("dp", dp, 1)
        self.cost = cost if cost is not None else default_cost()
        if not isinstance(self.cost, CostModel):
            raise ValueError(f"cost must be a wlb_opt.CostModel, got {type(self.cost).__name__}")
        if max_delay is not None:
            max_delay = _check_int("max_delay", max_delay, 1)
        self.max_delay = max_delay
        self.seed = _check_int("seed", seed, 0)
        cap = 2 * self.dp * self.n_micro * self.max_tokens
        self.max_backlog_tokens = cap if max_backlog_tokens is None else _check_int(
            "max_backlog_tokens", max_backlog_tokens, 0)
        if pp is None:
            pp = int(self.cost.meta.get("parallel", {}).get("pp", 1)) if isinstance(self.cost.meta, dict) else 1
        self.pp = _check_int("pp", pp, 1)
        if not (isinstance(delay_budget, (int, float)) and delay_budget >= 0 and math.isfinite(delay_budget)):
            raise ValueError(f"delay_budget must be a finite number of steps >= 0, got {delay_budget!r}")
        self.delay_budget = float(delay_budget)
        if not isinstance(method, str):
            raise ValueError(f"method must be a solve_pack method name, got {method!r}")
        get_method(method)  # ValueError naming the valid methods
        if method == "original":
            # Plain-4D cuts documents at sequence boundaries; the packer tracks whole pieces
            # (queues, carry, arrival steps), so it only runs methods that keep pieces whole.
            raise ValueError("WLBPacker cannot run method='original' (it cuts documents at sequence "
                             "boundaries); use solve_pack(..., method='original') per global batch, or a "
                             "method that keeps pieces whole: 'wlb', 'wlb_ls', 'fixed', 'cpsat', 'milp'")
        self.method = method
        if release not in RELEASE_POLICIES:
            raise ValueError(f"release must be one of {RELEASE_POLICIES}, got {release!r}")
        self.release = release
        if not (isinstance(balance_tolerance, (int, float)) and not isinstance(balance_tolerance, bool)
                and math.isfinite(balance_tolerance) and balance_tolerance >= 1.0):
            raise ValueError(f"balance_tolerance must be a finite imbalance >= 1.0 (max / mean), "
                             f"got {balance_tolerance!r}")
        self.balance_tolerance = float(balance_tolerance)
        if isinstance(thresholds, str):
            if thresholds != "auto":
                raise ValueError(f"thresholds must be 'auto' or an increasing list of positive lengths, got {thresholds!r}")
            self.n_queues = 2 if n_queues is None else _check_int("n_queues", n_queues, 1)
            self.thresholds: list[int] | None = None
        else:
            self.thresholds = _check_thresholds(thresholds)
            if n_queues is not None and n_queues != len(self.thresholds):
                raise ValueError(f"n_queues={n_queues!r} does not match the {len(self.thresholds)} thresholds "
                                 f"{self.thresholds}; pass n_queues=None or {len(self.thresholds)}")
            self.n_queues = len(self.thresholds)
        self._auto = self.thresholds is None
        self._fingerprint = _cost_fingerprint(self.cost)
        self._reset_stream()

    # ------------------------------------------------------------------ state
    def _reset_stream(self) -> None:
        # A held piece is [id, offset, length, arrival_step].
        self._queues: list[deque] = [deque() for _ in range(self.n_queues)]
        self._carry: list[list[int]] = []
        self._held: set[tuple[int, int]] = set()
        self._step = 0
        self._next_auto_id = 0
        self._calibration: dict | None = None
        self._imb: list[float] = []
        self._acc = dict(pieces=0, tokens=0, delay_sum=0, delay_token_sum=0, delayed_tokens=0, delay_max=0,
                         queue_wait_max=0, late_pieces=0)

    @property
    def step(self) -> int:
        """Index of the next plan `pack` or `drain` will emit."""
        return self._step

    @property
    def capacity_tokens(self) -> int:
        return self.dp * self.n_micro * self.max_tokens

    def _config(self) -> dict:
        return dict(n_micro=self.n_micro, max_tokens=self.max_tokens, dp=self.dp, n_queues=self.n_queues,
                    max_delay=self.max_delay, seed=self.seed, max_backlog_tokens=self.max_backlog_tokens,
                    pp=self.pp, method=self.method, release=self.release,
                    balance_tolerance=self.balance_tolerance, cost_fingerprint=self._fingerprint)

    def queued_ids(self) -> np.ndarray:
        """Ids of the pieces held in outlier queues (neither placed nor deferred), queue by
        queue, FIFO order inside each."""
        return np.array([e[0] for q in self._queues for e in q], dtype=np.int64)

    def carried_ids(self) -> np.ndarray:
        """Ids of the pieces deferred by the last plan (placed first in the next)."""
        return np.array([e[0] for e in self._carry], dtype=np.int64)

    # ------------------------------------------------------------------ input
    def _validate_batch(self, lengths, ids, offsets):
        lengths = validate_lengths(lengths)
        n = len(lengths)
        if ids is None:
            ids = np.arange(self._next_auto_id, self._next_auto_id + n, dtype=np.int64)
        else:
            ids = validate_ids(ids, n)
        offsets = np.zeros(n, np.int64) if offsets is None else validate_ids(offsets, n, "offsets")
        if n and np.any(offsets < 0):
            raise ValueError(f"offsets must be >= 0, got {int(offsets.min())}")
        if n and lengths.max() > self.max_tokens:
            i = int(np.argmax(lengths))
            raise ValueError(f"document {int(ids[i])} (position {i}) has {int(lengths[i])} tokens > "
                             f"max_tokens={self.max_tokens}; cut documents with wlb_opt.split_documents first")
        if n > 1:
            order = np.lexsort((offsets, ids))
            same = (ids[order][1:] == ids[order][:-1]) & (offsets[order][1:] == offsets[order][:-1])
            if same.any():
                k = int(order[1:][np.argmax(same)])
                hint = "" if np.any(offsets) else " (pieces of one document need distinct offsets)"
                raise ValueError(f"ids: id {int(ids[k])} with offset {int(offsets[k])} is repeated within the "
                                 f"batch (position {k}){hint}")
        if self._held:
            for k, key in enumerate(zip(ids.tolist(), offsets.tolist())):
                if key in self._held:
                    raise ValueError(f"ids: id {key[0]} (offset {key[1]}, position {k}) is already held by the "
                                     "packer (queued or carried from an earlier step)")
        return lengths, ids, offsets

    # ------------------------------------------------------------------ one step
    def _queue_of(self, length: int) -> int:
        """Queue index for an outlier, -1 for a regular document."""
        th = self.thresholds
        i = -1
        for k, limit in enumerate(th):
            if length >= limit:
                i = k
            else:
                break
        return i

    def _plan_step(self, entries: list[list[int]], queues: list[deque], carry: list[list[int]],
                   step: int, release_all: bool):
        """Queue the outliers of `entries`, release, and pack. Mutates only the given queues
        (copies); returns (plan, new_carry, released_count)."""
        fresh = []
        for e in entries:
            q = self._queue_of(e[2])
            (queues[q].append(e) if q >= 0 else fresh.append(e))
        need = self.dp * self.n_micro
        if self.release == "group" and not release_all:
            return self._plan_group(fresh, queues, carry, step)
        released: list[list[int]] = []
        for qi, q in enumerate(queues):
            if release_all:
                released.extend(q)
                q.clear()
                continue
            if len(q) >= need:  # paper §3.2: exactly dp x n_micro, FIFO, once per step
                released.extend(q.popleft() for _ in range(need))
            elif q and self.max_delay is not None and step - q[0][3] >= self.max_delay:
                # Forced release of a queue that did not fill: top it up to one outlier per
                # micro-batch with the FIFO heads of the nearest other levels, so that no
                # micro-batch is left without one (they are the most alike documents held).
                group = [q.popleft() for _ in range(len(q))]
                for k in sorted(range(len(queues)), key=lambda k: (abs(k - qi), k)):
                    while k != qi and queues[k] and len(group) < need:
                        group.append(queues[k].popleft())
                released.extend(group)
            if self.max_delay is not None:  # anything still at its deadline goes too
                while q and step - q[0][3] >= self.max_delay:
                    released.append(q.popleft())
        if self.max_delay is not None:
            due = [e for e in carry + released if step - e[3] >= self.max_delay]
            due.sort(key=lambda e: -e[2])  # stable: longest first among the due ones
            due_keys = {(e[0], e[1]) for e in due}
            first = due + [e for e in carry if (e[0], e[1]) not in due_keys]
            rest = [e for e in released if (e[0], e[1]) not in due_keys] + fresh
        else:
            first, rest = list(carry), released + fresh
        pending, plan, p_arr = self._solve(first, rest)
        n_early = 0
        if self.release == "balance" and not release_all and any(queues):
            pending, plan, p_arr, early = self._release_early(first, rest, queues, pending, plan, p_arr)
            released.extend(early)
            n_early = len(early)
        if self.dp > 1:
            plan.replica_of = deal_by_1f1b(plan.loads, self.dp, self.n_micro, self.pp)
        plan.step = step
        plan.info.extra.update(arrival_step=p_arr.tolist(), released=len(released), released_early=n_early,
                               carried_in=len(carry), thresholds=list(self.thresholds or []),
                               queue_wait_max=max((step - e[3] for e in released), default=0))
        new_carry = [pending[i] for i in plan.deferred.tolist()]
        return plan, new_carry, len(released)

    def _group_split(self, carry: list, released: list, fresh: list, step: int):
        """(first, rest) for release="group": due pieces (carried or released) first, longest
        first, then the other carried pieces; the released outliers and fresh documents after."""
        if self.max_delay is None:
            return list(carry), released + fresh
        due = [e for e in carry + released if step - e[3] >= self.max_delay]
        due.sort(key=lambda e: -e[2])
        due_keys = {(e[0], e[1]) for e in due}
        first = due + [e for e in carry if (e[0], e[1]) not in due_keys]
        return first, [e for e in released if (e[0], e[1]) not in due_keys] + fresh

    def _plan_group(self, fresh: list, queues: list[deque], carry: list, step: int):
        """release="group" (beyond the paper, opt-in): all held outliers form one pool. The
        pool's pieces at max_delay leave; then, greedily, the step takes a group of held
        outliers adjacent in (length, arrival) order (1 to dp x n_micro of them: a single
        outlier that short documents can balance, or several of similar cost) whenever the
        packed step's predicted imbalance stays within max(balance_tolerance, the imbalance
        without them) and no more tokens are deferred. Among admissible groups the one with
        the most tokens wins (ties: lower imbalance, then the earliest arrival); repeats until
        none is admissible. Mutates `queues`; returns (plan, new_carry, released_count)."""
        need = self.dp * self.n_micro
        pool = sorted((e for q in queues for e in q), key=lambda e: e[3])  # stable: FIFO among equals
        if self.max_delay is not None:
            released = [e for e in pool if step - e[3] >= self.max_delay]
        else:
            released = []
        taken = {(e[0], e[1]) for e in released}
        n_forced = len(released)
        first, rest = self._group_split(carry, released, fresh, step)
        pending, plan, p_arr = self._solve(first, rest)
        base_def = self._deferred_tokens(plan)
        while True:
            remaining = sorted((e for e in pool if (e[0], e[1]) not in taken), key=lambda e: (e[2], e[3]))
            if not remaining:
                break
            limit = max(self.balance_tolerance, plan.imbalance) + 1e-12
            best = None
            for k in range(1, min(need, len(remaining)) + 1):
                for i in range(len(remaining) - k + 1):
                    group = remaining[i:i + k]
                    t_first, t_rest = self._group_split(carry, released + group, fresh, step)
                    t_pending, t_plan, t_arr = self._solve(t_first, t_rest)
                    tokens = sum(e[2] for e in group)
                    t_def = self._deferred_tokens(t_plan)
                    if (t_plan.imbalance > limit or t_def - base_def >= tokens
                            or t_def > self.max_backlog_tokens // 2):
                        continue
                    key = (-tokens, t_plan.imbalance, min(e[3] for e in group), i)
                    if best is None or key < best[0]:
                        best = (key, group, t_pending, t_plan, t_arr)
            if best is None:
                break
            _, group, pending, plan, p_arr = best
            base_def = self._deferred_tokens(plan)
            released = released + group
            taken |= {(e[0], e[1]) for e in group}
        for q in queues:  # keep each queue's FIFO order for what stays
            kept = [e for e in q if (e[0], e[1]) not in taken]
            q.clear()
            q.extend(kept)
        if self.dp > 1:
            plan.replica_of = deal_by_1f1b(plan.loads, self.dp, self.n_micro, self.pp)
        plan.step = step
        plan.info.extra.update(arrival_step=p_arr.tolist(), released=len(released),
                               released_early=len(released) - n_forced, carried_in=len(carry),
                               thresholds=list(self.thresholds or []),
                               queue_wait_max=max((step - e[3] for e in released), default=0))
        new_carry = [pending[i] for i in plan.deferred.tolist()]
        return plan, new_carry, len(released)

    def _solve(self, first: list, rest: list):
        """Pack `first` (placed first) then `rest`; returns (pending, plan, arrival steps)."""
        pending = first + rest
        if pending:
            arr = np.array(pending, dtype=np.int64)
            p_ids, p_off, p_len, p_arr = arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3]
        else:
            p_ids = p_off = p_len = p_arr = np.zeros(0, dtype=np.int64)
        plan = solve_pack(p_len, self.n_micro, self.max_tokens, self.cost, self.method, ids=p_ids, offsets=p_off,
                          dp=self.dp, carried=len(first), seed=self.seed)
        return pending, plan, p_arr

    @staticmethod
    def _deferred_tokens(plan: PackPlan) -> int:
        return int(plan.lengths[plan.deferred].sum()) if len(plan.deferred) else 0

    def _early_candidates(self, queues: list[deque]) -> list[list[tuple[int, int]]]:
        """FIFO-respecting groups of held outliers a step may take early, as [(queue, count)]:
        the head of each queue, each whole queue, and each queue topped up to one outlier per
        micro-batch with the heads of the nearest levels (the most alike documents held)."""
        need = self.dp * self.n_micro
        out: list[list[tuple[int, int]]] = []
        for qi, q in enumerate(queues):
            if not q:
                continue
            out.append([(qi, 1)])
            if 1 < len(q) <= need:
                out.append([(qi, len(q))])
            if len(q) < need:
                group, room = [(qi, len(q))], need - len(q)
                for k in sorted(range(len(queues)), key=lambda k: (abs(k - qi), k)):
                    if k != qi and queues[k] and room:
                        take = min(room, len(queues[k]))
                        group.append((k, take))
                        room -= take
                if len(group) > 1:
                    out.append(group)
        seen, uniq = set(), []
        for g in out:
            key = tuple(sorted(g))
            if key not in seen:
                seen.add(key)
                uniq.append(g)
        return uniq

    def _release_early(self, first, rest, queues, pending, plan, p_arr):
        """release="balance": take held outliers (queue heads, FIFO) into this step while the
        step's predicted imbalance (max / mean of the packed loads) stays within
        max(balance_tolerance, the imbalance without them) and nothing more is deferred.
        Among admissible groups the one with the lowest imbalance wins (ties: more tokens,
        lower queue). Repeats until no group is admissible."""
        early: list[list[int]] = []
        base_def = self._deferred_tokens(plan)
        for _ in range(self.dp * self.n_micro + len(queues)):
            limit = max(self.balance_tolerance, plan.imbalance) + 1e-12
            best = None
            for group in self._early_candidates(queues):
                entries = [queues[qi][j] for qi, k in group for j in range(k)]
                t_pending, t_plan, t_arr = self._solve(first, rest + early + entries)
                tokens = sum(e[2] for e in entries)
                if t_plan.imbalance > limit or self._deferred_tokens(t_plan) > base_def:
                    continue
                key = (t_plan.imbalance, -tokens, sorted(group))
                if best is None or key < best[0]:
                    best = (key, group, entries, t_pending, t_plan, t_arr)
            if best is None:
                break
            _, group, entries, pending, plan, p_arr = best
            base_def = self._deferred_tokens(plan)
            for qi, k in group:
                for _ in range(k):
                    queues[qi].popleft()
            early.extend(entries)
        return pending, plan, p_arr, early

    def _commit(self, plan: PackPlan, queues, carry) -> None:
        self._queues, self._carry = queues, carry
        self._held = {(e[0], e[1]) for q in queues for e in q} | {(e[0], e[1]) for e in carry}
        self._step += 1
        arrival = np.asarray(plan.info.extra["arrival_step"], dtype=np.int64)
        if plan.micro_batches:
            placed = np.concatenate(plan.micro_batches)
        else:
            placed = np.zeros(0, dtype=np.int64)
        if placed.size:
            delay = plan.step - arrival[placed]
            toks = plan.lengths[placed]
            a = self._acc
            a["pieces"] += int(placed.size)
            a["tokens"] += int(toks.sum())
            a["delay_sum"] += int(delay.sum())
            a["delay_token_sum"] += int((delay * toks).sum())
            a["delayed_tokens"] += int(toks[delay > 0].sum())
            a["delay_max"] = max(a["delay_max"], int(delay.max()))
            if self.max_delay is not None:
                a["late_pieces"] += int(np.sum(delay > self.max_delay))
        self._acc["queue_wait_max"] = max(self._acc["queue_wait_max"], int(plan.info.extra["queue_wait_max"]))
        self._imb.append(float(plan.imbalance))

    def pack(self, lengths, ids=None, offsets=None) -> PackPlan:
        """Pack one global batch; returns the step's PackPlan.

        `lengths` are pieces no longer than max_tokens (see `split_documents`), `ids` their
        document ids (default: consecutive ids continuing across calls), `offsets` the start
        of each piece in its document (default 0; needed when pieces share an id).
        `plan.doc_ids` holds everything placed or deferred this step, including documents
        released from queues and carried from earlier steps. Raises ValueError (state
        unchanged) if the carried backlog exceeds `max_backlog_tokens`.
        """
        t0 = time.perf_counter()
        lengths, ids, offsets = self._validate_batch(lengths, ids, offsets)
        before = None
        if self._auto and self.thresholds is None and len(lengths):
            before = (self.thresholds, self.n_queues, self._queues, self._calibration)
            self.calibrate(lengths)  # on the first non-empty global batch
        step = self._step
        entries = [list(e) for e in zip(ids.tolist(), offsets.tolist(), lengths.tolist(), [step] * len(lengths))]
        queues = [deque(q) for q in self._queues]
        plan, carry, _ = self._plan_step(entries, queues, list(self._carry), step, release_all=False)
        backlog = sum(e[2] for e in carry)
        if backlog > self.max_backlog_tokens:
            if before is not None:  # leave the state exactly as it was, calibration included
                self.thresholds, self.n_queues, self._queues, self._calibration = before
            raise ValueError(
                f"overload at step {step}: {backlog} tokens would be carried, more than max_backlog_tokens="
                f"{self.max_backlog_tokens}; the stream brings more tokens per step than {self.dp} x "
                f"{self.n_micro} micro-batches of max_tokens={self.max_tokens} can hold. Use a larger max_tokens "
                "or fewer tokens per global batch (or raise max_backlog_tokens)")
        if ids is not None and len(ids):
            self._next_auto_id = max(self._next_auto_id, int(ids.max()) + 1)
        self._commit(plan, queues, carry)
        plan.info.wall_s = time.perf_counter() - t0
        return plan

    def drain(self) -> list[PackPlan]:
        """End of data: release every queue and emit plans until nothing is held."""
        plans = []
        while self._carry or any(self._queues):
            queues = [deque(q) for q in self._queues]
            plan, carry, _ = self._plan_step([], queues, list(self._carry), self._step, release_all=True)
            self._commit(plan, queues, carry)
            plans.append(plan)
        return plans

    # ------------------------------------------------------------------ statistics
    def stats(self) -> dict:
        """Delay and balance of the stream so far (steps emitted by pack and drain).

        Delays count placed pieces (a piece is a document or a window-sized part of one);
        undelayed pieces count as 0. Imbalance is max/mean of each plan's loads.
        `queue_wait_max` (steps from arrival to release from a queue) never exceeds
        max_delay; `late_pieces` counts pieces placed later than max_delay, which happens
        only when the pieces at their deadline do not fit in one step (a burst beyond
        capacity: they are placed first, but a full step defers them).
        """
        a = self._acc
        imb = np.asarray(self._imb, dtype=np.float64)
        pct = (lambda q: float(np.percentile(imb, q))) if imb.size else (lambda q: 1.0)
        return dict(
            steps=self._step, placed_pieces=a["pieces"], placed_tokens=a["tokens"],
            delay_mean_per_doc=a["delay_sum"] / a["pieces"] if a["pieces"] else 0.0,
            delay_max=a["delay_max"], queue_wait_max=a["queue_wait_max"], late_pieces=a["late_pieces"],
            delay_per_token=a["delay_token_sum"] / a["tokens"] if a["tokens"] else 0.0,
            delayed_token_share=a["delayed_tokens"] / a["tokens"] if a["tokens"] else 0.0,
            imbalance_mean=float(imb.mean()) if imb.size else 1.0, imbalance_p50=pct(50),
            imbalance_p90=pct(90), imbalance_max=float(imb.max()) if imb.size else 1.0,
            queued_pieces=sum(len(q) for q in self._queues),
            queued_tokens=sum(e[2] for q in self._queues for e in q),
            carried_pieces=len(self._carry), carried_tokens=sum(e[2] for e in self._carry),
            thresholds=None if self.thresholds is None else list(self.thresholds),
        )

    # ------------------------------------------------------------------ calibration
    def candidate_thresholds(self, sample, tokens_per_batch: int) -> list[int]:
        """Candidate thresholds, from the cost model and from the data:

        - lengths whose modelled cost is a fraction (_CALIBRATION_FRACTIONS) of one
          micro-batch's fair share of a global batch of `tokens_per_batch` sample tokens;
        - quantiles (_CALIBRATION_QUANTILES) of the sample's outlier lengths (pieces costing
          at least the smallest fraction), so that levels split the outliers actually seen.

        Candidates within 5% of a shorter one are merged (the shorter is kept)."""
        sample = np.asarray(sample, dtype=np.int64)
        per_token = float(self.cost.doc_cost(sample).sum() / sample.sum())
        fair = tokens_per_batch * per_token / (self.dp * self.n_micro)
        grid = np.arange(1, self.max_tokens + 1, dtype=np.int64)
        cum = self.cost.doc_cost(grid)
        raw = []
        for f in _CALIBRATION_FRACTIONS:
            k = int(np.searchsorted(cum, f * fair))
            if k < self.max_tokens:
                raw.append(int(grid[k]))
        if raw:
            outliers = np.sort(sample[sample >= raw[0]])
            if len(outliers) >= 2:
                for q in _CALIBRATION_QUANTILES:
                    raw.append(int(outliers[min(len(outliers) - 1, int(q * len(outliers)))]))
        out: list[int] = []
        for v in sorted(set(raw)):
            if not out or v > 1.05 * out[-1]:
                out.append(v)
        return out

    def calibrate(self, sample_lengths, tokens_per_batch: int | None = None, n_batches: int = 32) -> list[int]:
        """Choose n_queues thresholds by running this packer on a bootstrap stream.

        The stream is `n_batches` global batches of `tokens_per_batch` tokens (default: the
        sample's tokens, capped at dp x n_micro x max_tokens / 1.25) resampled from the sample
        with this packer's seed. Every increasing n_queues-subset of `candidate_thresholds` is
        run (same max_delay, then drained); the choice minimises mean imbalance among
        candidates whose delay per token is within `delay_budget` (ties within 0.002: less
        delay), else the least delay. Resets the stream; call before the first `pack`.
        Returns the thresholds (also recorded in `state_dict()`).
        """
        if self._step and (self._acc["pieces"] or self._held or self.thresholds is not None):
            raise ValueError(f"calibrate must be called before the first step; this packer is at step {self._step}")
        sample = validate_lengths(sample_lengths, "sample_lengths")
        if not len(sample):
            raise ValueError("sample_lengths is empty; calibration needs at least one document")
        if sample.max() > self.max_tokens:
            raise ValueError(f"sample_lengths holds {int(sample.max())} tokens > max_tokens={self.max_tokens}; "
                             "cut documents with wlb_opt.split_documents first")
        if self.n_queues == 0:
            self.thresholds = []
            return []
        n_batches = _check_int("n_batches", n_batches, 1)
        if tokens_per_batch is None:
            tokens_per_batch = min(int(sample.sum()), int(self.capacity_tokens / 1.25))
        tokens_per_batch = _check_int("tokens_per_batch", tokens_per_batch, 1)
        t0 = time.perf_counter()
        rng = np.random.default_rng(self.seed)
        mean_len = float(sample.mean())
        draw = rng.choice(sample, size=int(1.3 * n_batches * tokens_per_batch / mean_len) + 16, replace=True)
        while draw.sum() < n_batches * tokens_per_batch:
            draw = np.concatenate([draw, rng.choice(sample, size=len(draw) // 2 + 16, replace=True)])
        which = np.concatenate([[0], np.cumsum(draw)[:-1]]) // tokens_per_batch
        batches = [draw[which == b] for b in range(n_batches)]
        grid = self.candidate_thresholds(sample, tokens_per_batch)
        n_q = min(self.n_queues, len(grid))
        results = []
        for cand in combinations(grid, n_q):
            trial = WLBPacker(self.n_micro, self.max_tokens, self.cost, self.dp, list(cand), max_delay=self.max_delay,
                              seed=self.seed, max_backlog_tokens=self.max_backlog_tokens, pp=self.pp,
                              method=self.method, release=self.release, balance_tolerance=self.balance_tolerance)
            try:
                imbs = [trial.pack(b).imbalance for b in batches]
            except ValueError:
                continue  # overload under this candidate: not a choice
            trial.drain()
            st = trial.stats()
            results.append(dict(thresholds=list(cand), imbalance=float(np.mean(imbs)),
                                delay_per_token=st["delay_per_token"]))
        if not results:
            raise ValueError("calibration failed: every candidate overloaded the packer on the sample; "
                             "use a larger max_tokens or fewer tokens per global batch")
        ok = [r for r in results if r["delay_per_token"] <= self.delay_budget]
        if ok:
            best_imb = min(r["imbalance"] for r in ok)
            near = [r for r in ok if r["imbalance"] <= best_imb + 0.002]
            best = min(near, key=lambda r: (r["delay_per_token"], r["imbalance"]))
        else:
            best = min(results, key=lambda r: (r["delay_per_token"], r["imbalance"]))
        chosen = [int(x) for x in best["thresholds"]]
        self.thresholds = chosen
        self.n_queues = len(chosen)
        self._queues = [deque() for _ in range(self.n_queues)]
        self._calibration = dict(thresholds=chosen, candidates=results, sample_pieces=int(len(sample)),
                                 tokens_per_batch=tokens_per_batch, n_batches=n_batches,
                                 delay_budget=self.delay_budget, seconds=time.perf_counter() - t0)
        return list(chosen)

    @property
    def calibration(self) -> dict | None:
        """What `calibrate` measured (candidates with imbalance and delay), or None."""
        return self._calibration

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """JSON-serialisable state; `load_state_dict` on an equally configured packer resumes
        the stream exactly. Does not hold ids already emitted (see the module docstring)."""
        return dict(
            version=STATE_VERSION, config=self._config(), auto=self._auto,
            thresholds=None if self.thresholds is None else list(self.thresholds),
            step=self._step, next_auto_id=self._next_auto_id,
            queues=[[list(e) for e in q] for q in self._queues], carry=[list(e) for e in self._carry],
            calibration=self._calibration, imbalance=list(self._imb), accumulators=dict(self._acc),
        )

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict()`. Raises ValueError naming the field if the state comes from
        another format version or a packer configured differently."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"state version {got!r} is not supported; expected {STATE_VERSION}")
        config = state.get("config", {})
        mine = self._config()
        for name in _CONFIG_FIELDS:
            if name == "n_queues" and self._auto and self.thresholds is None:
                continue  # an uncalibrated "auto" packer adopts the state's thresholds
            if config.get(name) != mine[name]:
                raise ValueError(f"state_dict field config.{name}={config.get(name)!r} does not match this "
                                 f"packer's {name}={mine[name]!r}; build the packer with the same configuration")
        thresholds = state.get("thresholds")
        if not self._auto and thresholds != self.thresholds:
            raise ValueError(f"state_dict field thresholds={thresholds!r} does not match this packer's "
                             f"thresholds={self.thresholds!r}")
        if self._auto and state.get("auto") is False:
            raise ValueError("state_dict field auto=False: the state has explicit thresholds "
                             f"{thresholds!r}; build the packer with thresholds={thresholds!r}")
        try:
            self.thresholds = None if thresholds is None else _check_thresholds(thresholds)
            if self.thresholds is not None:
                self.n_queues = len(self.thresholds)
            queues = [deque([int(x) for x in e] for e in q) for q in state["queues"]]
            carry = [[int(x) for x in e] for e in state["carry"]]
            if len(queues) != self.n_queues or any(len(e) != 4 for q in queues for e in q) or any(
                    len(e) != 4 for e in carry):
                raise ValueError("queues/carry have the wrong shape")
            acc = {k: int(state["accumulators"][k]) for k in self._acc}
            step, next_id = int(state["step"]), int(state["next_auto_id"])
            imb = [float(x) for x in state["imbalance"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"state_dict is malformed: {exc}") from None
        self._queues, self._carry, self._acc, self._step, self._next_auto_id = queues, carry, acc, step, next_id
        self._imb = imb
        self._calibration = state.get("calibration")
        self._held = {(e[0], e[1]) for q in queues for e in q} | {(e[0], e[1]) for e in carry}

    def __repr__(self) -> str:
        return (f"WLBPacker(n_micro={self.n_micro}, max_tokens={self.max_tokens}, dp={self.dp}, "
                f"thresholds={self.thresholds if self.thresholds is not None else 'auto'}, "
                f"max_delay={self.max_delay}, step={self._step})")


def per_step_imbalance(plan: PackPlan, cost: CostModel, phase: str = "fwd") -> float:
    """max/mean over the plan's micro-batches of `cost.micro_batch_cost(..., phase)` (Table 2 uses "fwd")."""
    return imbalance([cost.micro_batch_cost(plan.lengths[mb], phase) for mb in plan.micro_batches])
