"""Process groups for the CP x PP x DP part of the layout (TP is inside a rank's module).

Ranks are laid out DP-major, then PP, then CP: global rank = (dp_rank * pp + pp_rank) * cp +
cp_rank, so a CP group is a block of consecutive ranks (one node when cp <= GPUs per node),
as in paper §7.1, and pipeline neighbours are cp ranks apart.
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
    pp: int = 1
    pp_rank: int = 0
    stage_group: Any = None
    """All ranks that hold the same pipeline stage (every DP replica and CP rank): gradient sums."""

    @property
    def rank(self) -> int:
        return self.global_rank(self.dp_rank, self.pp_rank, self.cp_rank)

    def global_rank(self, dp_rank: int, pp_rank: int, cp_rank: int) -> int:
        return (dp_rank * self.pp + pp_rank) * self.cp + cp_rank

    @property
    def next_stage_rank(self) -> int | None:
        return None if self.pp_rank == self.pp - 1 else self.global_rank(self.dp_rank, self.pp_rank + 1, self.cp_rank)

    @property
    def prev_stage_rank(self) -> int | None:
        return None if self.pp_rank == 0 else self.global_rank(self.dp_rank, self.pp_rank - 1, self.cp_rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def make_mesh(cp: int, dp: int, pp: int = 1) -> Mesh:
    """Create the CP, DP and per-stage groups on an initialised default group of cp*pp*dp ranks.

    Every rank must call this (new_group is collective, and every rank creates every group)."""
    if not dist.is_initialized():
        raise ValueError("make_mesh needs torch.distributed initialised (init_process_group)")
    world, rank = dist.get_world_size(), dist.get_rank()
    for name, value in (("cp", cp), ("dp", dp), ("pp", pp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"make_mesh: {name} must be an integer >= 1, got {value!r}")
    if cp * dp * pp != world:
        raise ValueError(f"cp x pp x dp must equal the world size {world}, got cp={cp}, pp={pp}, dp={dp}")
    cp_rank, pp_rank, dp_rank = rank % cp, (rank // cp) % pp, rank // (cp * pp)
    at = lambda d, p, c: (d * pp + p) * cp + c  # noqa: E731
    cp_group = dp_group = stage_group = None
    for d in range(dp):
        for p in range(pp):
            g = dist.new_group([at(d, p, c) for c in range(cp)])
            if (d, p) == (dp_rank, pp_rank):
                cp_group = g
    for p in range(pp):
        for c in range(cp):
            g = dist.new_group([at(d, p, c) for d in range(dp)])
            if (p, c) == (pp_rank, cp_rank):
                dp_group = g
    for p in range(pp):
        g = dist.new_group([at(d, p, c) for d in range(dp) for c in range(cp)])
        if p == pp_rank:
            stage_group = g
    return Mesh(cp=cp, dp=dp, cp_rank=cp_rank, dp_rank=dp_rank, cp_group=cp_group, dp_group=dp_group,
                pp=pp, pp_rank=pp_rank, stage_group=stage_group)
