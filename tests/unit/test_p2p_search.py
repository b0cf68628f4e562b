"""The searched meetings of the interleaved pipeline: their placement rule, the search's own
replay held to `wlb_opt.rendezvous._replay`, and the table the executor reads (every shape
completes under rendezvous semantics). How close the replay comes to the ideal DAG is measured
by `wlb-opt bench pipeline-replay`, not asserted here."""
from __future__ import annotations

import numpy as np
import pytest

from wlb_opt.p2p_search import _evaluate, _placement, op_times, search_meetings
from wlb_opt.rendezvous import _replay, simulate_rendezvous
from wlb_opt.schedule import _meeting_table, _plans, meeting_pairs, p2p_schedule, place_messages
from wlb_opt.simulate import pipeline_step_time

INTERLEAVED = [(pp, n, v) for v in (2, 4) for pp in range(2, 9) for n in range(pp, 17, pp)]


def _first_meeting(low_to_high: bool, first: int, last: int, low, high):
    """The plain rule: the first meeting whose boundary on the sender is at or after `first`;
    None if its boundary on the receiver is after `last`."""
    for lo, hi in zip(low, high):
        own, other = (lo, hi) if low_to_high else (hi, lo)
        if own >= first:
            return (own, other) if other <= last else None
    return None


def test_a_message_goes_to_the_first_meeting_after_it_is_made():
    # pp=2, n_micro=2, v=2: rank 0 runs F0.0 F1.0 F0.2 F1.2 B0.2 B1.2 B0.0 B1.0, rank 1 runs
    # F0.1 F1.1 F0.3 B0.3 F1.3 B1.3 B0.1 B1.1; meetings are (rank 0 boundary, rank 1 boundary)
    pair = meeting_pairs(2, 2, 2)[(0, 1)]
    _, low_to_high, first, last = pair
    assert first[:2].tolist() == [1, 2] and last[:2].tolist() == [0, 1]  # F0.0 -> F0.1, F1.0 -> F1.1
    for low, high in [([1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 4, 6, 7, 8]), ([1, 2, 4, 6, 7], [0, 1, 4, 6, 8]),
                      ([1, 2, 6, 7], [0, 1, 6, 8]), ([2, 3], [0, 1]), ([1], [0])]:
        want = [_first_meeting(bool(d), int(f), int(la), low, high) for d, f, la in zip(low_to_high, first, last)]
        got = place_messages(pair, low, high)
        if any(w is None for w in want):
            assert got is None
        else:
            assert list(zip(got[0].tolist(), got[1].tolist())) == want


@pytest.mark.parametrize("pp, n_micro, v, placement", [(2, 4, 2, "searched"), (2, 8, 4, "searched"),
                                                       (4, 8, 2, "nominal"), (4, 8, 2, "next_op")])
def test_the_search_replay_equals_the_rendezvous_replay(pp, n_micro, v, placement):
    dur, ideal = op_times(pp, n_micro, v, 3, 0.3, 5)
    sender, at_sender, receiver, at_receiver = _placement(pp, n_micro, v, placement)
    fast = _evaluate(pp, dur.shape[2], sender, at_sender, receiver, at_receiver, dur, ideal)
    rng = np.random.default_rng([5, pp, n_micro, v])
    plans = [[(list(g), op) for g, op in rank] for rank in _plans(pp, n_micro, v, placement)]
    for d in range(3):  # the same draws, in the replay's [pp, v, n_micro] layout
        f = rng.lognormal(0.0, 0.3, (pp, v, n_micro)) / (pp * v)
        b = 2.0 * rng.lognormal(0.0, 0.3, (pp, v, n_micro)) / (pp * v)
        slow = _replay(f, b, plans, 0.0).step_time_s / pipeline_step_time(f, b, "interleaved", v)
        assert fast[d] == pytest.approx(slow, rel=1e-12)


def test_the_search_replay_reports_a_deadlock():
    pp, n_micro, v = 2, 2, 2
    sender, at_sender, receiver, at_receiver = _placement(pp, n_micro, v, "auto")
    dur, ideal = op_times(pp, n_micro, v, 1, 0.3, 0)
    # the first forward's activation received before rank 1's first op, but sent at the very end
    first = int(np.flatnonzero(sender == 0)[0])
    at_sender = at_sender.copy()
    at_sender[first] = dur.shape[2]
    assert _evaluate(pp, dur.shape[2], sender, at_sender, receiver, at_receiver, dur, ideal).size == 0


def test_the_search_is_deterministic_and_its_meetings_are_valid():
    a = search_meetings(2, 4, 2, draws=8, iterations=300)
    b = search_meetings(2, 4, 2, draws=8, iterations=300)
    assert a == b
    meetings, score = a
    assert np.isfinite(score)
    for pair, (low, high) in meetings.items():
        assert np.all(np.diff(low) >= 0) and np.all(np.diff(high) >= 0)
        assert place_messages(meeting_pairs(2, 4, 2)[pair], low, high) is not None


def test_the_table_holds_searched_shapes_and_the_rest_fall_back_to_the_nominal_placement():
    table = _meeting_table()
    assert table and set(table) <= {f"{pp},{n},{v}" for pp, n, v in INTERLEAVED}
    for key in table:
        pp, n, v = map(int, key.split(","))
        assert p2p_schedule(pp, n, v) == [[list(g) for g, _ in r if g] for r in _plans(pp, n, v, "searched")]
    for pp, n, v in [(2, 18, 2)] + [s for s in INTERLEAVED if f"{s[0]},{s[1]},{s[2]}" not in table]:
        assert p2p_schedule(pp, n, v) == [[list(g) for g, _ in r if g] for r in _plans(pp, n, v, "nominal")]
    with pytest.raises(ValueError, match="no searched meetings"):
        _plans(2, 18, 2, "searched")
    with pytest.raises(ValueError, match="placement must be one of"):
        _plans(2, 4, 2, "latest")


@pytest.mark.parametrize("pp, n_micro, v", INTERLEAVED)
def test_every_searched_schedule_completes_under_rendezvous_semantics(pp, n_micro, v):
    # the replay raises RuntimeError if the groups deadlock; random op times, no transfer time
    # and a large one (a group that receives then waits for its data)
    rng = np.random.default_rng([pp, n_micro, v])
    f = rng.lognormal(0.0, 0.3, (pp, v, n_micro))
    b = 2.0 * rng.lognormal(0.0, 0.3, (pp, v, n_micro))
    ideal = pipeline_step_time(f, b, "interleaved", v)
    for p2p_s in (0.0, 0.5):
        res = simulate_rendezvous(f, b, v, p2p_s)
        assert res.step_time_s >= ideal * (1 - 1e-12)
        assert res.stage_busy_s.sum() == pytest.approx(f.sum() + b.sum())


def test_a_partial_search_keeps_a_stored_shape_it_does_not_beat_and_records_how_it_searched(tmp_path):
    """Re-searching one shape with a weaker search keeps the stored meetings unless the new
    ones beat them on the same fresh draws, and the table's header still describes the
    shapes searched under it."""
    import json
    from pathlib import Path

    from wlb_opt import p2p_search

    shipped = Path(p2p_search.__file__).with_name("p2p_meetings.json")
    table = json.loads(shipped.read_text())
    out = tmp_path / "meetings.json"
    out.write_text(shipped.read_text())
    assert p2p_search.main(["--v", "2", "--max-pp", "2", "--max-micro", "4", "--draws", "4", "--iterations", "20",
                            "--out", str(out)]) == 0
    after = json.loads(out.read_text())
    assert after["search"] == table["search"]
    for key in ("2,2,2", "2,4,2"):
        if after["meetings"].get(key) != table["meetings"].get(key):  # replaced: it beat the stored one
            assert after["searched"][key]["iterations"] == 20
    assert after["meetings"]["2,4,2"] == table["meetings"]["2,4,2"]  # 30000 annealing moves beat 20
    untouched = [k for k in table["meetings"] if not k.startswith("2,")]
    assert all(after["meetings"][k] == table["meetings"][k] for k in untouched)
