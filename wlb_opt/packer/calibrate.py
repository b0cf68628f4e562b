"""Choosing a packer's outlier thresholds from data (`WLBPacker.calibrate`).

The paper chose the queue thresholds by hand, offline (§3.2). Here they are chosen by
running the packer itself (same release policy, max_delay and layout) on a bootstrap
stream resampled from a sample of document lengths, for every increasing n_queues-subset
of the candidates:

- from the cost model: the lengths whose modelled cost is a fraction
  (CALIBRATION_FRACTIONS) of one micro-batch's fair share of a global batch, so they follow
  the model and the layout;
- from the data: quantiles (CALIBRATION_QUANTILES) of the sample's outlier lengths, so that
  levels split the outliers actually seen.

The choice minimises mean imbalance among the candidates whose displacement per token (the
record's `delay_per_token`: mean |training step - arrival step|, token-weighted; without
lookahead the mean delay) is within the packer's `delay_budget` (ties within 0.002: less
displacement), else the least displacement. `thresholds="auto"` calibrates on the first
non-empty global batch. The bootstrap draws from the sample by position with the packer's
seed, so the same lengths in another order can give other thresholds.

Work. Two candidate sets that put every length of the bootstrap stream in the same queue
plan the same stream, so each such class is run once (`_signature`; with release="group"
or "marginal" the queues only store one pool, so only the first threshold counts). The
runs are bounded by a work budget (`CALIBRATION_BUDGET`, counted in solver calls, not in
seconds, so that every process and rank chooses the same thresholds). While running every
class to the end fits the budget, that is what happens, and the choice is the one of
running every candidate. Otherwise the classes race: they advance together, and at
checkpoints (after 1, 2, 4, ... planned steps) the worse half is dropped, ranked by the same
rule on the steps planned so far (`_Trial.estimate`), until the survivors' runs fit; if the
budget runs out first, the choice is made among the survivors on what they planned (each
candidate's `batches` in the record says how far it ran; one that planned no step is not a
choice).
"""
from __future__ import annotations

import math
import time
from itertools import combinations
from typing import TYPE_CHECKING

import numpy as np

from .._validate import check_int, check_positive_real, validate_lengths
from ..cost import CostModel

if TYPE_CHECKING:
    from .packer import WLBPacker

CALIBRATION_FRACTIONS = (0.25, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
"""Candidate costs, as fractions of a micro-batch's fair share of a global batch."""
CALIBRATION_QUANTILES = (0.25, 0.5, 0.75)
"""Candidate quantiles of the sample's outlier lengths."""
# Candidates with mean imbalances this close count as equally balanced (then: less delay).
_IMBALANCE_TIE = 0.002
# Candidates within this ratio of a shorter one are merged into it.
_MERGE_RATIO = 1.05
CALIBRATION_BUDGET = 1500.0
"""Default work budget of a calibration, in units of `WORK_PIECES`: about 0.5 ms of CPU each
on a loaded 2-core x86 host, so under a second in all."""
WORK_PIECES = 128
"""Calibration work: a solver call (one candidate packing of one step, the release policy's
bookkeeping around it included) on n pieces counts 1 + n / WORK_PIECES units (its CPU time
is about a fixed part plus one proportional to the pieces; they are equal near 400)."""
# A run's work per step grows as its queues fill: its projection from the steps so far is
# taken this much larger when deciding whether every run can finish.
_PROJECTION_MARGIN = 1.25
# Release policies whose queues only store one pool of outliers (release.py): their plans
# depend on which pieces are outliers (length >= the first threshold), not on the levels.
_POOLED = ("group", "marginal")


def candidate_thresholds(cost: CostModel, sample, tokens_per_batch: int, n_micro_batches: int,
                         max_tokens: int) -> list[int]:
    """Candidate thresholds (token counts), from the cost model and from the data (see the
    module docstring), for global batches of `tokens_per_batch` sample tokens packed into
    `n_micro_batches` (dp x n_micro) micro-batches of `max_tokens`. Candidates within 5% of
    a shorter one are merged (the shorter is kept)."""
    sample = np.asarray(sample, dtype=np.int64)
    per_token = float(cost.doc_cost(sample).sum() / sample.sum())
    fair = tokens_per_batch * per_token / n_micro_batches
    raw = []
    for fraction in CALIBRATION_FRACTIONS:
        length = _shortest_costing(cost, fraction * fair, max_tokens)
        if length is not None:
            raw.append(length)
    if raw:
        outliers = np.sort(sample[sample >= raw[0]])
        if len(outliers) >= 2:
            for q in CALIBRATION_QUANTILES:
                raw.append(int(outliers[min(len(outliers) - 1, int(q * len(outliers)))]))
    out: list[int] = []
    for v in sorted(set(raw)):
        if not out or v > _MERGE_RATIO * out[-1]:
            out.append(v)
    return out


def _shortest_costing(cost: CostModel, seconds: float, max_tokens: int) -> int | None:
    """The shortest length in [1, max_tokens] whose `doc_cost` is >= `seconds`, or None. A
    bisection (doc_cost does not decrease with length, in floating point too: every term
    does not), so that a huge max_tokens costs no table of every length."""
    if float(cost.doc_cost(max_tokens)[0]) < seconds:
        return None
    low, high = 0, max_tokens  # doc_cost(high) >= seconds; low is below every answer
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if float(cost.doc_cost(mid)[0]) >= seconds else (mid, high)
    return high


def bootstrap_batches(sample: np.ndarray, tokens_per_batch: int, n_batches: int, seed: int) -> list[np.ndarray]:
    """`n_batches` global batches of about `tokens_per_batch` tokens drawn with replacement
    from `sample` (a document belongs to the batch in which it starts)."""
    rng = np.random.default_rng(seed)
    mean_len = float(sample.mean())
    draw = rng.choice(sample, size=int(1.3 * n_batches * tokens_per_batch / mean_len) + 16, replace=True)
    while draw.sum() < n_batches * tokens_per_batch:
        draw = np.concatenate([draw, rng.choice(sample, size=len(draw) // 2 + 16, replace=True)])
    which = np.concatenate([[0], np.cumsum(draw)[:-1]]) // tokens_per_batch
    return [draw[which == b] for b in range(n_batches)]


def _choose(results: list[dict], delay_budget: float) -> dict:
    ok = [r for r in results if r["delay_per_token"] <= delay_budget]
    if not ok:
        return min(results, key=lambda r: (r["delay_per_token"], r["imbalance"]))
    best_imbalance = min(r["imbalance"] for r in ok)
    near = [r for r in ok if r["imbalance"] <= best_imbalance + _IMBALANCE_TIE]
    return min(near, key=lambda r: (r["delay_per_token"], r["imbalance"]))


def _rank(results: list[dict], delay_budget: float) -> list[dict]:
    """`results` best first by `_choose` applied again to what is left."""
    left, ranked = list(results), []
    while left:
        best = _choose(left, delay_budget)
        ranked.append(best)
        left = [r for r in left if r is not best]
    return ranked


def _signature(thresholds, lengths: np.ndarray, release: str) -> tuple:
    """What the packer's plans of a stream of `lengths` depend on in `thresholds`: the queue
    of every distinct length (with a pooled release policy, only whether it is an outlier)."""
    if release in _POOLED:
        return tuple((lengths >= thresholds[0]).tolist())
    return tuple(np.searchsorted(np.asarray(thresholds), lengths, side="right").tolist())


class _Meter:
    """Calibration work so far: solver calls, a call on n pieces as 1 + n / WORK_PIECES."""

    def __init__(self) -> None:
        self.work = 0.0


class _Metered:
    """A packer's solve callback that adds its calls to a `_Meter` (a class, not a closure,
    so that a deep copy of the packer solves with the copy and counts on the same meter)."""

    def __init__(self, solve, meter: _Meter):
        self.solve, self.meter = solve, meter

    def __call__(self, first, rest):
        self.meter.work += 1.0 + (len(first) + len(rest)) / WORK_PIECES
        return self.solve(first, rest)

    def account(self, n_candidates: int, n_pieces: int) -> None:
        """Count candidates a release policy scored together (`FillTrial.with_groups`), each
        of about n_pieces pieces, as that many calls."""
        self.meter.work += n_candidates * (1.0 + n_pieces / WORK_PIECES)


class _Trial:
    """One class of candidates: its packer on the bootstrap stream, advanced a batch at a time."""

    def __init__(self, packer: WLBPacker, thresholds: list[int], meter: _Meter):
        self.thresholds = thresholds
        self.packer = packer._trial(thresholds)
        # every step of the trial packs through `_solve` (release.py's callback): count it
        self.packer._solve = _Metered(self.packer._solve, meter)
        self.meter = meter
        self.plans: list = []
        self.work = 0.0
        self.failed = False
        self.result: dict | None = None

    @property
    def steps(self) -> int:
        """Steps planned by `pack` so far (with lookahead K, K fewer than the batches)."""
        return sum(plan is not None for plan in self.plans)

    def advance(self, batches: list[np.ndarray], n: int, work_limit: float = math.inf) -> None:
        """Pack batches up to `n`, or until the meter reaches `work_limit` (a ValueError, an
        overload, ends the trial: not a choice)."""
        before = self.meter.work
        try:
            while len(self.plans) < n and not self.failed and self.meter.work < work_limit:
                self.plans.append(self.packer.pack(batches[len(self.plans)]))
        except ValueError:
            self.failed = True
        self.work += self.meter.work - before

    def evaluate(self) -> dict:
        """The run's result: mean imbalance of its steps and delay per token, the stream
        drained (the last packing of the trial)."""
        drained = self.packer.drain()
        # with lookahead=K the last K batches' steps are planned by the drain
        late = drained[:sum(plan is None for plan in self.plans)]
        imbalances = [plan.imbalance for plan in self.plans if plan is not None] + [plan.imbalance for plan in late]
        # the budget bounds displacement: with lookahead a piece trained early counts as far as
        # a late one (without it, displacement is the mean delay)
        self.result = dict(imbalance=float(np.mean(imbalances)),
                           delay_per_token=self.packer.stats()["displacement_per_token"], batches=len(self.plans))
        return self.result

    def estimate(self) -> dict:
        """The same measures on the steps planned so far, without draining (the drain of a
        short prefix would weigh its end, every held piece leaving at once): mean imbalance of
        the steps, and delay per token of the placed pieces plus the wait the held ones have
        accrued (a lower bound of theirs)."""
        delay_tokens, tokens = 0, 0
        for plan in self.plans:
            if plan is None:
                continue
            placed = np.ones(len(plan.lengths), dtype=bool)
            placed[plan.deferred] = False
            delay_tokens += int((np.abs(plan.delays()[placed]) * plan.lengths[placed]).sum())
            tokens += int(plan.lengths[placed].sum())
        now = self.packer.step
        for piece in self.packer.held_pieces():
            if piece.arrival <= now:
                delay_tokens += (now - piece.arrival) * piece.length
                tokens += piece.length
        imbalances = [plan.imbalance for plan in self.plans if plan is not None]
        if not imbalances:  # nothing planned yet: nothing known, never a choice over a run that planned
            self.result = dict(imbalance=math.inf, delay_per_token=math.inf, batches=len(self.plans))
            return self.result
        self.result = dict(imbalance=float(np.mean(imbalances)),
                           delay_per_token=delay_tokens / tokens if tokens else 0.0, batches=len(self.plans))
        return self.result


def _race(trials: list[_Trial], batches, budget: float | None, meter: _Meter, delay_budget: float,
          lookahead: int) -> list[_Trial]:
    """Run `trials` on `batches` within `budget` (None: all to the end) and return the
    survivors, each with its `result` (see the module docstring): the runs that reach the
    end are drained, the others estimated where they stopped. A dropped run keeps the
    estimate it was dropped on, for the record."""
    n_batches = len(batches)
    alive = list(trials)
    budget = math.inf if budget is None else budget  # every run to the end
    k = 0
    while alive and min(len(trial.plans) for trial in alive) < n_batches:
        # checkpoints after 1, 2, 4, ... planned steps (the first K batches plan none)
        target = min(n_batches, lookahead + 2 ** k)
        k += 1
        n = len(alive[0].plans)
        per_step = sum(trial.work / trial.steps for trial in alive if trial.steps)
        last = False
        if per_step and _PROJECTION_MARGIN * per_step * (target - n) > budget - meter.work:
            # the budget ends the race: the survivors go as far as it allows
            target, last = n + int((budget - meter.work) / (_PROJECTION_MARGIN * per_step)), True
            if target <= n:
                break
        for trial in alive:
            trial.advance(batches, target, work_limit=budget)
        alive = [trial for trial in alive if not trial.failed]
        if last or meter.work >= budget:
            break
        if target == n_batches or not alive:
            continue
        # every survivor's rest at its work per planned step so far (the drain's K steps included)
        rest = sum(trial.work / max(1, trial.steps) * (n_batches - trial.steps) for trial in alive)
        if _PROJECTION_MARGIN * rest <= budget - meter.work:
            continue  # every survivor can finish within the budget
        for trial in alive:
            trial.estimate()
        ranked = _rank([trial.result for trial in alive], delay_budget)
        alive.sort(key=lambda trial: next(i for i, r in enumerate(ranked) if r is trial.result))
        alive = alive[:max(1, math.ceil(len(alive) / 2))]
    alive = [trial for trial in alive if not trial.failed]
    for trial in alive:
        if len(trial.plans) == n_batches:
            trial.evaluate()
        else:
            trial.estimate()
    return alive


def calibrate_thresholds(packer: WLBPacker, sample_lengths, tokens_per_batch: int | None,
                         n_batches: int, budget: float | None = CALIBRATION_BUDGET) -> dict | None:
    """Run `packer`'s configuration on a bootstrap stream for every candidate set of
    thresholds, within `budget` units of work (solver calls; None: no bound; see the module
    docstring); returns the calibration record (chosen `thresholds`, every candidate's
    imbalance, delay per token and the bootstrap batches it was run on, the stream's size,
    the work done, seconds), or None if the packer has no queues or no length of the sample
    is a candidate (nothing to choose: no queues). The packer is not changed."""
    sample = validate_lengths(sample_lengths, "sample_lengths")
    if not len(sample):
        raise ValueError("sample_lengths is empty; calibration needs at least one document")
    if sample.max() > packer.max_tokens:
        raise ValueError(f"sample_lengths holds {int(sample.max())} tokens > max_tokens={packer.max_tokens}; "
                         "cut documents with wlb_opt.split_documents first")
    if packer.n_queues == 0:
        return None
    n_batches = check_int("n_batches", n_batches, 1)
    if tokens_per_batch is None:
        tokens_per_batch = max(1, min(int(sample.sum()), int(packer.capacity_tokens / 1.25)))
    tokens_per_batch = check_int("tokens_per_batch", tokens_per_batch, 1)
    if budget is not None:
        budget = check_positive_real("budget", budget, "units of work (solver calls)", allow_inf=True)
    t0 = time.perf_counter()
    grid = packer.candidate_thresholds(sample, tokens_per_batch)
    if not grid:  # no length of the sample is an outlier at this batch size: nothing to queue
        return None
    if tokens_per_batch > packer.capacity_tokens:  # every candidate would overload on such batches
        raise ValueError(f"tokens_per_batch={tokens_per_batch} is more than the packer can place in one step "
                         f"({packer.dp} x {packer.n_micro} micro-batches x max_tokens={packer.max_tokens} = "
                         f"{packer.capacity_tokens})")
    batches = bootstrap_batches(sample, tokens_per_batch, n_batches, packer.seed)
    lengths = np.unique(np.concatenate(batches))
    candidates = [list(thresholds) for thresholds in combinations(grid, min(packer.n_queues, len(grid)))]
    meter = _Meter()
    classes: dict[tuple, _Trial] = {}
    for thresholds in candidates:
        key = _signature(thresholds, lengths, packer.release)
        if key not in classes:
            classes[key] = _Trial(packer, thresholds, meter)
    trials = list(classes.values())
    survivors = {id(trial) for trial in _race(trials, batches, budget, meter, packer.delay_budget, packer.lookahead)}
    results, chosen_from = [], []
    for thresholds in candidates:
        trial = classes[_signature(thresholds, lengths, packer.release)]
        if trial.failed or trial.result is None or not math.isfinite(trial.result["imbalance"]):
            continue  # overload under this candidate, or no step planned within the budget: not a choice
        results.append(dict(thresholds=thresholds, **trial.result))
        if id(trial) in survivors:
            chosen_from.append(results[-1])
    if not results:
        raise ValueError("calibration failed: every candidate overloaded the packer on the sample (or planned no "
                         "step within the budget); use a larger max_tokens, fewer tokens per global batch or a "
                         "larger budget")
    chosen = [int(x) for x in _choose(chosen_from or results, packer.delay_budget)["thresholds"]]
    return dict(thresholds=chosen, candidates=results, sample_pieces=int(len(sample)),
                tokens_per_batch=tokens_per_batch, n_batches=n_batches, delay_budget=packer.delay_budget,
                work=meter.work, budget=None if budget is None or math.isinf(budget) else budget, runs=len(trials), seconds=time.perf_counter() - t0)
