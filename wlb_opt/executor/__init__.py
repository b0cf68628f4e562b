"""torch.distributed execution of wlb-opt plans (needs the ``torch`` extra).

- `context_parallel_attention`: CP attention over a ShardPlan (all-gather K/V, one
  document-masked attention call, reduce-scatter of dK/dV in rank-major order).
- `prefetch_kv` (-> `PendingKV`): start that K/V all-gather early; `gather_packed`: the
  differentiable rank-major all-gather + order restore it uses.
- `check_same_plan`: ranks compare `plan.digest()` before executing a step;
  `broadcast_plan`: plan on one rank (e.g. an exact solver) and send the plan to the others.
  `train_step` checks more in the same exchange (tokens within a replica, the vocabulary,
  replicated weights); a wait that fails raises `PeerWaitError` naming who did not arrive.
- `make_mesh`, `train_step`: CP x PP x DP groups and one training step of a PackPlan
  (variable-length 1F1B issuing `p2p_schedule`'s groups, or interleaved on per-pair channels, CP
  attention, DP gradient sums) with the loss normalised over the whole global batch;
  `TinyLM` and `split_stages`, a small model for tests and examples; `StageOutputs`, what
  a rank ran (`train_step(record=...)`).
- `apply_tensor_parallel`, `apply_fsdp`: TP and FSDP2 over the mesh's dimensions.

Token packing, labels and positions of a micro-batch live in `wlb_opt.batch`; the rest of
the modules here (`plumbing`, `pipeline`, `rollcall`, ...) are internals.

The executor never re-plans: it executes the plans it is given.
"""
from __future__ import annotations

from .._optional import require

require("torch", "wlb_opt.executor")

from ..schedule import P2POp, p2p_schedule  # noqa: E402
from .cp_attention import PendingKV, context_parallel_attention, gather_packed, prefetch_kv  # noqa: E402
from .mesh import Mesh, make_mesh  # noqa: E402
from .model import Stage, TinyLM, split_stages  # noqa: E402
from .plumbing import broadcast_plan, check_same_plan  # noqa: E402
from .rollcall import PeerWaitError  # noqa: E402
from .fsdp import apply_fsdp  # noqa: E402
from .tp import apply_tensor_parallel  # noqa: E402
from .pipeline import StageOutputs  # noqa: E402
from .train import train_step  # noqa: E402

__all__ = ["Mesh", "P2POp", "PeerWaitError", "PendingKV", "Stage", "StageOutputs", "TinyLM", "apply_fsdp",
           "apply_tensor_parallel", "broadcast_plan", "check_same_plan", "context_parallel_attention",
           "gather_packed", "make_mesh", "p2p_schedule", "prefetch_kv", "split_stages", "train_step"]

_MOVED = {
    **{name: "wlb_opt.executor.cp_attention" for name in ("CPContext", "cp_context", "packed_order_index")},
    **{name: "wlb_opt.batch" for name in ("local_inputs", "pack_tokens", "packed_labels", "packed_positions",
                                          "target_tokens")},
    "activation_dtype": "wlb_opt.executor.train",
    "fsdp_mesh": "wlb_opt.executor.fsdp",
    "tp_plan": "wlb_opt.executor.tp",
}
"""Names this package exported before it kept to its public ones -> where they live now."""


def __getattr__(name: str):
    if name in _MOVED:
        import importlib
        import warnings

        warnings.warn(f"wlb_opt.executor.{name} is not part of the executor's public API any more; import it from "
                      f"{_MOVED[name]}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
