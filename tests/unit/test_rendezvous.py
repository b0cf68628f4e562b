"""The rendezvous replays against twins written here: the executor's groups (1F1B) and channels
(interleaved) timed by fixed-point iteration (no code shared with `wlb_opt.rendezvous` but the
schedule itself), and the simulator's interleaved estimate (`simulate_step`) checked against
the channels' twin and the ideal DAG."""
import numpy as np
import pytest

import wlb_opt as wlb
from wlb_opt.schedule import stage_order, step_plan
from wlb_opt.simulate import pipeline_recurrence, simulate_step


def _producer(op, rank: int, pp: int) -> tuple[str, int, int]:
    """(direction, micro-batch, virtual stage that made the message) of a send or a receive."""
    vs = op.chunk * pp + rank
    if op.kind == "recv":
        vs += -1 if op.direction == "fwd" else 1
    return op.direction, op.micro, vs


def fixed_point_replay(f: np.ndarray, b: np.ndarray, p2p_s: np.ndarray, start_s=None) -> tuple[float, list]:
    """Step time and per-rank op end times of the executor's groups, by relaxation.

    Rank r posts group g when its previous op ends; the group completes at the latest post
    among it and the groups holding its messages' counterparts, plus the largest p2p_s of the
    micro-batches it receives; then its op runs. Post times start at 0 and are recomputed
    from the previous sweep's until nothing changes (the least fixed point: the longest path).
    """
    pp, v, m = f.shape
    plans = [step_plan(r, pp, m, v) for r in range(pp)]
    holder = {}
    for r, plan in enumerate(plans):
        for g, (group, _) in enumerate(plan):
            for op in group:
                holder[(op.kind, _producer(op, r, pp))] = (r, g)
    post = [[0.0] * len(plan) for plan in plans]
    for _ in range(sum(len(plan) for plan in plans) + 2):
        new = [[0.0] * len(plan) for plan in plans]
        ends = []
        for r, plan in enumerate(plans):
            t = 0.0 if start_s is None else float(start_s[r])
            mine = []
            for g, (group, op) in enumerate(plan):
                new[r][g] = t
                for p2p in group:
                    peer, pg = holder[("recv" if p2p.kind == "send" else "send", _producer(p2p, r, pp))]
                    t = max(t, post[peer][pg])
                receives = [float(p2p_s[p2p.micro]) for p2p in group if p2p.kind == "recv"]
                t += max(receives, default=0.0)
                if op is not None:
                    phase, k, vs = op
                    t += float((f if phase == "F" else b)[vs % pp, vs // pp, k])
                    mine.append(t)
            ends.append(mine)
        if new == post:
            return max(max(e) for e in ends), ends
        post = new
    raise AssertionError("the relaxation did not settle: the groups deadlock")


def test_fixed_point_twin_by_hand():
    # pp = 2, 1F1B, f = 1, b = 2, two micro-batches: (m + p - 1)(f + b) = 9. With 0.1 s of p2p
    # three receives lie on the critical path (rank 1's F0, rank 0's B0 and B1): 9.3; both
    # ranks starting at 0.5 s shift it all
    f, b = np.ones((2, 1, 2)), 2 * np.ones((2, 1, 2))
    assert fixed_point_replay(f, b, np.zeros(2))[0] == pytest.approx(9.0)
    assert fixed_point_replay(f, b, np.full(2, 0.1))[0] == pytest.approx(9.3)
    assert fixed_point_replay(f, b, np.full(2, 0.1), start_s=[0.5, 0.5])[0] == pytest.approx(9.8)


@pytest.mark.parametrize("pp, n_micro, v", [(2, 2, 1), (3, 6, 1), (2, 4, 2), (3, 6, 2), (4, 8, 2), (2, 4, 4)])
def test_rendezvous_replay_equals_the_fixed_point_twin(pp, n_micro, v):
    from wlb_opt.rendezvous import _replay

    rng = np.random.default_rng([pp, n_micro, v])
    for _ in range(4):
        f = rng.lognormal(0.0, 0.3, (pp, v, n_micro))
        b = 2.0 * rng.lognormal(0.0, 0.3, (pp, v, n_micro))
        p2p = rng.uniform(0.0, 0.2, n_micro)
        start = rng.uniform(0.0, 0.3, pp)
        want, ends = fixed_point_replay(f, b, p2p, start)
        res = _replay(f, b, [step_plan(r, pp, n_micro, v) for r in range(pp)], p2p, start)
        assert res.step_time_s == pytest.approx(want, rel=1e-12)
        for r in range(pp):
            got = sorted(row["end_s"] for row in res.timeline if row["stage"] == r)
            assert got == pytest.approx(sorted(ends[r]), rel=1e-12)


def channels_fixed_point(f: np.ndarray, b: np.ndarray, p2p_s: np.ndarray, start_s=None) -> float:
    """Step time of the executor's channels, by relaxation. A message of (direction, micro,
    producer) goes from the producer's rank to the consumer's; each ordered pair of ranks is
    a channel whose k-th message is the k-th its sender makes. The receive of message k is
    posted at the start (k = 0) or when the receiver starts the op that took message k - 1;
    the message arrives p2p_s after both its send (the end of the op that made it) and its
    receive are posted; an op starts when its rank is free and its input has arrived."""
    pp, v, m = f.shape
    nv = pp * v
    orders = [stage_order(r, pp, m, v) for r in range(pp)]
    seq: dict = {}  # (sender, receiver) -> messages in the sender's order
    for r in range(pp):
        for phase, k, vs in orders[r]:
            if phase == "F" and vs < nv - 1:
                seq.setdefault((r, (vs + 1) % pp), []).append(("F", k, vs))
            if phase == "B" and vs > 0:
                seq.setdefault((r, (vs - 1) % pp), []).append(("B", k, vs))
    where = {msg: (c, i) for c, msgs in seq.items() for i, msg in enumerate(msgs)}
    start = {(r, op): 0.0 for r in range(pp) for op in orders[r]}
    for _ in range(sum(map(len, orders)) + 2):
        new, end = {}, {}
        for r in range(pp):
            t = 0.0 if start_s is None else float(start_s[r])
            for op in orders[r]:
                new[(r, op)] = t
                end[(r, op)] = t + float((f if op[0] == "F" else b)[op[2] % pp, op[2] // pp, op[1]])
                t = end[(r, op)]
        for r in range(pp):  # the inputs, from the previous sweep's times
            t = 0.0 if start_s is None else float(start_s[r])
            for op in orders[r]:
                phase, k, vs = op
                made = (("F", k, vs - 1) if phase == "F" and vs > 0
                        else ("B", k, vs + 1) if phase == "B" and vs < nv - 1 else None)
                if made is not None:
                    (src, dst), i = where[made]
                    sent = start[(src, (made[0], k, made[2]))] + float(
                        (f if made[0] == "F" else b)[made[2] % pp, made[2] // pp, k])
                    if i == 0:
                        posted = 0.0 if start_s is None else float(start_s[dst])
                    else:
                        prev = seq[(src, dst)][i - 1]
                        taker = ("F", prev[1], prev[2] + 1) if prev[0] == "F" else ("B", prev[1], prev[2] - 1)
                        posted = start[(dst, taker)]
                    t = max(t, max(sent, posted) + float(p2p_s[k]))
                new[(r, op)] = t
                t += float((f if phase == "F" else b)[vs % pp, vs // pp, k])
        if new == start:
            return max(start[(r, orders[r][-1])] + float((f if orders[r][-1][0] == "F" else b)[
                orders[r][-1][2] % pp, orders[r][-1][2] // pp, orders[r][-1][1]]) for r in range(pp))
        start = new
    raise AssertionError("the relaxation did not settle: the channels deadlock")


@pytest.mark.parametrize("pp, n_micro, v", [(2, 2, 2), (2, 4, 2), (3, 6, 2), (4, 8, 2), (2, 4, 4), (4, 4, 4),
                                            (3, 3, 1)])
def test_channel_replay_equals_its_twin_and_the_ideal_dag(pp, n_micro, v):
    from wlb_opt.rendezvous import _replay_channels, simulate_channels

    rng = np.random.default_rng([pp, n_micro, v, 1])
    for _ in range(4):
        f = rng.lognormal(0.0, 0.3, (pp, v, n_micro))
        b = 2.0 * rng.lognormal(0.0, 0.3, (pp, v, n_micro))
        p2p = rng.uniform(0.0, 0.2, n_micro)
        start = rng.uniform(0.0, 0.3, pp)
        assert _replay_channels(f, b, p2p, start).step_time_s == pytest.approx(
            channels_fixed_point(f, b, p2p, start), rel=1e-12)
        dag = pipeline_recurrence(f, b, "interleaved" if v > 1 else "1f1b", v, p2p).step_time_s
        assert simulate_channels(f, b, v).step_time_s == pytest.approx(
            pipeline_recurrence(f, b, "interleaved" if v > 1 else "1f1b", v).step_time_s, rel=1e-12)
        assert _replay_channels(f, b, p2p).step_time_s == pytest.approx(dag, rel=1e-12)


def test_channel_replay_by_hand_and_its_errors():
    from wlb_opt.rendezvous import simulate_channels

    # pp = 2, 1F1B, f = 1, b = 2, two micro-batches, 0.1 s of p2p: the ideal pipeline's 9.2 (by
    # hand: rank 1's F0 at 1.1, its B0 ends at 4.1, rank 0's B0 at 4.2 to 6.2, rank 1's F1 and B1
    # end at 7.1, rank 0's B1 at 7.2 to 9.2); the groups' twin above gives 9.3
    assert simulate_channels(np.ones((2, 2)), 2 * np.ones((2, 2)), 1, 0.1).step_time_s == pytest.approx(9.2)
    with pytest.raises(ValueError, match="p2p_s"):
        simulate_channels(np.ones((2, 2)), np.ones((2, 2)), p2p_s=float("nan"))
    with pytest.raises(ValueError, match="same shape"):
        simulate_channels(np.ones((2, 2)), np.ones((2, 3)))


def test_the_simulators_interleaved_estimate_is_the_channel_replay():
    """`simulate_step` (what `wlb-opt bench e2e` runs) times the interleaved pipeline as the
    twin above replays the executor's channels, per-micro-batch p2p included: between the
    ideal DAG and the groups, and the DAG itself when no transfer outlasts an op,
    where the groups 1F1B uses would run above it on these micro-batches."""
    from wlb_opt.rendezvous import _replay_channels

    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4, dp=2),
                                  wlb.HardwareSpec.preset("h100"))
    pp = cost.parallel.pp
    rng = np.random.default_rng(5)
    plan = wlb.solve_pack(rng.integers(500, 20000, 60), 8, 131072, cost, "original", dp=cost.parallel.dp)
    p2p = rng.uniform(0.0, 2e-3, len(plan.micro_batches))
    groups_above_dag = False
    for v in (2, 4):
        step = simulate_step(plan, None, cost, virtual_stages=v, p2p_s=p2p, allreduce_s=0.0)
        for replica in range(plan.dp):
            idx = plan.replica_micro_batches(replica)
            f = np.repeat(np.tile(step.mb_fwd_s[idx] / pp / v, (pp, 1))[:, None, :], v, axis=1)
            b = np.repeat(np.tile(step.mb_bwd_s[idx] / pp / v, (pp, 1))[:, None, :], v, axis=1)
            want = channels_fixed_point(f, b, p2p[idx])
            assert step.replica_step_s[replica] == pytest.approx(want, rel=1e-12)
            dag = pipeline_recurrence(f, b, "interleaved", v, p2p[idx]).step_time_s
            groups = fixed_point_replay(f, b, p2p[idx])[0]
            assert dag * (1 - 1e-12) <= want <= groups * (1 + 1e-12)
            groups_above_dag |= groups > dag * (1 + 1e-9)
            # the DAG where no transfer is longer than an op (one receive ahead suffices)
            assert _replay_channels(f, b, np.minimum(p2p[idx], f.min())).step_time_s == pytest.approx(
                pipeline_recurrence(f, b, "interleaved", v, np.minimum(p2p[idx], f.min())).step_time_s, rel=1e-12)
    assert groups_above_dag


def _runs_on_streams(pp: int, n_micro: int, v: int, stream_of) -> bool:
    """Whether the interleaved channels' program completes when every rank's p2p operations go
    to FIFO streams `stream_of(rank, peer, kind)` (NCCL runs one communicator's operations in
    the order posted, and a send and its receive move together once both head their streams).
    Each rank keeps the next receive of each channel posted, waits for a receive before the op
    that needs it, and posts a send when its op ends; durations do not matter here."""
    from collections import deque

    from wlb_opt.schedule import channel_messages, stage_order

    channels = channel_messages(pp, n_micro, v)
    nv = pp * v
    programs = []
    for r in range(pp):
        prog = []
        incoming = {c: 0 for c in channels if c[1] == r}
        prog += [("post", c, 0) for c in incoming if channels[c]]
        for phase, k, vs in stage_order(r, pp, n_micro, v):
            made = (("fwd", k, vs - 1) if phase == "F" and vs > 0
                    else ("bwd", k, vs + 1) if phase == "B" and vs < nv - 1 else None)
            if made is not None:
                c = (made[2] % pp, r)
                i = incoming[c]
                prog += [("wait", c, i)] + ([("post", c, i + 1)] if i + 1 < len(channels[c]) else [])
                incoming[c] = i + 1
            for c, msgs in channels.items():
                if c[0] == r and (("fwd", k, vs) in msgs if phase == "F" else ("bwd", k, vs) in msgs):
                    prog.append(("send", c, msgs.index(("fwd" if phase == "F" else "bwd", k, vs))))
        programs.append(prog)
    streams: dict = {}
    done: set = set()
    pos = [0] * pp
    while True:
        moved = False
        for r in range(pp):
            while pos[r] < len(programs[r]):
                act, c, i = programs[r][pos[r]]
                if act == "wait" and (c, i) not in done:
                    break
                if act != "wait":
                    peer = c[0] if act == "post" else c[1]
                    streams.setdefault(stream_of(r, peer, "recv" if act == "post" else "send"), deque()).append(
                        (act, c, i))
                pos[r] += 1
                moved = True
        for key, q in streams.items():  # a message moves when its send and its receive head their streams
            if q and q[0][0] == "send":
                _, c, i = q[0]
                other = next((k2 for k2, q2 in streams.items() if q2 and q2[0] == ("post", c, i)), None)
                if other is not None:
                    q.popleft()
                    streams[other].popleft()
                    done.add((c, i))
                    moved = True
        if all(pos[r] == len(programs[r]) for r in range(pp)) and not any(streams.values()):
            return True
        if not moved:
            return False


@pytest.mark.parametrize("pp, n_micro, v", [(2, 4, 2), (3, 6, 2), (4, 8, 4)])
def test_channels_need_a_stream_per_direction(pp, n_micro, v):
    """The executor's channels complete with one FIFO stream per ordered pair of ranks (a
    process group per direction, `channel_groups`); with one stream per pair of ranks (one
    communicator for both directions) a receive posted ahead holds back the rank's own send
    behind it, and the step deadlocks."""
    assert _runs_on_streams(pp, n_micro, v, lambda r, peer, kind: (r, peer, kind))  # per direction
    assert not _runs_on_streams(pp, n_micro, v, lambda r, peer, kind: (r, frozenset((r, peer))))  # shared
