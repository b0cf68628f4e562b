"""The no-tuning defaults of `PackerConfig` and the feedback rule of balance_tolerance="auto".

`PackerConfig()` (what `WLBPacker(n_micro, max_tokens, cost)` runs) is:

- one pool of outliers: pieces of at least `DEFAULT_CUTOFF_SHARE` x max_tokens tokens, no
  calibration (thresholds calibrated on a first batch did not carry over to other streams);
- release="marginal" (`MarginalRelease` in release.py states the rule), with or without
  lookahead: a group with pieces seen ahead pays for their lead, less `EARLY_CREDIT` steps,
  in the score, and the groups
  of arrived pieces are formed among those alone (`GroupRelease._candidates`), so that
  lookahead only adds candidates to those a step has without it; a piece trains at most
  `MAX_LEAD` steps early;
- a step that took groups is weighed against the step without them, both trimmed
  (`TRIM_WITHOUT_GROUPS`), the groups' relief counted `HELD_GROUP_STEPS` times;
- a step still above `REPAIR_FROM` imbalance takes more groups of held pieces, several seen
  ahead allowed, while that pays (below 16 micro-batches);
- after its groups and trim, a step sheds short pieces of its heaviest micro-batch while that
  pays at the same price (`SHED_SHORT_PIECES`);
- max_delay `DEFAULT_MAX_DELAY` steps;
- method="wlb_phases": each step packed by Algorithm 1's rule with the forward and the
  backward time of each micro-batch balanced apart (solvers/phases.py); the release decides
  on Algorithm 1's packings (from 16 micro-batches, with the short pieces in lumps:
  packer/trial.py);
- balance_tolerance="auto": the right tolerance differs between data sets, so the packer sets
  it each step from the stream's own displacement per token so far (`running_displacement`):
  `TOLERANCE_LOW` up to RISE_FROM x target, rising linearly to the policy's high value
  (`TOLERANCE_HIGH`, `MARGINAL_TOLERANCE_HIGH` for "marginal") at RISE_TO x target, where
  target = `TARGET_SHARE` x delay_budget (`adaptive_tolerance`). It needs no sample and
  follows drifts in the data.

The constants were chosen on calibration streams, never on the streams the benchmarks score;
docs/tuning.md gives the selection rule, what was tried and what decided each choice.
`PackerConfig.legacy()` reproduces the packer's earlier defaults.
"""
from __future__ import annotations

from .pieces import arrived_sums

DEFAULT_CUTOFF_SHARE = 0.3
"""Default outlier cutoff: pieces >= int(0.3 x max_tokens) tokens wait in the pool."""
DEFAULT_MAX_DELAY = 32
"""Default max_delay (steps). With release="marginal" the rule rarely lets a piece wait this
long; where it would (`real` and `code` hold a few outliers 16 steps and more), a longer limit
lets them join a step that suits them instead of being forced into one: on the calibration
streams 32 beat 16 at equal displacement, and longer limits changed nothing (docs/tuning.md)."""
TOLERANCE_LOW = 1.05
"""balance_tolerance="auto" while the stream's displacement is far inside the budget."""
TOLERANCE_HIGH = 1.3
"""balance_tolerance="auto" once the stream's displacement reaches the budget."""
MARGINAL_TOLERANCE_HIGH = 2.0
"""release="marginal": balance_tolerance="auto" once the displacement reaches the budget
(the price of a group's tokens is then MARGINAL_PRICE x (2.0 - 1) = 0.5 imbalance per step
of capacity)."""
MARGINAL_PRICE = 0.5
"""release="marginal": price of a group's tokens per unit of tolerance above 1 (release.py)."""
MAX_LEAD = 2
"""release="marginal" with lookahead: a held outlier trains at most this many steps before the
step it arrives in (`ReleasePolicy.max_lead`). Pieces seen further ahead wait in the pool, out
of the step's groups, until they are that close. On the calibration streams (4 micro-batches,
lookahead 4) a lead of 2 beat 1, 3 and no limit by the selection rule (docs/tuning.md), so a
packer with lookahead K > 2 makes the plans of lookahead 2, K - 2 calls later: what it sees
beyond two batches does not change them."""
EARLY_CREDIT = 0.5
"""release="marginal" with lookahead: an early piece is valued at its lead less this many steps
(`release.displacement_relief`). Left to wait, an outlier that has arrived still waits for a
step that suits it, so training it early does not cost its whole lead; with no credit the rule
took few early pieces. On the calibration streams (4 micro-batches, lookahead 2, each curve
read against the curve without credit at equal displacement) 0.5 lowered the imbalance of
`default`, `real`, `code` and `heavy`. A credit of 1 lowered `default` and `real` a little more
but makes a piece one step early free, so the feedback's price no longer holds early pieces
back: on `prose` the displacement stopped following the budget (docs/tuning.md)."""
SHED_SHORT_PIECES = True
"""release="marginal": after the trim a step defers the short pieces of its heaviest micro-batch,
one at a time, while each lowers the imbalance by more than its tokens are worth at the groups'
price (`MarginalRelease._shed`). A step that takes a few outliers is often full to its token cap
with its longest outlier's micro-batch the heaviest; its short pieces wait a step, in one with
room. On the calibration streams (4 micro-batches, lookahead 0 and 2, each curve read against the
curve without it at equal displacement) it lowered the imbalance of every distribution, and at
32 micro-batches of most runs (docs/tuning.md)."""
TRIM_WITHOUT_GROUPS = True
"""release="marginal": a step that took groups is weighed again, trimmed, against the step
without them, trimmed too (`MarginalRelease._without_groups_instead`). A group is taken when it
beats the step without it as that step is; a starved step (a batch of a few short documents
after one of outliers) whose short pieces include one long one is less balanced without the
outliers than with them, though without that one piece it would be balanced. On the
calibration streams (4 micro-batches, lookahead 0 and 2, each curve read against the curve
without it at equal displacement; `HELD_GROUP_STEPS` = 2) it lowered `prose` and left the
other four within noise; at 32 micro-batches it lowered `heavy` and `prose` (docs/tuning.md)."""
HELD_GROUP_STEPS = 2.0
"""release="marginal": the step without groups is taken only where it gains more than this many
steps of the groups' relief (`MarginalRelease.held_group_steps`). At 1, on a stream of mostly
outliers (`prose`, lookahead 4) the groups held back ran the displacement over its budget with
the feedback at its high; at 2 it stays within (docs/tuning.md)."""
REPAIR_FROM = 1.02
"""release="marginal" with method "wlb_phases" or "wlb" (the step packers whose candidates are
Algorithm 1's packings), steps of fewer than 16 micro-batches (dp x n_micro): a step whose
imbalance is still above this after its groups, its trim and the step without groups takes
more groups of held pieces, one at a time, while the best lowers its score at the groups'
price (`MarginalRelease._repaired`); these groups may hold several pieces seen ahead. The
worst steps of a stream of mostly outliers are starved ones (a few medium outliers, little
else), which a group with one early piece cannot balance: on `prose` with lookahead 2 a
few worst steps held most of the excess over the offline schedule of the same reach. On the
calibration streams (4 micro-batches, lookahead 0 and 2, each curve read against the curve
without it at equal displacement) it lowered every distribution with lookahead, `prose` and
`heavy` most, and left lookahead 0 within noise; 1.05 and 1.1 did about as well
(docs/tuning.md). None: no repair."""
TARGET_SHARE = 0.9
"""The feedback aims at this share of `delay_budget` (margin for the drain and noise)."""
# The rule rises from TOLERANCE_LOW at RISE_FROM x target to TOLERANCE_HIGH at RISE_TO x target.
RISE_FROM, RISE_TO = 0.7, 1.1
# Pseudo-tokens at the target, so that the first steps (few tokens placed) are not erratic:
# two steps' capacity.
PRIOR_STEPS = 2


def running_displacement(totals: dict, held, step: int, capacity_tokens: int, target: float) -> float:
    """Displacement per token of the stream so far: placed tokens' |displacement| plus the
    wait already accrued by the held pieces (queued, carried), over placed + held tokens,
    smoothed by `PRIOR_STEPS` steps of capacity at `target`. Held pieces that have not
    arrived yet (lookahead) have neither waited nor joined the stream: left out, rather than
    counted as tokens of no displacement, which would understate it."""
    # accrued = sum((step - arrival) x length) = step x tokens - weighted (`pieces.arrived_sums`:
    # C-level maps, or arrays for the parts of a chain held as tables)
    tokens, weighted = arrived_sums(held, step)
    accrued = step * tokens - weighted
    prior = PRIOR_STEPS * capacity_tokens
    return (totals["displacement_token_sum"] + accrued + target * prior) / (totals["tokens"] + tokens + prior)


def adaptive_tolerance(displacement: float, delay_budget: float, high: float | None = None) -> float:
    """balance_tolerance="auto" for a stream at `displacement` (steps per token; the module
    docstring states the rule); `high` defaults to TOLERANCE_HIGH."""
    high = TOLERANCE_HIGH if high is None else high
    target = TARGET_SHARE * delay_budget
    if target <= 0:
        return high
    x = (displacement / target - RISE_FROM) / (RISE_TO - RISE_FROM)
    return TOLERANCE_LOW + (high - TOLERANCE_LOW) * min(1.0, max(0.0, x))
