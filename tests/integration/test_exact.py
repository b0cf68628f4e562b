"""Exact packing models (CP-SAT, PuLP with CBC and HiGHS) against brute-force enumeration of
set partitions, plus the lexicographic allow_defer model, hints, wlb_ls, and bad input.

Small instances only (<= 8 documents, <= 3 micro-batches); time limits of a few seconds that
these instances never reach; one deterministic worker.

The solvers come with the `exact` extra (ortools, pulp, highspy): each test that runs one
asks for it through a fixture (`exact_extra`, or `ortools` for CP-SAT alone) that skips it
when the extra is missing; the rest (brute force, wlb_ls, input checks made before any
solver is imported, the missing-extra message) run without it."""
import functools
import subprocess
import sys

import numpy as np
import pytest
from conftest import unit_cost as _unit_cost
from hypothesis import given, settings
from hypothesis import strategies as st

import wlb_opt as wlb
from wlb_opt.cost import default_cost
from wlb_opt.solvers import exact_common
from wlb_opt.solvers.exact_common import START_KEPT_STATUS, PhaseSolve, PlanSource
from wlb_opt.solvers.problem import PackProblem

EXACT = [("cpsat", None), ("milp", "cbc"), ("milp", "highs")]
# Generous: these instances solve in milliseconds; HiGHS and CBC limits are wall-clock, so a
# stalled shared machine must not turn "optimal" into "feasible" (one such flake was seen).
LIMIT = 60
REL_TOL = 1e-5  # CP-SAT floors costs to 1e-7 of the largest bin per item; MILP tolerances ~1e-6

# Forward cost only: 1e-3 per attention pair and 1e-2 per token (seconds-like magnitudes).
unit_cost = functools.partial(_unit_cost, attn=1e-3, linear=1e-2)


@pytest.fixture(scope="module")
def exact_extra():
    """Skip the test unless the whole `exact` extra imports (CP-SAT, PuLP/CBC, HiGHS)."""
    for name in ("ortools", "pulp", "highspy"):
        pytest.importorskip(name)


@pytest.fixture(scope="module")
def ortools():
    """Skip the test unless OR-Tools (CP-SAT) imports."""
    pytest.importorskip("ortools")


# ------------------------------------------------------------------ brute force (the slow twin)
def set_partitions(items: list[int], max_blocks: int):
    """All partitions of `items` into at most `max_blocks` non-empty blocks."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest, max_blocks):
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1:]
        if len(part) < max_blocks:
            yield [[first]] + part


def brute_force(lengths, weights, n_bins, max_tokens, bin_const=0.0, allow_defer=False, carried=0):
    """Lexicographic optimum (max placed tokens, then min largest load) by enumeration.
    Returns (placed_tokens, largest_load) or None when nothing places every document."""
    n = len(lengths)
    best = None
    subsets = range(1 << n) if allow_defer else [(1 << n) - 1]
    for mask in subsets:
        placed = [i for i in range(n) if mask >> i & 1]
        if any(i not in placed for i in range(carried)):
            continue
        tokens = int(sum(lengths[i] for i in placed))
        if best is not None and tokens < best[0]:
            continue
        for part in set_partitions(placed, n_bins):
            if any(sum(lengths[i] for i in blk) > max_tokens for blk in part):
                continue
            load = max([sum(weights[i] for i in blk) for blk in part] + [0.0]) + bin_const
            if best is None or (tokens, -load) > (best[0], -best[1]):
                best = (tokens, load)
    return best


def test_set_partitions_count_bell_numbers():
    assert [sum(1 for _ in set_partitions(list(range(n)), n)) for n in range(7)] == [1, 1, 2, 5, 15, 52, 203]
    assert sum(1 for _ in set_partitions(list(range(5)), 2)) == 16  # S(5,1) + S(5,2)


# ------------------------------------------------------------------ exact == brute force
instances = st.tuples(
    st.lists(st.integers(1, 40), min_size=1, max_size=8),
    st.integers(1, 3),
    st.floats(0.8, 1.6),
)


def _cap(lengths, n_micro, slack):
    return max(int(max(lengths)), int(np.ceil(slack * sum(lengths) / n_micro)))


@pytest.mark.usefixtures("exact_extra")
@settings(max_examples=25)
@given(inst=instances, mb_const=st.sampled_from([0.0, 0.5]))
def test_exact_methods_reach_the_brute_force_optimum(inst, mb_const):
    lengths, n_micro, slack = inst
    lengths = np.array(lengths, dtype=np.int64)
    cap = _cap(lengths, n_micro, slack)
    cost = unit_cost(mb_const=mb_const)
    weights = cost.doc_cost(lengths)
    opt = brute_force(lengths.tolist(), weights.tolist(), n_micro, cap, cost.mb_const())
    for method, backend in EXACT:
        if lengths.sum() > n_micro * cap or opt is None:
            with pytest.raises(ValueError):
                wlb.solve_pack(lengths, n_micro, cap, cost, method, backend=backend, time_limit=LIMIT, deterministic=True)
            continue
        plan = wlb.solve_pack(lengths, n_micro, cap, cost, method, backend=backend, time_limit=LIMIT, deterministic=True)
        wlb.check_pack(plan, lengths, cap, cost=cost)
        info = plan.info
        assert len(plan.deferred) == 0
        assert info.objective == pytest.approx(opt[1], rel=REL_TOL), (method, backend, info)
        assert info.bound <= info.objective
        assert info.bound <= opt[1] * (1 + 1e-9)
        assert info.status.startswith("optimal"), info.status
        assert info.scale is not None and info.scale > 0


@pytest.mark.usefixtures("exact_extra")
@settings(max_examples=20)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=7), n_micro=st.integers(1, 3),
       slack=st.floats(0.4, 1.0), carried=st.integers(0, 2))
def test_allow_defer_is_lexicographic(lengths, n_micro, slack, carried):
    lengths = np.array(lengths, dtype=np.int64)
    carried = min(carried, len(lengths))
    cap = max(int(max(lengths)), int(slack * sum(lengths) / n_micro))
    if lengths[:carried].sum() > n_micro * cap:
        carried = 0
    cost = unit_cost()
    weights = cost.doc_cost(lengths)
    opt = brute_force(lengths.tolist(), weights.tolist(), n_micro, cap, allow_defer=True, carried=carried)
    if opt is None:  # the carried documents alone do not fit in any packing
        return
    for method, backend in EXACT:
        plan = wlb.solve_pack(lengths, n_micro, cap, cost, method, backend=backend, carried=carried,
                              time_limit=LIMIT, deterministic=True, allow_defer=True)
        wlb.check_pack(plan, lengths, cap, cost=cost)
        assert plan.placed_tokens == opt[0], (method, backend, plan.info)
        assert plan.info.objective == pytest.approx(opt[1], rel=REL_TOL), (method, backend, plan.info)
        assert plan.info.bound <= plan.info.objective
        assert not np.isin(plan.deferred, np.arange(carried)).any()


@pytest.mark.usefixtures("exact_extra")
def test_zero_slack_fixed_length_places_the_most_tokens():
    # window 10, two sequences: the greedy heuristics leave a gap; 7+3 and 6+4 fill both.
    lengths = np.array([7, 6, 4, 3, 5])
    cost = unit_cost()
    for method, backend in EXACT:
        plan = wlb.solve_pack(lengths, 2, 10, cost, method, backend=backend, allow_defer=True,
                              time_limit=LIMIT, deterministic=True)
        assert plan.placed_tokens == 20 and plan.lengths[plan.deferred].tolist() == [5]
        assert sorted(plan.tokens.tolist()) == [10, 10]


@pytest.mark.usefixtures("ortools")
def test_no_placing_heuristic_beats_a_proven_optimum():
    rng = np.random.default_rng(3)
    cost = unit_cost(mb_const=0.1)
    for _ in range(12):
        lengths = rng.integers(1, 60, size=rng.integers(6, 11))
        n_micro = int(rng.integers(2, 4))
        cap = int(1.3 * lengths.sum() / n_micro) + int(lengths.max())
        exact = wlb.solve_pack(lengths, n_micro, cap, cost, "cpsat", time_limit=LIMIT, deterministic=True)
        assert exact.info.status == "optimal"
        for method in ("wlb", "wlb_ls", "fixed"):
            plan = wlb.solve_pack(lengths, n_micro, cap, cost, method)
            if len(plan.deferred) == 0:
                assert plan.info.objective >= exact.info.objective * (1 - REL_TOL)


# ------------------------------------------------------------------ hints and determinism
@pytest.mark.usefixtures("ortools")
@settings(max_examples=15)
@given(lengths=st.lists(st.integers(1, 50), min_size=2, max_size=30), n_micro=st.integers(2, 4),
       seed=st.integers(0, 1000))
def test_cpsat_is_never_worse_than_a_feasible_hint(lengths, n_micro, seed):
    lengths = np.array(lengths, dtype=np.int64)
    cap = int(lengths.sum())  # any assignment is feasible
    rng = np.random.default_rng(seed)
    assign = rng.integers(0, n_micro, size=len(lengths))
    hint = [np.flatnonzero(assign == b) for b in range(n_micro)]
    cost = unit_cost()
    hint_obj = max(cost.micro_batch_cost(lengths[h]) if len(h) else cost.mb_const() for h in hint)
    plan = wlb.solve_pack(lengths, n_micro, cap, cost, "cpsat", hint=hint, time_limit=0.05, deterministic=True)
    wlb.check_pack(plan, lengths, cap, cost=cost)
    assert plan.info.objective <= hint_obj
    assert plan.info.extra["start"] == "hint"


@pytest.mark.usefixtures("ortools")
def test_deterministic_mode_repeats_itself():
    rng = np.random.default_rng(0)
    lengths = rng.integers(50, 3000, size=40)
    cost = unit_cost(attn=1e-6, linear=1e-3, mb_const=0.1)
    # A hint far from optimal, so the solver has work to do within its deterministic budget.
    hint = [np.arange(0, 37), np.arange(37, 38), np.arange(38, 39), np.arange(39, 40)]
    plans = [wlb.solve_pack(lengths, 4, int(lengths.sum()), cost, "cpsat", time_limit=0.2, deterministic=True,
                            seed=1, hint=hint) for _ in range(2)]
    assert plans[0].digest() == plans[1].digest()


# ------------------------------------------------------------------ the two-phase driver
class _NoPlanModel:
    """A LexModel whose solver never finds a plan, with a chosen phase-2 (lower, upper):
    drives exact_common.solve_lex without any solver installed."""

    name = "stub"

    def __init__(self, lower: float, upper: float):
        self.lower, self.upper = lower, upper
        self.calls: list[str] = []
        self.plan = None

    def maximize_placed(self, start, time_limit):
        self.calls.append("maximize_placed")
        return PhaseSolve(status="unknown", assign=None, proven=False)

    def add_makespan(self, placed_tokens, start):
        self.calls.append("add_makespan")
        return self.lower, self.upper

    def minimize_makespan(self, start, time_limit):
        self.calls.append("minimize_makespan")
        return PhaseSolve(status="unknown", assign=None, proven=False)

    def bound(self, plan):
        self.plan = plan
        return 0.0, " (stub bound)"


def _driver_problem(**options):
    lengths = np.array([5, 4, 3, 3])
    return PackProblem(lengths=lengths, weights=lengths * 1.0, n_bins=2, max_tokens=8,
                       options=dict(deterministic=True, **options))


def test_driver_skips_phase_2_when_the_start_meets_the_bound():
    data = exact_common.prepare(_driver_problem())
    model = _NoPlanModel(lower=1.0, upper=1.0)
    result = exact_common.solve_lex(data, model, scale=1.0, build_s=0.0, extra={})
    assert model.calls == ["add_makespan"]  # no solver run at all
    assert model.plan.source is PlanSource.START_MEETS_BOUND and model.plan.phase2 is None
    assert result.status == "optimal (stub bound)"
    assert result.extra["phase1"] == "not needed"
    assert result.extra["phase2"] == "start meets the lower bound"
    assert result.solve_s == 0.0
    assert [b.tolist() for b in result.bins] == [b.tolist() for b in data.start.bins]


def test_driver_keeps_the_start_when_the_solver_finds_nothing():
    data = exact_common.prepare(_driver_problem(allow_defer=True))
    data.placeable += 1  # pretend the start may not place the most tokens, so phase 1 runs
    model = _NoPlanModel(lower=0.5, upper=1.0)
    result = exact_common.solve_lex(data, model, scale=1.0, build_s=0.0, extra={})
    assert model.calls == ["maximize_placed", "add_makespan", "minimize_makespan"]
    assert model.plan.source is PlanSource.START_KEPT
    assert model.plan.placed_tokens == -data.start_key[0]
    assert result.status == START_KEPT_STATUS + " (stub bound) (placed tokens not proven maximal)"
    assert result.extra["phase1"] == result.extra["phase2"] == "unknown"
    assert result.extra["phase1_bound_tokens"] == data.placeable


def test_driver_without_a_start_or_a_plan_raises():
    data = exact_common.prepare(_driver_problem())
    data.start_assign = None  # as when no heuristic places every document
    with pytest.raises(ValueError, match=r"stub found no plan .*time_limit=10.0 s \(unknown\)"):
        exact_common.solve_lex(data, _NoPlanModel(lower=0.5, upper=1.0), scale=1.0, build_s=0.0, extra={})


def test_driver_with_allow_defer_and_no_plan_in_time_names_the_carried_documents():
    data = exact_common.prepare(_driver_problem(allow_defer=True))
    data.start_assign = None
    with pytest.raises(ValueError, match=r"stub found no plan that places the 0 carried documents within "
                                         r"time_limit=10.0 s \(unknown\); raise time_limit$"):
        exact_common.solve_lex(data, _NoPlanModel(lower=0.5, upper=1.0), scale=1.0, build_s=0.0, extra={})


def test_driver_runs_phase_1_from_nothing_when_the_start_is_no_plan():
    # a start that leaves a carried document out is dropped (start_assign None); its placed
    # tokens are no target phase 2 could be held to
    data = exact_common.prepare(_driver_problem(allow_defer=True))
    data.start_assign = None
    model = _NoPlanModel(lower=0.5, upper=1.0)
    with pytest.raises(ValueError):
        exact_common.solve_lex(data, model, scale=1.0, build_s=0.0, extra={})
    assert model.calls[0] == "maximize_placed"


@pytest.mark.parametrize("method, backend", EXACT)
def test_a_start_that_defers_a_carried_document_leaves_the_problem_solvable(exact_extra, method, backend):
    # the heuristic start defers carried document 4; the best plan, {5, 4} and {3, 3, 4},
    # defers the two fresh documents (it used to be "proved infeasible")
    lengths, cost = np.array([3, 3, 4, 5, 4, 3, 2]), default_cost()
    tokens, load = brute_force(lengths, cost.doc_cost(lengths), 2, 10, cost.mb_const(), True, carried=5)
    plan = wlb.solve_pack(lengths, 2, 10, cost, method, backend=backend, carried=5, allow_defer=True,
                          time_limit=LIMIT, deterministic=True)
    wlb.check_pack(plan, lengths, 10, cost=cost)
    assert plan.placed_tokens == tokens == 19
    assert plan.info.objective == pytest.approx(load, rel=REL_TOL)


def test_cbc_claims_the_most_placed_tokens_only_where_it_placed_them(exact_extra):
    # CBC (warm start, preprocessing off) called phase 1's 39 tokens optimal here; 40 fit
    lengths, cost = np.array([8, 7, 4, 10, 16, 18, 20]), default_cost()
    tokens, _ = brute_force(lengths, cost.doc_cost(lengths), 2, 20, cost.mb_const(), True)
    plan = wlb.solve_pack(lengths, 2, 20, cost, "milp", backend="cbc", allow_defer=True, time_limit=LIMIT,
                          deterministic=True)
    assert tokens == 40
    assert plan.placed_tokens == tokens or "(placed tokens not proven maximal)" in plan.info.status


def test_the_highs_bound_stays_below_the_optimum_of_near_tied_weights(exact_extra):
    from wlb_opt.solvers import milp

    # eight near-tied weights over two bins: HiGHS proved a makespan 2.8e-6 above the best plan's
    rng = np.random.default_rng(26)
    n, n_bins = int(rng.integers(5, 9)), int(rng.integers(2, 4))
    weights = rng.integers(1, 6, n) * (1 + 1e-6 * rng.standard_normal(n))
    problem = PackProblem(lengths=np.ones(n, dtype=np.int64), weights=weights, n_bins=n_bins, max_tokens=n,
                          time_limit=LIMIT, options={"deterministic": True}, backend="highs")
    result = milp.solve(problem)
    _, best = brute_force([1] * n, weights.tolist(), n_bins, n)
    assert result.bound <= best


@settings(max_examples=30)
@given(lengths=st.lists(st.integers(1, 400), min_size=0, max_size=80), n_micro=st.integers(1, 6),
       slack=st.floats(0.5, 2.0), carried_frac=st.floats(0, 1))
def test_wlb_ls_is_feasible_and_never_worse_than_algorithm1(lengths, n_micro, slack, carried_frac):
    lengths = np.array(lengths, dtype=np.int64)
    cap = max(int(lengths.max()) if len(lengths) else 1, int(slack * lengths.sum() / n_micro) if len(lengths) else 1)
    carried = int(carried_frac * len(lengths))
    cost = unit_cost(mb_const=0.01)
    base = wlb.solve_pack(lengths, n_micro, cap, cost, "wlb", carried=carried)
    plan = wlb.solve_pack(lengths, n_micro, cap, cost, "wlb_ls", carried=carried)
    wlb.check_pack(plan, lengths, cap, cost=cost)
    assert plan.placed_tokens >= base.placed_tokens
    if plan.placed_tokens == base.placed_tokens:
        assert plan.info.objective <= base.info.objective * (1 + 1e-12)
    again = wlb.solve_pack(lengths, n_micro, cap, cost, "wlb_ls", carried=carried)
    assert again.digest() == plan.digest()


# ------------------------------------------------------------------ bad input
@pytest.mark.usefixtures("exact_extra")
def test_infeasible_instances_name_the_document_or_the_excess():
    cost = unit_cost()
    with pytest.raises(ValueError, match="document 7 .*11 tokens > max_tokens=10"):
        wlb.solve_pack([3, 11], 2, 10, cost, "cpsat", ids=[5, 7])
    with pytest.raises(ValueError, match="5 tokens over"):
        wlb.solve_pack([9, 8, 8], 2, 10, cost, "cpsat")
    with pytest.raises(ValueError, match="5 tokens over"):
        wlb.solve_pack([9, 8, 8], 2, 10, cost, "milp", backend="highs")
    # the solver functions check on their own too (called without the facade)
    from wlb_opt.solvers import cpsat

    problem = PackProblem(lengths=np.array([3, 11]), weights=np.array([1.0, 2.0]), n_bins=2, max_tokens=10)
    with pytest.raises(ValueError, match="position 1.*11 tokens"):
        cpsat.solve(problem)
    deferred = cpsat.solve(PackProblem(lengths=np.array([3, 11]), weights=np.array([1.0, 2.0]), n_bins=2,
                                       max_tokens=10, options=dict(allow_defer=True, deterministic=True)))
    assert deferred.deferred.tolist() == [1]
    plan = wlb.solve_pack([9, 8, 8], 2, 10, cost, "cpsat", allow_defer=True, deterministic=True)
    assert plan.deferred_tokens == 8


def test_bad_time_limit_backend_and_max_iter():
    # checked before any solver is imported
    cost = unit_cost()
    with pytest.raises(ValueError, match="time_limit"):
        wlb.solve_pack([3, 4], 2, 10, cost, "cpsat", time_limit=0)
    with pytest.raises(ValueError, match="time_limit"):
        wlb.solve_pack([3, 4], 2, 10, cost, "milp", time_limit=-1.0)
    with pytest.raises(ValueError, match="backend.*valid: \\['cbc', 'highs'\\]"):
        wlb.solve_pack([3, 4], 2, 10, cost, "milp", backend="gurobi")
    with pytest.raises(ValueError, match="max_iter"):
        wlb.solve_pack([3, 4], 2, 10, cost, "wlb_ls", max_iter=-1)


@pytest.mark.usefixtures("ortools")
def test_bad_exact_options():
    cost = unit_cost()
    with pytest.raises(ValueError, match="unknown options \\['alow_defer'\\]"):
        wlb.solve_pack([3, 4], 2, 10, cost, "cpsat", alow_defer=True)
    with pytest.raises(ValueError, match="gap_limit"):
        wlb.solve_pack([3, 4], 2, 10, cost, "cpsat", gap_limit=2.0)
    with pytest.raises(ValueError, match="hint leaves piece indices \\[1\\]"):
        wlb.solve_pack([3, 4], 2, 10, cost, "cpsat", hint=[[0], []])
    with pytest.raises(ValueError, match="more than once"):
        wlb.solve_pack([3, 4], 2, 10, cost, "cpsat", hint=[[0, 1], [1]])
    # a float index would be truncated, a bool read as 0 or 1
    with pytest.raises(ValueError, match=r"hint\[0\] must hold item indices \(integers\), got \[0.7\]"):
        wlb.solve_pack([3, 4], 2, 10, cost, "cpsat", hint=[[0.7], [1]])
    with pytest.raises(ValueError, match=r"hint\[1\] must hold item indices"):
        wlb.solve_pack([3, 4], 2, 10, cost, "milp", hint=[[0], [True]])
    with pytest.raises(ValueError, match="hint must be one list of piece indices per micro-batch, got int"):
        wlb.solve_pack([3, 4], 2, 10, cost, "cpsat", hint=5)
    # the solvers' seeds are 32-bit, and CP-SAT takes at most 10,000 workers: named, not a solver's TypeError
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2147483647\] for an exact method"):
        wlb.solve_pack([3, 4], 2, 10, cost, "cpsat", seed=2**31)
    with pytest.raises(ValueError, match=r"num_workers must be an integer in \[0, 10000\]"):
        wlb.solve_pack([3, 4], 2, 10, cost, "cpsat", num_workers=10_001)
    with pytest.raises(ValueError, match=r"milp backend must be one of \['cbc', 'highs'\], got 3"):
        wlb.solve_pack([3, 4], 2, 10, cost, "milp", backend=3)
    with pytest.raises(ValueError, match="seed must be an integer >= 0 and <= 2147483647"):
        wlb.solve_shard([3, 4], 2, "cpsat", seed=2**31)
    with pytest.raises(ValueError, match="seed must be an integer >= 0 and <= 2147483647"):  # at construction
        wlb.WLBPacker(2, 10, cost, seed=2**31, config=wlb.PackerConfig(method="cpsat"))
    assert wlb.WLBPacker(2, 10, cost, seed=2**31).seed == 2**31  # the heuristics take any int64 seed
    with pytest.raises(ValueError, match="workers must be an integer >= 1 and <= 10000"):
        wlb.solve_shard([3, 4], 2, "cpsat", workers=10_001)


@pytest.mark.parametrize("module, method, backend", [("ortools.sat.python.cp_model", "cpsat", None),
                                                     ("pulp", "milp", "cbc"), ("highspy", "milp", "highs")])
def test_missing_backend_names_the_extra(monkeypatch, module, method, backend):
    # Runs without the extra too: a missing module raises the same ImportError.
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(ImportError, match=r"wlb-opt\[exact\]"):
        wlb.solve_pack([3, 4], 2, 10, unit_cost(), method, backend=backend)


def test_ortools_and_highspy_load_in_one_process():
    pytest.importorskip("ortools")
    pytest.importorskip("highspy")
    # OR-Tools bundles its own HiGHS; some highspy versions clash with it (the versions pinned
    # in constraints-cpu.txt load together). Both orders, in a fresh interpreter, each solving.
    code = """
import {first}, {second}
from ortools.sat.python import cp_model
import highspy
m = cp_model.CpModel(); x = m.new_int_var(0, 5, "x"); m.maximize(x)
s = cp_model.CpSolver(); assert s.solve(m) == cp_model.OPTIMAL and s.value(x) == 5
h = highspy.Highs(); h.setOptionValue("output_flag", False)
h.addVar(0, 4); h.changeColCost(0, -1.0); h.changeColIntegrality(0, highspy.HighsVarType.kInteger); h.run()
assert abs(h.getInfo().objective_function_value + 4) < 1e-9
print("ok")
"""
    for first, second in (("ortools", "highspy"), ("highspy", "ortools")):
        out = subprocess.run([sys.executable, "-c", code.format(first=first, second=second)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr


# ------------------------------------------------------------------ found by brute force
@pytest.mark.parametrize("backend", ["cbc", "highs"])
@pytest.mark.parametrize("lengths, n_micro, max_tokens, carried", [
    ([16, 16, 5, 2, 21], 1, 36, 0),  # CBC's preprocessing placed 28 of 34 tokens, "optimal"
    ([10, 29, 7, 26, 12, 16, 10], 2, 82, 6),  # and called a model the start satisfies infeasible
])
def test_milp_reaches_the_brute_force_optimum_where_cbcs_preprocessing_did_not(exact_extra, backend, lengths,
                                                                              n_micro, max_tokens, carried):
    cost = wlb.CostModel(coef={"fwd": dict(attn=1e-3, linear=1e-2, comm=0.0, doc_const=0.01, mb_const=0.1),
                               "bwd": dict(attn=0, linear=0, comm=0.0, doc_const=0.0, mb_const=0.0)},
                         attn_flops_per_pair=1.0)
    lengths = np.array(lengths)
    tokens, load = brute_force(lengths, cost.doc_cost(lengths), n_micro, max_tokens, cost.mb_const(), True, carried)
    plan = wlb.solve_pack(lengths, n_micro, max_tokens, cost, "milp", backend=backend, carried=carried,
                          allow_defer=True, time_limit=LIMIT, deterministic=True)
    assert plan.placed_tokens == tokens
    assert plan.info.objective == pytest.approx(load, rel=REL_TOL)
    assert plan.info.status.startswith("optimal")


@pytest.mark.parametrize("backend", ["cbc", "highs"])
def test_milp_proves_the_most_placed_tokens_it_found(exact_extra, backend):
    # three 6-token documents, two micro-batches of 10: 12 tokens at most; the capacity
    # estimate (18) is no proof, the solver's optimum of phase 1 is
    plan = wlb.solve_pack([6, 6, 6], 2, 10, unit_cost(), "milp", backend=backend, allow_defer=True, time_limit=LIMIT,
                          deterministic=True)
    assert plan.placed_tokens == 12 and plan.info.extra["phase1_bound_tokens"] == 12
    assert "not proven maximal" not in plan.info.status and plan.info.status.startswith("optimal")


def test_a_gap_limit_is_named_in_the_status_and_in_the_placed_tokens(ortools):
    cost = unit_cost()
    lengths = np.array([18, 8, 17, 14, 16, 23, 1])
    plan = wlb.solve_pack(lengths, 2, 97, cost, "cpsat", time_limit=LIMIT, deterministic=True, gap_limit=0.2)
    assert plan.info.bound < plan.info.objective  # the start met the bound within the gap: not proven optimal
    assert plan.info.status.startswith("optimal within gap_limit=0.2")
    # phase 1 stopped at the gap: fewer tokens than the most placeable, and the status says so
    lengths = np.array([4, 7, 10, 8, 32, 34, 23])
    tokens, _ = brute_force(lengths, cost.doc_cost(lengths), 2, 35, allow_defer=True)
    plan = wlb.solve_pack(lengths, 2, 35, cost, "cpsat", allow_defer=True, time_limit=LIMIT, deterministic=True,
                          gap_limit=0.1)
    assert plan.placed_tokens < tokens and "(placed tokens not proven maximal)" in plan.info.status
    exact = wlb.solve_pack(lengths, 2, 35, cost, "cpsat", allow_defer=True, time_limit=LIMIT, deterministic=True)
    assert exact.placed_tokens == tokens and exact.info.status == "optimal"


def test_deterministic_phase_2_gets_its_share_of_the_budget_whatever_the_clock():
    class Slow(_NoPlanModel):  # a phase 1 that took the whole budget on the wall clock
        def maximize_placed(self, start, time_limit):
            self.calls.append(("maximize_placed", time_limit))
            return PhaseSolve(status="unknown", assign=None, proven=False, solve_s=100.0)

        def minimize_makespan(self, start, time_limit):
            self.calls.append(("minimize_makespan", time_limit))
            return PhaseSolve(status="unknown", assign=None, proven=False)

    data = exact_common.prepare(_driver_problem(allow_defer=True))
    data.placeable += 1  # phase 1 runs
    model = Slow(lower=0.5, upper=1.0)
    exact_common.solve_lex(data, model, scale=1.0, build_s=0.0, extra={})
    limits = dict(c for c in model.calls if isinstance(c, tuple))
    assert limits["maximize_placed"] == pytest.approx(10.0 * 0.4)
    assert limits["minimize_makespan"] == pytest.approx(10.0 * 0.6)


@pytest.mark.parametrize("method, backend", EXACT)
def test_carried_documents_that_fit_no_plan_are_named_with_allow_defer(exact_extra, method, backend):
    kw = dict(backend=backend) if backend else {}
    with pytest.raises(ValueError, match=r"the 3 carried documents \(which are never deferred again\) fit no plan "
                                         r"of 2 micro-batches of max_tokens=10"):
        wlb.solve_pack([6, 6, 6, 1], 2, 10, unit_cost(), method, carried=3, allow_defer=True, time_limit=LIMIT,
                       deterministic=True, **kw)


@pytest.mark.parametrize("method", ["cpsat", "milp"])
@pytest.mark.parametrize("config", [{}, dict(max_delay=1), dict(release="paper")])
def test_an_exact_method_packer_drains_a_carry_larger_than_a_step(exact_extra, method, config):
    """The exact models place every carried piece: the packer carries only those that surely
    fit a step, so a drain (or a carry past one step) goes on instead of failing for good."""
    packer = wlb.WLBPacker(1, 100, unit_cost(), config=wlb.PackerConfig(method=method, **config))
    plans = [packer.pack([20] * 12), packer.pack([])] + list(packer.drain())
    assert [int(plan.tokens.sum()) for plan in plans] == [100, 100, 40]
    trained = sorted(int(i) for plan in plans for mb in plan.micro_batches for i in plan.doc_ids[mb])
    assert trained == list(range(12))  # every piece once


def test_solve_pack_names_a_carry_past_capacity_as_such_even_with_allow_defer(ortools):
    with pytest.raises(ValueError, match="the 3 carried items hold 30 tokens, more than 1 micro-batches x 20 = 20"):
        wlb.solve_pack([10, 10, 10, 5], 1, 20, unit_cost(), "cpsat", carried=3, allow_defer=True)


def test_bench_exact_scores_no_plan_that_cuts_documents_against_the_bounds_for_whole_ones(ortools):
    """"original" cuts documents at sequence boundaries (less attention work): the Eq. 1 bound,
    proven for whole documents, is no bound for it, whatever tokens it places."""
    from types import SimpleNamespace

    from wlb_opt.bench.exact import run_instance, summarise

    window = 4096
    pieces = np.array([window // 2, window, window // 2])
    args = SimpleNamespace(workers=1, gap_limit=0.0, time_limit=LIMIT, seed=0)
    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), hardware=wlb.HardwareSpec.preset("h100"))
    rows = run_instance(pieces, np.arange(3), np.zeros(3, np.int64), 2, window, cost, ["original", "fixed"],
                        ["cpsat_eq1"], args)
    by = {r["method"]: r for r in rows}
    assert not by["original"]["whole"] and not by["original"]["comparable"] and by["original"]["ratio"] is None
    assert by["fixed"]["whole"] and by["fixed"]["comparable"] and by["fixed"]["ratio"] >= 1 - 1e-9
    for r in rows:
        r.update(dist="default", docs_target=3, docs=3, n_micro=2, instance=0, total_tokens=int(pieces.sum()))
    assert {s["method"]: s["docs"] for s in summarise(rows)} == {"original": 3, "fixed": 3, "cpsat_eq1": 3}
