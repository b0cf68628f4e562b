"""The frontier MILP (`wlb_opt.solvers.frontier_milp`): its bound never exceeds the optimum of
whole-piece plans found by enumerating every (step, micro-batch) of every piece (an
independent reference), its optimum equals the enumeration of its own outlier steps, every
packer plan maps onto a feasible point of the model whose value is the plan's own sum of
maxima (so the bound lies below every packer plan within its displacement); `wlb-opt bench
frontier` runs end to end in tests/bench/test_frontier_bench.py."""
import itertools

import numpy as np
import pytest

from conftest import unit_cost

pytest.importorskip("highspy")

from wlb_opt.packer import PackerConfig, WLBPacker  # noqa: E402
from wlb_opt.solvers.frontier_milp import (aggregate_imbalance, brute_force_frontier, filler_classes,  # noqa: E402
                                           frontier_problem, plan_solution, solution_violation, solve_frontier)

COST = unit_cost(attn=1e-4, linear=1e-3, doc_const=1e-3)


def fwd(lengths):
    return COST.doc_cost(lengths, "fwd")


def tiny_stream(rng, n_steps, n_outliers, n_short=(1, 5)):
    """Batches (pieces, ids, offsets) of short pieces plus `n_outliers` long ones in all."""
    where = rng.integers(0, n_steps, n_outliers)
    batches, next_id = [], 0
    for s in range(n_steps):
        lengths = list(rng.integers(1, 25, int(rng.integers(*n_short)))) + \
            list(rng.integers(40, 95, int((where == s).sum())))
        batches.append((np.array(lengths, dtype=np.int64), np.arange(next_id, next_id + len(lengths)),
                        np.zeros(len(lengths), dtype=np.int64)))
        next_id += len(lengths)
    return batches


def whole_piece_optimum(batches, n_micro, max_tokens, early, late, budget):
    """min over every plan of whole pieces (each piece in a step of [arrival - early, arrival +
    late] and a micro-batch, <= max_tokens per micro-batch, displacement per token <= budget)
    of the sum over steps of the largest micro-batch's cost; inf if none fits."""
    lengths = np.concatenate([b[0] for b in batches])
    arrival = np.concatenate([np.full(len(b[0]), s) for s, b in enumerate(batches)])
    n_slots = len(batches) + late
    costs = fwd(lengths)
    choices = [[(t, j) for t in range(max(0, a - early), min(n_slots, a + late + 1)) for j in range(n_micro)]
               for a in arrival.tolist()]
    best = np.inf
    for combo in itertools.product(*choices):
        steps = np.array([c[0] for c in combo])
        disp = float(np.abs(steps - arrival) @ lengths) / lengths.sum()
        if disp > budget + 1e-12:
            continue
        slot = steps * n_micro + np.array([c[1] for c in combo])
        tokens = np.bincount(slot, weights=lengths, minlength=n_slots * n_micro)
        if tokens.max() > max_tokens:
            continue
        mb_cost = np.bincount(slot, weights=costs, minlength=n_slots * n_micro).reshape(n_slots, n_micro)
        best = min(best, float(mb_cost.max(axis=1).sum()))
    return best


@pytest.mark.parametrize("seed", range(3))
def test_bound_never_exceeds_the_whole_piece_optimum(seed):
    rng = np.random.default_rng(seed)
    batches = tiny_stream(rng, n_steps=2, n_outliers=2, n_short=(1, 3))
    assert sum(len(b[0]) for b in batches) <= 6
    for budget in (0.0, 0.3, 1.0):
        exact = whole_piece_optimum(batches, n_micro=2, max_tokens=120, early=1, late=1, budget=budget)
        problem = frontier_problem(batches, fwd, n_micro=2, max_tokens=120, outlier_min=40, early=1, late=1)
        result = solve_frontier(problem, budget, time_limit=20)
        if not np.isfinite(exact):
            continue
        assert result.status == "Optimal"
        assert result.bound <= exact * (1 + 1e-6)
        assert result.bound >= problem.total_cost / problem.n_micro * (1 - 1e-9)  # the mean is a floor too


@pytest.mark.parametrize("seed", range(3))
def test_frontier_optimum_equals_enumerating_its_outlier_steps(seed):
    rng = np.random.default_rng(seed)
    batches = tiny_stream(rng, n_steps=3, n_outliers=3)
    problem = frontier_problem(batches, fwd, n_micro=2, max_tokens=120, outlier_min=40, early=1, late=1)
    assert len(problem.outlier_length) == 3
    for budget in (0.0, 0.15, 0.6):
        exact = solve_frontier(problem, budget, time_limit=30)
        brute = brute_force_frontier(problem, budget)
        if not np.isfinite(brute):
            assert exact.objective is None
            continue
        assert exact.status == "Optimal"
        assert exact.objective == pytest.approx(brute, rel=1e-3)
        assert exact.bound <= exact.objective * (1 + 1e-6)
        assert exact.displacement_per_token <= budget + 1e-9


def test_every_packer_plan_is_a_feasible_point_below_which_the_bound_lies():
    rng = np.random.default_rng(7)
    batches = tiny_stream(rng, n_steps=12, n_outliers=8)
    mbc = COST.mb_const("fwd")
    checked = 0
    for kw in (dict(thresholds=[40], max_delay=4), dict(thresholds=[40], max_delay=4, lookahead=2),
               dict(thresholds=[40], max_delay=4, release="group", balance_tolerance=1.2),
               dict(thresholds=[20, 60], max_delay=6, release="balance")):
        packer = WLBPacker(2, 120, COST, config=PackerConfig(**kw))
        plans = [p for p in (packer.pack(*b) for b in batches) if p is not None] + packer.drain()
        disp = packer.stats()["displacement_per_token"]
        problem = frontier_problem(batches, fwd, n_micro=2, max_tokens=120, outlier_min=40, early=2, late=6,
                                   n_slots=max(12 + 6, max(p.step for p in plans) + 1))
        solution, why = plan_solution(problem, plans)
        assert solution is not None, (kw, why)
        total = sum(max(COST.micro_batch_cost(p.lengths[mb], "fwd") - mbc for mb in p.micro_batches) for p in plans)
        assert solution.sum_of_max == pytest.approx(total, rel=1e-12)
        assert solution.displacement_per_token == pytest.approx(disp, rel=1e-12)
        assert solution_violation(problem, solution, disp + 1e-9) <= 1e-6
        result = solve_frontier(problem, disp + 1e-9, time_limit=5, starts=[solution])
        assert result.objective is not None and result.objective <= total * (1 + 1e-6)  # the start is kept
        assert result.bound <= total * (1 + 1e-6), kw
        assert aggregate_imbalance(result.bound, problem) <= aggregate_imbalance(total, problem) + 1e-6
        checked += 1
    assert checked == 4


class _Plan:
    """The fields of a PackPlan that `plan_solution` reads."""

    def __init__(self, step, lengths, ids, offsets, micro_batches):
        self.step, self.lengths, self.doc_ids, self.offsets = step, lengths, ids, offsets
        self.micro_batches = micro_batches


def random_plans(rng, batches, n_micro, cap, early, n_slots, late):
    """A random whole-piece plan: each piece (random order) in a random step of its window,
    in that step's emptiest micro-batch if it fits, else in the first step of its window
    that has room; None if a piece fits nowhere."""
    pieces = [(length, i, o, s) for s, b in enumerate(batches) for length, i, o in zip(*[x.tolist() for x in b])]
    slots: dict = {}
    for k in rng.permutation(len(pieces)).tolist():
        length, i, o, s = pieces[k]
        window = list(range(max(0, s - early), min(n_slots, s + late + 1)))
        first = int(rng.integers(len(window)))
        for t in window[first:] + window[:first]:
            mbs = slots.setdefault(t, [[] for _ in range(n_micro)])
            j = int(np.argmin([sum(p[0] for p in mb) for mb in mbs]))
            if sum(p[0] for p in mbs[j]) + length <= cap:
                mbs[j].append((length, i, o))
                break
        else:
            return None
    plans = []
    for t, mbs in slots.items():
        flat = [p for mb in mbs for p in mb]
        bounds = np.cumsum([0] + [len(mb) for mb in mbs])
        plans.append(_Plan(t, np.array([p[0] for p in flat]), np.array([p[1] for p in flat]),
                           np.array([p[2] for p in flat]),
                           tuple(np.arange(bounds[j], bounds[j + 1]) for j in range(n_micro))))
    return plans


@pytest.mark.parametrize("seed", range(4))
def test_random_whole_piece_plans_satisfy_every_row_of_the_model(seed, monkeypatch):
    """Validity row by row, the grouping cuts included (the stream is dense enough that a
    group of big outliers pushes filler out of its step): random plans that move outliers
    and short pieces alike, early and late, map onto points the model admits."""
    from wlb_opt.solvers import frontier_milp

    rng = np.random.default_rng(seed)
    batches = tiny_stream(rng, n_steps=8, n_outliers=10, n_short=(8, 14))
    n_micro, cap, early, late = 2, 120, 2, 3
    problem = frontier_problem(batches, fwd, n_micro, cap, outlier_min=40, early=early, late=late)
    cuts = []
    real_cuts = frontier_milp._grouping_cuts

    def counting(m, *args):
        before = len(m.row_lo)
        real_cuts(m, *args)
        cuts.append(len(m.row_lo) - before)

    monkeypatch.setattr(frontier_milp, "_grouping_cuts", counting)
    found = 0
    for _ in range(40):
        plans = random_plans(rng, batches, n_micro, cap, early, problem.n_slots, late)
        if plans is None:
            continue
        solution, why = plan_solution(problem, plans)
        assert solution is not None, why
        assert solution_violation(problem, solution, solution.displacement_per_token + 1e-9) <= 1e-6
        found += 1
    assert found >= 5 and max(cuts) > 0


def test_plan_solution_names_what_does_not_fit():
    rng = np.random.default_rng(3)
    batches = tiny_stream(rng, n_steps=6, n_outliers=4)
    packer = WLBPacker(2, 120, COST, config=PackerConfig(thresholds=[40], max_delay=4))
    plans = [packer.pack(*b) for b in batches] + packer.drain()
    narrow = frontier_problem(batches, fwd, 2, 120, outlier_min=40, early=0, late=0,
                              n_slots=max(p.step for p in plans) + 1)
    delayed = any(p.delays()[p.lengths >= 40].max(initial=0) > 0 for p in plans)
    solution, why = plan_solution(narrow, plans)
    if delayed:
        assert solution is None and "outside its window" in why
    wide = frontier_problem(batches, fwd, 2, 120, outlier_min=40, early=0, late=4,
                            n_slots=max(p.step for p in plans) + 1)
    assert plan_solution(wide, plans)[0] is not None
    last = max(i for i, p in enumerate(plans) if len(p.doc_ids))
    solution, why = plan_solution(wide, plans[:last] + plans[last + 1:])
    assert solution is None and "not in the plans" in why
    solution, why = plan_solution(wide, plans + plans[:1])
    assert solution is None and "twice" in why


def test_the_bound_holds_for_short_pieces_trained_early_when_outliers_may_not():
    # `early` bounds the outliers' window only: with early=0 a plan may still train short
    # pieces ahead of their arrival, and the bound must lie below it
    from wlb_opt.plan import PackPlan, SolveInfo
    batches = [(np.array([60]), np.array([0]), np.array([0])),
               (np.array([20, 20, 20, 20]), np.array([1, 2, 3, 4]), np.zeros(4, dtype=np.int64))]
    problem = frontier_problem(batches, fwd, n_micro=2, max_tokens=120, outlier_min=40, early=0, late=0)

    def plan(step, lengths, ids, micro_batches):
        lengths = np.array(lengths)
        return PackPlan(doc_ids=np.array(ids), lengths=lengths, offsets=np.zeros(len(lengths), dtype=np.int64),
                        micro_batches=micro_batches, replica_of=np.zeros(2, dtype=np.int64),
                        deferred=np.zeros(0, dtype=np.int64), loads=np.array([fwd(lengths[mb]).sum() for mb in micro_batches]),
                        tokens=np.array([int(lengths[mb].sum()) for mb in micro_batches]), n_micro=2, max_tokens=120,
                        info=SolveInfo(method="by hand"), step=step)

    # two of step 1's short pieces train in step 0, beside its outlier
    plans = [plan(0, [60, 20, 20], [0, 1, 2], (np.array([0]), np.array([1, 2]))),
             plan(1, [20, 20], [3, 4], (np.array([0]), np.array([1])))]
    solution, why = plan_solution(problem, plans)
    assert solution is not None, why
    assert solution_violation(problem, solution, 0.3) < 1e-9
    sum_of_max = max(fwd(np.array([60])).sum(), fwd(np.array([20, 20])).sum()) + fwd(np.array([20])).sum()
    assert solve_frontier(problem, 0.3, time_limit=10).bound <= sum_of_max * (1 + 1e-9)


def test_filler_classes_keep_cost_per_token_within_the_tolerance():
    lengths = np.arange(1, 5000)
    density = fwd(lengths) / lengths
    edges = filler_classes(lengths, density, 1.05)
    cls = np.searchsorted(edges, lengths, side="right") - 1
    for c in range(len(edges)):
        d = density[cls == c]
        assert d.max() <= 1.05 * d.min() * (1 + 1e-12)
    assert len(filler_classes(lengths, density, 10.0)) < len(edges)


def test_bad_input():
    problem = frontier_problem(tiny_stream(np.random.default_rng(0), 2, 1), fwd, 2, 120, outlier_min=40,
                               early=0, late=1)
    for budget in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="budget must be"):
            solve_frontier(problem, budget)
    batches = tiny_stream(np.random.default_rng(0), 2, 1)
    with pytest.raises(ValueError, match="n_micro"):
        frontier_problem(batches, fwd, 0, 120, outlier_min=40, early=0, late=1)
    with pytest.raises(ValueError, match="max_tokens"):
        frontier_problem(batches, fwd, 2, 10, outlier_min=40, early=0, late=1)
    with pytest.raises(ValueError, match="early and late"):
        frontier_problem(batches, fwd, 2, 120, outlier_min=40, early=-1, late=1)
    with pytest.raises(ValueError, match="density_tolerance"):
        frontier_problem(batches, fwd, 2, 120, outlier_min=40, early=0, late=1, density_tolerance=0.9)
    with pytest.raises(ValueError, match="distinct"):
        frontier_problem(batches + batches[:1], fwd, 2, 120, outlier_min=40, early=0, late=1)


