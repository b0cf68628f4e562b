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

The choice minimises mean imbalance among the candidates whose delay per token is within
the packer's `delay_budget` (ties within 0.002: less delay), else the least delay.
`thresholds="auto"` calibrates on the first global batch.
"""
from __future__ import annotations

import time
from itertools import combinations
from typing import TYPE_CHECKING

import numpy as np

from .._validate import check_int, validate_lengths
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


def candidate_thresholds(cost: CostModel, sample, tokens_per_batch: int, n_micro_batches: int,
                         max_tokens: int) -> list[int]:
    """Candidate thresholds (token counts), from the cost model and from the data (see the
    module docstring), for global batches of `tokens_per_batch` sample tokens packed into
    `n_micro_batches` (dp x n_micro) micro-batches of `max_tokens`. Candidates within 5% of
    a shorter one are merged (the shorter is kept)."""
    sample = np.asarray(sample, dtype=np.int64)
    per_token = float(cost.doc_cost(sample).sum() / sample.sum())
    fair = tokens_per_batch * per_token / n_micro_batches
    grid = np.arange(1, max_tokens + 1, dtype=np.int64)
    cum = cost.doc_cost(grid)
    raw = []
    for fraction in CALIBRATION_FRACTIONS:
        k = int(np.searchsorted(cum, fraction * fair))
        if k < max_tokens:
            raw.append(int(grid[k]))
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


def calibrate_thresholds(packer: WLBPacker, sample_lengths, tokens_per_batch: int | None,
                         n_batches: int) -> dict | None:
    """Run `packer`'s configuration on a bootstrap stream for every candidate set of
    thresholds; returns the calibration record (chosen `thresholds`, every candidate's
    imbalance and delay per token, the stream's size, seconds), or None if the packer has
    no queues (nothing to choose). The packer is not changed."""
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
        tokens_per_batch = min(int(sample.sum()), int(packer.capacity_tokens / 1.25))
    tokens_per_batch = check_int("tokens_per_batch", tokens_per_batch, 1)
    t0 = time.perf_counter()
    batches = bootstrap_batches(sample, tokens_per_batch, n_batches, packer.seed)
    grid = packer.candidate_thresholds(sample, tokens_per_batch)
    results = []
    for thresholds in combinations(grid, min(packer.n_queues, len(grid))):
        trial = packer._trial(list(thresholds))
        try:
            plans = [trial.pack(batch) for batch in batches]
        except ValueError:
            continue  # overload under this candidate: not a choice
        drained = trial.drain()
        # with lookahead=K the last K batches' steps are planned by the drain
        late = drained[:sum(plan is None for plan in plans)]
        imbalances = [plan.imbalance for plan in plans if plan is not None] + [plan.imbalance for plan in late]
        results.append(dict(thresholds=list(thresholds), imbalance=float(np.mean(imbalances)),
                            delay_per_token=trial.stats()["delay_per_token"]))
    if not results:
        raise ValueError("calibration failed: every candidate overloaded the packer on the sample; "
                         "use a larger max_tokens or fewer tokens per global batch")
    chosen = [int(x) for x in _choose(results, packer.delay_budget)["thresholds"]]
    return dict(thresholds=chosen, candidates=results, sample_pieces=int(len(sample)),
                tokens_per_batch=tokens_per_batch, n_batches=n_batches, delay_budget=packer.delay_budget,
                seconds=time.perf_counter() - t0)
