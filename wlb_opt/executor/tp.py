"""Tensor parallelism inside a pipeline stage, through PyTorch's DTensor (`parallelize_module`).

The plan for the library's Llama-style blocks (Megatron's, without sequence parallelism):

- column-parallel: the Q, K and V projections and the SwiGLU gate and up projections
  (`wq`, `wk`, `wv`, `w1`, `w3`); each TP rank computes its share of the heads / channels;
- row-parallel: the attention output and the down projection (`wo`, `w2`); their partial
  outputs are summed over the TP group (one all-reduce each, forward; the column-parallel
  inputs' gradients get one each, backward);
- replicated: embeddings, RMSNorms and the LM head (every TP rank holds and updates them
  identically).

Attention heads are split over TP, so CP attention runs on each rank's local heads with GQA
intact (query and KV heads must both divide by tp). Without sequence parallelism every TP
rank holds all of its micro-batch's tokens (this CP rank's share), and the two all-reduces
per block and phase are the TP traffic; the analytic cost model prices TP as four
activation shards per layer and phase with sequence parallelism, the same bytes moved as
two all-reduces (`CostModel.analytic`, `tp_comm_exposed`). Where it differs: the analytic
model also divides the LM head's GEMM and the element-wise work by tp, which this plan runs
replicated (sequence parallelism and a vocabulary-parallel head would match it; not built).
"""
from __future__ import annotations

import torch

COLUMN = ("wq", "wk", "wv", "w1", "w3")
ROW = ("wo", "w2")


def tp_plan() -> dict:
    """The `parallelize_module` plan of one block: {submodule name: ParallelStyle}."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {**{name: ColwiseParallel() for name in COLUMN}, **{name: RowwiseParallel() for name in ROW}}


def apply_tensor_parallel(stage: torch.nn.Module, tp_mesh) -> torch.nn.Module:
    """Shard every block of `stage` over the 1-D DeviceMesh `tp_mesh` (in place; returns it)."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    # another model family's stage (e.g. the Hugging Face adapter's) brings its own block plan
    # and head counts: `block_tp_plan()` and `tp_heads` = (query heads, key/value heads)
    plan = stage.block_tp_plan() if hasattr(stage, "block_tp_plan") else tp_plan()
    heads = getattr(stage, "tp_heads", None)
    for block in getattr(stage, "blocks", []):
        q_heads, kv_heads = heads if heads is not None else (block.heads, block.kv_heads)
        for name, count in (("query heads", q_heads), ("key/value heads", kv_heads)):
            if count % tp:
                raise ValueError(f"tensor parallelism over tp={tp} needs the {name} ({count}) to divide by tp")
        parallelize_module(block, tp_mesh, plan)
    return stage


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise); writes to it reach the DTensor."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t
