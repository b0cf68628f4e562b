"""The pipeline as the executor runs it: compute ops around rendezvous point-to-point messages.

`simulate_pipeline` (wlb_opt.simulate) times a schedule as a DAG in which a send never blocks
its sender: an operation starts once its device is free and its input has arrived. On a real
machine a send completes only when its receiver has posted the matching receive (NCCL for
large messages; gloo's `isend` too). A rank that waits for its sends can therefore wait for a
neighbour to *take* its output, which the DAG does not model. For 1F1B the executor posts
the groups of `p2p_schedule` and waits for each whole group; they pair sends with the
receives the peer needs next, yet a rank that sends a gradient back and receives the next
one in the same group waits for its upstream neighbour to take the first, so where the
micro-batches differ the groups can run a few percent slower than the DAG (`wlb-opt bench
pipeline-replay`: up to 2.5% on its draws). For the interleaved schedule no schedule of
blocking groups comes close, and the executor runs channels instead.

`simulate_rendezvous(fwd, bwd, virtual_stages, p2p_s)` replays `step_plan` with given
operation times: a rank posts its group when its previous op ends; the group completes when
every one of its operations' counterparts has been posted (plus `p2p_s` of transfer time if
any op of the group receives); then the rank runs its op. That is how the executor runs
1F1B.

The interleaved executor's channels (`simulate_channels`): one process group per
(sender, receiver) pair, whose messages go in the sender's order (`channel_messages`). A
send is posted when its op ends and never waited on before the end of the step; each
receiver keeps the next receive of each of its channels posted, and posts the one after as
soon as it takes a message. A message still moves only when both ends are posted (the
same rendezvous), but the receive is already there: it arrives `p2p_s` after its send,
and only an op that needs it waits. When every channel's messages are taken in the order
they are made (true of every shape `stage_order` builds; the replay raises otherwise), this
is the ideal pipeline `simulate_pipeline` times, as long as a message's transfer is not
longer than the op that took the one before it (one receive ahead, `RECEIVES_AHEAD`, waits
for that op to start).
"""
from __future__ import annotations

import math

import numpy as np

from ._validate import is_float
from .schedule import RECEIVES_AHEAD, _makes, _needs, channel_messages, message_key, stage_order, step_plan
from .simulate import SimResult, _check_total, _chunk_costs


def simulate_rendezvous(fwd, bwd, virtual_stages: int = 1, p2p_s: float = 0.0) -> SimResult:
    """Step time of the pipeline over the groups of `p2p_schedule` (what the executor runs for
    1F1B; for v > 1 the best blocking groups found, which it does not run) under rendezvous
    point-to-point semantics.

    Args:
        fwd, bwd: [stages, micro_batches] seconds (split evenly over the chunks) or
            [stages, virtual_stages, micro_batches].
        virtual_stages: model chunks per stage (1: 1F1B; > 1: interleaved 1F1B).
        p2p_s: seconds a group that receives waits for the data once both sides are posted.

    Returns a SimResult (its `critical_path` is empty: the replay keeps no DAG).
    """
    f, b, p2p = _checked(fwd, bwd, virtual_stages, p2p_s)
    pp, v, m = f.shape
    return _replay(f, b, [step_plan(r, pp, m, v) for r in range(pp)], p2p)


def _replay(f: np.ndarray, b: np.ndarray, plans: list, p2p_s, start_s=None) -> SimResult:
    """The replay itself: `plans[r]` is rank r's list of (group, op) pairs (`step_plan`), f and b
    are [pp, v, m] seconds, `p2p_s` seconds per micro-batch (a scalar for all) that a group
    waits for the data of each micro-batch it receives (the largest of them) once both sides
    are posted; `start_s[r]` the second rank r starts (default all at 0: a step's work before
    its pipeline, such as reading its inputs, delays each rank by its own amount). Raises
    RuntimeError if the groups deadlock."""
    pp, m = f.shape[0], f.shape[2]
    p2p_mb = np.broadcast_to(np.asarray(p2p_s, dtype=np.float64), (m,))
    # group index of every receive and send, by (rank, message): where a counterpart lives
    where: dict[tuple, int] = {}
    for r, plan in enumerate(plans):
        for gi, (group, _) in enumerate(plan):
            for op in group:
                where[(r, op.kind, message_key(op, r, pp))] = gi
    posted: dict[tuple[int, int], float] = {}
    pos, clock = [0] * pp, [0.0] * pp if start_s is None else [float(t) for t in start_s]
    timeline: list[dict] = []
    while any(pos[r] < len(plans[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            if pos[r] >= len(plans[r]):
                continue
            if (r, pos[r]) not in posted:  # posting a group is progress: a peer may now complete
                posted[(r, pos[r])] = clock[r]
                moved = True
            group, op = plans[r][pos[r]]
            t, ready = clock[r], True
            for p2p in group:
                other = "recv" if p2p.kind == "send" else "send"
                key = (p2p.peer, where[(p2p.peer, other, message_key(p2p, r, pp))])
                if key not in posted:
                    ready = False
                    break
                t = max(t, posted[key])
            if not ready:
                continue
            if any(p2p.kind == "recv" for p2p in group):
                t += max(float(p2p_mb[o.micro]) for o in group if o.kind == "recv")
            if op is not None:
                phase, micro, vs = op
                dur = float((f if phase == "F" else b)[vs % pp, vs // pp, micro])
                timeline.append(dict(stage=r, virtual_stage=vs, phase=phase, micro_batch=micro,
                                     start_s=t, end_s=t + dur))
                t += dur
            clock[r], pos[r], moved = t, pos[r] + 1, True
        if not moved:  # p2p_schedule never gets here (tests/unit/test_schedule.py)
            raise RuntimeError(f"pipeline replay is stuck at groups {pos}")
    return _result_of(timeline, clock, pp)


def _result_of(timeline: list[dict], clock: list[float], pp: int) -> SimResult:
    step = max(clock)
    busy = np.zeros(pp)
    for row in timeline:
        busy[row["stage"]] += row["end_s"] - row["start_s"]
    bubble = 1.0 - busy.sum() / pp / step if step > 0 else 0.0  # pp x step could overflow
    return SimResult(step_time_s=step, bubble_fraction=float(bubble), stage_busy_s=busy, critical_path=[],
                     timeline=timeline)


def simulate_channels(fwd, bwd, virtual_stages: int = 1, p2p_s: float = 0.0) -> SimResult:
    """Step time of the pipeline over per-channel process groups (module docstring): the
    interleaved executor's p2p. Same arguments as `simulate_rendezvous`."""
    return _replay_channels(*_checked(fwd, bwd, virtual_stages, p2p_s))


def _checked(fwd, bwd, virtual_stages: int, p2p_s) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(f, b, p2p per micro-batch) of the simulate_* arguments, checked."""
    f = _chunk_costs(fwd, "fwd", virtual_stages)
    b = _chunk_costs(bwd, "bwd", virtual_stages)
    if f.shape != b.shape:
        raise ValueError(f"fwd and bwd must have the same shape, got {f.shape} and {b.shape}")
    if not (is_float(p2p_s) and math.isfinite(p2p_s) and p2p_s >= 0):
        raise ValueError(f"p2p_s must be seconds >= 0 (a finite real number), got {p2p_s!r}")
    _check_total(f, b, np.asarray([float(p2p_s)] * f.shape[2]))
    return f, b, np.full(f.shape[2], float(p2p_s))


def _replay_channels(f: np.ndarray, b: np.ndarray, p2p_s, start_s=None, ahead: int = RECEIVES_AHEAD) -> SimResult:
    """The channel replay itself (f, b: [pp, v, m] seconds; `p2p_s` per micro-batch or a scalar;
    `start_s` as in `_replay`; `ahead` receives kept posted per channel). Raises RuntimeError
    if a rank needs a message before one made earlier on the same channel (its receive would
    not be the one posted)."""
    pp, v, m = f.shape
    n_virtual = pp * v
    p2p_mb = np.broadcast_to(np.asarray(p2p_s, dtype=np.float64), (m,))
    orders = [stage_order(r, pp, m, v) for r in range(pp)]
    channels = channel_messages(pp, m, v)
    index = {c: {key: k for k, key in enumerate(messages)} for c, messages in channels.items()}
    sent: dict[tuple, float] = {}  # (channel, index) -> second the send was posted
    posted: dict[tuple, float] = {}  # (channel, index) -> second the receive was posted
    taken = {c: 0 for c in channels}  # messages each receiver has taken per channel
    clock = [0.0] * pp if start_s is None else [float(t) for t in start_s]
    for (src, dst), messages in channels.items():
        for k in range(min(ahead, len(messages))):
            posted[((src, dst), k)] = clock[dst]
    pos = [0] * pp
    timeline: list[dict] = []
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            if pos[r] >= len(orders[r]):
                continue
            op = orders[r][pos[r]]
            phase, micro, vs = op
            t = clock[r]
            for direction, _, peer in _needs(op, pp, n_virtual):
                c = (peer, r)
                k = taken[c]
                if channels[c][k] != (direction, micro, vs - 1 if direction == "fwd" else vs + 1):
                    raise RuntimeError(f"rank {r} needs {direction} of micro-batch {micro} before message {k} "
                                       f"{channels[c][k]} of channel {c}")
                if (c, k) not in sent:
                    break
                arrived = max(sent[(c, k)], posted[(c, k)]) + float(p2p_mb[micro])
                t = max(t, arrived)
                taken[c] = k + 1
                if k + ahead < len(channels[c]):
                    posted[(c, k + ahead)] = t  # the next receive, once the rank has waited for this one
            else:
                dur = float((f if phase == "F" else b)[vs % pp, vs // pp, micro])
                timeline.append(dict(stage=r, virtual_stage=vs, phase=phase, micro_batch=micro,
                                     start_s=t, end_s=t + dur))
                t += dur
                for direction, _, peer in _makes(op, pp, n_virtual):
                    c = (r, peer)
                    sent[(c, index[c][(direction, micro, vs)])] = t
                clock[r], pos[r], moved = t, pos[r] + 1, True
        if not moved:
            raise RuntimeError(f"pipeline channel replay is stuck at ops {pos}")
    return _result_of(timeline, clock, pp)
