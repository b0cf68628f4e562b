"""The rendezvous replay against a twin written here: the executor's groups timed by fixed-point
iteration on post times (no code shared with `wlb_opt.rendezvous` but the schedule itself),
and the simulator's interleaved estimate (`simulate_step`) checked against that twin."""
import numpy as np
import pytest

import wlb_opt as wlb
from wlb_opt.schedule import step_plan
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


def test_the_simulators_interleaved_estimate_is_the_replay_not_the_dag():
    """`simulate_step` (what `wlb-opt bench e2e` runs) times the interleaved pipeline as the
    twin above replays the executor's groups, per-micro-batch p2p included, and that is not
    the ideal DAG on these micro-batches."""
    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4, dp=2),
                                  wlb.HardwareSpec.preset("h100"))
    pp = cost.parallel.pp
    rng = np.random.default_rng(5)
    plan = wlb.solve_pack(rng.integers(500, 20000, 60), 8, 131072, cost, "original", dp=cost.parallel.dp)
    p2p = rng.uniform(0.0, 2e-3, len(plan.micro_batches))
    above_dag = False
    for v in (2, 4):
        step = simulate_step(plan, None, cost, virtual_stages=v, p2p_s=p2p, allreduce_s=0.0)
        for replica in range(plan.dp):
            idx = plan.replica_micro_batches(replica)
            f = np.repeat(np.tile(step.mb_fwd_s[idx] / pp / v, (pp, 1))[:, None, :], v, axis=1)
            b = np.repeat(np.tile(step.mb_bwd_s[idx] / pp / v, (pp, 1))[:, None, :], v, axis=1)
            want, _ = fixed_point_replay(f, b, p2p[idx])
            assert step.replica_step_s[replica] == pytest.approx(want, rel=1e-12)
            dag = pipeline_recurrence(f, b, "interleaved", v, p2p[idx]).step_time_s
            above_dag |= want > dag * (1 + 1e-9)
    assert above_dag
