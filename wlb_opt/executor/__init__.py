"""torch.distributed execution of wlb-opt plans (needs the ``torch`` extra).

- `context_parallel_attention`: CP attention over a ShardPlan (all-gather K/V, one
  document-masked attention call, reduce-scatter of dK/dV in rank-major order).
- `gather_packed`: the differentiable rank-major all-gather + order restore it uses.
- `check_same_plan`: ranks compare `plan.digest()` before executing a step;
  `broadcast_plan`: plan on one rank (e.g. an exact solver) and send the plan to the others.
  `train_step` checks more in the same exchange (tokens within a replica, the vocabulary,
  replicated weights); a wait that fails raises `PeerWaitError` naming who did not arrive.
- `make_mesh`, `train_step`: CP x PP x DP groups and one training step of a PackPlan
  (variable-length 1F1B or interleaved pipeline issuing `p2p_schedule`'s groups, CP
  attention, DP gradient sums) with the loss normalised over the whole global batch;
  `TinyLM` and `split_stages`, a small model for tests and examples.

The executor never re-plans: it executes the plans it is given.
"""
from __future__ import annotations

from .._optional import require

require("torch", "wlb_opt.executor")

from ..schedule import P2POp, p2p_schedule  # noqa: E402
from .cp_attention import (CPContext, PendingKV, context_parallel_attention, cp_context, gather_packed,  # noqa: E402
                           packed_order_index, prefetch_kv)
from .mesh import Mesh, make_mesh  # noqa: E402
from .model import Stage, TinyLM, split_stages  # noqa: E402
from .plumbing import broadcast_plan, check_same_plan, local_inputs  # noqa: E402
from .rollcall import PeerWaitError  # noqa: E402
from .fsdp import apply_fsdp, fsdp_mesh  # noqa: E402
from .tp import apply_tensor_parallel, tp_plan  # noqa: E402
from .train import (StageOutputs, activation_dtype, pack_tokens, packed_labels, packed_positions,  # noqa: E402
                    target_tokens, train_step)

__all__ = ["CPContext", "Mesh", "PeerWaitError", "PendingKV", "P2POp", "Stage", "StageOutputs", "TinyLM", "activation_dtype", "apply_fsdp", "apply_tensor_parallel", "broadcast_plan",
           "check_same_plan", "context_parallel_attention", "cp_context", "fsdp_mesh", "gather_packed", "local_inputs",
           "make_mesh", "p2p_schedule", "pack_tokens", "packed_labels", "packed_order_index", "packed_positions", "prefetch_kv",
           "split_stages", "target_tokens", "tp_plan", "train_step"]
