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
    """Shard every block of `stage` over the 1-D DeviceMesh `tp_mesh` (in place; returns it).

    Every block is checked before any is sharded (a refusal leaves the stage as it was):
    the query and key/value head counts and every sharded width (the MLP's included) must
    divide by tp, every projection the plan names must be an `nn.Linear`, and the block may
    hold no other weight that tensor parallelism would leave whole while its inputs are split
    (a fused projection such as Phi-3's ``qkv_proj`` or ``gate_up_proj``, whose output
    interleaves Q, K and V or gate and up, a per-head norm over all heads, MoE experts).
    Each refusal is a ValueError naming the module."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    # another model family's stage (e.g. the Hugging Face adapter's) brings its own block plan
    # and head counts: `block_tp_plan()` and `tp_heads` = (query heads, key/value heads)
    plan = stage.block_tp_plan() if hasattr(stage, "block_tp_plan") else tp_plan()
    heads = getattr(stage, "tp_heads", None)
    blocks = list(getattr(stage, "blocks", []))
    names = list(getattr(stage, "block_names", None) or [f"blocks.{i}" for i in range(len(blocks))])
    for name, block in zip(names, blocks):
        _check_shardable(block, name, plan, tp, heads if heads is not None else (block.heads, block.kv_heads))
    for block in blocks:
        parallelize_module(block, tp_mesh, plan)
    return stage


def _check_shardable(block: torch.nn.Module, where: str, plan: dict, tp: int, heads: tuple[int, int]) -> None:
    """ValueError naming the module of `block` (called `where`) that `plan` cannot shard over tp.
    The plan's first entry is the query projection: its input width is the model's, its
    parent module the attention."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    q_heads, kv_heads = heads
    for label, count in (("query heads", q_heads), ("key/value heads", kv_heads)):
        if count % tp:
            raise ValueError(f"tensor parallelism over tp={tp} needs the {label} ({count}) to divide by tp "
                             f"({where}); use a tp that divides {count}")
    modules = dict(block.named_modules())
    planned = set()
    for name, style in plan.items():
        module = modules.get(name)
        if not isinstance(module, torch.nn.Linear):
            others = [n for n, m in modules.items() if isinstance(m, torch.nn.Linear) and n not in plan]
            if module is None and others:  # e.g. Phi-3: self_attn.qkv_proj and mlp.gate_up_proj, no q_proj
                raise ValueError(f"tensor parallelism cannot shard {where}.{others[0]}: a fused projection (its "
                                 "output concatenates Q, K and V, or gate and up, so splitting its columns evenly "
                                 f"would not give each rank whole heads or matching channels); the plan needs "
                                 f"{name}, which the block does not have. Run this model with tp=1")
            found = "nothing" if module is None else f"a {type(module).__name__}"
            raise ValueError(f"tensor parallelism cannot shard {where}.{name}: the plan shards it as a linear "
                             f"projection, and the block has {found} there (a layout the TP plan does not know, "
                             "such as MoE experts); run this model with tp=1")
        column = isinstance(style, ColwiseParallel)
        width = module.out_features if column else module.in_features
        if width % tp:
            side = "output" if column else "input"
            raise ValueError(f"tensor parallelism over tp={tp} needs the {side} width of {where}.{name} ({width}) "
                             "to divide by tp")
        planned.update(id(p) for p in module.parameters())
    first = next(iter(plan), "")
    hidden = modules[first].in_features if first else None
    head_dim = modules[first].out_features // q_heads if first else None
    attention = first.rsplit(".", 1)[0] + "." if "." in first else None
    for name, param in block.named_parameters():
        if id(param) in planned:
            continue
        # left whole on every rank: fine for a norm over one head, or over the residual stream
        # outside the attention (a norm over all heads' queries, OLMo 2's, is not)
        if param.dim() == 1 and (param.numel() == head_dim or (
                param.numel() == hidden and not (attention and name.startswith(attention)))):
            continue
        owner = name.rsplit(".", 1)[0] if "." in name else name
        raise ValueError(f"tensor parallelism cannot shard {where}.{owner}: its weight {name} "
                         f"{tuple(param.shape)} is not in the TP plan, which splits the heads and MLP channels "
                         "around it (a fused projection such as qkv_proj or gate_up_proj, a norm over all heads, "
                         "or MoE experts); run this model with tp=1")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise); writes to it reach the DTensor."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t
