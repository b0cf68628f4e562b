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
