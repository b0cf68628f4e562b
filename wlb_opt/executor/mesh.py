"""Process groups for the CP x DP part of the layout (TP and PP are outside this module).

Ranks are laid out DP-major: global rank = dp_rank * cp + cp_rank, so the CP group of a
replica is a block of consecutive ranks (one node when cp <= GPUs per node), as in paper §7.1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class Mesh:
    cp: int
    dp: int
    cp_rank: int
    dp_rank: int
    cp_group: Any
    dp_group: Any
    world_group: Any = None

    @property
    def rank(self) -> int:
        return self.dp_rank * self.cp + self.cp_rank


def make_mesh(cp: int, dp: int) -> Mesh:
    """Create the CP and DP groups on an initialised default process group of cp x dp ranks.

    Every rank must call this (new_group is collective)."""
    if not dist.is_initialized():
        raise ValueError("make_mesh needs torch.distributed initialised (init_process_group)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if cp < 1 or dp < 1 or cp * dp != world:
        raise ValueError(f"cp x dp must equal the world size {world}, got cp={cp}, dp={dp}")
    cp_group = dp_group = None
    for d in range(dp):
        g = dist.new_group([d * cp + c for c in range(cp)])
        if rank // cp == d:
            cp_group = g
    for c in range(cp):
        g = dist.new_group([d * cp + c for d in range(dp)])
        if rank % cp == c:
            dp_group = g
    return Mesh(cp=cp, dp=dp, cp_rank=rank % cp, dp_rank=rank // cp, cp_group=cp_group, dp_group=dp_group,
                world_group=dist.group.WORLD)
