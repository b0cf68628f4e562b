"""Pipeline schedules: which operation each stage runs when.

One module owns the order of operations, so that the simulator (`wlb_opt.simulate`) and the
executor (`wlb_opt.executor.train`) run the same schedule. An operation is a tuple
(phase "F" | "B", micro-batch, virtual stage); its device is virtual stage % pp.

It also owns the point-to-point messages around those operations: the groups of blocking
sends and receives of `p2p_schedule` (Megatron's pairing for 1F1B, which the executor issues;
for the interleaved schedule meetings per pair of ranks, read from wlb_opt/p2p_meetings.json,
written offline by `wlb_opt.p2p_search`, where it holds the shape, else read off the nominal
ideal timeline), and the order of each channel's messages (`channel_messages`), which the
executor runs the interleaved schedule on: no schedule of blocking groups comes close enough
to the ideal pipeline there (`wlb_opt.rendezvous`).
"""
from __future__ import annotations

import functools
import json
import numbers
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np

Schedule = Literal["1f1b", "interleaved"]
SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved")
PLACEMENTS: tuple[str, ...] = ("auto", "searched", "nominal", "next_op")
"""Where the interleaved schedule's messages meet (see `_plans`)."""

# An operation: (phase "F" | "B", micro-batch, virtual stage). Device = virtual stage % pp.
Op = tuple[str, int, int]


def stage_order(stage: int, pp: int, n_micro: int, virtual_stages: int = 1) -> list[Op]:
    """The operations of physical stage `stage` in the order it runs them.

    1F1B (PipeDream-flush): pp - stage - 1 warm-up forwards, then alternate one forward and
    one backward, then the remaining backwards.
    Interleaved (Megatron-LM, Narayanan et al. 2021): micro-batches go in groups of pp; within
    a group all micro-batches run chunk 0, then chunk 1, ...; backwards run chunks in reverse.
    Warm-up is 2 (pp - stage - 1) + (v - 1) pp forwards. With v = 1 Megatron runs the plain
    1F1B schedule, and so does this function (the grouping is then the identity). The
    interleaved order needs n_micro to be a multiple of pp (Megatron's constraint: with a
    partial last group it deadlocks); ValueError otherwise.
    """
    v = virtual_stages
    _check_counts(pp, n_micro, v)
    if v > 1 and pp > 1 and n_micro % pp:
        check_pipeline_shape(pp, n_micro, v)
    if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or not 0 <= stage < pp:
        raise ValueError(f"stage must be in [0, pp={pp}), got {stage!r}")
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


# ---------------------------------------------------------------------- point-to-point
class P2POp(NamedTuple):
    """One pipeline send or receive of a step: `kind` "send" | "recv", `peer` the other
    pipeline rank, `direction` "fwd" (activations) | "bwd" (their gradients), `micro` the
    micro-batch slot 0..n_micro-1 of the replica, `chunk` the issuing rank's local model
    chunk 0..v-1 (the chunk that produces a send, or consumes a receive)."""

    kind: str
    peer: int
    direction: str
    micro: int
    chunk: int


def message_key(op: P2POp, rank: int, pp: int) -> tuple[str, int, int]:
    """(direction, micro, virtual stage of the producer): the same for a send and the receive
    that matches it."""
    vs = op.chunk * pp + rank
    if op.kind == "send":
        return op.direction, op.micro, vs
    return op.direction, op.micro, vs - 1 if op.direction == "fwd" else vs + 1


def _check_counts(pp: int, n_micro: int, virtual_stages: int) -> None:
    """ValueError unless pp and virtual_stages are integers >= 1 and n_micro one >= 0."""
    for name, value in (("pp", pp), ("n_micro", n_micro), ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < (0 if name == "n_micro" else 1):
            raise ValueError(f"{name} must be an integer >= {0 if name == 'n_micro' else 1}, got {value!r}")


def check_pipeline_shape(pp: int, n_micro: int, virtual_stages: int) -> None:
    """ValueError unless (pp, n_micro, virtual_stages) is a schedule this library can run."""
    _check_counts(pp, n_micro, virtual_stages)
    if virtual_stages > 1 and pp < 2:
        raise ValueError(f"virtual_stages={virtual_stages} needs pp >= 2 (chunks of one rank would send to "
                         "themselves); use virtual_stages=1")
    if virtual_stages > 1 and n_micro % pp:
        raise ValueError(f"the interleaved schedule needs n_micro to be a multiple of pp={pp}, got "
                         f"n_micro={n_micro}; use virtual_stages=1 or pack a multiple of pp micro-batches")


def _needs(op: Op, pp: int, n_virtual: int) -> list[tuple[str, str, int]]:
    """Receives compute op `op` needs first: (direction, "recv", peer device)."""
    phase, _, vs = op
    if phase == "F" and vs > 0:
        return [("fwd", "recv", (vs - 1) % pp)]
    if phase == "B" and vs < n_virtual - 1:
        return [("bwd", "recv", (vs + 1) % pp)]
    return []


def _makes(op: Op, pp: int, n_virtual: int) -> list[tuple[str, str, int]]:
    """Sends compute op `op` produces: (direction, "send", peer device)."""
    phase, _, vs = op
    if phase == "F" and vs < n_virtual - 1:
        return [("fwd", "send", (vs + 1) % pp)]
    if phase == "B" and vs > 0:
        return [("bwd", "send", (vs - 1) % pp)]
    return []


def _initial_plan(rank: int, pp: int, n_micro: int, virtual_stages: int) -> list[tuple[list[P2POp], Op | None]]:
    """(group, op) pairs before any receive is moved: the group before op i holds the sends op
    i-1 produced and the receives op i needs (Megatron's send_forward_recv_backward pairing)."""
    n_virtual = pp * virtual_stages
    plan, pending = [], []
    for op in stage_order(rank, pp, n_micro, virtual_stages):
        _, micro, vs = op
        needs = [P2POp(kind, peer, d, micro, vs // pp) for d, kind, peer in _needs(op, pp, n_virtual)]
        plan.append((pending + needs, op))
        pending = [P2POp(kind, peer, d, micro, vs // pp) for d, kind, peer in _makes(op, pp, n_virtual)]
    plan.append((pending, None))
    return plan


def _nominal_timeline(pp: int, n_micro: int, virtual_stages: int) -> list[list[tuple[float, float]]]:
    """(start, end) of every op of `stage_order`, per rank, in the ideal pipeline (an op starts
    once its rank is free and its input exists; sends never wait) with every forward of a chunk
    taking 1 and every backward 2: the shape of the schedule the executor should follow."""
    n_virtual = pp * virtual_stages
    orders = [stage_order(r, pp, n_micro, virtual_stages) for r in range(pp)]
    end: dict[Op, float] = {}
    times: list[list[tuple[float, float]]] = [[] for _ in range(pp)]
    free, ptr = [0.0] * pp, [0] * pp
    while any(ptr[r] < len(orders[r]) for r in range(pp)):
        for r in range(pp):
            while ptr[r] < len(orders[r]):
                phase, micro, vs = op = orders[r][ptr[r]]
                if phase == "F":
                    dep = ("F", micro, vs - 1) if vs > 0 else None
                else:
                    dep = ("B", micro, vs + 1) if vs < n_virtual - 1 else ("F", micro, vs)
                if dep is not None and dep not in end:
                    break
                start = max(free[r], end[dep] if dep is not None else 0.0)
                free[r] = end[op] = start + (1.0 if phase == "F" else 2.0)
                times[r].append((start, free[r]))
                ptr[r] += 1
    return times


def _meeting(sender_gaps, lo_s: int, receiver_gaps, hi_r: int) -> tuple[int, int]:
    """(sender boundary, receiver boundary) for one message: boundary k of a rank is the gap
    before its op k, `gaps[k]` its (from, to) in the nominal timeline. The sender may use
    boundaries >= lo_s (after the op that made the message), the receiver boundaries <= hi_r
    (before the op that needs it). A pair whose gaps overlap lets both ranks post their halves
    at the same moment, so neither waits for the other to take or give; of those the latest is
    taken (the receiver gets the message just before it needs it, so a receive posted early
    never holds its rank). Without an overlap, the pair that leaves the shortest wait."""
    best, best_key = (lo_s, hi_r), None
    i, j = lo_s, 0
    while i < len(sender_gaps) and j <= hi_r:  # two sorted interval lists, merged
        (s_from, s_to), (r_from, r_to) = sender_gaps[i], receiver_gaps[j]
        wait = max(s_from, r_from) - min(s_to, r_to)
        key = (max(wait, 0.0), -max(s_from, r_from))
        if best_key is None or key < best_key:
            best, best_key = (i, j), key
        if s_to < r_to:
            i += 1
        else:
            j += 1
    return best


def _messages(pp: int, n_micro: int, virtual_stages: int) -> list[tuple[int, int, int, int, P2POp, P2POp]]:
    """Every message of a step: (sender, index of the op that makes it in the sender's
    `stage_order`, receiver, index of the op that needs it, the send, the receive), in the
    sender's op order, ranks in turn."""
    n_virtual = pp * virtual_stages
    orders = [stage_order(r, pp, n_micro, virtual_stages) for r in range(pp)]
    index = [{op: k for k, op in enumerate(o)} for o in orders]
    out = []
    for r in range(pp):
        for k, op in enumerate(orders[r]):
            _, micro, vs = op
            for direction, _, peer in _makes(op, pp, n_virtual):
                other = vs + 1 if direction == "fwd" else vs - 1
                consumer = index[peer][("F" if direction == "fwd" else "B", micro, other)]
                out.append((r, k, peer, consumer, P2POp("send", peer, direction, micro, vs // pp),
                            P2POp("recv", r, direction, micro, other // pp)))
    return out


def _grouped(pp: int, n_micro: int, virtual_stages: int, at_sender, at_receiver) -> list[list[list]]:
    """Every rank's (group, op) pairs with message i of `_messages` sent in the group before
    op at_sender[i] of its sender and received in the group before op at_receiver[i] of its
    receiver (index len(ops): after the last op)."""
    orders = [stage_order(r, pp, n_micro, virtual_stages) for r in range(pp)]
    groups: list[list[list[P2POp]]] = [[[] for _ in range(len(o) + 1)] for o in orders]
    for (sender, _, receiver, _, send, recv), s, r in zip(_messages(pp, n_micro, virtual_stages), at_sender,
                                                          at_receiver):
        groups[sender][int(s)].append(send)
        groups[receiver][int(r)].append(recv)
    return [[[g, op] for g, op in zip(groups[r], orders[r] + [None])] for r in range(pp)]


def _derived_plan(pp: int, n_micro: int, virtual_stages: int) -> list[list[list]]:
    """Every rank's (group, op) pairs for v >= 2, read off the nominal ideal timeline: each
    message is exchanged at the boundaries `_meeting` picks on its two ranks."""
    times = _nominal_timeline(pp, n_micro, virtual_stages)
    gaps = [[(times[r][k - 1][1] if k else 0.0, times[r][k][0] if k < len(times[r]) else float("inf"))
             for k in range(len(times[r]) + 1)] for r in range(pp)]
    at_sender, at_receiver = [], []
    for sender, made, receiver, needed, _, _ in _messages(pp, n_micro, virtual_stages):
        s, r = _meeting(gaps[sender], made + 1, gaps[receiver], needed)
        at_sender.append(s)
        at_receiver.append(r)
    return _grouped(pp, n_micro, virtual_stages, at_sender, at_receiver)


def meeting_pairs(pp: int, n_micro: int, virtual_stages: int):
    """Per pair of ranks (low, high) that exchange messages: the indices into `_messages` of
    its messages, whether each goes from low to high, the first boundary its sender may send
    it at (after the op that makes it) and the last its receiver may take it at (before the op
    that needs it). Boundary k of a rank is the moment before its op k."""
    pairs: dict[tuple[int, int], list] = {}
    for i, (sender, made, receiver, needed, _, _) in enumerate(_messages(pp, n_micro, virtual_stages)):
        pairs.setdefault((min(sender, receiver), max(sender, receiver)), []).append(
            (i, sender < receiver, made + 1, needed))
    return {pair: tuple(np.array(col) for col in zip(*rows)) for pair, rows in sorted(pairs.items())}


def place_messages(pair_messages, low_at, high_at):
    """(sender boundary, receiver boundary) of each message of one pair of ranks (`meeting_pairs`)
    given its meetings: meeting j is the low rank's boundary low_at[j] with the high rank's
    high_at[j], both non-decreasing in j. A message goes to the first meeting at or after the
    boundary its sender may send it at (the output leaves as soon as it can); None if that
    meeting comes after the boundary its receiver needs it by (or there is none)."""
    _, low_to_high, first, last = pair_messages
    low_at, high_at = np.asarray(low_at), np.asarray(high_at)
    j = np.where(low_to_high, np.searchsorted(low_at, first), np.searchsorted(high_at, first))
    if np.any(j >= len(low_at)):
        return None
    own = np.where(low_to_high, low_at[j], high_at[j])
    other = np.where(low_to_high, high_at[j], low_at[j])
    if np.any(other > last):
        return None
    return own, other


@functools.cache
def _meeting_table() -> dict:
    """The searched meetings (wlb_opt/p2p_meetings.json, written by `python -m
    wlb_opt.p2p_search`): "pp,n_micro,v" -> "low,high" -> [low boundaries, high boundaries]."""
    path = Path(__file__).with_name("p2p_meetings.json")
    return json.loads(path.read_text())["meetings"] if path.exists() else {}


def _searched_plan(pp: int, n_micro: int, virtual_stages: int) -> list[list[list]] | None:
    """Every rank's (group, op) pairs from the searched meetings of this shape; None if the
    table has no such shape."""
    table = _meeting_table().get(f"{pp},{n_micro},{virtual_stages}")
    if table is None:
        return None
    n_messages = len(_messages(pp, n_micro, virtual_stages))
    at_sender, at_receiver = np.zeros(n_messages, dtype=int), np.zeros(n_messages, dtype=int)
    for (low, high), msgs in meeting_pairs(pp, n_micro, virtual_stages).items():
        placed = place_messages(msgs, *table[f"{low},{high}"])
        if placed is None:
            raise RuntimeError(f"p2p_meetings.json: shape {(pp, n_micro, virtual_stages)} leaves a message of "
                               f"ranks {low},{high} without a meeting; regenerate it with python -m wlb_opt.p2p_search")
        at_sender[msgs[0]], at_receiver[msgs[0]] = placed
    return _grouped(pp, n_micro, virtual_stages, at_sender, at_receiver)


def _unblock(plans: list, pp: int, shape: tuple) -> None:
    """Run the ranks' groups jointly under rendezvous semantics (a rank moves on when its whole
    group has met its counterparts); when no rank can move, a send is waiting for a receive its
    peer has planned for later, and that receive is moved into the peer's current group (its
    buffer is allocated earlier; nothing else changes). Receives can always move earlier,
    because every shape is known from the plan; sends cannot (they carry what an op computed).
    Raises RuntimeError if that does not help (no shape the library accepts gets there)."""
    current, done = [0] * pp, [set() for _ in range(pp)]

    def group(r):
        return plans[r][current[r]][0] if current[r] < len(plans[r]) else None

    def match(r, op):
        peer_group = group(op.peer)
        key = message_key(op, r, pp)
        for j, other in enumerate(peer_group or []):
            if other.peer == r and other.kind != op.kind and j not in done[op.peer] and \
                    message_key(other, op.peer, pp) == key:
                return j
        return None

    while any(current[r] < len(plans[r]) for r in range(pp)):
        progress = False
        for r in range(pp):
            for i, op in enumerate(group(r) or []):
                j = None if i in done[r] else match(r, op)
                if j is not None:
                    done[r].add(i)
                    done[op.peer].add(j)
                    progress = True
        for r in range(pp):
            g = group(r)
            if g is not None and len(done[r]) == len(g):
                current[r] += 1
                done[r] = set()
                progress = True
        if not progress and not _pull_receive(plans, pp, current, done, group):
            stuck = {r: group(r) for r in range(pp) if group(r) is not None}
            raise RuntimeError(f"pipeline schedule {shape} cannot progress: {stuck}")


def _pull_receive(plans, pp: int, current: list, done: list, group) -> bool:
    """Move the receive one stuck send waits for into its peer's current group; False if none."""
    for r in range(pp):
        for i, op in enumerate(group(r) or []):
            if op.kind != "send" or i in done[r]:
                continue
            key = message_key(op, r, pp)
            for later in range(current[op.peer] + 1, len(plans[op.peer])):
                ops = plans[op.peer][later][0]
                hit = [o for o in ops if o.kind == "recv" and o.peer == r and message_key(o, op.peer, pp) == key]
                if hit:
                    ops.remove(hit[0])
                    plans[op.peer][current[op.peer]][0].append(hit[0])
                    return True
    return False


@functools.lru_cache(maxsize=256)
def _plans(pp: int, n_micro: int, virtual_stages: int, placement: str = "auto") -> tuple:
    """Every rank's (group, op) pairs, deadlock-free under rendezvous semantics.

    1F1B (v = 1) starts from `_initial_plan`: Megatron's pairing of each op's sends with the
    receives the next op needs, which in 1F1B are the messages the two neighbours exchange
    next (a rank can still wait for a neighbour to take its gradient: `wlb_opt.rendezvous`). The interleaved schedule has slack: an input is made well
    before it is needed, so that pairing has ranks wait for neighbours to take what they send
    (a blocking send is a meeting of both ranks, and each meeting costs the earlier rank the
    gap). `placement` chooses the interleaved groups:

    - "auto" (`p2p_schedule`'s): "searched" for the shapes wlb_opt/p2p_meetings.json holds (pp
      2..8, v 2 and 4, n_micro a multiple of pp up to 16), else "nominal";
    - "searched": each pair of ranks meets at the boundaries `wlb_opt.p2p_search` found by
      replaying candidate schedules on random op times (fewer, well-placed meetings); every
      message goes to the first meeting after the op that makes it (`place_messages`);
    - "nominal": each message where both ranks are idle at the same moment in the nominal
      ideal timeline (`_derived_plan`);
    - "next_op": Megatron's pairing (the baseline of `wlb-opt bench pipeline-replay`).

    `_unblock` then checks the plan under rendezvous semantics (and repairs it, for 1F1B).
    The result is a fixed, deterministic function of (pp, n_micro, virtual_stages), so every
    rank derives the same schedule. Inside a group, sends are in message order (those to
    one peer in the order it receives them) and receives in their sender's issue order, so both
    ends of every pair of ranks see their messages in the same order (NCCL matches
    point-to-point in issue order; the meetings of a pair are ordered on both ranks, so no two
    messages cross).
    """
    check_pipeline_shape(pp, n_micro, virtual_stages)
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    plans = None
    if virtual_stages > 1 and placement in ("auto", "searched"):
        plans = _searched_plan(pp, n_micro, virtual_stages)
        if plans is None and placement == "searched":
            raise ValueError(f"no searched meetings for shape {(pp, n_micro, virtual_stages)}")
    if plans is None and virtual_stages > 1 and placement != "next_op":
        plans = _derived_plan(pp, n_micro, virtual_stages)
    if plans is None:
        plans = [[[list(g), op] for g, op in _initial_plan(r, pp, n_micro, virtual_stages)] for r in range(pp)]
    _unblock(plans, pp, (pp, n_micro, virtual_stages))
    taken = {message_key(o, r, pp): gi for r in range(pp) for gi, (g, _) in enumerate(plans[r])
             for o in g if o.kind == "recv"}  # message key -> receiver's group index
    order: dict[tuple, tuple[int, int]] = {}  # message key -> (sender's group index, position)
    # final in-group order: sends by message key, except that the sends to one peer go in the
    # order that peer receives them; receives by their sender's issue order
    for r in range(pp):
        for gi, (g, _) in enumerate(plans[r]):
            sends = sorted((o for o in g if o.kind == "send"), key=lambda o: message_key(o, r, pp))
            for peer in {o.peer for o in sends}:  # a peer's slots, in the order it receives
                slots = [pos for pos, o in enumerate(sends) if o.peer == peer]
                mine = sorted((sends[pos] for pos in slots), key=lambda o: taken[message_key(o, r, pp)])
                for pos, o in zip(slots, mine):
                    sends[pos] = o
            for pos, o in enumerate(sends):
                order[message_key(o, r, pp)] = (gi, pos)
    for r in range(pp):
        for g, _ in plans[r]:
            g.sort(key=lambda o: (0, order[message_key(o, r, pp)], 0) if o.kind == "send"
                   else (1, order[message_key(o, r, pp)], o.peer))
    return tuple(tuple((tuple(g), op) for g, op in plans[r]) for r in range(pp))


RECEIVES_AHEAD = 1
"""Receives the interleaved executor keeps posted on each channel into a rank: the next
message's (its buffer allocated before the message is needed). One is the ideal pipeline
whenever a transfer takes less than an op (`wlb_opt.rendezvous`); each more costs one
boundary buffer per channel."""


def channel_messages(pp: int, n_micro: int,
                     virtual_stages: int = 1) -> dict[tuple[int, int], list[tuple[str, int, int]]]:
    """The messages of a step by channel: (sender rank, receiver rank) -> `message_key`s in the
    order the sender makes them (its `stage_order`). The interleaved executor gives every
    such channel its own process group (`wlb_opt.executor.pipeline`): the k-th send of a
    channel meets its k-th receive, so each receiver posts its receives in this order."""
    check_pipeline_shape(pp, n_micro, virtual_stages)
    n_virtual = pp * virtual_stages
    channels: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for rank in range(pp):
        for op in stage_order(rank, pp, n_micro, virtual_stages):
            _, micro, vs = op
            for direction, _, peer in _makes(op, pp, n_virtual):
                channels.setdefault((rank, peer), []).append((direction, micro, vs))
    return channels


def step_plan(rank: int, pp: int, n_micro: int, virtual_stages: int = 1) -> list[tuple[list[P2POp], Op | None]]:
    """Rank `rank`'s step as (group, compute op) pairs: the group is posted and waited on just
    before the op; the last pair has op None (the sends of the last op). See `_plans`."""
    return [(list(g), op) for g, op in _plans(pp, n_micro, virtual_stages)[rank]]


def p2p_schedule(pp: int, n_micro: int, virtual_stages: int = 1) -> list[list[list[P2POp]]]:
    """For each pipeline rank, the ordered communication groups of one step (rank -> groups ->
    ops). A group is issued whole (`batch_isend_irecv`) and waited on whole before the next;
    the executor issues exactly these for 1F1B (the interleaved schedule runs on channels,
    `channel_messages`; these groups are the best blocking ones found for it). Deadlock-free
    under rendezvous semantics (no buffering), and every send meets exactly one receive, in
    the same order on both ends of each pair of ranks (tests/unit/test_schedule.py replays
    every shape)."""
    check_pipeline_shape(pp, n_micro, virtual_stages)
    return [[list(g) for g, _ in _plans(pp, n_micro, virtual_stages)[r] if g] for r in range(pp)]
