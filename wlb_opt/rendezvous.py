"""The pipeline as the executor runs it: compute ops interleaved with blocking p2p groups.

`simulate_pipeline` (wlb_opt.simulate) times a schedule as a DAG in which a send never blocks
its sender: an operation starts once its device is free and its input has arrived. The
executor (wlb_opt.executor.train_step) instead posts the groups of `p2p_schedule` and waits
for each whole group, and a send completes only when its receiver has posted the matching
receive (NCCL for large messages; gloo's `isend` too). A rank can therefore wait for a
neighbour to *take* its output, which the DAG does not model. For 1F1B the groups pair
sends with the receives the peer needs next, so the two models agree; for the interleaved
schedule they do not (`wlb-opt bench validate-sim` sets both against measured steps).

`simulate_rendezvous(fwd, bwd, virtual_stages, p2p_s)` replays `step_plan` with given
operation times: a rank posts its group when its previous op ends; the group completes when
every one of its operations' counterparts has been posted (plus `p2p_s` of transfer time if
any op of the group receives); then the rank runs its op.
"""
from __future__ import annotations

import math

import numpy as np

from ._validate import is_float
from .schedule import message_key, step_plan
from .simulate import SimResult, _check_total, _chunk_costs


def simulate_rendezvous(fwd, bwd, virtual_stages: int = 1, p2p_s: float = 0.0) -> SimResult:
    """Step time of the executor's pipeline under rendezvous point-to-point semantics.

    Args:
        fwd, bwd: [stages, micro_batches] seconds (split evenly over the chunks) or
            [stages, virtual_stages, micro_batches].
        virtual_stages: model chunks per stage (1: 1F1B; > 1: interleaved 1F1B).
        p2p_s: seconds a group that receives waits for the data once both sides are posted.

    Returns a SimResult (its `critical_path` is empty: the replay keeps no DAG).
    """
    f = _chunk_costs(fwd, "fwd", virtual_stages)
    b = _chunk_costs(bwd, "bwd", virtual_stages)
    if f.shape != b.shape:
        raise ValueError(f"fwd and bwd must have the same shape, got {f.shape} and {b.shape}")
    if not (is_float(p2p_s) and math.isfinite(p2p_s) and p2p_s >= 0):
        raise ValueError(f"p2p_s must be seconds >= 0 (a finite real number), got {p2p_s!r}")
    _check_total(f, b, np.asarray([float(p2p_s)] * f.shape[2]))
    pp, v, m = f.shape
    return _replay(f, b, [step_plan(r, pp, m, v) for r in range(pp)], np.full(m, float(p2p_s)))


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
    step = max(clock)
    busy = np.zeros(pp)
    for row in timeline:
        busy[row["stage"]] += row["end_s"] - row["start_s"]
    bubble = 1.0 - busy.sum() / pp / step if step > 0 else 0.0  # pp x step could overflow
    return SimResult(step_time_s=step, bubble_fraction=float(bubble), stage_busy_s=busy, critical_path=[],
                     timeline=timeline)
