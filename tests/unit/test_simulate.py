"""Simulator: closed forms, monotonicity, DAG vs recurrence vs a naive reference written here,
interleaved with v = 1 equals 1F1B, and simulate_step's composition of CP, PP and DP."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wlb_opt as wlb
from wlb_opt.simulate import (best_order, build_dag, compare_to_measured, pipeline_recurrence, pipeline_step_time,
                              simulate_pipeline, simulate_step, stage_order)


def naive_1f1b(fwd, bwd, p2p=0.0):
    """Textbook 1F1B by fixed-point iteration on start times (no shared code with the module).

    Stage s runs F0..F_{w-1} (w = p-s-1), then F_{w+i}, B_i, then the rest of the backwards.
    Times are relaxed until nothing changes: start = max(previous op end, input end + p2p).
    """
    p, m = fwd.shape
    seqs = []
    for s in range(p):
        w = min(p - s - 1, m)
        seq = [("F", i) for i in range(w)]
        for i in range(m - w):
            seq += [("F", w + i), ("B", i)]
        seq += [("B", i) for i in range(m - w, m)]
        seqs.append(seq)
    end = {}
    for _ in range(4 * p * m + 4):
        changed = False
        for s in range(p):
            t = 0.0
            for ph, i in seqs[s]:
                if ph == "F":
                    ready = end.get((s - 1, "F", i), 0.0) + p2p if s > 0 else 0.0
                    d = fwd[s, i]
                else:
                    ready = end.get((s + 1, "B", i), 0.0) + p2p if s < p - 1 else end.get((s, "F", i), 0.0)
                    d = bwd[s, i]
                t = max(t, ready) + d
                if end.get((s, ph, i)) != t:
                    end[(s, ph, i)] = t
                    changed = True
        if not changed:
            break
    return max(end.values())


@pytest.mark.parametrize("p, m, f, b", [(1, 1, 1.0, 2.0), (4, 4, 1.0, 2.0), (4, 8, 0.5, 1.0), (8, 3, 2.0, 3.0)])
def test_identical_micro_batches_match_closed_form(p, m, f, b):
    fwd, bwd = np.full((p, m), f), np.full((p, m), b)
    res = simulate_pipeline(fwd, bwd, "1f1b")
    assert res.step_time_s == pytest.approx((m + p - 1) * (f + b))
    assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert np.allclose(res.stage_busy_s, m * (f + b))


def test_interleaved_closed_form_and_bubble_shrinks():
    p, m, v = 4, 8, 2
    fwd, bwd = np.full((p, m), 1.0), np.full((p, m), 2.0)
    res = simulate_pipeline(fwd, bwd, "interleaved", v)
    # Narayanan et al. 2021: bubble (p-1)/v chunks of (f+b)/v... step = (m + (p-1)/v)(f+b)
    assert res.step_time_s == pytest.approx((m + (p - 1) / v) * 3.0)
    assert res.bubble_fraction < simulate_pipeline(fwd, bwd, "1f1b").bubble_fraction


@settings(max_examples=40)
@given(p=st.integers(1, 5), m=st.integers(1, 7), seed=st.integers(0, 10**6), p2p=st.floats(0, 0.3))
def test_dag_recurrence_and_naive_reference_agree_on_1f1b(p, m, seed, p2p):
    rng = np.random.default_rng(seed)
    fwd, bwd = rng.random((p, m)) + 0.01, rng.random((p, m)) + 0.01
    dag = simulate_pipeline(fwd, bwd, "1f1b", 1, p2p)
    rec = pipeline_recurrence(fwd, bwd, "1f1b", 1, p2p)
    assert dag.step_time_s == pytest.approx(rec.step_time_s, rel=1e-12)
    assert dag.step_time_s == pytest.approx(naive_1f1b(fwd, bwd, p2p), rel=1e-12)
    assert np.allclose(dag.stage_busy_s, fwd.sum(1) + bwd.sum(1))


@settings(max_examples=30)
@given(p=st.integers(1, 4), groups=st.integers(1, 3), v=st.integers(1, 3), seed=st.integers(0, 10**6))
def test_dag_and_recurrence_agree_on_interleaved(p, groups, v, seed):
    rng = np.random.default_rng(seed)
    m = p * groups
    fwd, bwd = rng.random((p, v, m)), rng.random((p, v, m))
    p2p = rng.random(m) * 0.1
    sched = "interleaved" if v > 1 else "1f1b"
    dag = simulate_pipeline(fwd, bwd, sched, v, p2p)
    rec = pipeline_recurrence(fwd, bwd, sched, v, p2p)
    assert dag.step_time_s == pytest.approx(rec.step_time_s, rel=1e-12)
    assert pipeline_step_time(fwd, bwd, sched, v, p2p) == pytest.approx(dag.step_time_s, rel=1e-12)
    starts = {(r["phase"], r["micro_batch"], r["virtual_stage"]): r["start_s"] for r in rec.timeline}
    for r in dag.timeline:
        assert r["start_s"] == pytest.approx(starts[(r["phase"], r["micro_batch"], r["virtual_stage"])])


def test_networkx_longest_path_of_build_dag_is_the_step_time():
    import networkx as nx

    rng = np.random.default_rng(7)
    for p, m, v, order in [(4, 4, 2, [2, 0, 3, 1]), (3, 5, 1, None), (2, 4, 3, [3, 2, 1, 0])]:
        fwd, bwd = rng.random((p, m)), rng.random((p, m))
        p2p = rng.random(m) * 0.1
        sched = "interleaved" if v > 1 else "1f1b"
        g = build_dag(fwd, bwd, sched, v, p2p, order)
        res = simulate_pipeline(fwd, bwd, sched, v, p2p, order)
        assert nx.dag_longest_path_length(g, weight="weight") == pytest.approx(res.step_time_s, rel=1e-12)
        assert pipeline_recurrence(fwd, bwd, sched, v, p2p, order).step_time_s == pytest.approx(res.step_time_s)


def test_critical_path_is_a_chain_that_sums_to_the_step():
    rng = np.random.default_rng(3)
    fwd, bwd = rng.random((4, 8)), rng.random((4, 8))
    res = simulate_pipeline(fwd, bwd, "interleaved", 2, 0.05)
    ends = {(r["phase"], r["micro_batch"], r["virtual_stage"]): (r["start_s"], r["end_s"]) for r in res.timeline}
    path = res.critical_path
    assert ends[path[0]][0] == pytest.approx(0.0)
    assert ends[path[-1]][1] == pytest.approx(res.step_time_s)
    for a, b in zip(path, path[1:]):
        assert ends[b][0] >= ends[a][1] - 1e-12  # b starts after a ends (gap = p2p at most)
        assert ends[b][0] <= ends[a][1] + 0.05 + 1e-12


@settings(max_examples=30)
@given(p=st.integers(1, 4), m=st.integers(1, 6), seed=st.integers(0, 10**6), extra=st.floats(0.0, 2.0),
       interleaved=st.booleans())
def test_a_heavier_micro_batch_never_shortens_the_step(p, m, seed, extra, interleaved):
    rng = np.random.default_rng(seed)
    v = 2 if interleaved else 1
    if interleaved:
        m = p * max(1, m // p)
    sched = "interleaved" if interleaved else "1f1b"
    fwd, bwd = rng.random((p, m)), rng.random((p, m))
    base = simulate_pipeline(fwd, bwd, sched, v, 0.01).step_time_s
    j = int(rng.integers(m))
    f2, b2 = fwd.copy(), bwd.copy()
    f2[:, j] += extra / 3
    b2[:, j] += 2 * extra / 3
    assert simulate_pipeline(f2, b2, sched, v, 0.01).step_time_s >= base - 1e-12


@settings(max_examples=20)
@given(p=st.integers(1, 5), m=st.integers(1, 8), seed=st.integers(0, 10**6))
def test_interleaved_with_one_chunk_equals_1f1b(p, m, seed):
    rng = np.random.default_rng(seed)
    fwd, bwd = rng.random((p, m)), rng.random((p, m))
    a = simulate_pipeline(fwd, bwd, "interleaved", 1, 0.02)
    b = simulate_pipeline(fwd, bwd, "1f1b", 1, 0.02)
    assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-12)
    assert [stage_order(s, p, m, 1) for s in range(p)] == [stage_order(s, p, m) for s in range(p)]


def test_every_stage_runs_every_operation_once():
    for p, m, v in [(4, 4, 2), (2, 6, 3), (3, 3, 1)]:
        ops = [op for s in range(p) for op in stage_order(s, p, m, v)]
        assert len(ops) == len(set(ops)) == 2 * p * m * v
        assert all(vs % p == s for s in range(p) for _, _, vs in stage_order(s, p, m, v))


def test_best_order_is_never_worse_and_can_help():
    rng = np.random.default_rng(0)
    p, m = 4, 5
    fwd = np.tile(rng.random(m) * [1, 1, 1, 1, 6], (p, 1))
    bwd = 2 * fwd
    order, t = best_order(fwd, bwd, "1f1b")
    assert sorted(order) == list(range(m))
    base = simulate_pipeline(fwd, bwd, "1f1b").step_time_s
    assert t <= base + 1e-12
    assert simulate_pipeline(fwd, bwd, "1f1b", order=order).step_time_s == pytest.approx(t)
    assert t < base  # a heavy last micro-batch is worse than a heavy first one under 1F1B


@pytest.mark.parametrize("kwargs, match", [
    (dict(schedule="gpipe"), "schedule"),
    (dict(schedule="1f1b", virtual_stages=2), "interleaved"),
    (dict(schedule="interleaved", virtual_stages=0), "virtual_stages"),
    (dict(schedule="interleaved", virtual_stages=2, fwd=np.ones((4, 3))), "multiple"),
    (dict(p2p_s=[0.1, 0.2, 0.3]), "p2p_s"),
    (dict(fwd=-np.ones((2, 2))), "fwd"),
    (dict(order=[0, 0]), "permutation"),
])
def test_bad_input_raises_value_error(kwargs, match):
    args = dict(fwd=np.ones((2, 2)), bwd=None, schedule="1f1b", virtual_stages=1, p2p_s=0.0)
    args.update(kwargs)
    if args["bwd"] is None:
        args["bwd"] = np.ones_like(args["fwd"])
    with pytest.raises(ValueError, match=match):
        simulate_pipeline(**args)


def test_compare_to_measured_hook():
    res = simulate_pipeline(np.ones((2, 2)), np.ones((2, 2)))
    out = compare_to_measured(res, res.step_time_s * 2, res.stage_busy_s)
    assert out["step_rel_error"] == pytest.approx(-0.5)
    assert out["stage_rel_error"] == pytest.approx([0.0, 0.0])
    with pytest.raises(ValueError, match="measured_step_s"):
        compare_to_measured(res, 0.0)


# ---------------------------------------------------------------- simulate_step
@pytest.fixture(scope="module")
def cost7b():
    return wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4, dp=2),
                                  wlb.HardwareSpec.preset("h100"))


class _Shard:  # not a ShardPlan: refused
    def __init__(self, loads):
        self.loads = np.asarray(loads, dtype=np.float64)


def test_simulate_step_composes_cp_pp_dp(cost7b):
    parallel = wlb.ParallelSpec(tp=8, cp=2, pp=4, dp=2)
    rng = np.random.default_rng(1)
    lengths = rng.integers(100, 20000, 60)
    plan = wlb.solve_pack(lengths, 4, 131072, cost7b, "wlb", dp=2)
    no_cp = simulate_step(plan, None, cost7b, parallel)
    # A CP imbalance on one micro-batch (max rank 1.5x its mean) can only slow the step down.
    import dataclasses

    def shard(j, loads):  # micro-batch j's shard, its ranks' loads set
        real = wlb.solve_shard(plan.lengths[plan.micro_batches[j]], None, "per_doc", cost7b)
        return dataclasses.replace(real, loads=np.asarray(loads, dtype=np.float64))

    shards = [shard(j, [load, load]) for j, load in enumerate(plan.loads)]
    shards[0] = shard(0, [1.5 * plan.loads[0], 0.5 * plan.loads[0]])
    with_cp = simulate_step(plan, shards, cost7b, parallel)
    assert with_cp.step_time_s >= no_cp.step_time_s
    assert with_cp.imbalance_cp == pytest.approx((1.5 + 7 * 1.0) / 8)
    assert no_cp.imbalance_pp == pytest.approx(plan.imbalance)
    assert no_cp.step_time_s == pytest.approx(max(no_cp.replica_step_s) + no_cp.allreduce_s)
    assert no_cp.allreduce_s > 0 and len(no_cp.pipelines) == 2
    # fwd + bwd of each micro-batch add up to its load, split by the model's own phase ratio
    assert np.allclose(no_cp.mb_fwd_s + no_cp.mb_bwd_s, plan.loads)
    j = 1
    share = cost7b.micro_batch_cost(plan.lengths[plan.micro_batches[j]], "fwd") / plan.loads[j]
    assert no_cp.mb_fwd_s[j] == pytest.approx(share * plan.loads[j])
    # the recurrence path and the order search agree or improve
    fast = simulate_step(plan, None, cost7b, parallel, use_dag=False)
    assert fast.step_time_s == pytest.approx(no_cp.step_time_s)
    searched = simulate_step(plan, None, cost7b, parallel, search_order=True)
    assert searched.step_time_s <= no_cp.step_time_s + 1e-12
    assert sorted(sum(searched.orders, [])) == list(range(8))


def test_simulate_step_checks_its_input(cost7b):
    plan = wlb.solve_pack([1000, 2000, 3000], 4, 131072, cost7b, "wlb", dp=2)
    with pytest.raises(ValueError, match="dp"):
        simulate_step(plan, None, cost7b, wlb.ParallelSpec(tp=8, cp=2, pp=4, dp=1))
    with pytest.raises(ValueError, match="shards"):
        simulate_step(plan, [_Shard([1.0, 1.0])], cost7b, wlb.ParallelSpec(tp=8, cp=2, pp=4, dp=2))
    # a replica left without micro-batches is named by replica_of, not by the pipeline's shape
    with pytest.raises(ValueError, match=r"replica_of must give each of the plan's dp=2 replicas n_micro=4"):
        simulate_step(plan.replace(replica_of=[0] * 8), None, cost7b, wlb.ParallelSpec(tp=8, cp=2, pp=4, dp=2))
    # each shard must be its micro-batch's, for the layout's CP degree; None only for an empty one
    real = wlb.solve_shards(plan, 2, "per_doc", cost7b)
    other = wlb.solve_shards(plan, 4, "per_doc", cost7b.without_layout())
    with pytest.raises(ValueError, match=r"shards\[1\] shards pieces of lengths .*, not micro-batch 1's"):
        simulate_step(plan, [real[0], real[0]] + real[2:], cost7b)
    with pytest.raises(ValueError, match=r"shards\[0\] is sharded for cp=4, but the layout has cp=2"):
        simulate_step(plan, other, cost7b)
    with pytest.raises(TypeError, match=r"shards\[0\] must be a ShardPlan \(or None for an empty micro-batch\), got int"):
        simulate_step(plan, [1] * 8, cost7b)
    with pytest.raises(ValueError, match=r"shards\[0\] is None, but micro-batch 0 holds"):
        simulate_step(plan, [None] + real[1:], cost7b)


def test_simulate_step_takes_solve_shards_of_a_step_with_empty_micro_batches(cost7b):
    """`solve_shards` gives None for an empty micro-batch: that slot costs its constant alone."""
    plan = wlb.solve_pack([5000], 4, 131072, cost7b, "wlb", dp=2)  # one piece, seven empty slots
    shards = wlb.solve_shards(plan, 2, "per_doc", cost7b)
    assert sum(s is None for s in shards) == 7
    with_shards = simulate_step(plan, shards, cost7b)
    empty = cost7b.micro_batch_cost(np.zeros(0, dtype=np.int64), "fwd_bwd")
    assert with_shards.mb_fwd_s[1] + with_shards.mb_bwd_s[1] == pytest.approx(empty)
    assert with_shards.step_time_s > 0


# ---------------------------------------------------------------------- rendezvous replay
def test_rendezvous_replay_by_hand_and_against_the_dag():
    import wlb_opt as wlb

    # pp = 2, 1F1B, two equal micro-batches (f = 1, b = 2): the groups pair every send with the
    # receive the peer needs next, so nothing waits beyond the DAG: (m + p - 1)(f + b) = 9
    f, b = np.ones((2, 2)), 2 * np.ones((2, 2))
    res = wlb.simulate_rendezvous(f, b)
    assert res.step_time_s == pytest.approx(9.0)
    assert res.stage_busy_s.tolist() == pytest.approx([6.0, 6.0])
    rng = np.random.default_rng(1)
    for _ in range(40):
        pp = int(rng.integers(2, 5))
        v = int(rng.choice([1, 2]))
        m = pp * int(rng.integers(1, 3))
        f = rng.uniform(0.1, 1.0, (pp, v, m))
        b = 2 * f
        dag = pipeline_recurrence(f, b, "interleaved" if v > 1 else "1f1b", v).step_time_s
        rdv = wlb.simulate_rendezvous(f, b, v).step_time_s
        # blocking sends can only add waiting; every op still runs once
        assert rdv >= dag * (1 - 1e-12)
        assert wlb.simulate_rendezvous(f, b, v).stage_busy_s.sum() == pytest.approx(f.sum() + b.sum())
    with pytest.raises(ValueError, match="p2p_s"):
        wlb.simulate_rendezvous(np.ones((2, 2)), np.ones((2, 2)), p2p_s=-1.0)


def test_simulate_step_times_the_interleaved_pipeline_as_the_executor_runs_it(cost7b):
    import wlb_opt as wlb
    from wlb_opt.rendezvous import simulate_channels

    pp = cost7b.parallel.pp
    rng = np.random.default_rng(3)
    plan = wlb.solve_pack(rng.integers(500, 20000, 60), 8, 131072, cost7b, "wlb", dp=cost7b.parallel.dp)
    kw = dict(virtual_stages=2, p2p_s=0.0, allreduce_s=0.0)
    step = simulate_step(plan, None, cost7b, **kw)
    ideal = simulate_step(plan, None, cost7b, blocking_p2p=False, **kw)
    idx = plan.replica_micro_batches(0)
    f = np.tile(step.mb_fwd_s[idx] / pp, (pp, 1))
    b = np.tile(step.mb_bwd_s[idx] / pp, (pp, 1))
    assert step.replica_step_s[0] == pytest.approx(simulate_channels(f, b, 2).step_time_s, rel=1e-12)
    assert ideal.replica_step_s[0] == pytest.approx(pipeline_recurrence(f, b, "interleaved", 2).step_time_s, rel=1e-12)
    # the executor's channels run the interleaved pipeline at the ideal DAG's time
    assert step.step_time_s == pytest.approx(ideal.step_time_s, rel=1e-12)
    # a searched order runs the same replay on the micro-batches in that order
    searched = simulate_step(plan, None, cost7b, search_order=True, **kw)
    order = [idx.index(j) for j in searched.orders[0]]
    assert searched.replica_step_s[0] == pytest.approx(
        simulate_channels(f[:, order], b[:, order], 2).step_time_s, rel=1e-12)
    assert sorted(r["micro_batch"] for r in searched.pipelines[0].timeline if r["phase"] == "F" and
                  r["virtual_stage"] == 0) == list(range(len(idx)))


def test_simulate_step_times_1f1b_by_the_executors_blocking_groups(cost7b):
    import wlb_opt as wlb

    # pp = 3, micro-batches of forward 5, 1, 2 (backward twice that) on every stage: stage 1
    # sends B(0) back and receives B(1) in one group, and stage 0 posts it only at t = 45 (after
    # its own F(2)), so stage 1 waits from 43; the last backward of stage 0 ends at 53, where the
    # DAG (sends never wait) ends at 51
    f = np.tile([5.0, 1.0, 2.0], (3, 1))
    assert wlb.simulate_rendezvous(f, 2 * f).step_time_s == pytest.approx(53.0)
    assert simulate_pipeline(f, 2 * f, "1f1b").step_time_s == pytest.approx(51.0)

    pp = cost7b.parallel.pp
    rng = np.random.default_rng(5)
    plan = wlb.solve_pack(rng.integers(500, 20000, 60), 8, 131072, cost7b, "wlb", dp=cost7b.parallel.dp)
    kw = dict(schedule="1f1b", p2p_s=0.0, allreduce_s=0.0)
    step = simulate_step(plan, None, cost7b, **kw)
    ideal = simulate_step(plan, None, cost7b, blocking_p2p=False, **kw)
    for r in range(plan.dp):
        idx = plan.replica_micro_batches(r)
        fr = np.tile(step.mb_fwd_s[idx] / pp, (pp, 1))
        br = np.tile(step.mb_bwd_s[idx] / pp, (pp, 1))
        assert step.replica_step_s[r] == pytest.approx(wlb.simulate_rendezvous(fr, br).step_time_s, rel=1e-12)
        assert ideal.replica_step_s[r] == pytest.approx(pipeline_recurrence(fr, br, "1f1b").step_time_s, rel=1e-12)
        assert step.replica_step_s[r] >= ideal.replica_step_s[r] * (1 - 1e-12)
    searched = simulate_step(plan, None, cost7b, search_order=True, **kw)
    idx = plan.replica_micro_batches(0)
    order = [idx.index(j) for j in searched.orders[0]]
    fr = np.tile(step.mb_fwd_s[idx] / pp, (pp, 1))
    br = np.tile(step.mb_bwd_s[idx] / pp, (pp, 1))
    assert searched.replica_step_s[0] == pytest.approx(
        wlb.simulate_rendezvous(fr[:, order], br[:, order]).step_time_s, rel=1e-12)


@pytest.mark.parametrize("dp, cp", [(1, 2), (2, 1), (2, 4), (1, 8), (1, 1)])
def test_the_gradient_sync_rings_over_every_rank_that_holds_the_same_weights(dp, cp):
    """The executor sums gradients over the dp replicas and the cp ranks within each: a ring
    over n = dp x cp ranks, priced by hand here (2 (n-1)/n x a stage's bf16 gradients)."""
    from wlb_opt.simulate import allreduce_seconds
    parallel = wlb.ParallelSpec(tp=8, cp=cp, pp=4, dp=dp)
    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), parallel, wlb.HardwareSpec.preset("h100"))
    n = dp * cp
    stage_grad_bytes = cost.model.n_params / (4 * 8) * 2
    by_hand = 2 * (n - 1) / n * stage_grad_bytes / (cost.hardware.network_gbps * 1e9)
    assert allreduce_seconds(cost, parallel) == pytest.approx(by_hand, rel=1e-12)
    assert (allreduce_seconds(cost, parallel) > 0) == (n > 1)
