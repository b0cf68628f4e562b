"""torch.distributed execution of wlb-opt plans (needs the ``torch`` extra).

- `context_parallel_attention`: CP attention over a ShardPlan (all-gather K/V, one
  document-masked attention call, reduce-scatter of dK/dV in rank-major order).
- `gather_packed`: the differentiable rank-major all-gather + order restore it uses.
- `check_same_plan`: ranks compare `plan.digest()` before executing a step.

The executor never re-plans: it executes the plans it is given.
"""
from __future__ import annotations

from .._optional import require

require("torch", "wlb_opt.executor")

from .cp_attention import context_parallel_attention, gather_packed, packed_order_index  # noqa: E402
from .plumbing import check_same_plan, local_inputs  # noqa: E402

__all__ = ["check_same_plan", "context_parallel_attention", "gather_packed", "local_inputs", "packed_order_index"]
