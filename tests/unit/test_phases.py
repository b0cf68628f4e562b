"""wlb_phases: its heap loop (Python and compiled) against a scan of every bin, and its stop at
the first item it defers that another placement places, Algorithm 1
when the phases weigh alike, never deferring what Algorithm 1 places, lower forward and
backward imbalance than Algorithm 1 on the steps of a real-length stream, and, from 32 bins,
its short tail in lumps: cut as a per-item twin cuts it, placed as the scan places the lumps,
at the balance of the item-by-item placement."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wlb_opt as wlb
from wlb_opt.packer import per_step_imbalance
from wlb_opt.solvers.greedy import compiled_available, placement_order, use_compiled, wlb_assign_python
from wlb_opt.solvers import phases as phases_module
from wlb_opt.solvers.phases import (LUMP_MIN_BINS, LUMP_SHARE, LUMP_SPLIT, phases_assign, geometric_lumps,
                                    phases_or_algorithm1, tail_lumps, wlb_phases)
from wlb_opt.solvers.problem import PackProblem
from wlb_opt.workloads import DEFAULT_SEED, global_batches

COST = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4, dp=1),
                              wlb.HardwareSpec.preset("h100"))


needs_numba = pytest.mark.skipif(not compiled_available(), reason="numba (the `fast` extra) is not installed")
BOTH_LOOPS = pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_numba)],
                                     ids=["python", "compiled"])


def phases_assign_reference(order, lengths, fwd, bwd, n_bins: int, cap: int, fwd_const: float = 0.0,
                            bwd_const: float = 0.0) -> np.ndarray:
    """`phases_assign` by a scan of every bin per item (O(items x bins)): each item to the bin
    whose key, max(forward / mean forward, backward / mean backward), is least (ties: the
    lowest index) if it fits under `cap` tokens, else to the bin of fewest tokens if it fits
    there, else deferred (-1). Where a phase has no cost, the key is the bin's summed cost
    (Algorithm 1)."""
    order = np.asarray(order, dtype=np.int64)
    if not len(order):
        return np.zeros(0, dtype=np.int64)
    f_mean = (float(np.add.reduce(fwd[order])) + n_bins * fwd_const) / n_bins
    b_mean = (float(np.add.reduce(bwd[order])) + n_bins * bwd_const) / n_bins
    apart = f_mean > 0 and b_mean > 0
    f_load = np.full(n_bins, fwd_const / f_mean if apart else 0.0)
    b_load = np.full(n_bins, bwd_const / b_mean if apart else 0.0)
    toks = np.zeros(n_bins, dtype=np.int64)
    out = np.full(len(order), -1, dtype=np.int64)
    for k, i in enumerate(order.tolist()):
        key = np.maximum(f_load, b_load) if apart else f_load
        b = int(np.argmin(key))  # first of the least: the lowest index
        if toks[b] + lengths[i] > cap:
            b = int(np.argmin(toks))
            if toks[b] + lengths[i] > cap:
                continue
        toks[b] += lengths[i]
        if apart:
            f_load[b] += fwd[i] / f_mean
            b_load[b] += bwd[i] / b_mean
        else:
            f_load[b] += fwd[i] + bwd[i]
        out[k] = b
    return out


def _phases(lengths):
    return COST.doc_cost(lengths, "fwd"), COST.doc_cost(lengths, "bwd")


@BOTH_LOOPS
@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(1, 5000), min_size=0, max_size=70), n_bins=st.integers(1, 7),
       slack=st.floats(0.3, 2.0), carried_frac=st.floats(0, 1))
def test_the_heap_loop_places_as_a_scan_of_every_bin(compiled, lengths, n_bins, slack, carried_frac):
    lengths = np.array(lengths, dtype=np.int64)
    cap = max(1, int(slack * lengths.sum() / n_bins)) if len(lengths) else 1  # tight caps defer and fall back
    fwd, bwd = _phases(lengths)
    problem = PackProblem(lengths=lengths, weights=fwd + bwd, n_bins=n_bins, max_tokens=cap,
                          carried=int(carried_frac * len(lengths)))
    order = placement_order(problem, lengths)
    consts = (COST.mb_const("fwd"), COST.mb_const("bwd"))
    with use_compiled(compiled):
        got = phases_assign(order, lengths, fwd, bwd, n_bins, cap, *consts)
    np.testing.assert_array_equal(got, phases_assign_reference(order, lengths, fwd, bwd, n_bins, cap, *consts))
    for b in range(n_bins):
        assert lengths[order[got == b]].sum() <= cap


def test_phases_that_weigh_alike_give_algorithm1():
    # backward = 2 x forward, term by term: a micro-batch's two shares are equal and the rule
    # is Algorithm 1's on the sum (random costs: no two different sums tie)
    rng = np.random.default_rng(0)
    for _ in range(40):
        n, n_bins = int(rng.integers(1, 200)), int(rng.integers(1, 9))
        lengths = rng.integers(1, 4000, n)
        fwd = rng.random(n) * lengths
        cap = int(rng.uniform(0.5, 2.0) * lengths.sum() / n_bins) + 1
        order = np.argsort(-lengths, kind="stable")
        np.testing.assert_array_equal(phases_assign(order, lengths, fwd, 2 * fwd, n_bins, cap, 0.5, 1.0),
                                      wlb_assign_python(order, lengths, 3 * fwd, n_bins, cap))


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=70), n_bins=st.integers(1, 6),
       slack=st.floats(0.3, 1.5))
def test_nothing_algorithm1_places_is_deferred(lengths, n_bins, slack):
    lengths = np.array(lengths, dtype=np.int64)
    cap = max(1, int(slack * lengths.sum() / n_bins))
    fwd, bwd = _phases(lengths)
    order = np.argsort(-lengths, kind="stable")
    algorithm1 = wlb_assign_python(order, lengths, fwd + bwd, n_bins, cap)
    placed, fallback = phases_or_algorithm1(order, lengths, fwd + bwd, fwd, bwd, n_bins, cap, 0.0, 0.0)
    assert not np.any((placed < 0) & (algorithm1 >= 0))
    if fallback:
        np.testing.assert_array_equal(placed, algorithm1)
    result = wlb_phases(PackProblem(lengths=lengths, weights=fwd + bwd, n_bins=n_bins, max_tokens=cap,
                                    phase_weights=(fwd, bwd)))
    assert result.extra["fallback"] == fallback


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=70), n_bins=st.integers(1, 6),
       slack=st.floats(0.3, 1.5), carried_frac=st.floats(0, 1), data=st.data())
def test_the_loop_stops_at_the_first_item_it_defers_that_another_placement_places(lengths, n_bins, slack,
                                                                                  carried_frac, data):
    # against the scan of every bin: None exactly where the whole placement defers an item the
    # other placement places, else the whole placement; the other one is asked for once, and
    # only where an item is deferred
    lengths = np.array(lengths, dtype=np.int64)
    cap = max(1, int(slack * lengths.sum() / n_bins))
    fwd, bwd = _phases(lengths)
    problem = PackProblem(lengths=lengths, weights=fwd + bwd, n_bins=n_bins, max_tokens=cap,
                          carried=int(carried_frac * len(lengths)))
    order = placement_order(problem, lengths)
    whole = phases_assign_reference(order, lengths, fwd, bwd, n_bins, cap)
    other = np.array(data.draw(st.lists(st.integers(-1, n_bins - 1), min_size=len(order), max_size=len(order))),
                     dtype=np.int64)
    asked = []

    def placed_by():
        asked.append(1)
        return other

    with use_compiled(False):
        got = phases_assign(order, lengths, fwd, bwd, n_bins, cap, stop_if_placed_by=placed_by)
    if np.any((whole < 0) & (other >= 0)):
        assert got is None
    else:
        np.testing.assert_array_equal(got, whole)
    assert len(asked) == int(bool(np.any(whole < 0)))


def test_algorithm1_is_kept_where_the_balanced_placement_would_defer_more():
    # two bins of 20 tokens; the balanced placement leaves the fifth item (6 tokens) no room
    # that Algorithm 1 keeps for it
    lengths = np.array([9, 8, 7, 6, 6, 3])
    fwd, bwd = np.array([8.0, 5, 3, 4, 9, 5]), np.array([1.0, 4, 3, 3, 9, 7])
    order = np.arange(6)
    assert phases_assign(order, lengths, fwd, bwd, 2, 20).tolist() == [0, 1, 1, 0, -1, 1]
    algorithm1 = wlb_assign_python(order, lengths, fwd + bwd, 2, 20)
    assert algorithm1.tolist() == [0, 1, 0, 1, 1, 0]
    placed, fallback = phases_or_algorithm1(order, lengths, fwd + bwd, fwd, bwd, 2, 20, 0.0, 0.0)
    assert fallback and placed.tolist() == algorithm1.tolist()
    result = wlb_phases(PackProblem(lengths=lengths, weights=fwd + bwd, n_bins=2, max_tokens=20,
                                    phase_weights=(fwd, bwd)))
    assert result.extra["fallback"] and not len(result.deferred)


def test_solve_pack_balances_the_phases_better_than_algorithm1_on_real_steps():
    # each phase's max / mean over a stream's batches (N = 4): the quantity the pipeline pays
    # per phase, lower for wlb_phases in both phases, while the sum stays near Algorithm 1's
    window = 131072
    batches = global_batches("real", window, 4 * window, 30, seed=DEFAULT_SEED + 7)
    imbalance = {method: {phase: [] for phase in ("fwd", "bwd", "fwd_bwd")} for method in ("wlb", "wlb_phases")}
    for lengths, ids, offsets in batches:
        for method, phases in imbalance.items():
            plan = wlb.solve_pack(lengths, 4, int(1.25 * window), COST, method, ids=ids, offsets=offsets)
            assert plan.info.method == method
            for phase, values in phases.items():
                values.append(per_step_imbalance(plan, COST, phase))
    mean = {method: {phase: float(np.mean(v)) for phase, v in phases.items()} for method, phases in imbalance.items()}
    assert mean["wlb_phases"]["fwd"] < mean["wlb"]["fwd"]
    assert mean["wlb_phases"]["bwd"] < mean["wlb"]["bwd"]
    assert mean["wlb_phases"]["fwd_bwd"] < mean["wlb"]["fwd_bwd"] + 0.01


@BOTH_LOOPS
def test_a_full_least_loaded_bin_is_passed_over_only_while_it_stays_the_least_loaded(compiled):
    # in this order (placed first, not longest first): the 2-token item finds the least-loaded
    # bin without room and falls back; the next 1-token item fits that bin, which stops being
    # the least loaded, so the last item goes by load again, not to the fewest-token bin
    lengths = np.array([6, 4, 1, 2, 1, 2], dtype=np.int64)
    fwd = np.array([20.0, 28.0, 7.0, 28.0, 21.0, 22.0])
    bwd = np.array([11.0, 10.0, 20.0, 5.0, 23.0, 16.0])
    order = np.arange(6)
    want = phases_assign_reference(order, lengths, fwd, bwd, 3, 7)
    assert want.tolist() == [0, 1, 2, 2, 0, 1]
    with use_compiled(compiled):
        np.testing.assert_array_equal(phases_assign(order, lengths, fwd, bwd, 3, 7), want)


@needs_numba
@pytest.mark.parametrize("slack", [0.8, 1.3])
def test_the_compiled_loop_places_real_steps_as_the_python_loop(slack):
    # 32 micro-batches of real-length documents with equal lengths among them (ties on keys
    # and tokens), overloaded (slack 0.8: fallbacks and deferrals) and not
    for lengths, _, _ in global_batches("real", 8192, 32 * 8192, 3, seed=DEFAULT_SEED + 7):
        fwd, bwd = _phases(lengths)
        order = np.argsort(-lengths, kind="stable")
        cap = int(slack * lengths.sum() / 32)
        with use_compiled(False):
            python = phases_assign(order, lengths, fwd, bwd, 32, cap, 1e-3, 2e-3)
        with use_compiled(True):
            compiled = phases_assign(order, lengths, fwd, bwd, 32, cap, 1e-3, 2e-3)
        np.testing.assert_array_equal(python, compiled)
        assert (python < 0).any() == (slack < 1)


def _tail_lumps_twin(sizes, n_bins, cap, n_first):
    """`tail_lumps` item by item: the bucket of each item's tokens left, by int.bit_length."""
    if n_bins < LUMP_MIN_BINS:
        return None
    long = [k for k, size in enumerate(sizes) if size >= max(1, int(cap * LUMP_SHARE))]
    cut = max([n_first] + [k + 1 for k in long])
    if len(sizes) - cut < phases_module.LUMP_MIN_TAIL:
        return None
    return cut, _geometric_lumps_twin(sizes[cut:], LUMP_SPLIT * n_bins)


def _geometric_lumps_twin(sizes, split, finest=1):
    """`geometric_lumps` item by item: the bucket of each item's tokens left, by int.bit_length."""
    bits = (split - 1).bit_length()
    lump_of, keys, left = [], [], sum(sizes)
    for size in sizes:
        octave = max(left, 1).bit_length() - 1
        key = ("fine", left // finest) if left < finest * 2**bits else (octave, left >> max(octave - bits, 0))
        lump_of.append(lump_of[-1] + (key != keys[-1]) if lump_of else 0)
        keys.append(key)
        left -= size
    return lump_of


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 800), top=st.integers(1, 5000), split=st.integers(1, 200),
       finest=st.integers(1, 6000))
def test_geometric_lumps_cut_as_a_per_item_twin_and_hold_a_share_of_what_is_left(seed, n, top, split, finest):
    sizes = np.sort(np.random.default_rng(seed).integers(1, top + 1, n))[::-1].astype(np.int64)
    lump_of = geometric_lumps(sizes, split, finest)
    assert lump_of.tolist() == _geometric_lumps_twin(sizes.tolist(), split, finest)
    starts = np.flatnonzero(np.diff(lump_of, prepend=-1))
    left = np.cumsum(sizes[::-1])[::-1]
    scale = 2 ** (split - 1).bit_length()
    for first, end in zip(starts, list(starts[1:]) + [len(sizes)]):
        # a lump holds under max(1 / 2^b of the tokens left where it starts, finest), its last item aside
        assert sizes[first:end].sum() - sizes[end - 1] < max(left[first] / scale, finest)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_short=st.integers(40, 600), n_long=st.integers(0, 40),
       n_bins=st.sampled_from([31, 32, 48, 64]), cap=st.integers(20_000, 200_000), carried_frac=st.floats(0, 0.3))
def test_the_tail_is_cut_in_lumps_as_a_per_item_twin_cuts_it(seed, n_short, n_long, n_bins, cap, carried_frac):
    # short items (below the tail's bound) and long ones, in random order; ties among lengths
    rng = np.random.default_rng(seed)
    short_max = max(2, int(cap * LUMP_SHARE))
    lengths = rng.permutation(np.concatenate([rng.integers(1, rng.integers(2, short_max + 1), n_short),
                                              rng.integers(short_max, cap + 1, n_long)])).astype(np.int64)
    problem = PackProblem(lengths=lengths, weights=lengths.astype(float), n_bins=n_bins, max_tokens=cap,
                          carried=int(carried_frac * len(lengths)))
    order = placement_order(problem, lengths)
    got = tail_lumps(order, lengths, n_bins, cap, problem.carried)
    want = _tail_lumps_twin(lengths[order].tolist(), n_bins, cap, problem.carried)
    if want is None:
        assert got is None
        return
    cut, lump_of = got
    assert cut == want[0] and lump_of.tolist() == want[1]
    sizes = lengths[order[cut:]]
    assert cut >= problem.carried and (sizes < cap * LUMP_SHARE).all()
    starts = np.flatnonzero(np.diff(lump_of, prepend=-1))
    assert np.array_equal(lump_of[starts], np.arange(len(starts)))  # numbered 0, 1, ... in order
    left = np.cumsum(sizes[::-1])[::-1]
    scale = 2 ** (LUMP_SPLIT * n_bins - 1).bit_length()
    for first, end in zip(starts, list(starts[1:]) + [len(sizes)]):
        # a lump holds under 1 / 2^b of the tokens left where it starts, its last item aside;
        # where fewer than 2^b tokens are left, every item is a lump of its own
        assert sizes[first:end].sum() - sizes[end - 1] < left[first] / scale
        assert left[first] >= scale or end - first == 1


@BOTH_LOOPS
@pytest.mark.parametrize("dist, slack", [("real", 1.3), ("heavy", 1.3), ("heavy", 0.9)])
def test_the_lumped_tail_is_placed_as_the_scan_places_its_lumps(compiled, dist, slack):
    # from 32 bins: each lump one item of its pieces' tokens and phase costs, placed by the
    # scan of every bin (and Algorithm 1 on the same lumps where the step overloads), its
    # pieces where it goes; fewer bins: item by item, as before
    for lengths, _, _ in global_batches(dist, 131072, 32 * 131072, 2, seed=DEFAULT_SEED + 11):
        fwd, bwd = _phases(lengths)
        cap = int(slack * lengths.sum() / 32)
        order = np.argsort(-lengths, kind="stable")
        consts = (COST.mb_const("fwd"), COST.mb_const("bwd"))
        cut, lump_of = tail_lumps(order, lengths, 32, cap)
        n_items = cut + lump_of[-1] + 1
        assert n_items < 0.8 * len(order)
        head, tail = order[:cut], order[cut:]

        def items(values):
            return np.concatenate([values[head], np.bincount(lump_of, weights=values[tail])])

        item_lengths = np.concatenate([lengths[head], np.bincount(lump_of, weights=lengths[tail]).astype(np.int64)])
        scan = phases_assign_reference(np.arange(n_items), item_lengths, items(fwd), items(bwd), 32, cap, *consts)
        algorithm1 = wlb_assign_python(np.arange(n_items), item_lengths, items(fwd + bwd), 32, cap)
        if np.any((scan < 0) & (algorithm1 >= 0)):
            scan = algorithm1
        with use_compiled(compiled):
            placed, fallback = phases_or_algorithm1(order, lengths, fwd + bwd, fwd, bwd, 32, cap, *consts)
        np.testing.assert_array_equal(placed, np.concatenate([scan[:cut], scan[cut:][lump_of]]))
        assert (placed < 0).any() == (slack < 1)
        tokens = np.bincount(placed[placed >= 0], weights=lengths[order][placed >= 0], minlength=32)
        assert tokens.max() <= cap
        with use_compiled(compiled):
            fewer = phases_or_algorithm1(order, lengths, fwd + bwd, fwd, bwd, 31, cap, *consts)[0]
        np.testing.assert_array_equal(fewer, phases_assign_reference(order, lengths, fwd, bwd, 31, cap, *consts))


def test_lumps_keep_the_balance_of_the_item_by_item_placement(monkeypatch):
    # 32 micro-batches of real and heavy-tailed steps without their outliers (documents over
    # 32K tokens: the streaming packer delays those), where the short tail decides the balance:
    # each phase's max / mean within 0.001 of the item-by-item placement's, on average over
    # the steps, and the plans differ
    window = 131072
    for dist in ("real", "heavy"):
        gaps, differ = {"fwd": [], "bwd": []}, 0
        for lengths, ids, offsets in global_batches(dist, window, 32 * window, 12, seed=DEFAULT_SEED + 13):
            keep = lengths <= 32768
            plans = {}
            for lumped in (True, False):
                monkeypatch.setattr(phases_module, "LUMP_MIN_BINS", 32 if lumped else 10**9)
                plans[lumped] = wlb.solve_pack(lengths[keep], 32, int(1.25 * window), COST, "wlb_phases",
                                               ids=ids[keep], offsets=offsets[keep])
            differ += plans[True].digest() != plans[False].digest()
            for phase, values in gaps.items():
                values.append(per_step_imbalance(plans[True], COST, phase) - per_step_imbalance(plans[False], COST, phase))
        assert differ >= 6
        for phase, values in gaps.items():
            assert abs(float(np.mean(values))) < 1e-3, (dist, phase, np.mean(values))
