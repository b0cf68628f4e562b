"""Pipeline schedules: which operation each stage runs when.

One module owns the order of operations, so that the simulator (`wlb_opt.simulate`) and the
executor (`wlb_opt.executor.train`) run the same schedule. An operation is a tuple
(phase "F" | "B", micro-batch, virtual stage); its device is virtual stage % pp.
"""
from __future__ import annotations

from typing import Literal

Schedule = Literal["1f1b", "interleaved"]
SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved")

# An operation: (phase "F" | "B", micro-batch, virtual stage). Device = virtual stage % pp.
Op = tuple[str, int, int]


def stage_order(stage: int, pp: int, n_micro: int, virtual_stages: int = 1) -> list[Op]:
    """The operations of physical stage `stage` in the order it runs them.

    1F1B (PipeDream-flush): pp - stage - 1 warm-up forwards, then alternate one forward and
    one backward, then the remaining backwards.
    Interleaved (Megatron-LM, Narayanan et al. 2021): micro-batches go in groups of pp; within
    a group all micro-batches run chunk 0, then chunk 1, ...; backwards run chunks in reverse.
    Warm-up is 2 (pp - stage - 1) + (v - 1) pp forwards. With v = 1 Megatron runs the plain
    1F1B schedule, and so does this function (the grouping is then the identity).
    """
    v = virtual_stages
    fwd_seq, bwd_seq = [], []
    for g in range(0, n_micro, pp):
        group = range(g, min(g + pp, n_micro))
        for c in range(v):
            fwd_seq.extend(("F", mb, c * pp + stage) for mb in group)
            bwd_seq.extend(("B", mb, (v - 1 - c) * pp + stage) for mb in group)
    total = n_micro * v
    warmup = (pp - stage - 1) if v == 1 else 2 * (pp - stage - 1) + (v - 1) * pp
    warmup = min(warmup, total)
    order = fwd_seq[:warmup]
    for i in range(total - warmup):
        order.append(fwd_seq[warmup + i])
        order.append(bwd_seq[i])
    order.extend(bwd_seq[total - warmup:])
    return order
