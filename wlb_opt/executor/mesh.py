"""The DP x PP x CP x TP layout of the ranks, on PyTorch's own DeviceMesh.

`make_mesh(dp=, pp=, cp=, tp=)` builds a `torch.distributed.device_mesh.DeviceMesh` with the
dimension names ("dp", "pp", "cp", "tp") and wraps it in a `Mesh`, which takes every process
group from it. Ranks are laid out row-major over those dimensions, TP innermost, then CP:

    global rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank

so a TP group, then a CP group, is a block of consecutive ranks (one node when tp x cp fits
in it, as in paper §7.1), and pipeline neighbours are cp x tp ranks apart. A user who already
has a DeviceMesh (torchtitan, FSDP2) hands it over with `Mesh.from_device_mesh`, in any
dimension order and with a mapping of their names onto ours; missing dimensions have size 1.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

DIMS: tuple[str, ...] = ("dp", "pp", "cp", "tp")
DEFAULT_TIMEOUT_S = 300.0
"""Seconds the groups `make_mesh` creates wait for a peer before a collective or p2p wait
fails (unless `timeout=` says otherwise): long enough for a first step that compiles
kernels, short enough that a stalled rank is reported in minutes, not torch's 30."""
SELF_GROUP = "self"
"""The group of a dimension of size 1 that the DeviceMesh does not have: no communication."""


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the layout, and the process groups it communicates over.

    `cp_group`, `dp_group`, `tp_group`: this rank's groups along CP, DP and TP (`SELF_GROUP`
    for a dimension of size 1 that the DeviceMesh does not have); `stage_group`: every rank
    that holds the same pipeline stage and TP shard (all DP replicas and CP ranks: where the
    gradients of one parameter shard are summed). `device_mesh`: the DeviceMesh (None for a
    mesh built by hand)."""

    cp: int
    dp: int
    cp_rank: int
    dp_rank: int
    cp_group: Any
    dp_group: Any
    pp: int = 1
    pp_rank: int = 0
    stage_group: Any = None
    tp: int = 1
    tp_rank: int = 0
    tp_group: Any = None
    device_mesh: Any = None
    ranks: Any = None
    """Global rank of every coordinate, as nested lists indexed [dp][pp][cp][tp]."""
    dim_names: dict = field(default_factory=dict)
    """The DeviceMesh's dimension names -> ours ("dp", "pp", "cp", "tp")."""
    timeout_s: float | None = None
    """Seconds the mesh's groups wait for a peer (`make_mesh(timeout=...)`; None: not known).
    A rank whose wait failed waits at most this long (and at most 30 s) for the others to
    report before it names the ranks that did not arrive."""

    def __post_init__(self) -> None:
        # the gradients of a parameter shard are summed over stage_group; None is the default
        # group (every rank), which also holds the other stages and TP shards once pp x tp > 1
        if self.stage_group is None and self.pp * self.tp > 1:
            raise ValueError(f"Mesh: stage_group=None (the default group, every rank) with pp={self.pp}, "
                             f"tp={self.tp}: the gradients are summed over stage_group, which must hold only the "
                             "ranks of this rank's pipeline stage and TP shard (its DP and CP ranks; SELF_GROUP when "
                             "dp x cp = 1); pass it, or build the mesh with Mesh.from_device_mesh or make_mesh")

    @property
    def rank(self) -> int:
        return self.global_rank(self.dp_rank, self.pp_rank, self.cp_rank)

    def global_rank(self, dp_rank: int, pp_rank: int, cp_rank: int, tp_rank: int | None = None) -> int:
        tp_rank = self.tp_rank if tp_rank is None else tp_rank
        if self.ranks is not None:
            return int(self.ranks[dp_rank][pp_rank][cp_rank][tp_rank])
        return ((dp_rank * self.pp + pp_rank) * self.cp + cp_rank) * self.tp + tp_rank

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

    @classmethod
    def from_device_mesh(cls, device_mesh, names: dict[str, str] | None = None) -> "Mesh":
        """Our Mesh over a user's DeviceMesh with any subset of the dimensions dp, pp, cp, tp,
        in any order. `names` maps the user's dimension names onto ours; several of the
        user's may map onto one of ours (``{"dp_replicate": "dp", "dp_shard": "dp"}``: they
        are flattened, in the mesh's order). torchtitan 0.3's named sub-mesh of ("pp",
        "batch", "cp", "tp") needs ``names={"batch": "dp"}``
        (`wlb_opt.integrations.torchtitan.wlb_mesh` builds it from its ParallelDims).
        Dimensions it does not have are of size 1. Checks the names before any collective; a
        ValueError names what is wrong."""
        own = tuple(device_mesh.mesh_dim_names or ())
        if len(own) != device_mesh.ndim:
            raise ValueError("the DeviceMesh needs mesh_dim_names (init_device_mesh(..., mesh_dim_names=...))")
        names = dict(names or {})
        unknown_keys = set(names) - set(own)
        if unknown_keys:
            raise ValueError(f"names maps dimensions {sorted(unknown_keys)} that the DeviceMesh does not have; "
                             f"its dimensions are {list(own)}")
        ours = [names.get(n, n) for n in own]
        bad = [n for n in ours if n not in DIMS]
        if bad:
            raise ValueError(f"DeviceMesh dimensions {list(own)} map to {ours}; each must be one of {list(DIMS)} "
                             "(pass names={'your_name': 'dp'|'pp'|'cp'|'tp'})")
        if ours.count("pp") > 1 or ours.count("cp") > 1 or ours.count("tp") > 1:
            raise ValueError(f"DeviceMesh dimensions {list(own)} map to {ours}; only dp may gather several")
        members = {d: [i for i, o in enumerate(ours) if o == d] for d in DIMS}
        size, local, group = {}, {}, {}
        coord = device_mesh.get_coordinate()
        if coord is None:
            raise ValueError("this rank is not part of the DeviceMesh")
        for d in DIMS:
            idx = members[d]
            if not idx:
                size[d], local[d], group[d] = 1, 0, SELF_GROUP
            elif len(idx) == 1:
                size[d], local[d], group[d] = device_mesh.size(idx[0]), coord[idx[0]], device_mesh.get_group(own[idx[0]])
            else:  # several user dimensions flattened into one of ours, in the mesh's order
                flat = device_mesh[tuple(own[i] for i in idx)]._flatten("_".join(own[i] for i in idx))
                size[d], local[d], group[d] = flat.size(), flat.get_local_rank(), flat.get_group()
        order = [i for d in DIMS for i in members[d]]
        ranks = device_mesh.mesh.permute(*order).reshape([size[d] for d in DIMS]).tolist()
        stage_dims = [own[i] for i in sorted(members["dp"] + members["cp"])]
        if not stage_dims or size["dp"] * size["cp"] == 1:
            stage_group = SELF_GROUP
        elif len(stage_dims) == 1:
            stage_group = device_mesh.get_group(stage_dims[0])
        else:
            stage_group = device_mesh[tuple(stage_dims)]._flatten("_".join(stage_dims)).get_group()
        return cls(cp=size["cp"], dp=size["dp"], cp_rank=local["cp"], dp_rank=local["dp"], cp_group=group["cp"],
                   dp_group=group["dp"], pp=size["pp"], pp_rank=local["pp"], stage_group=stage_group, tp=size["tp"],
                   tp_rank=local["tp"], tp_group=group["tp"], device_mesh=device_mesh, ranks=ranks,
                   dim_names=dict(zip(own, ours)))


def _check_degree(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"make_mesh: {name} must be an integer >= 1, got {value!r}")
    return value


def _timeout_seconds(timeout) -> float:
    seconds = DEFAULT_TIMEOUT_S if timeout is None else timeout
    seconds = seconds.total_seconds() if isinstance(seconds, datetime.timedelta) else seconds
    if (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0
            or not math.isfinite(seconds)):
        raise ValueError(f"make_mesh: timeout must be a positive finite number of seconds or a timedelta, "
                         f"got {timeout!r}")
    return float(seconds)


def _timeout_options(timeout):
    """backend_override for init_device_mesh that gives every group `timeout` (a timedelta or
    seconds; None: DEFAULT_TIMEOUT_S, and no override on a backend that takes no options)."""
    default = timeout is None
    seconds = _timeout_seconds(timeout)
    backend = str(dist.get_backend()).lower()
    if default and "nccl" not in backend and "gloo" not in backend:
        return None
    if "nccl" in backend:
        options = dist.ProcessGroupNCCL.Options()
        name = "nccl"
    elif "gloo" in backend:
        options = dist.ProcessGroupGloo._Options()
        name = "gloo"
    else:
        raise ValueError(f"make_mesh: timeout is supported for gloo and nccl groups, the default group is {backend!r}")
    options._timeout = datetime.timedelta(seconds=float(seconds))
    return {dim: (name, options) for dim in DIMS}


def make_mesh(*, dp: int | None = None, pp: int = 1, cp: int = 1, tp: int = 1, device_type: str | None = None,
              timeout: datetime.timedelta | float | None = None) -> Mesh:
    """A DeviceMesh named ("dp", "pp", "cp", "tp") over the initialised default group, as a Mesh.

    Every rank must call it (creating the groups is collective). `dp=None` takes the world
    size / (pp x cp x tp); `device_type` defaults to "cuda" when the default group is NCCL,
    else "cpu". The groups the mesh creates use the default group's backend and wait
    `timeout` (a timedelta or seconds) for a peer; the default, None, is DEFAULT_TIMEOUT_S =
    300 s (the default group keeps the timeout the user gave init_process_group). A wait
    that runs out raises in `train_step` with the step, the rank, the operation and the
    rank(s) that did not arrive. The sizes are checked before any collective."""
    if not dist.is_initialized():
        raise ValueError("make_mesh needs torch.distributed initialised (init_process_group)")
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    pp, cp, tp = (_check_degree(n, v) for n, v in (("pp", pp), ("cp", cp), ("tp", tp)))
    if dp is None:
        if world % (pp * cp * tp):
            raise ValueError(f"make_mesh: the world size {world} is not divisible by pp x cp x tp = {pp * cp * tp} "
                             f"(pp={pp}, cp={cp}, tp={tp})")
        dp = world // (pp * cp * tp)
    dp = _check_degree("dp", dp)
    if dp * pp * cp * tp != world:
        raise ValueError(f"make_mesh: dp x pp x cp x tp must equal the world size {world}, got dp={dp}, pp={pp}, "
                         f"cp={cp}, tp={tp}")
    if device_type is None:
        device_type = "cuda" if "nccl" in str(dist.get_backend()).lower() else "cpu"
    override = _timeout_options(timeout)
    device_mesh = init_device_mesh(device_type, (dp, pp, cp, tp), mesh_dim_names=DIMS, backend_override=override)
    if override is not None:  # the stage group (and FSDP2's) is dp x cp flattened: it waits as long as the others
        # (a fresh override: init_device_mesh consumes the dict it is given)
        device_mesh[("dp", "cp")]._flatten("dp_cp", backend_override=_timeout_options(timeout)["dp"])
    return dataclasses.replace(Mesh.from_device_mesh(device_mesh), timeout_s=_timeout_seconds(timeout))


_CHANNEL_GROUPS: dict = {}
"""channel_groups' groups by layout (and default process group), created once per process."""


def channel_groups(mesh: Mesh, device=None) -> dict[tuple[int, int], Any]:
    """This rank's pipeline channels: one process group for each ordered pair (sender,
    receiver) of neighbouring pipeline ranks (ring neighbours: the interleaved schedule's last
    stage feeds the first), so that the messages of one pair never wait behind another's
    (`wlb_opt.executor.pipeline`). Keys are pipeline ranks. Two ranks get two groups, one
    per direction: NCCL runs the operations of one communicator in the order they were
    posted, and a receive posted ahead of a send on a shared one could wait forever.

    Every rank of the world creates every pipeline's groups (`new_group` is collective), in
    the same order, on its first call for a layout; later calls return the same groups.
    Each group then carries one blocking message, sender to receiver, in that same order on
    every rank (`device`: where the message lives, the device NCCL runs on). NCCL sets up a
    communicator on its first operation and blocks until both ranks do: were the first
    operation the executor's receives posted ahead, every rank would wait in the setup of
    its incoming channel for a peer waiting in the setup of another. In one global order,
    the earliest group not yet set up always has both ranks at it."""
    world = dist.distributed_c10d._get_default_group()
    coords = [(d, c, t) for d in range(mesh.dp) for c in range(mesh.cp) for t in range(mesh.tp)]
    layout = tuple(tuple(mesh.global_rank(d, p, c, t) for p in range(mesh.pp)) for d, c, t in coords)
    key = (id(world), layout)
    cached = _CHANNEL_GROUPS.get(key)
    if cached is not None and cached[0] is world:
        return cached[1]
    pairs = sorted({(p, (p + 1) % mesh.pp) for p in range(mesh.pp)} | {((p + 1) % mesh.pp, p) for p in range(mesh.pp)})
    pairs = [(a, b) for a, b in pairs if a != b]
    options = {} if mesh.timeout_s is None else dict(timeout=datetime.timedelta(seconds=mesh.timeout_s))
    me = dist.get_rank()
    mine: dict[tuple[int, int], Any] = {}
    order = []
    for ranks in layout:
        for a, b in pairs:
            group = dist.new_group(sorted((ranks[a], ranks[b])), **options)
            if me in (ranks[a], ranks[b]):
                mine[(a, b)] = group
                order.append((ranks[a], ranks[b], group))
    token = torch.zeros(1, device=device)
    for sender, receiver, group in order:  # set up, one channel at a time in the global order
        if me == sender:
            dist.send(token, receiver, group=group)
        else:
            dist.recv(token, sender, group=group)
    _CHANNEL_GROUPS[key] = (world, mine)
    return mine
