"""The simulator-validation benchmark's analysis: measured op times in, step comparison out."""
import pytest

from wlb_opt.bench.validate_sim import analyse


def test_analyse_reproduces_the_1f1b_closed_form():
    # pp = 2, two identical micro-batches: f = 1, b = 2 -> (m + p - 1)(f + b) = 9 seconds
    def ops(stage):  # (phase, micro-batch, virtual stage, seconds)
        return [("F", 0, stage, 1.0), ("F", 1, stage, 1.0), ("B", 0, stage, 2.0), ("B", 1, stage, 2.0)]

    gathered = [[dict(step=1, wall=9.0, ops=ops(s), micro_batches=[0, 1], tokens=[4, 4])] for s in range(2)]
    (row,) = analyse(gathered, pp=2)
    assert row["simulated_s"] == pytest.approx(9.0)
    assert row["rel_error"] == pytest.approx(0.0)
    # a heavier micro-batch on stage 1 lengthens the simulated step; the measured wall is kept
    gathered[1][0]["ops"] = [("F", 0, 1, 3.0), ("B", 0, 1, 2.0), ("F", 1, 1, 1.0), ("B", 1, 1, 2.0)]
    (row,) = analyse(gathered, pp=2)
    assert row["simulated_s"] > 9.0 and row["measured_s"] == 9.0


def test_analyse_predicts_from_the_cost_model():
    import wlb_opt as wlb

    zero = dict(attn=0.0, linear=0.0, comm=0.0, doc_const=0.0, mb_const=0.0)
    # fwd 1 s and bwd 2 s per token over all layers; pp = 2 -> 0.5 / 1.0 s per stage for 1-token micro-batches
    cost = wlb.CostModel(coef={"fwd": dict(zero, linear=1.0), "bwd": dict(zero, linear=2.0)}, attn_flops_per_pair=1.0)
    def rec(stage):
        ops = [("F", 0, stage, 0.5), ("F", 1, stage, 0.5), ("B", 0, stage, 1.0), ("B", 1, stage, 1.0)]
        return dict(step=1, wall=4.5, ops=ops, micro_batches=[0, 1], lengths=[[1], [1]], tokens=[1, 1])

    (row,) = analyse([[rec(0)], [rec(1)]], pp=2, cost=cost)
    # (m + p - 1)(f + b) = 3 x 1.5 = 4.5 s
    assert row["predicted_s"] == pytest.approx(4.5)
    assert row["predicted_rel_error"] == pytest.approx(0.0)


def test_analyse_interleaved_places_ops_by_virtual_stage():
    """v = 2: rank r runs virtual stages r and r + pp; the simulated step of the measured
    ops equals the independent recurrence on the same [pp, v, m] durations."""
    import numpy as np

    from wlb_opt.rendezvous import simulate_channels
    from wlb_opt.simulate import pipeline_recurrence

    pp, v, m = 2, 2, 2
    f = np.arange(1, pp * v * m + 1, dtype=float).reshape(pp, v, m) / 10
    b = 2 * f
    gathered = []
    for r in range(pp):
        ops = [(ph, j, c * pp + r, (f if ph == "F" else b)[r, c, j]) for ph in "FB" for c in range(v) for j in range(m)]
        gathered.append([dict(step=1, wall=1.0, ops=ops, micro_batches=list(range(m)), tokens=[1] * m)])
    (row,) = analyse(gathered, pp=pp, virtual_stages=v)
    assert row["virtual_stages"] == 2
    assert row["dag_s"] == pytest.approx(pipeline_recurrence(f, b, "interleaved", v).step_time_s)
    # the simulator's estimate is the replay of the executor's channels, as simulate_step's: the DAG
    assert row["simulated_s"] == pytest.approx(simulate_channels(f, b, v).step_time_s, rel=1e-12)
    assert row["simulated_s"] == pytest.approx(row["dag_s"], rel=1e-12)


def test_single_rank_errors_and_the_breakdown():
    import numpy as np

    import wlb_opt as wlb
    from wlb_opt.bench.validate_sim import analyse_single, breakdown

    zero = dict(attn=0.0, linear=0.0, comm=0.0, doc_const=0.0, mb_const=0.0)
    cost = wlb.CostModel(coef={"fwd": dict(zero, linear=1.0), "bwd": dict(zero, linear=2.0)}, attn_flops_per_pair=1.0)
    # micro-batches of 1 and 2 tokens: predicted F 1, 2 and B 2, 4 -> step 9 s; measured ops 10% slower
    rec = dict(step=1, wall=11.0, cpu=11.0, lengths=[[1], [2]], ops=[("F", 0, 0, 1.1), ("F", 1, 0, 2.2), ("B", 0, 0, 2.2),
                                                             ("B", 1, 0, 4.4)])
    (row,) = analyse_single([rec], cost)
    assert row["predicted_s"] == pytest.approx(9.0) and row["step_rel_error"] == pytest.approx(9 / 11 - 1)
    assert row["op_median_abs_error"] == pytest.approx(1 - 1 / 1.1) and row["busy_s"] == pytest.approx(9.9)
    # pipeline of 2 stages, 2 micro-batches, f = 1, b = 2: (m + p - 1)(f + b) = 9 s; x2 contention -> 18 s;
    # + 0.5 s p2p per boundary crossing on the critical path
    f, b = np.ones((2, 2)), 2 * np.ones((2, 2))
    pipe = [dict(virtual_stages=1, step=1, measured_s=18.0, tokens=[1, 1], predicted_rel_error=-0.5,
                 _pred_fwd=f, _pred_bwd=b, _schedule="1f1b")]
    (out,) = breakdown(pipe, 2.0, lambda tokens: [0.5] * len(tokens))
    assert out["with_contention_error"] == pytest.approx(0.0)
    assert out["with_comm_error"] > 0 and out["comm_s"] == pytest.approx(out["with_comm_error"] * 18.0)


def test_the_interleaved_prediction_is_the_channel_replay():
    import numpy as np

    import wlb_opt as wlb
    from wlb_opt.bench.validate_sim import predicted_pipeline_s
    from wlb_opt.rendezvous import simulate_channels

    zero = dict(attn=0.0, linear=0.0, comm=0.0, doc_const=0.0, mb_const=0.0)
    cost = wlb.CostModel(coef={"fwd": dict(zero, linear=1.0), "bwd": dict(zero, linear=2.0)}, attn_flops_per_pair=1.0)
    pp, v, m = 2, 2, 4
    lengths = [[1], [2], [3], [1]]
    gathered = []
    for r in range(pp):
        ops = [(ph, j, c * pp + r, 0.1) for ph in "FB" for c in range(v) for j in range(m)]
        gathered.append([dict(step=1, wall=10.0, ops=ops, micro_batches=list(range(m)), lengths=lengths,
                              tokens=[1, 2, 3, 1])])
    (row,) = analyse(gathered, pp=pp, cost=cost, virtual_stages=v)
    f = np.tile([cost.micro_batch_cost(d, "fwd") / pp for d in lengths], (pp, 1))
    b = np.tile([cost.micro_batch_cost(d, "bwd") / pp for d in lengths], (pp, 1))
    want = simulate_channels(f, b, v).step_time_s
    assert row["predicted_s"] == pytest.approx(want, rel=1e-12)
    assert predicted_pipeline_s(f, b, v, 0.25) == pytest.approx(simulate_channels(f, b, v, 0.25).step_time_s)


def test_work_outside_the_ops_is_measured_from_the_clocks_and_fed_to_the_replay():
    """pp = 2, 1F1B, f = 1 s, b = 2 s, two micro-batches, clocks written by hand: both ranks
    start their pipeline 0.5 s into the step, every group that receives takes 0.1 s once both
    sides are posted, the last rank out spends 0.2 s after its pipeline: a 10 s step, which
    the replay fed those reproduces (the simulator on op times alone says 9 s)."""
    import numpy as np

    from wlb_opt.bench.validate_sim import replay_with_overheads, step_overheads

    ops = [("F", 0, None, 1.0), ("F", 1, None, 1.0), ("B", 0, None, 2.0), ("B", 1, None, 2.0)]
    t0 = 100.0  # perf_counter seconds; groups are (post, done) of the non-empty groups in order
    groups = [[(1.5, 1.5), (2.5, 4.7), (6.7, 7.8)],   # rank 0: send F0 | send F1 + recv B0 | recv B1
              [(0.5, 1.6), (4.6, 4.7), (7.7, 7.7)]]   # rank 1: recv F0 | send B0 + recv F1 | send B1
    ends = [9.8, 7.7]
    ranks = [dict(step=1, wall=10.0, ops=[(ph, j, r, s) for ph, j, _, s in ops], micro_batches=[0, 1], tokens=[4, 4],
                  clock=[t0, t0 + 10.0], pipeline=[t0 + 0.5, t0 + ends[r]],
                  groups=[[t0 + a, t0 + d] for a, d in groups[r]]) for r in range(2)]
    over = step_overheads(ranks, 2, 1)
    assert over["start_s"] == pytest.approx([0.5, 0.5]) and over["teardown_s"] == pytest.approx(0.2)
    assert over["transfer_s"] == pytest.approx(0.1)
    f, b = np.ones((2, 1, 2)), 2 * np.ones((2, 1, 2))
    assert replay_with_overheads(f, b, 1, over, over["transfer_s"]) == pytest.approx(10.0)
    (row,) = analyse([[ranks[0]], [ranks[1]]], pp=2, p2p_s_per_mb=lambda tokens: [0.0] * len(tokens))
    assert row["simulated_s"] == pytest.approx(9.0) and row["replay_measured_p2p_s"] == pytest.approx(10.0)
    assert row["replay_s"] == pytest.approx(9.7)  # no transfer time: 9 s + 0.5 + 0.2
    assert row["setup_s"] == pytest.approx(0.5) and row["transfer_ms"] == pytest.approx(100.0)
    ranks[1]["groups"].pop()
    with pytest.raises(ValueError, match="recorded 2 p2p groups, but its schedule has 3"):
        step_overheads(ranks, 2, 1)


def test_a_channel_transfer_counts_only_receives_the_rank_was_waiting_for():
    """Interleaved channels: a message's transfer is its completion minus the later of its two
    posts, taken only where the receiver was already waiting then (else it arrived unseen)."""
    from wlb_opt.bench.validate_sim import step_overheads

    # (kind, peer, direction, micro, chunk, posted, waited, done), absolute seconds
    sends = [["send", 1, "fwd", 0, 0, 101.0, None, None], ["send", 1, "fwd", 1, 0, 102.0, None, None]]
    receives = [["recv", 0, "fwd", 0, 0, 100.5, 100.8, 101.3],   # waiting before the send: 0.3 s
                ["recv", 0, "fwd", 1, 0, 101.3, 105.0, 105.0]]   # waited long after: not counted
    ranks = [dict(clock=[100.0, 110.0], pipeline=[100.5, 109.0], groups=[], messages=sends),
             dict(clock=[100.0, 110.0], pipeline=[100.2, 109.5], groups=[], messages=receives)]
    over = step_overheads(ranks, 2, 2)
    assert over["transfer_s"] == pytest.approx(0.3)
    assert over["start_s"] == pytest.approx([0.5, 0.2]) and over["teardown_s"] == pytest.approx(0.5)
