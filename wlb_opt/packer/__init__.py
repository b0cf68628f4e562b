"""`WLBPacker`: the stateful streaming packer of WLB-LLM (paper §3.2, Algorithm 1), made safe
for a training job.

One global batch goes in per step, one PackPlan comes out. Outlier documents (length >= L1)
wait in multi-level FIFO queues (queue i holds L_i <= d < L_{i+1}; the last queue is open
above) until a queue holds dp x n_micro of them, which are then released together so that
every micro-batch gets one outlier of similar length. Algorithm 1 (`solve_pack(method="wlb")`)
then packs the carried documents first and the rest longest-first.

What the paper leaves open is settled in the module that owns each rule:

- config.py: `PackerConfig`, the policy (thresholds, queues, release, max_delay, tolerance,
  delay budget, method, lookahead), validated once, and its presets `paper` and `legacy`.
- packer.py: the `WLBPacker` class and one step (queue, release, pack, deal to DP
  replicas by modelled 1F1B time, commit); overload (`max_backlog_tokens`), `drain()`,
  the identity of a piece (id, offset), `plan.step` and `plan.arrival_step`.
- release.py: when held outliers leave: the paper's rule, `max_delay`, and the policies
  beyond the paper, `release="balance"`, `release="group"` and `release="marginal"`.
- defaults.py: the no-tuning defaults (release "marginal", with or without lookahead) and the feedback
  rule of balance_tolerance="auto"; docs/tuning.md says how they were chosen.
- calibrate.py: `calibrate(sample)` and `thresholds="auto"`: thresholds chosen by running
  the packer on a bootstrap stream (the paper chose them by hand).
- state.py: the typed held-piece record `HeldPiece` and the JSON `state_dict()`; a resumed
  run emits the same plans.
- stats.py: `stats()`: delay and balance of the stream so far; `per_step_imbalance`.
"""
from .config import PackerConfig, PackerMethod
from .packer import WLBPacker
from .release import RELEASE_POLICIES, ReleaseName
from .state import STATE_VERSION, HeldPiece
from .stats import per_step_imbalance

__all__ = ["WLBPacker", "PackerConfig", "per_step_imbalance", "HeldPiece", "RELEASE_POLICIES", "STATE_VERSION", "PackerMethod",
           "ReleaseName"]
