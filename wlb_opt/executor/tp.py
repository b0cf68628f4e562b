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

    Every block is checked before any is sharded (a refusal leaves the stage as it was): the
    mesh's size must be an integer >= 1, the query and key/value head counts and every sharded
    width (the MLP's included) must divide by tp, every projection the plan names must be an
    `nn.Linear`, and the block may hold no other weight that tensor parallelism would leave
    whole while its inputs are split (a fused projection such as Phi-3's ``qkv_proj`` or
    ``gate_up_proj``, whose output interleaves Q, K and V or gate and up; a norm over all
    heads; per-head norms paired with heads by position; MoE experts and their router;
    low-rank latent attention projections). A stage that names the module classes it is known
    to shard correctly (`tp_module_classes`: {submodule: class names}, the Hugging Face
    adapter's) has every other class refused. Each refusal is a ValueError naming the module
    and the reason."""
    from torch.distributed.tensor.parallel import parallelize_module

    if not callable(getattr(tp_mesh, "size", None)) or getattr(tp_mesh, "ndim", 1) != 1:
        raise ValueError(f"tp_mesh must be a 1-D DeviceMesh of the TP ranks (from make_mesh: mesh.device_mesh['tp']), "
                         f"got {type(tp_mesh).__name__}" + (f" of {tp_mesh.ndim} dimensions"
                                                           if hasattr(tp_mesh, "ndim") else ""))
    tp = tp_mesh.size()
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor parallelism needs a mesh whose size() is an integer >= 1 (the TP ranks), got "
                         f"{tp!r}")
    # another model family's stage (e.g. the Hugging Face adapter's) brings its own block plan
    # and head counts: `block_tp_plan()` and `tp_heads` = (query heads, key/value heads)
    plan = stage.block_tp_plan() if hasattr(stage, "block_tp_plan") else tp_plan()
    heads = getattr(stage, "tp_heads", None)
    known = getattr(stage, "tp_module_classes", None)
    blocks = list(getattr(stage, "blocks", []))
    names = list(getattr(stage, "block_names", None) or [f"blocks.{i}" for i in range(len(blocks))])
    for name, block in zip(names, blocks):
        _check_shardable(block, name, plan, tp, heads if heads is not None else (block.heads, block.kv_heads))
        if known:
            _check_known(block, name, known)
    for block in blocks:
        parallelize_module(block, tp_mesh, plan)
    return stage


def _check_known(block: torch.nn.Module, where: str, known: dict) -> None:
    """ValueError unless each submodule `known` names is of a class listed there: one whose
    forward is known to work on a rank's share of the heads and channels (another class may
    split, chunk or pair heads along the global head axis, DiffLlama's attention say, with
    nothing in its weights to show it)."""
    modules = dict(block.named_modules())
    for path, classes in known.items():
        kind = type(modules.get(path)).__name__
        if kind not in classes:
            raise ValueError(f"tensor parallelism cannot shard {where}.{path}: its class {kind} is not one the TP "
                             f"plan is tested on ({', '.join(sorted(classes))}), and its forward may not work on a "
                             "rank's share of the heads or channels; run this model with tp=1")


def _why_missing(modules: dict, where: str, name: str) -> str:
    """Why the block has no linear `name` where the plan needs one: the true layout in its place."""
    parent = name.rsplit(".", 1)[0] if "." in name else ""
    linears = [n for n, m in modules.items() if isinstance(m, torch.nn.Linear)]
    fused = [n for n in linears if any(k in n.rsplit(".", 1)[-1] for k in ("qkv", "gate_up", "query_key_value"))]
    if fused:  # e.g. Phi-3: self_attn.qkv_proj and mlp.gate_up_proj, no q_proj
        return (f"tensor parallelism cannot shard {where}.{fused[0]}: a fused projection (its output concatenates "
                "Q, K and V, or gate and up, so splitting its columns evenly would not give each rank whole heads "
                f"or matching channels); the plan needs {name}, which the block does not have. Run this model with "
                "tp=1")
    moe = [n for n in modules if n.rsplit(".", 1)[-1] in ("experts", "router")]
    if moe:
        owner = moe[0].rsplit(".", 1)[0] if "." in moe[0] else moe[0]
        return (f"tensor parallelism cannot shard {where}.{owner}: a mixture-of-experts layer ({type(modules[owner]).__name__}"
                f": experts and a router), which the TP plan, one dense MLP split by channels, does not shard; "
                "run this model with tp=1")
    latent = [n for n in linears if n.rsplit(".", 1)[-1] in ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj")]
    if latent:
        return (f"tensor parallelism cannot shard {where}.{parent}: multi-head latent attention (low-rank "
                f"projections {', '.join(latent)}, DeepSeek's), not the per-head Q, K and V projections the plan "
                "splits; run this model with tp=1")
    if name.endswith("gate_proj") and all(f"{parent}.{n}" in modules for n in ("up_proj", "down_proj")):
        return (f"tensor parallelism cannot shard {where}.{parent}: an MLP without a gate projection (up_proj and "
                "down_proj only, not SwiGLU), which the plan's gate_proj / up_proj / down_proj layout does not "
                "match; run this model with tp=1")
    there = f"linear projections {', '.join(linears[:4])}" if linears else "no linear projection"
    return (f"tensor parallelism cannot shard {where}.{name}: the plan shards it as a linear projection, and the "
            f"block has {'a ' + type(modules[name]).__name__ if name in modules else 'nothing'} there ({there}: a "
            "layout the TP plan does not know); run this model with tp=1")


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
            raise ValueError(_why_missing(modules, where, name))
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
        inside = bool(attention and name.startswith(attention))
        owner = name.rsplit(".", 1)[0] if "." in name else name
        per_head = inside and (param.dim() > 1 or any(part.isdigit() for part in name.split(".")))
        if per_head:  # Cohere's q_norm rows, StableLM's ModuleList of LayerNorms: one per global head
            raise ValueError(f"tensor parallelism cannot shard {where}.{owner}: per-head norms ({name} "
                             f"{tuple(param.shape)}), one per head of the whole model and paired with the heads "
                             "by position, so a rank holding a share of the heads would pair them wrongly; run "
                             "this model with tp=1")
        # left whole on every rank: fine for a norm over the residual stream outside the attention
        # (its input's gradient is all-reduced by the column-parallel projections after it)
        if param.dim() == 1 and param.numel() == hidden and not inside:
            continue
        if inside and param.dim() == 1 and param.numel() == head_dim:  # Qwen 3's q_norm, DiffLlama's lambda_q1
            raise ValueError(f"tensor parallelism cannot shard {where}.{owner}: a weight shared by all heads ({name} "
                             f"{tuple(param.shape)}), left whole on every rank while each rank runs a share of the "
                             "heads, so each rank's gradient of it covers its own heads only (the plan does not "
                             "all-reduce it over TP); run this model with tp=1")
        if inside and param.dim() == 1:
            raise ValueError(f"tensor parallelism cannot shard {where}.{owner}: a norm over all heads' features "
                             f"({name} {tuple(param.shape)}), which a rank holding a share of the heads cannot "
                             "compute; run this model with tp=1")
        raise ValueError(f"tensor parallelism cannot shard {where}.{owner}: its weight {name} "
                         f"{tuple(param.shape)} is not in the TP plan, which splits the heads and MLP channels "
                         "around it (a fused projection such as qkv_proj or gate_up_proj, a norm over all heads, "
                         "or MoE experts); run this model with tp=1")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise); writes to it reach the DTensor."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t
