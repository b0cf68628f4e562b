"""The packer's per-step candidate packing (`StepSolver`, trial.py) gives the plans of
`solve_pack(method="wlb")` ("wlb_phases": the kept plan that of `solve_pack(method="wlb_phases")`),
candidates made from a packing equal those packed alone, and the no-tuning defaults keep
their recorded plans at 32 micro-batches (tests/data/make_packer_n32_digests.py), lookahead
0 and 4, with either step packer; from 16 micro-batches "wlb_phases" packs its candidates with
their short pieces in lumps, and still keeps solve_pack's plan."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import operator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wlb_opt as wlb
from wlb_opt.packer import PackerConfig, WLBPacker
from wlb_opt.packer.defaults import REPAIR_FROM
from wlb_opt.packer.state import HeldPiece
import wlb_opt.packer.trial as trial_module
import wlb_opt.solvers.greedy as greedy_module
from wlb_opt.packer.trial import BELOW_ANY, COARSE_CUTS, StepSolver, TrialPack, as_pack_plan
from wlb_opt.solvers.greedy import compiled_available, use_compiled
from wlb_opt.solvers.phases import geometric_lumps
from wlb_opt.workloads import DEFAULT_SEED, global_batches

COST = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4, dp=1),
                              wlb.HardwareSpec.preset("h100"))


@st.composite
def steps(draw):
    n_micro = draw(st.integers(1, 6))
    cap = draw(st.integers(8, 400))
    n = draw(st.integers(0, 3 * n_micro * cap // 40 + 3))  # up to ~3x capacity: overloaded steps defer
    lengths = draw(st.lists(st.integers(1, cap), min_size=n, max_size=n))
    pieces = [HeldPiece(id=i // 2, offset=(i % 2) * 1000, length=d, arrival=draw(st.integers(0, 3)))
              for i, d in enumerate(lengths)]
    cut = sorted(draw(st.lists(st.integers(0, n), min_size=2, max_size=2)))
    return n_micro, cap, pieces, pieces[:cut[0]], pieces[cut[0]:cut[1]], pieces[cut[1]:]


@settings(max_examples=150, deadline=None)
@given(steps(), st.sampled_from(["wlb", "wlb_phases"]))
def test_a_candidate_packs_as_solve_pack_does(step, method):
    # the plan kept: Algorithm 1's packing, or ("wlb_phases") the same pieces packed with the
    # phases balanced apart; what the release reads is Algorithm 1's either way
    n_micro, cap, pieces, first, rest, tail = step
    lengths = np.array([piece.length for piece in pieces], dtype=np.int64)
    phases = None
    if method == "wlb_phases":
        phases = (COST.doc_cost(lengths, "fwd") if len(pieces) else np.zeros(0),
                  COST.doc_cost(lengths, "bwd") if len(pieces) else np.zeros(0), COST.mb_const("fwd"),
                  COST.mb_const("bwd"))
    solver = StepSolver(pieces, COST.doc_cost(lengths) if len(pieces) else np.zeros(0), tail, n_micro=n_micro,
                        dp=1, max_tokens=cap, bin_const=COST.mb_const(), method=method, phases=phases)
    # the fresh pieces last (the packer's order: found by position) or first (by key)
    moved = list(range(len(pieces) - len(tail), len(pieces))) + list(range(len(pieces) - len(tail)))
    solver_moved = StepSolver([pieces[i] for i in moved], (COST.doc_cost(lengths) if len(pieces) else np.zeros(0))[moved],
                              tail, n_micro=n_micro, dp=1, max_tokens=cap, bin_const=COST.mb_const(), method=method,
                              phases=phases and (phases[0][moved], phases[1][moved], *phases[2:]))
    one_out = len(tail) // 2
    # rest ending with the step's fresh pieces (sorted once, reused), with all of them but one
    # (a trimmed step), and any other rest
    for solver, rest_given in [(solver, rest + tail), (solver, rest + tail), (solver, tail[1:] + rest),
                               (solver, rest + tail[:one_out] + tail[one_out + 1:]),
                               (solver_moved, rest + tail[:one_out] + tail[one_out + 1:]),
                               (solver_moved, rest + tail)]:
        pending, trial, arrival = solver.solve(first, rest_given)
        assert pending == first + rest_given
        assert arrival.tolist() == [piece.arrival for piece in pending]
        got = as_pack_plan(trial)
        kw = dict(ids=[piece.id for piece in pending], offsets=[piece.offset for piece in pending], carried=len(first))
        want = wlb.solve_pack([piece.length for piece in pending], n_micro, cap, COST, method, **kw)
        assert got.digest() == want.digest() and got.info.extra == want.info.extra
        assert np.array_equal(got.loads, want.loads) and np.array_equal(got.tokens, want.tokens)
        want = wlb.solve_pack([piece.length for piece in pending], n_micro, cap, COST, "wlb", **kw)
        # a candidate's loads are Algorithm 1's running sums, the plan's solve_pack's sums: equal
        # but for rounding
        assert trial.imbalance == pytest.approx(want.imbalance, rel=1e-12, abs=0)
        assert trial.deferred_tokens == want.deferred_tokens
        assert solver.solve(first, rest_given)[1].defers_any(pending) == bool(len(want.deferred))


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.skipif(
    not compiled_available(), reason="numba (the `fast` extra) is not installed"))], ids=["python", "compiled"])
def test_the_defaults_keep_their_recorded_plans_at_32_micro_batches(compiled):
    with use_compiled(compiled):
        _check_n32_digests()


def _check_n32_digests():
    ref = json.loads((Path(__file__).parents[1] / "data" / "packer_n32_digests.json").read_text())
    runs = [(ref["stream"], name, run) for name, run in ref["runs"].items()]
    runs += [(ref["capped"]["stream"], name, run) for name, run in ref["capped"]["runs"].items()]
    for st_, name, run_ref in runs:
        dist = name.split("/")[0]
        batches = global_batches(dist, st_["window"], st_["n_micro"] * st_["window"], st_["steps"],
                                 seed=DEFAULT_SEED + st_["seed_offset"])
        packer = WLBPacker(st_["n_micro"], st_["max_tokens"], COST,
                           config=PackerConfig(lookahead=run_ref["lookahead"], method=run_ref["method"]))
        plans = [packer.pack(*b) for b in batches] + packer.drain()
        digests = [p.digest() + f"/{p.step}/" + hashlib.sha256(p.arrival_step.tobytes()).hexdigest()[:16]
                   for p in plans if p is not None]
        assert digests == run_ref["digests"], name


def _algorithm1_solver(step) -> StepSolver:
    """The StepSolver of a drawn step (Algorithm 1's packings)."""
    n_micro, cap, pieces, _, _, tail = step
    lengths = np.array([piece.length for piece in pieces], dtype=np.int64)
    return StepSolver(pieces, COST.doc_cost(lengths) if len(pieces) else np.zeros(0), tail, n_micro=n_micro,
                      dp=1, max_tokens=cap, bin_const=COST.mb_const())


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.skipif(
    not compiled_available(), reason="numba (the `fast` extra) is not installed"))], ids=["python", "compiled"])
@settings(max_examples=60, deadline=None)
@given(step=steps(), data=st.data())
def test_candidates_made_from_a_packing_equal_those_packed_alone(step, data, compiled):
    # TrialPack.with_groups (each group merged into the packing's order, packed when first
    # read; in Python, a group that goes first shares the packing's placements:
    # `SharedPlacements`) against StepSolver.solve of the same pieces, also for a candidate
    # of a candidate
    with use_compiled(compiled), pytest.MonkeyPatch.context() as patch:
        patch.setattr(trial_module, "SHARED_MIN_BINS", 1)  # shared on steps of any size
        _check_candidates_made_from_a_packing(step, data)


@settings(max_examples=80, deadline=None)
@given(step=steps(), data=st.data())
def test_a_candidate_takes_algorithm1s_input_from_its_packing(step, data):
    # TrialPack._item_lists: a candidate of a packing already packed in Python takes the loop's
    # input lists from the packing's (its group's pieces put in), and a trimmed packing
    # (`without`) from its own less the piece: each must equal the lists of its own placement
    # order, and pack as StepSolver.solve's packing of the same pieces / as its order packed
    with use_compiled(False):
        n_micro, cap, pieces, first, rest, tail = step
        solver = _algorithm1_solver(step)
        n_held = data.draw(st.integers(0, len(rest)))
        held, extra = rest[:n_held], rest[n_held:]
        groups = [extra[i:i + k] for i in range(len(extra)) for k in (1, 2, 3) if i + k <= len(extra)][:6]
        _, base, _ = solver.solve(first, held + tail)
        assert base.imbalance >= 0 and "_item_lists" in base.__dict__  # packed: its lists are kept

        def lists_of(order):
            return solver.lengths[order].tolist(), solver.weights[order].tolist()

        for group in groups:
            trial = base.with_group(group)
            _, alone, _ = solver.solve(first, held + group + tail)
            assert as_pack_plan(trial).digest() == as_pack_plan(alone).digest()
            assert trial._item_lists == lists_of(trial._order)
            if len(trial.pending) > len(first):
                position = data.draw(st.integers(len(first), len(trial.pending) - 1))
                _, smaller, _ = trial.without(position)
                assert smaller._item_lists == lists_of(smaller._order)
                want = greedy_module.wlb_assign_python(smaller._order, solver.lengths, solver.weights, n_micro, cap)
                assert np.array_equal(smaller._placed_bin, want)


def _check_candidates_made_from_a_packing(step, data):
    n_micro, cap, pieces, first, rest, tail = step
    solver = _algorithm1_solver(step)
    n_held = data.draw(st.integers(0, len(rest)))
    held, extra = rest[:n_held], rest[n_held:]
    groups = [extra[i:i + k] for i in range(len(extra)) for k in (1, 2, 3) if i + k <= len(extra)][:8]
    counted = []
    _, base, _ = solver.solve(first, held + tail)
    trials = base.with_groups(groups, account=lambda n, n_pieces: counted.append((n, n_pieces)))
    assert counted == []  # nothing is packed before it is read
    for group, trial in zip(groups, trials):
        pending, alone, arrival = solver.solve(first, held + group + tail)
        assert trial.pending == pending
        assert np.array_equal(trial.arrival, arrival)
        assert trial.deferred_tokens == alone.deferred_tokens
        assert counted[-1] == (1, len(pending))
        assert as_pack_plan(trial).digest() == as_pack_plan(alone).digest()
        assert trial.imbalance == alone.imbalance and np.array_equal(trial.loads, alone.loads)
        assert trial.defers_any(group) == alone.defers_any(group)
        for more, again in zip(groups[:2], trial.with_groups(groups[:2])):
            if set(more) & set(group):
                continue
            want = as_pack_plan(solver.solve(first, held + group + more + tail)[1])
            assert as_pack_plan(again).digest() == want.digest()


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.skipif(
    not compiled_available(), reason="numba (the `fast` extra) is not installed"))], ids=["python", "compiled"])
@settings(max_examples=60, deadline=None)
@given(step=steps(), data=st.data())
def test_a_candidate_rejects_exactly_what_its_full_packing_fails(step, data, compiled):
    # TrialPack.rejects stops packing once the candidate surely fails a limit (a lower bound on
    # its imbalance passes the threshold, its deferred tokens reach the limit, a piece to keep
    # is deferred): it must answer as the full packing does (overloaded steps, whose deferred
    # pieces lower the mean, included), count one packing (none under a threshold below 1),
    # and leave the candidate readable.
    # A step meets an order again: a packing of it done whole is reused, one stopped stops
    # again under limits no looser (thresholds in any order); the reference is packed whole by
    # a solver of its own. The Python loop stops early; the compiled one packs whole.
    with use_compiled(compiled):
        n_micro, cap, pieces, first, rest, tail = step
        solver, reference = _algorithm1_solver(step), _algorithm1_solver(step)
        groups = [rest[i:i + 2] for i in range(0, len(rest), 2)][:4]
        _, base, _ = solver.solve(first, tail)
        for group in groups:
            exact = reference.solve(first, group + tail)[1]
            at, deferred = exact.imbalance, exact.deferred_tokens
            thresholds = [None, at - 1e-3, at * (1 - 1e-8), at * (1 + 1e-8), at + 1e-3, data.draw(st.floats(0.5, 3.0))]
            trial = None
            for threshold in data.draw(st.permutations(thresholds)):
                if threshold is not None and abs(threshold - at) <= 2e-9 * at:  # within the rounding margin: either
                    continue
                limit = data.draw(st.sampled_from([float("inf"), deferred, deferred + 1, max(deferred - 1, 0)]))
                keep = group[:data.draw(st.integers(0, len(group)))]
                want = (threshold is not None and at > threshold) or deferred >= limit or exact.defers_any(keep)
                counted = []
                trial = base.with_groups([group], account=lambda n, n_pieces: counted.append(n))[0]
                assert trial.rejects(threshold, limit, keep) == want, (threshold, at, limit, deferred)
                assert trial.rejects(threshold, limit, keep) == want  # asked again, stopped or not
                # a threshold below 1 rejects without a packing: no imbalance is below 1
                assert counted == ([] if threshold is not None and threshold < BELOW_ANY else [1])
            if trial is not None:  # the last candidate read whole, after its packing stopped or not
                assert trial.imbalance == at and trial.deferred_tokens == deferred
                assert counted == [1]  # still one packing


@pytest.mark.parametrize("dist, lookahead, steps", [("prose", 0, 80), ("code", 2, 80), ("real", 4, 100)])
def test_a_trimmed_step_is_the_step_packed_again_without_its_piece(dist, lookahead, steps, monkeypatch):
    # `MarginalRelease._trimmed` makes the step less one piece from the kept candidate
    # (`TrialPack.without`: its order less the piece) rather than through `solve`: the same
    # candidate, so the same decision and the same plan, trim taken or not
    from wlb_opt.packer.release import MarginalRelease
    from wlb_opt.packer.trial import TrialPack
    trim, seen = MarginalRelease._trimmed, {"taken": 0, "refused": 0}

    without, made = TrialPack.without, {"got": [], "want": []}

    def made_without(trial, position):
        out = without(trial, position)
        made["got"].append(out[1])
        return out

    def made_by_solve(solve):
        def counted(first, rest):
            out = solve(first, rest)
            made["want"].append(out[1])
            return out
        return counted

    def both(self, result, fresh, carry, step, solve, below=None):
        made["got"].clear()
        made["want"].clear()
        with monkeypatch.context() as m:
            m.setattr(TrialPack, "without", made_without)
            got = trim(self, result, fresh, carry, step, solve, below)
        with monkeypatch.context() as m:
            m.delattr(TrialPack, "without")
            want = trim(self, result, fresh, carry, step, made_by_solve(solve), below)
        assert len(made["got"]) == len(made["want"]) <= 1
        for a, b in zip(made["got"], made["want"]):  # the candidates themselves
            assert (a._n_first, a._n_rest, a.pending) == (b._n_first, b._n_rest, b.pending)
            assert np.array_equal(a._pending_idx, b._pending_idx) and np.array_equal(a._order, b._order)
        assert (got is None) == (want is None)
        if got is not None:
            assert got[1] == want[1]  # the trimmed step's imbalance as the rule weighs it
            (got, _), (want, _) = got, want
            assert got.pending == want.pending and got.released == want.released and got.n_early == want.n_early
            assert np.array_equal(got.arrival, want.arrival)
            assert got.plan.digest() == want.plan.digest()
            assert np.array_equal(got.plan.deferred, want.plan.deferred)
            assert np.array_equal(got.plan.loads, want.plan.loads)
        seen["taken" if got is not None else "refused"] += 1
        return None if got is None else (got, _)

    monkeypatch.setattr(MarginalRelease, "_trimmed", both)
    W = 131072
    packer = WLBPacker(4, int(1.25 * W), COST, config=PackerConfig(lookahead=lookahead))
    for batch in global_batches(dist, W, 4 * W, steps, seed=DEFAULT_SEED + 7):  # long enough for 3 trims
        packer.pack(*batch)
    assert seen["taken"] >= 3 and seen["refused"] >= 20


@pytest.mark.parametrize("dist, lookahead, max_delay, carried_move, carried_stay",
                         [("heavy", 0, 16, True, False), ("prose", 2, 2, True, True), ("heavy", 0, 1, False, True),
                          ("real", 0, None, False, True)])
def test_the_trim_may_defer_exactly_the_fresh_pieces_and_the_carried_ones_not_due(dist, lookahead, max_delay,
                                                                                   carried_move, carried_stay,
                                                                                   monkeypatch):
    # `MarginalRelease._movable_test` finds them from the released pieces and the deadline
    # alone: the same answer as the plain definition over the step's fresh and carried pieces
    from wlb_opt.packer.release import MarginalRelease
    movable_test, seen, current = MarginalRelease._movable_test, {"carried": 0, "fresh": 0, "stays": 0}, {}

    def both(self, result, fresh, step):
        test = movable_test(self, result, fresh, step)
        carry, fresh_set = set(current["carry"]), set(fresh)
        allowed = fresh_set | {p for p in carry if max_delay is not None and step - p.arrival < max_delay}

        def checked(i):
            got, piece = test(i), result.pending[i]
            assert got == (piece in allowed)
            seen["carried"] += got and piece in carry
            seen["fresh"] += got and piece in fresh_set
            seen["stays"] += piece in carry and piece not in allowed
            return got
        return checked

    trim = MarginalRelease._trimmed

    def trim_seeing_carry(self, result, fresh, carry, step, solve, below=None):
        current["carry"] = carry
        return trim(self, result, fresh, carry, step, solve, below)

    monkeypatch.setattr(MarginalRelease, "_movable_test", both)
    monkeypatch.setattr(MarginalRelease, "_trimmed", trim_seeing_carry)
    W = 131072
    packer = WLBPacker(4, int(1.25 * W), COST, config=PackerConfig(lookahead=lookahead, max_delay=max_delay))
    for batch in global_batches(dist, W, 4 * W, 80, seed=DEFAULT_SEED + 9):
        packer.pack(*batch)
    # carried pieces the trim may defer, and carried pieces it may not (due, or no max_delay)
    assert seen["fresh"] > 100 and (seen["carried"] > 0) == carried_move and (seen["stays"] > 0) == carried_stay


def _step_of_32(dist: str, seed: int, n_outliers: int):
    """A 32-micro-batch step of `dist`: fresh pieces, and outliers held from earlier steps."""
    W = 131072
    lengths = global_batches(dist, W, 32 * W, 1, seed=DEFAULT_SEED + seed)[0][0]
    rng = np.random.default_rng(seed)
    held = [HeldPiece(id=10**6 + i, offset=0, length=int(d), arrival=-1)
            for i, d in enumerate(rng.integers(int(0.3 * 1.25 * W), W, n_outliers))]
    fresh = [HeldPiece(id=i, offset=0, length=int(d), arrival=0) for i, d in enumerate(lengths)]
    return held, fresh


def _phases_solver(pieces, fresh, n_micro, dp=1):
    lengths = np.array([piece.length for piece in pieces], dtype=np.int64)
    phases = (COST.doc_cost(lengths, "fwd"), COST.doc_cost(lengths, "bwd"), COST.mb_const("fwd"), COST.mb_const("bwd"))
    return StepSolver(pieces, COST.doc_cost(lengths), fresh, n_micro=n_micro, dp=dp, max_tokens=int(1.25 * 131072),
                      bin_const=COST.mb_const(), method="wlb_phases", phases=phases)


@pytest.mark.parametrize("dist, seed", [("real", 0), ("heavy", 1), ("prose", 2)])
def test_lumped_candidates_place_their_long_pieces_as_algorithm1_and_keep_solve_packs_plan(dist, seed):
    # From 16 micro-batches, "wlb_phases" packs its candidates with the short tail in lumps of
    # a share of the tail left to place, down to max_tokens / 40 tokens: the pieces before the
    # tail are placed as Algorithm 1 places them
    # (so a group is placed or deferred the same way), every piece of a lump shares its
    # micro-batch, no micro-batch passes the token cap, and the plan kept is solve_pack's
    # "wlb_phases" plan of its pieces (with the phases' own lumps, solvers.phases.tail_lumps).
    # Below 16 micro-batches, or with "wlb", no lumps.
    held, fresh = _step_of_32(dist, seed, 40)
    solver = _phases_solver(held + fresh, fresh, 32)
    assert solver.lump_tokens == int(1.25 * 131072) // 40
    assert _phases_solver(held + fresh, fresh, 8).lump_tokens == 0
    assert _phases_solver(held + fresh, fresh, 4, dp=4).lump_tokens == solver.lump_tokens
    assert _algorithm1_solver((32, int(1.25 * 131072), held + fresh, [], [], fresh)).lump_tokens == 0
    cap = solver.max_tokens
    for group in (held[:0], held[:5], held[10:42]):
        pending, trial, _ = solver.solve([], group + fresh)
        order, placed = trial._order, trial._placed_bin
        lengths = solver.lengths[order]
        cut = int(np.flatnonzero(lengths >= solver.lump_tokens)[-1]) + 1
        exact = wlb.solve_pack([p.length for p in pending], 32, cap, COST, "wlb",
                               ids=[p.id for p in pending], offsets=[p.offset for p in pending])
        exact_bin = np.full(len(pending), -1)
        for b, mb in enumerate(exact.micro_batches):
            exact_bin[mb] = b
        assert np.array_equal(placed[:cut], exact_bin[trial._positions[:cut]])  # the long pieces: Algorithm 1's
        tail_lengths = lengths[cut:]
        split = max(COARSE_CUTS, 32)
        lump = geometric_lumps(tail_lengths, split, solver.lump_tokens)
        left = np.cumsum(tail_lengths[::-1])[::-1]
        share = 2 ** (split - 1).bit_length()  # a lump holds under 1 / share of the tail left, or lump_tokens
        for k in np.unique(lump):
            assert len(set(placed[cut:][lump == k].tolist())) == 1  # a lump is placed, or deferred, whole
            first = int(np.flatnonzero(lump == k)[0])
            assert tail_lengths[lump == k][:-1].sum() < max(left[first] / share, solver.lump_tokens)
        assert len(np.unique(lump)) < len(tail_lengths) / 4  # a step's short pieces go by the dozen at first
        tokens = np.bincount(placed[placed >= 0], weights=lengths[placed >= 0], minlength=32)
        assert tokens.max() <= cap
        assert trial.imbalance == wlb.imbalance(trial.loads)
        kept = as_pack_plan(trial)
        want = wlb.solve_pack([p.length for p in pending], 32, cap, COST, "wlb_phases",
                              ids=[p.id for p in pending], offsets=[p.offset for p in pending])
        assert kept.digest() == want.digest() and np.array_equal(kept.loads, want.loads)


@pytest.mark.skipif(not compiled_available(), reason="numba (the `fast` extra) is not installed")
@pytest.mark.parametrize("dist, seed, n_outliers", [("real", 4, 40), ("heavy", 5, 40), ("prose", 6, 90)])
def test_the_compiled_lumped_loop_packs_and_sums_as_the_python_loop(dist, seed, n_outliers):
    # the compiled loop packs a lumped candidate and sums its micro-batches' costs piece by
    # piece on the way: the same placements, loads (the floats of np.bincount, compared
    # exactly) and deferred tokens as the Python loop, also where the step is overloaded
    # (lumps deferred whole, fallbacks to the micro-batch of fewest tokens)
    held, fresh = _step_of_32(dist, seed, n_outliers)
    overloaded = []
    for group in (held[:0], held[:5], held[10:n_outliers]):
        trials = {}
        for compiled in (False, True):
            solver = _phases_solver(held + fresh, fresh, 32)
            with use_compiled(compiled):
                trial = solver.solve([], group + fresh)[1]
                placed, sums, deferred = solver.assign_and_sum(trial._order)
                assert (sums is None) == (not compiled)
                trials[compiled] = (trial._placed_bin, trial.loads, trial.deferred_tokens, trial.imbalance)
            if compiled:
                keep = placed >= 0
                want = np.bincount(placed[keep], weights=solver.weights[trial._order[keep]], minlength=32)
                assert np.array_equal(sums, want) and deferred == int(solver.lengths[trial._order[~keep]].sum())
        python, compiled = trials[False], trials[True]
        assert np.array_equal(python[0], compiled[0]) and np.array_equal(python[1], compiled[1])
        assert python[2:] == compiled[2:]
        overloaded.append(python[2] > 0)
    # with 30 or 80 outliers every step defers; a prose batch alone holds more than the step's tokens
    assert overloaded == [dist == "prose", dist == "prose", True]


def test_a_lumped_candidate_rejects_exactly_what_its_full_packing_fails():
    # TrialPack.rejects on lumped candidates: the stopped packing answers as the whole one
    held, fresh = _step_of_32("real", 3, 40)
    solver, reference = _phases_solver(held + fresh, fresh, 32), _phases_solver(held + fresh, fresh, 32)
    with use_compiled(False):
        base = solver.solve([], fresh)[1]
        for group in (held[:3], held[3:20], held[20:40]):
            whole = reference.solve([], group + fresh)[1]
            at, deferred = whole.imbalance, whole.deferred_tokens
            for threshold, limit in [(None, float("inf")), (at * 0.99, float("inf")), (at * 1.01, float("inf")),
                                     (None, deferred), (None, deferred + 1)]:
                want = (threshold is not None and at > threshold) or deferred >= limit or whole.defers_any(group)
                assert base.with_group(group).rejects(threshold, limit, group) == want


@pytest.mark.parametrize("compiled", [False, True])
def test_a_candidate_watching_short_pieces_in_the_lumped_tail_packs_as_the_whole_candidate(compiled):
    # a group of short held pieces (user thresholds below max_tokens / 40) falls in the tail
    # that "wlb_phases" packs in lumps: a stop that watches them must not change the lumps,
    # so the stopped packing, the whole one and the compiled loop's agree
    if compiled and not compiled_available():
        pytest.skip("the compiled loops need the 'fast' extra (numba)")
    held, fresh = _step_of_32("real", 4, 0)
    rng = np.random.default_rng(4)
    short = [HeldPiece(id=10**6 + i, offset=0, length=int(d), arrival=-1) for i, d in enumerate(rng.integers(1, 99, 5))]
    solver, reference = _phases_solver(short + fresh, fresh, 32), _phases_solver(short + fresh, fresh, 32)
    with use_compiled(False):
        whole = reference.solve([], short + fresh)[1]
        want = (whole._placed_bin, whole.imbalance, whole.deferred_tokens)
    with use_compiled(compiled):
        watched = solver.solve([], short + fresh)[1]
        assert watched._split is not None and set(solver._indices(short)) <= set(watched._split[1].tolist())
        assert watched.rejects(None, float("inf"), short) == whole.defers_any(short)
        assert np.array_equal(watched._placed_bin, want[0]) and (watched.imbalance, watched.deferred_tokens) == want[1:]


@pytest.mark.parametrize("dist, lookahead", [("real", 0), ("heavy", 4)])
def test_large_steps_of_the_default_step_packer_try_the_sparse_groups(dist, lookahead, monkeypatch):
    # From 32 micro-batches "wlb_phases" tries the groups `sparse_window` keeps: on every call of
    # a stream, `_windows` gives exactly the windows of every run of held pieces that it keeps
    # (those holding an early piece at their own stride)
    # (bounds and reliefs included), in Python as with numpy, and leaves some out. With
    # method="wlb", or at 16 micro-batches, every run is tried.
    from wlb_opt.packer import release as release_module
    windows, small = release_module.GroupRelease._windows, release_module.SMALL_WINDOWS
    seen = {"sparse": 0, "every": 0, "thinned": 0}

    def checked(self, remaining, ctx, early_only=False, arrived=False):
        got = windows(self, remaining, ctx, early_only, arrived)
        if arrived:  # the caller's hint that no piece is early changes no window, bound or relief
            assert all(piece.arrival <= ctx.step for piece in remaining)
            assert windows(self, remaining, ctx, early_only) == got
        if not self.sparse_windows:
            seen["every"] += 1
            return got
        seen["sparse"] += 1
        every = windows(dataclasses.replace(self, sparse_windows=False), remaining, ctx, early_only, arrived)
        top = min(self.need, len(remaining))
        chosen = [k for k, (size, start) in enumerate(zip(every[0], every[1]))
                  if release_module.sparse_window(size, start, len(remaining), top, early=early_only)]
        assert got == tuple(None if part is None else [part[k] for k in chosen] for part in every)
        seen["thinned"] += len(chosen) < len(every[0])
        monkeypatch.setattr(release_module, "SMALL_WINDOWS", 10**9)
        assert windows(self, remaining, ctx, early_only, arrived) == got
        assert windows(self, remaining, ctx, early_only) == got
        monkeypatch.setattr(release_module, "SMALL_WINDOWS", small)
        return got

    monkeypatch.setattr(release_module.GroupRelease, "_windows", checked)
    window = 131072
    for n_micro, method, sparse in ((32, "wlb_phases", True), (32, "wlb", False), (16, "wlb_phases", False)):
        seen.update(sparse=0, every=0)
        packer = WLBPacker(n_micro, int(1.25 * window), COST, config=PackerConfig(lookahead=lookahead, method=method))
        assert packer._release.sparse_windows == sparse
        for batch in global_batches(dist, window, n_micro * window, 6, seed=DEFAULT_SEED + 5):
            packer.pack(*batch)
        assert (seen["sparse"] > 0, seen["every"] > 0) == (sparse, not sparse)
    assert seen["thinned"] > 0


def test_large_steps_of_the_default_step_packer_pack_at_most_max_packed_per_search(monkeypatch):
    # From 32 micro-batches "wlb_phases" packs at most MAX_PACKED candidates per search of
    # `_candidates`, and the slow steps of a heavy stream reach it; with method="wlb", or at 16
    # micro-batches, a search packs every candidate its bounds leave.
    from wlb_opt.packer import release as release_module
    from wlb_opt.packer.trial import TrialPack
    candidates, with_group = release_module.GroupRelease._candidates, TrialPack.with_group
    packed: list[int] = []

    def counted_group(self, group, account=None):
        packed[-1] += 1
        return with_group(self, group, account)

    def counted(self, *args, **kwargs):
        packed.append(0)
        yield from candidates(self, *args, **kwargs)

    monkeypatch.setattr(TrialPack, "with_group", counted_group)
    monkeypatch.setattr(release_module.GroupRelease, "_candidates", counted)
    window = 131072
    for n_micro, method, cap in ((32, "wlb_phases", release_module.MAX_PACKED), (32, "wlb", None),
                                 (16, "wlb_phases", None)):
        packed.clear()
        packer = WLBPacker(n_micro, int(1.25 * window), COST, config=PackerConfig(lookahead=4, method=method))
        assert packer._release.max_packed == cap
        for batch in global_batches("heavy", window, n_micro * window, 40, seed=DEFAULT_SEED + 5):
            packer.pack(*batch)
        if cap is None:
            assert max(packed) > release_module.MAX_PACKED  # the searches the cap would cut
        else:
            assert max(packed) == cap, str(packed)


def test_large_steps_of_the_default_step_packer_pack_at_most_max_step_packed_per_step(monkeypatch):
    # From 32 micro-batches "wlb_phases" also packs at most MAX_STEP_PACKED candidates per step,
    # over all its rounds and pair searches; a step that reaches it keeps what it has taken, and
    # every piece is still trained exactly once. The cap is set to 24 here so that a short heavy
    # stream reaches it; without it the same steps pack more.
    from wlb_opt.packer import packer as packer_module
    from wlb_opt.packer import release as release_module
    from wlb_opt.packer.trial import TrialPack
    with_group = TrialPack.with_group
    packed: list[int] = []

    def counted_group(self, group, account=None):
        packed[-1] += 1
        return with_group(self, group, account)

    monkeypatch.setattr(TrialPack, "with_group", counted_group)
    window = 131072
    for n_micro, method, cap in ((32, "wlb_phases", release_module.MAX_STEP_PACKED), (32, "wlb", None),
                                 (16, "wlb_phases", None)):
        assert WLBPacker(n_micro, int(1.25 * window), COST,
                         config=PackerConfig(method=method))._release.max_step_packed == cap
    batches = global_batches("heavy", window, 32 * window, 40, seed=DEFAULT_SEED + 5)
    for cap in (None, 24):
        monkeypatch.setattr(packer_module, "MAX_STEP_PACKED", cap)
        packer = WLBPacker(32, int(1.25 * window), COST, config=PackerConfig(lookahead=4))
        packed.clear()
        plans = []
        for batch in batches:
            packed.append(0)
            plans.append(packer.pack(*batch))
        if cap is None:
            assert max(packed) > 24  # the steps the cap cuts
        else:
            assert max(packed) == cap
        plans = [plan for plan in plans if plan is not None] + packer.drain()
        trained = np.concatenate([plan.doc_ids[mb] for plan in plans for mb in plan.micro_batches])
        assert sorted(trained.tolist()) == sorted(np.concatenate([ids for _, ids, _ in batches]).tolist())


def test_the_sparse_groups_are_the_sizes_and_starts_named():
    from wlb_opt.packer.release import _window_layout, sparse_window

    def listed(size, start, n, top):  # the rule as its docstring states it, written out
        sizes = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, top}
        return size in sizes and (start % max(1, size // 4) == 0 or start == n - size)

    assert {size for size in range(1, 33) if sparse_window(size, 0, 100, 32)} == {1, 2, 3, 4, 6, 8, 12, 16, 24, 32}
    assert sparse_window(20, 0, 40, 20)  # the largest size a pool allows is always tried
    # starts every size // 4 pieces, and the run that ends at the last piece
    assert [i for i in range(100 - 24 + 1) if sparse_window(24, i, 100, 32)] == list(range(0, 73, 6)) + [76]
    assert [i for i in range(10 - 3 + 1) if sparse_window(3, i, 10, 32)] == list(range(8))
    for n, top in ((34, 32), (88, 32), (7, 7), (20, 16), (70, 64)):
        layout = _window_layout(n, top)
        assert layout.sparse.tolist() == [listed(int(s), int(i), n, top) for s, i in zip(layout.sizes, layout.starts)]
    assert int(_window_layout(34, 32).sparse.sum()) == 193 and int(_window_layout(88, 32).sparse.sum()) == 536
    # a group holding an early piece: the same sizes, a start every size pieces (no overlap) and the last run
    assert [i for i in range(100 - 24 + 1) if sparse_window(24, i, 100, 32, early=True)] == [0, 24, 48, 72, 76]
    assert [i for i in range(10 - 3 + 1) if sparse_window(3, i, 10, 32, early=True)] == [0, 3, 6, 7]
    assert [i for i in range(10 - 1 + 1) if sparse_window(1, i, 10, 32, early=True)] == list(range(10))
    assert not any(sparse_window(5, i, 100, 32, early=True) for i in range(96))
    for n, top in ((34, 32), (88, 32), (7, 7), (20, 16), (70, 64)):
        layout = _window_layout(n, top)
        assert layout.sparse_early.tolist() == [listed(int(s), int(i), n, top) and (i % s == 0 or i == n - s)
                                                for s, i in zip(layout.sizes.tolist(), layout.starts.tolist())]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), top=st.integers(1, 300), seed=st.integers(0, 2**31), sparse=st.booleans(),
       share=st.floats(0.0, 1.0))
def test_the_windows_costs_are_their_left_to_right_sums_however_gathered(n, top, seed, sparse, share):
    """`_window_costs` gathers a pool's windows size by size, a row per window or over the
    (top x n) layout: each way gives every window's cost added left to right from its first
    piece (the Python sum over the group, float for float) and its largest, for the sparse
    set's windows or every one, and for any subset of them (the windows left after the masks)."""
    from wlb_opt.packer.release import _sparse_windows, _window_costs, _window_layout

    top = min(top, n)
    rng = np.random.default_rng(seed)
    costs = rng.gamma(0.5, 1e-3, n)
    layout = _window_layout(n, top)
    sizes, starts = _sparse_windows(n, top) if sparse else (layout.sizes, layout.starts)
    if sparse:  # the sparse set in the layout's order
        assert np.array_equal(sizes, layout.sizes[layout.sparse]) and np.array_equal(starts, layout.starts[layout.sparse])
    subset = np.flatnonzero(rng.random(len(sizes)) < share)
    sizes, starts = sizes[subset], starts[subset]
    listed = costs.tolist()
    expected_total = [functools.reduce(operator.add, listed[i:i + k])  # left to right
                      for k, i in zip(sizes.tolist(), starts.tolist())]
    expected_heaviest = [max(listed[i:i + k]) for k, i in zip(sizes.tolist(), starts.tolist())]
    for how in (None, "by_size", "rows", "layout"):
        total, heaviest = _window_costs(costs, sizes, starts, top, how)
        assert total.tolist() == expected_total, how
        assert heaviest.tolist() == expected_heaviest, how


def test_a_step_of_64_micro_batches_plans_alike_with_either_sum_of_the_sparse_groups(monkeypatch):
    from wlb_opt.packer import release

    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4, dp=2),
                                  wlb.HardwareSpec.preset("h100"))
    batches = global_batches("real", 131072, 64 * 131072, 8, seed=DEFAULT_SEED + 21)

    def digests():
        packer = WLBPacker(32, int(1.25 * 131072), cost, config=PackerConfig(lookahead=2))
        return [p.digest() for p in [packer.pack(*b) for b in batches] + packer.drain() if p is not None]

    size_by_size = digests()
    monkeypatch.setattr(release, "SPARSE_SUMS_FROM", 10**9)  # a row per window, or the layout
    assert digests() == size_by_size


def _reference_shed(plan, pending, released, fresh, step, max_delay, price, backlog_half):
    """`MarginalRelease._shed` written from its definition, on whole arrays: the heaviest
    micro-batch (lowest index among equals) sheds its shortest movable piece (the first
    placed among equals) while the imbalance falls by more than price x its tokens."""
    loads = plan.loads.astype(np.float64).copy()
    mbs = [list(mb) for mb in plan.micro_batches]
    costs = COST.doc_cost(plan.lengths)
    room = backlog_half - int(plan.lengths[plan.deferred].sum())
    fresh_set, released_set = set(fresh), set(released)

    def movable(i):
        piece = pending[i]
        if max_delay is None:
            return piece in fresh_set
        return piece not in released_set and step - piece.arrival < max_delay

    shed = []
    while True:
        h = int(np.argmax(loads))
        options = [i for i in mbs[h] if movable(i)]
        if len(mbs[h]) <= 1 or not options:
            break
        i = min(options, key=lambda i: (plan.lengths[i], mbs[h].index(i)))
        if plan.lengths[i] > room:
            break
        after = loads.copy()
        after[h] -= costs[i]
        gain = loads.max() / loads.mean() - after.max() / after.mean()
        if gain <= price * plan.lengths[i]:
            break
        loads, room = after, room - int(plan.lengths[i])
        mbs[h].remove(i)
        shed.append(i)
    return shed


@pytest.mark.parametrize("dist, lookahead, max_delay", [("default", 0, 32), ("real", 2, 32), ("heavy", 0, None)])
def test_a_shed_step_defers_what_its_definition_defers_and_keeps_the_rest_in_place(dist, lookahead, max_delay,
                                                                                   monkeypatch):
    # `MarginalRelease._shed` against a plain re-implementation on every step of a stream:
    # the same pieces deferred, each a movable one, the others where they were, in order, and
    # the loads and tokens those of the pieces left (check_pack)
    from wlb_opt.packer.release import MarginalRelease
    from wlb_opt.plan import check_pack

    shed_step, seen = MarginalRelease._shed, {"steps": 0, "shed": 0}

    def checked(self, result, fresh, step):
        before = as_pack_plan(result.plan)
        out = shed_step(self, result._replace(plan=before), fresh, step)
        after = out.plan
        n_before = len(before.deferred)
        got = after.deferred[n_before:].tolist()
        want = _reference_shed(before, result.pending, result.released, fresh, step, self.max_delay,
                               self._token_price(), self.max_backlog_tokens // 2)
        assert got == want
        assert np.array_equal(after.deferred[:n_before], before.deferred)
        gone = set(got)
        for old, new in zip(before.micro_batches, after.micro_batches):
            assert new.tolist() == [i for i in old.tolist() if i not in gone] and len(new) >= 1 or not len(old)
        assert out.pending is result.pending and out.released is result.released
        check_pack(after, after.lengths, after.max_tokens, ids=after.doc_ids, offsets=after.offsets, cost=COST)
        if got:
            assert after.imbalance < before.imbalance and after.info.extra["shed"] == len(got)
        # the plan's largest micro-batch cost, summed again here, not the one before the shed
        assert after.info.objective == pytest.approx(max(COST.micro_batch_cost(after.lengths[mb])
                                                         for mb in after.micro_batches), rel=1e-12)
        seen["steps"] += 1
        seen["shed"] += len(got)
        return out

    monkeypatch.setattr(MarginalRelease, "_shed", checked)
    W = 131072
    packer = WLBPacker(4, int(1.25 * W), COST, config=PackerConfig(lookahead=lookahead, max_delay=max_delay))
    for batch in global_batches(dist, W, 4 * W, 60, seed=DEFAULT_SEED + 11):
        packer.pack(*batch)
    assert seen["steps"] >= 50 and seen["shed"] >= 20


def test_a_policy_without_shedding_keeps_the_trimmed_plan():
    # shed=False: the plan is the one the groups and the trim made, nothing more deferred
    from wlb_opt.packer.release import MarginalRelease

    W = 131072
    batches = global_batches("default", W, 4 * W, 40, seed=DEFAULT_SEED + 11)
    runs = {}
    for shed in (True, False):
        packer = WLBPacker(4, int(1.25 * W), COST)
        assert isinstance(packer._release, MarginalRelease) and packer._release.shed
        packer._release = dataclasses.replace(packer._release, shed=shed)
        runs[shed] = [packer.pack(*batch) for batch in batches]
    counts = [plan.info.extra.get("shed", 0) for plan in runs[True]]
    assert sum(counts) > 0 and all("shed" not in plan.info.extra for plan in runs[False])
    first = next(i for i, c in enumerate(counts) if c)  # the streams agree until a step sheds
    assert [p.digest() for p in runs[True][:first]] == [p.digest() for p in runs[False][:first]]
    assert len(runs[True][first].deferred) == len(runs[False][first].deferred) + counts[first]


def _defaults_train_every_piece_once(dist: str, lookahead: int, steps: int, seed: int) -> WLBPacker:
    """Runs the no-tuning defaults (4 micro-batches) on a stream of `dist` to its drain and
    checks that every piece fed is trained exactly once; returns the packer."""
    W = 131072
    packer = WLBPacker(4, int(1.25 * W), COST, config=PackerConfig(lookahead=lookahead))
    batches = global_batches(dist, W, 4 * W, steps, seed=DEFAULT_SEED + seed)
    plans = [packer.pack(*batch) for batch in batches] + packer.drain()
    trained = sorted((int(i), int(o)) for p in plans if p is not None for mb in p.micro_batches
                     for i, o in zip(p.doc_ids[mb], p.offsets[mb]))
    assert trained == sorted((int(i), int(o)) for b in batches for i, o in zip(b[1], b[2]))
    return packer


@pytest.mark.parametrize("dist, lookahead, seed", [("prose", 0, 11), ("prose", 2, 11), ("heavy", 0, 12)])
def test_a_step_without_its_groups_is_taken_only_where_it_scores_lower(dist, lookahead, seed, monkeypatch):
    # `MarginalRelease._without_groups_instead` on every step that weighs it: the step without
    # groups is taken only where its imbalance plus its trimmed piece's tokens at the price is
    # below the chosen step's score; where it is not taken, the trim run without the early
    # stop of `below` finds no such step either; a step taken puts every group piece back in
    # its queue, in its order, and keeps the rest of the queues as they were
    from wlb_opt.packer.release import MarginalRelease
    from wlb_opt.plan import check_pack

    weigh, seen = MarginalRelease._without_groups_instead, {"weighed": 0, "taken": 0}

    def checked(self, chosen, score, without_groups, fresh, queues, before, carry, step, solve):
        out = weigh(self, chosen, score, without_groups, fresh, queues, before, carry, step, solve)
        if score <= 1.0:
            assert out is chosen
            return out
        seen["weighed"] += 1
        free = self._trimmed(without_groups, fresh, carry, step, solve)  # without `below`'s early stop
        lower = free is not None and free[1] + self._token_price() * free[0].pending[-1].length < score
        assert (out is not chosen) == lower
        if out is chosen:
            return out
        seen["taken"] += 1
        assert out.pending == free[0].pending and out.plan.digest() == free[0].plan.digest()
        assert out.released == without_groups.released and out.n_early == 0
        gone = {piece.key for piece in without_groups.released}
        assert [list(q) for q in queues] == [[p for p in was if p.key not in gone] for was in before]
        assert {piece.key for piece in chosen.released} - gone <= {p.key for q in queues for p in q}
        plan = as_pack_plan(out.plan)
        check_pack(plan, plan.lengths, plan.max_tokens, ids=plan.doc_ids, offsets=plan.offsets, cost=COST)
        return out

    monkeypatch.setattr(MarginalRelease, "_without_groups_instead", checked)
    _defaults_train_every_piece_once(dist, lookahead, 120, seed)
    assert seen["weighed"] >= 3 and seen["taken"] >= 2


def test_a_policy_that_does_not_weigh_the_step_without_groups_keeps_the_grouped_step():
    # trim_without_groups=False: the plans of the groups, trim and shed alone; the streams
    # agree until a step of the default takes the step without its groups
    from wlb_opt.packer.release import MarginalRelease

    W = 131072
    batches = global_batches("prose", W, 4 * W, 80, seed=DEFAULT_SEED + 11)
    runs, taken = {}, []
    weigh = MarginalRelease._without_groups_instead

    def counted(self, chosen, *args):
        out = weigh(self, chosen, *args)
        taken.append(out is not chosen)
        return out

    for on in (True, False):
        packer = WLBPacker(4, int(1.25 * W), COST)
        assert isinstance(packer._release, MarginalRelease) and packer._release.trim_without_groups
        packer._release = dataclasses.replace(packer._release, trim_without_groups=on)
        if on:
            MarginalRelease._without_groups_instead = counted
        try:
            runs[on] = [packer.pack(*batch) for batch in batches]
        finally:
            MarginalRelease._without_groups_instead = weigh
    assert any(taken)
    first = next(i for i, plan in enumerate(runs[True]) if plan is not None and plan.info.extra.get("released") == 0
                 and runs[False][i] is not None and runs[False][i].info.extra.get("released", 0) > 0)
    assert [p.digest() for p in runs[True][:first]] == [p.digest() for p in runs[False][:first]]


def test_the_groups_relief_counted_twice_takes_the_step_without_groups_less_readily():
    # held_group_steps: the step without groups must outgain that many steps of the groups'
    # relief. Two streams, at 1 and at the default 2, agree until the first step that one of
    # them weighs differently, and there the step at 1 is taken without its groups and the
    # step at 2 keeps them
    from wlb_opt.packer.release import MarginalRelease

    W = 131072
    batches = global_batches("prose", W, 4 * W, 80, seed=DEFAULT_SEED + 11)
    weigh = MarginalRelease._without_groups_instead
    runs, taken = {}, {}
    for steps in (1.0, 2.0):
        record = taken.setdefault(steps, {})

        def counted(self, chosen, score, without_groups, fresh, queues, before, carry, step, solve):
            out = weigh(self, chosen, score, without_groups, fresh, queues, before, carry, step, solve)
            record[step] = out is not chosen
            return out

        packer = WLBPacker(4, int(1.25 * W), COST)
        assert isinstance(packer._release, MarginalRelease) and packer._release.held_group_steps == 2.0
        packer._release = dataclasses.replace(packer._release, held_group_steps=steps)
        MarginalRelease._without_groups_instead = counted
        try:
            runs[steps] = [packer.pack(*batch) for batch in batches]
        finally:
            MarginalRelease._without_groups_instead = weigh
    differ = [s for s in sorted(taken[1.0]) if taken[1.0][s] != taken[2.0].get(s)]
    assert differ, "no step took the step without groups at 1 and not at 2"
    first = differ[0]
    assert taken[1.0][first] and not taken[2.0].get(first, False)
    assert [p.digest() for p in runs[1.0][:first]] == [p.digest() for p in runs[2.0][:first]]
    assert runs[1.0][first].digest() != runs[2.0][first].digest()


def _repair_groups(policy, chosen, fresh, queues, carry, step, solve):
    """The score of every group `MarginalRelease._repaired` may take first from `chosen`
    (None: not allowed), written apart from the policy, from its docstring."""
    from wlb_opt.packer.release import displacement_relief

    lam = policy._token_price()
    back = {chosen.pending[i].key for i in chosen.plan.deferred.tolist()}
    released = list(chosen.released)
    fixed = {p.key for p in released}
    pool = sorted((p for q in queues for p in q if p.key not in fixed and p.arrival - step <= policy.max_lead),
                  key=lambda p: (p.length, p.arrival))
    scores = []
    for n in range(1, policy.need + 1):
        for i in range(len(pool) - n + 1):
            group = pool[i:i + n]
            pending, plan, _ = solve(*policy._split([p for p in carry if p.key not in back], released + group,
                                                    [p for p in fresh if p.key not in back], step))
            keep = {p.key for p in released + group}
            allowed = plan.deferred_tokens <= chosen.plan.deferred_tokens and not any(
                pending[j].key in keep for j in plan.deferred.tolist())
            scores.append(plan.imbalance - lam * displacement_relief(group, step, policy.early_credit)
                          if allowed else None)
    return scores


@pytest.mark.parametrize("dist, lookahead", [("prose", 2), ("prose", 0), ("heavy", 2)])
def test_a_repaired_step_scores_lower_and_a_step_left_has_no_group_that_would(dist, lookahead, monkeypatch):
    # `MarginalRelease._repaired` on every step above `repair_from`: a step it changes holds
    # the step's pieces plus groups of held pieces (gone from their queues, the rest of each
    # queue in its order), defers what the step deferred and, beyond that, no more tokens than
    # the step deferred, and its imbalance less the groups' relief at the price is below the
    # step's imbalance; a step it leaves has no group that
    # scores lower (the groups packed apart); every piece of the stream is trained once
    from wlb_opt.packer.release import MarginalRelease, displacement_relief
    from wlb_opt.plan import check_pack

    repair, seen = MarginalRelease._repaired, {"left": 0, "repaired": 0}

    def checked(self, chosen, fresh, queues, carry, step, solve):
        before = [list(q) for q in queues]
        scores = _repair_groups(self, chosen, fresh, before, carry, step, solve)
        out = repair(self, chosen, fresh, queues, carry, step, solve)
        base = chosen.plan.imbalance
        if out is chosen:
            seen["left"] += 1
            assert all(score is None or score >= base for score in scores)
            assert [list(q) for q in queues] == before
            return out
        seen["repaired"] += 1
        assert any(score is not None and score < base for score in scores)
        n = len(chosen.released)
        assert out.released[:n] == chosen.released and out.n_early == chosen.n_early + len(out.released) - n
        group = out.released[n:]
        taken = {p.key for p in group}
        held = {p.key for was in before for p in was}
        assert taken and taken <= held and all(p.arrival - step <= self.max_lead for p in group)
        assert [list(q) for q in queues] == [[p for p in was if p.key not in taken] for was in before]
        assert sorted(p.key for p in out.pending) == sorted([p.key for p in chosen.pending] + list(taken))
        back = {chosen.pending[i].key for i in chosen.plan.deferred.tolist()}
        deferred = [out.pending[i] for i in out.plan.deferred.tolist()]
        assert back <= {p.key for p in deferred} and not taken & {p.key for p in deferred}
        assert sum(p.length for p in deferred if p.key not in back) <= chosen.plan.deferred_tokens
        _, plan, _ = solve(*self._split([p for p in carry if p.key not in back], list(chosen.released) + group,
                                        [p for p in fresh if p.key not in back], step))
        assert plan.imbalance - self._token_price() * displacement_relief(group, step, self.early_credit) < base
        kept = as_pack_plan(out.plan)
        check_pack(kept, kept.lengths, kept.max_tokens, ids=kept.doc_ids, offsets=kept.offsets, cost=COST)
        return out

    monkeypatch.setattr(MarginalRelease, "_repaired", checked)
    packer = _defaults_train_every_piece_once(dist, lookahead, 100, 11)
    assert packer._release.repair_from == REPAIR_FROM
    assert seen["repaired"] >= 1 and seen["left"] >= 3


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=7), n_bins=st.integers(1, 3),
       cap=st.integers(1, 24), n_held=st.integers(0, 7))
def test_a_step_surely_defers_only_where_no_placement_places_every_piece(lengths, n_bins, cap, n_held):
    # `_surely_defers` (the repair's bound before it packs a group) against every placement of
    # the pieces, held ones and lengths alike, into n_bins micro-batches of cap tokens
    import itertools

    from wlb_opt.packer.release import _surely_defers

    held = [HeldPiece(i, 0, d, 0) for i, d in enumerate(lengths[:n_held])]
    others = sorted(lengths[n_held:], reverse=True)
    fits = any(all(sum(d for d, b in zip(lengths, bins) if b == k) <= cap for k in range(n_bins))
               for bins in itertools.product(range(n_bins), repeat=len(lengths)))
    if _surely_defers(held, others, n_bins, cap):
        assert not fits
    if max(lengths) <= cap and len(lengths) <= n_bins:
        assert not _surely_defers(held, others, n_bins, cap)


def test_a_step_surely_defers_where_the_pigeonhole_says_so():
    from wlb_opt.packer.release import _surely_defers

    held = [HeldPiece(i, 0, 60, 0) for i in range(3)]
    assert _surely_defers(held, [60, 60], 4, 100)  # five pieces of 60 in four micro-batches of 100
    assert not _surely_defers(held, [60, 40], 4, 100)  # 60 + 40 fit one
    assert _surely_defers([], [30] * 9, 4, 89)  # some micro-batch holds three of nine
    assert not _surely_defers([], [30] * 9, 4, 90)


def test_steps_of_16_micro_batches_or_more_are_never_repaired(monkeypatch):
    # the repair packs every move of a round (tens of packings); from 16 micro-batches the
    # candidates are packed in lumps and a step's time is the planner's budget, so there the
    # plans are those without it (the recorded 32-micro-batch digests hold them)
    from wlb_opt.packer.release import MarginalRelease

    def never(*args):
        raise AssertionError("a step of 16 micro-batches was repaired")

    monkeypatch.setattr(MarginalRelease, "_repaired", never)
    W = 131072
    packer = WLBPacker(16, int(1.25 * W), COST, config=PackerConfig(lookahead=2))
    assert packer._release.repair_from is None
    for batch in global_batches("prose", W, 16 * W, 12, seed=DEFAULT_SEED + 11):
        packer.pack(*batch)
    assert WLBPacker(15, int(1.25 * W), COST)._release.repair_from == REPAIR_FROM


def test_only_the_algorithm_1_step_packers_repair_their_steps():
    # the candidates of "wlb_fill" are scored apart and those of the other methods cost a
    # solve each: their steps are never repaired
    W = 131072
    for method in ("wlb_phases", "wlb", "wlb_fill", "wlb_ls", "fixed"):
        packer = WLBPacker(4, int(1.25 * W), COST, config=PackerConfig(method=method))
        assert packer._release.repair_from == (REPAIR_FROM if method in ("wlb_phases", "wlb") else None)


@pytest.mark.parametrize("n_micro,dist,lookahead", [(32, "real", 4), (32, "heavy", 0), (4, "real", 2), (4, "code", 0)])
def test_the_plans_are_the_same_whether_candidates_share_placements_or_not(n_micro, dist, lookahead, monkeypatch):
    # the candidates whose group goes first share their packing's placements of the other
    # pieces (`TrialPack._assign_shared`): the default packer's plans are those it makes with
    # every candidate packed alone, and candidates did share placements (at 4 micro-batches
    # too, below SHARED_MIN_BINS)
    monkeypatch.setattr(trial_module, "SHARED_MIN_BINS", 1)
    window = 32768
    batches = global_batches(dist, window, n_micro * window, 30 if n_micro == 32 else 80, seed=DEFAULT_SEED + 7)

    def plans():
        packer = WLBPacker(n_micro, int(1.25 * window), COST, config=PackerConfig(lookahead=lookahead))
        out = [packer.pack(*b) for b in batches] + packer.drain()
        return [(p.digest(), p.step, p.arrival_step.tolist()) for p in out if p is not None]

    reused = []
    state = greedy_module._Run.state

    def counted_state(run, k, loads, toks):  # the shared placements a candidate reuses
        reused.append(k)
        return state(run, k, loads, toks)

    monkeypatch.setattr(greedy_module._Run, "state", counted_state)
    with use_compiled(False):
        shared = plans()
        assert sum(reused) > 0
        monkeypatch.setattr(TrialPack, "_assign_shared", lambda self, stop: trial_module._UNSHARED)
        assert shared == plans()
