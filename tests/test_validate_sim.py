"""The simulator-validation benchmark's analysis: measured op times in, step comparison out."""
import pytest

from wlb_opt.bench.validate_sim import analyse


def test_analyse_reproduces_the_1f1b_closed_form():
    # pp = 2, two identical micro-batches: f = 1, b = 2 -> (m + p - 1)(f + b) = 9 seconds
    ops = [("F", 0, 1.0), ("F", 1, 1.0), ("B", 0, 2.0), ("B", 1, 2.0)]
    gathered = [[dict(step=1, wall=9.0, ops=ops, micro_batches=[0, 1], tokens=[4, 4])] for _ in range(2)]
    (row,) = analyse(gathered, pp=2)
    assert row["simulated_s"] == pytest.approx(9.0)
    assert row["rel_error"] == pytest.approx(0.0)
    # a heavier micro-batch on stage 1 lengthens the simulated step; the measured wall is kept
    gathered[1][0]["ops"] = [("F", 0, 3.0), ("B", 0, 2.0), ("F", 1, 1.0), ("B", 1, 2.0)]
    (row,) = analyse(gathered, pp=2)
    assert row["simulated_s"] > 9.0 and row["measured_s"] == 9.0


def test_analyse_predicts_from_the_cost_model():
    import wlb_opt as wlb

    zero = dict(attn=0.0, linear=0.0, comm=0.0, doc_const=0.0, mb_const=0.0)
    # fwd 1 s and bwd 2 s per token over all layers; pp = 2 -> 0.5 / 1.0 s per stage for 1-token micro-batches
    cost = wlb.CostModel(coef={"fwd": dict(zero, linear=1.0), "bwd": dict(zero, linear=2.0)}, attn_flops_per_pair=1.0)
    ops = [("F", 0, 0.5), ("F", 1, 0.5), ("B", 0, 1.0), ("B", 1, 1.0)]
    rec = dict(step=1, wall=4.5, ops=ops, micro_batches=[0, 1], lengths=[[1], [1]], tokens=[1, 1])
    (row,) = analyse([[rec], [dict(rec)]], pp=2, cost=cost)
    # (m + p - 1)(f + b) = 3 x 1.5 = 4.5 s
    assert row["predicted_s"] == pytest.approx(4.5)
    assert row["predicted_rel_error"] == pytest.approx(0.0)
