"""Delay and balance of a packed stream: the accumulator behind `WLBPacker.stats()`.

Every plan the packer emits (from `pack` or `drain`) is added once. Delays count placed
pieces (a piece is a document or a window-sized part of one): the delay (displacement) of a
piece is `plan.step` where it is placed minus the step it arrived (`plan.arrival_step`);
undelayed pieces count as 0, pieces trained early (`lookahead`) as negative. Imbalance is
max / mean of each plan's loads.

Token-weighted: `delay_per_token` is the signed mean, `displacement_per_token` the mean of
|displacement| (the two agree without lookahead), `late_token_share` / `early_token_share`
the shares of tokens trained after / before their arrival step (`delayed_token_share` is
the late share, under its older name).

`queue_wait_max` (steps from arrival to release from a queue) never exceeds max_delay;
`late_pieces` counts pieces placed later than max_delay, which happens only when the
pieces at their deadline do not fit in one step (a burst beyond capacity: they are placed
first, but a full step defers them).

The totals are integers and the imbalances floats, so the accumulator round-trips through
JSON exactly (keys "accumulators" and "imbalance" of the packer's state).
"""
from __future__ import annotations

import math

import numpy as np

from ..cost import CostModel
from ..plan import PackPlan, _imbalance as imbalance

TOTALS = ("pieces", "tokens", "delay_sum", "delay_token_sum", "delayed_tokens", "delay_max", "queue_wait_max",
          "late_pieces", "displacement_token_sum", "early_tokens")
"""Integer totals over the placed pieces (delays in steps, tokens in tokens)."""
# Totals added with lookahead; a state written before them has no early pieces,
# so |displacement| = delay there: (total, the total it defaults to, else 0).
_LOOKAHEAD_TOTALS = {"displacement_token_sum": "delay_token_sum", "early_tokens": None}
# Sums of signed delays: negative once lookahead trains pieces early.
_SIGNED_TOTALS = frozenset({"delay_sum", "delay_token_sum"})


class StreamStats:
    """Running totals of delay and balance over the plans of one stream."""

    def __init__(self) -> None:
        self.totals: dict[str, int] = dict.fromkeys(TOTALS, 0)
        self.imbalances: list[float] = []

    def add(self, plan: PackPlan, max_delay: int | None, queue_wait_max: int) -> None:
        """Count one emitted plan; `queue_wait_max`: the longest queue wait it released."""
        placed = np.concatenate(plan.micro_batches) if plan.micro_batches else np.zeros(0, dtype=np.int64)
        a = self.totals
        if placed.size:
            add = np.add.reduce  # what .sum() runs, without its Python-level wrapper (a step's fixed cost)
            delay = plan.delays()[placed]
            toks = plan.lengths[placed]
            weighted = delay * toks
            a["pieces"] += int(placed.size)
            a["tokens"] += int(add(toks))
            a["delay_sum"] += int(add(delay))
            a["delay_token_sum"] += int(add(weighted))
            a["delayed_tokens"] += int(add(toks[delay > 0]))
            a["displacement_token_sum"] += int(add(np.abs(weighted)))  # lengths are > 0: |delay| x tokens
            a["early_tokens"] += int(add(toks[delay < 0]))
            a["delay_max"] = max(a["delay_max"], int(np.maximum.reduce(delay)))
            if max_delay is not None:
                a["late_pieces"] += int(np.count_nonzero(delay > max_delay))
        a["queue_wait_max"] = max(a["queue_wait_max"], int(queue_wait_max))
        self.imbalances.append(float(plan.imbalance))

    def summary(self, *, steps: int, queues, carry, thresholds: list[int] | None) -> dict:
        """The `WLBPacker.stats()` dict (see the module docstring); `queues` and `carry` are
        what the packer still holds."""
        a = self.totals
        imb = np.asarray(self.imbalances, dtype=np.float64)
        pct = (lambda q: float(np.percentile(imb, q))) if imb.size else (lambda q: 1.0)
        return dict(
            steps=steps, placed_pieces=a["pieces"], placed_tokens=a["tokens"],
            delay_mean_per_doc=a["delay_sum"] / a["pieces"] if a["pieces"] else 0.0,
            delay_max=a["delay_max"], queue_wait_max=a["queue_wait_max"], late_pieces=a["late_pieces"],
            delay_per_token=a["delay_token_sum"] / a["tokens"] if a["tokens"] else 0.0,
            delayed_token_share=a["delayed_tokens"] / a["tokens"] if a["tokens"] else 0.0,
            displacement_per_token=a["displacement_token_sum"] / a["tokens"] if a["tokens"] else 0.0,
            early_token_share=a["early_tokens"] / a["tokens"] if a["tokens"] else 0.0,
            late_token_share=a["delayed_tokens"] / a["tokens"] if a["tokens"] else 0.0,
            imbalance_mean=float(imb.mean()) if imb.size else 1.0, imbalance_p50=pct(50),
            imbalance_p90=pct(90), imbalance_max=float(imb.max()) if imb.size else 1.0,
            queued_pieces=sum(len(q) for q in queues),
            queued_tokens=sum(piece.length for q in queues for piece in q),
            carried_pieces=len(carry), carried_tokens=sum(piece.length for piece in carry),
            thresholds=None if thresholds is None else list(thresholds),
        )

    # ------------------------------------------------------------------ checkpointing
    def state(self) -> dict:
        """The JSON part of the packer's state this accumulator owns."""
        return dict(imbalance=list(self.imbalances), accumulators=dict(self.totals))

    @classmethod
    def from_state(cls, state: dict) -> "StreamStats":
        """Inverse of `state()`, read from a packer state (KeyError / TypeError / ValueError
        if malformed)."""
        out = cls()
        totals, imbalances = state["accumulators"], state["imbalance"]
        for k in TOTALS:
            if k not in totals and k in _LOOKAHEAD_TOTALS:  # a state from before lookahead
                old = _LOOKAHEAD_TOTALS[k]
                v = totals[old] if old else 0
            else:
                v = totals[k]
            low = None if k in _SIGNED_TOTALS else 0
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or (low is not None and v < low):
                what = "an integer" if low is None else "an integer >= 0"
                raise ValueError(f"state_dict field accumulators.{k} must be {what}, got {v!r}")
            out.totals[k] = int(v)
        if not isinstance(imbalances, (list, tuple)):
            raise ValueError(f"state_dict field imbalance must be a list of numbers, got {imbalances!r}")
        for i, x in enumerate(imbalances):
            # max / mean of a step's loads is >= 1 (rounding aside) and finite
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 1.0 - 1e-9:
                raise ValueError(f"state_dict field imbalance[{i}] must be a finite imbalance >= 1.0, got {x!r}")
        out.imbalances = [float(x) for x in imbalances]
        return out


def per_step_imbalance(plan: PackPlan, cost: CostModel, phase: str = "fwd") -> float:
    """max/mean over the plan's micro-batches of `cost.micro_batch_cost(..., phase)` (Table 2 uses "fwd")."""
    return imbalance([cost.micro_batch_cost(plan.lengths[mb], phase) for mb in plan.micro_batches])
