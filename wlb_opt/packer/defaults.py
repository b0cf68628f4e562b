"""What `WLBPacker(n_micro, max_tokens, cost)` does with no tuning (issue 16), and why.

The paper tuned its queue thresholds by hand on its own data; the packer's earlier defaults
(thresholds calibrated on the first global batch, two queues, release="paper", max_delay 8)
reached 1.06-1.10 mean imbalance on streams they were not tuned on. The defaults now are:

- one pool of outliers: pieces of at least 0.3 x max_tokens tokens (`DEFAULT_CUTOFF_SHARE`;
  49152 = 3W/8 for the usual max_tokens = 1.25 W), no calibration (on the calibration
  streams 0.3 beat 0.1, 0.15, 0.2 and 0.4: real 1.034-1.047 against 1.042-1.054 at 0.2);
- release="group" (release.py): groups of similar outliers, or a single one, leave as soon as
  the step stays within the balance tolerance;
- max_delay 16 (`DEFAULT_MAX_DELAY`);
- balance_tolerance="auto": a feedback rule on the stream's own displacement. The tolerance
  trades imbalance for displacement, and the right value differs between data sets (on the
  calibration streams 1.2 kept the default distribution at 0.47-0.57 delay per token while
  the real and code files stayed near 0.3-0.45 at 1.25), so the packer sets it each step
  from the displacement per token so far (`running_displacement`): `TOLERANCE_LOW` while the
  stream is well inside `delay_budget`, rising linearly to `TOLERANCE_HIGH` as it reaches
  the budget (`adaptive_tolerance`). It needs no sample and follows drifts in the data.

The constants were chosen on calibration streams only (seeds DEFAULT_SEED + 100..102 of the
default, real and code distributions, 200 steps, 7B (8,2,4,1), N = 4, max_tokens 163840),
never on the streams the benchmarks score (seeds DEFAULT_SEED + 0..6). The old defaults are
reproduced exactly by passing them: thresholds="auto", n_queues=2, max_delay=8,
release="paper", balance_tolerance=1.02 (tests/test_lookahead.py checks the plans).
"""
from __future__ import annotations

DEFAULT_CUTOFF_SHARE = 0.3
"""Default outlier cutoff: pieces >= int(0.3 x max_tokens) tokens wait in the pool."""
DEFAULT_MAX_DELAY = 16
"""Default max_delay (steps)."""
TOLERANCE_LOW = 1.05
"""balance_tolerance="auto" while the stream's displacement is far inside the budget."""
TOLERANCE_HIGH = 1.5
"""balance_tolerance="auto" once the stream's displacement reaches the budget."""
TARGET_SHARE = 0.9
"""The feedback aims at this share of `delay_budget` (margin for the drain and noise)."""
# The rule rises from TOLERANCE_LOW at RISE_FROM x target to TOLERANCE_HIGH at RISE_TO x target.
RISE_FROM, RISE_TO = 0.9, 1.1
# Pseudo-tokens at the target, so that the first steps (few tokens placed) are not erratic:
# two steps' capacity.
PRIOR_STEPS = 2


def running_displacement(totals: dict, held, step: int, capacity_tokens: int, target: float) -> float:
    """Displacement per token of the stream so far: placed tokens' |displacement| plus the
    wait already accrued by the held pieces (queued, carried), over placed + held tokens,
    smoothed by `PRIOR_STEPS` steps of capacity at `target`."""
    accrued = sum(max(0, step - piece.arrival) * piece.length for piece in held)
    tokens = sum(piece.length for piece in held)
    prior = PRIOR_STEPS * capacity_tokens
    return (totals["displacement_token_sum"] + accrued + target * prior) / (totals["tokens"] + tokens + prior)


def adaptive_tolerance(displacement: float, delay_budget: float) -> float:
    """balance_tolerance="auto" for a stream at `displacement` per token (see the module
    docstring): TOLERANCE_LOW up to RISE_FROM x target, TOLERANCE_HIGH from RISE_TO x target,
    linear between (target = TARGET_SHARE x delay_budget)."""
    target = TARGET_SHARE * delay_budget
    if target <= 0:
        return TOLERANCE_HIGH
    x = (displacement / target - RISE_FROM) / (RISE_TO - RISE_FROM)
    return TOLERANCE_LOW + (TOLERANCE_HIGH - TOLERANCE_LOW) * min(1.0, max(0.0, x))
