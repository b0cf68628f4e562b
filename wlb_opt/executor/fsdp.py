"""Sharded data parallelism for pipeline stages through PyTorch's FSDP2 (`fully_shard`).

`apply_fsdp(stage, mesh)` shards a stage's parameters over the flattened dp x cp dimensions of
the mesh, as torchtitan does: every rank of those dimensions holds the same stage, and its
gradients are the sum over all of them (the loss is already normalised by the global batch's
target tokens, so FSDP's usual division by the group size is turned off). With a pipeline,
`train_step` lets a chunk's gradients reduce-scatter only after its last micro-batch's
backward (`set_requires_gradient_sync`), so each step pays one reduce-scatter per chunk.
Parameters are gathered before each forward and freed after it (`reshard_after_forward`,
default True: least memory; False keeps them between a chunk's forward and backward, one
all-gather per micro-batch fewer, at the cost of the full chunk's weights).
"""
from __future__ import annotations

import torch


def fsdp_mesh(mesh):
    """The 1-D DeviceMesh FSDP2 shards over: the dims that are our dp and cp, flattened in the
    DeviceMesh's own order (a user's names mapped, e.g. torchtitan's dp_replicate/dp_shard)."""
    dm = mesh.device_mesh
    if dm is None:
        raise ValueError("apply_fsdp needs a Mesh built on a DeviceMesh (make_mesh or Mesh.from_device_mesh)")
    dims = [n for n in (dm.mesh_dim_names or ()) if mesh.dim_names.get(n, n) in ("dp", "cp")]
    if not dims:
        raise ValueError(f"the DeviceMesh has neither a dp nor a cp dimension: {dm.mesh_dim_names}")
    if len(dims) == 1:
        return dm[dims[0]]
    return dm[tuple(dims)]._flatten("_".join(dims))


def apply_fsdp(stage: torch.nn.Module, mesh, reshard_after_forward: bool = True) -> torch.nn.Module:
    """`fully_shard` the stage over `fsdp_mesh(mesh)`, summing (not averaging) gradients.

    Each block is its own FSDP unit (gathered while it runs; `reshard_after_forward` applies
    to them). The stage itself is the root unit holding the rest (embeddings, final norm, LM
    head); it stays gathered between its forward and its backward, because the loss applies
    the head after the stage's forward, in chunks whose number differs between ranks: no
    collective may depend on it."""
    from torch.distributed.fsdp import fully_shard

    shard_mesh = fsdp_mesh(mesh)
    for block in getattr(stage, "blocks", []):
        fully_shard(block, mesh=shard_mesh, reshard_after_forward=reshard_after_forward)
        block.set_gradient_divide_factor(1.0)
    fully_shard(stage, mesh=shard_mesh, reshard_after_forward=False)
    stage.set_gradient_divide_factor(1.0)
    return stage


def is_fsdp(module: torch.nn.Module) -> bool:
    """Whether `module` is sharded with FSDP2, itself or through the FSDP2 module it names
    as `fsdp_root` (an adapter stage over a model part sharded elsewhere, e.g. by
    torchtitan; such a stage forwards `set_requires_gradient_sync` to it)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule) or isinstance(getattr(module, "fsdp_root", None), FSDPModule)
