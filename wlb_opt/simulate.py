"""Step-time simulator: pipeline schedules as a networkx DAG, and a whole 4D step on top.

Why a simulator: the paper's end-to-end numbers (§7.3) come from a cluster we do not have.
What WLB-LLM changes is *which work each rank does*; how long a step then takes follows from
the schedule's dependencies, which we can compute exactly for a given cost per operation.

`simulate_pipeline(fwd, bwd, schedule, virtual_stages, p2p_s)` builds one node per
(phase, micro-batch, virtual stage) operation, with two kinds of edges:

- data edges: F(vs-1, m) -> F(vs, m), B(vs+1, m) -> B(vs, m), F(last, m) -> B(last, m),
  weighted by the point-to-point send time when they cross devices;
- order edges: consecutive operations of one device in its schedule order (1F1B, or
  Megatron's interleaved 1F1B with v model chunks per device).

Every operation starts as soon as its device and its inputs are ready, so the step time is
the longest path of that DAG (node weights = durations) and the critical path is that path.
`pipeline_recurrence` computes the same start times by a plain event loop without networkx;
the tests check that both agree.

`simulate_step(plan, shards, cost, parallel)` composes a step: a micro-batch's stage time is
the max over its CP ranks' loads (CP is synchronous) divided by pp (layers split evenly);
each DP replica runs its own pipeline; the step is the slowest replica plus a modelled
gradient all-reduce.

Modelled: per-op compute from the cost model (including its exposed TP/CP communication),
PP send/recv per micro-batch, pipeline dependencies and bubbles, DP gradient sync.
Not modelled: overlap of the gradient all-reduce with backward (we charge it fully, which is
pessimistic for every method alike), memory (activation limits, recomputation), network
contention between concurrent collectives, kernel launch jitter, the embedding and LM head
making the first and last stages heavier, optimizer step time.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ._validate import INT64_MAX, bool_position, check_int, check_real
from .plan import ShardPlan, check_replicas, imbalance
from .schedule import SCHEDULES, Op, Schedule, stage_order
from .specs import ParallelSpec


@dataclass
class SimResult:
    """What one pipeline run looks like. Times in seconds."""

    step_time_s: float
    """Time from the first operation's start to the last one's end."""
    bubble_fraction: float
    """Idle share of all stage-time: 1 - sum(stage_busy_s) / (stages x step_time_s)."""
    stage_busy_s: np.ndarray
    """Per physical stage, seconds of compute."""
    critical_path: list
    """Operations (phase, micro_batch, virtual_stage) on the longest path, in time order."""
    timeline: list = field(default_factory=list)
    """One dict per operation: stage, virtual_stage, phase, micro_batch, start_s, end_s."""

    def to_dict(self) -> dict:
        return dict(step_time_s=self.step_time_s, bubble_fraction=self.bubble_fraction,
                    stage_busy_s=self.stage_busy_s.tolist(),
                    critical_path=[list(op) for op in self.critical_path], timeline=self.timeline)


# ---------------------------------------------------------------------- inputs
MAX_OPERATIONS = 2**24
"""Most (phase, micro-batch, virtual stage) operations one simulated pipeline may hold: the
DAG and the event loop keep a Python object per operation (a real step has thousands)."""


def _seconds_array(values, name: str) -> np.ndarray:
    """`values` as float64 seconds, if they are real numbers (not bools, strings or objects;
    integers within int64, as everywhere else in the library)."""
    try:
        arr = np.asarray(values)
    except ValueError:  # numpy's "inhomogeneous shape": rows of different lengths
        raise ValueError(f"{name} must be a rectangular array of seconds (every row as long), got {values!r:.80}") \
            from None
    if arr.dtype.kind not in "iuf":
        raise ValueError(f"{name} must hold seconds (real numbers), got dtype {arr.dtype} ({values!r:.60})")
    at = bool_position(values)
    if at is not None:  # numpy read [True, 1] as integers
        raise ValueError(f"{name} must hold seconds (real numbers), got a bool at index {list(at)}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > INT64_MAX:
        # most likely a negative number cast to unsigned
        raise ValueError(f"{name} must hold seconds that fit in int64 as integers, got {int(arr.max())}")
    return arr.astype(np.float64)


def _check_total(f: np.ndarray, b: np.ndarray, p2p: np.ndarray) -> None:
    """A step is at most every operation and every send in a row: if that sum is finite,
    so are the step time, the timeline and the bubble fraction."""
    pp, v, m = f.shape
    with np.errstate(over="ignore"):
        total = f.sum() + b.sum() + 2.0 * pp * v * p2p.sum()
    if not np.isfinite(total):
        raise ValueError("fwd, bwd and p2p_s must add up to a finite number of seconds (their total "
                         "overflows float64, so the step time would be inf)")


def _chunk_costs(costs, name: str, virtual_stages: int) -> np.ndarray:
    """[pp, m] (split evenly over v chunks) or [pp, v, m] -> [pp, v, m] seconds."""
    virtual_stages = check_int("virtual_stages", virtual_stages, 1)
    arr = _seconds_array(costs, name)
    if arr.ndim in (2, 3) and 2 * virtual_stages * arr.shape[0] * arr.shape[-1] > MAX_OPERATIONS:
        raise ValueError(f"{name} of shape {arr.shape} with virtual_stages={virtual_stages} makes "
                         f"{2 * virtual_stages * arr.shape[0] * arr.shape[-1]} operations; the simulator "
                         f"holds one object per operation and takes at most {MAX_OPERATIONS}")
    if arr.ndim == 2:
        arr = np.repeat(arr[:, None, :] / virtual_stages, virtual_stages, axis=1)
    elif arr.ndim != 3 or arr.shape[1] != virtual_stages:
        raise ValueError(f"{name} must have shape [stages, micro_batches] or [stages, {virtual_stages}, "
                         f"micro_batches], got {arr.shape}")
    if arr.shape[0] < 1 or arr.shape[2] < 1:
        raise ValueError(f"{name} needs at least one stage and one micro-batch, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{name} must hold finite seconds >= 0")
    return arr


def _validate(fwd, bwd, schedule: str, virtual_stages: int, p2p_s):
    if not isinstance(schedule, str) or schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    virtual_stages = check_int("virtual_stages", virtual_stages, 1)
    if schedule == "1f1b" and virtual_stages != 1:
        raise ValueError(f"schedule '1f1b' has one chunk per stage; use schedule='interleaved' for "
                         f"virtual_stages={virtual_stages}")
    f = _chunk_costs(fwd, "fwd", virtual_stages)
    b = _chunk_costs(bwd, "bwd", virtual_stages)
    if f.shape != b.shape:
        raise ValueError(f"fwd and bwd must have the same shape, got {f.shape} and {b.shape}")
    pp, m = f.shape[0], f.shape[2]
    if virtual_stages > 1 and m % pp:
        # Megatron-LM's classic constraint: its grouped order deadlocks on a partial last group.
        raise ValueError(f"the interleaved schedule needs micro_batches to be a multiple of stages "
                         f"(pp={pp}), got {m}; use virtual_stages=1 or pad the step")
    p2p = _seconds_array(p2p_s, "p2p_s")
    p2p = np.broadcast_to(p2p, (m,)) if p2p.ndim == 0 else p2p
    if p2p.shape != (m,) or not np.all(np.isfinite(p2p)) or np.any(p2p < 0):
        raise ValueError(f"p2p_s must be seconds >= 0, a scalar or one per micro-batch ({m}), got {p2p_s!r}")
    _check_total(f, b, p2p)
    return f, b, p2p


def _deps(op: Op, n_virtual: int) -> list[Op]:
    """Data dependencies of one operation (other operations of the same micro-batch)."""
    phase, mb, vs = op
    if phase == "F":
        return [("F", mb, vs - 1)] if vs > 0 else []
    return [("B", mb, vs + 1)] if vs < n_virtual - 1 else [("F", mb, vs)]


def _durations(f: np.ndarray, b: np.ndarray) -> dict[Op, float]:
    pp, v, m = f.shape
    dur = {}
    for c in range(v):
        for s in range(pp):
            vs = c * pp + s
            for mb in range(m):
                dur[("F", mb, vs)] = float(f[s, c, mb])
                dur[("B", mb, vs)] = float(b[s, c, mb])
    return dur


def _check_order(order, m: int) -> list[int]:
    """`order` as a list of ints if it is a permutation of range(m) (integers, not bools or floats)."""
    values = order.tolist() if isinstance(order, np.ndarray) else order
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"order must be a permutation of range({m}) (a sequence of integers), got {order!r:.80}")
    values = list(values)
    if any(isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) for x in values):
        bad = next(x for x in values if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)))
        raise ValueError(f"order must be a permutation of range({m}) (integers), got {bad!r} in {values!r:.80}")
    perm = [int(x) for x in values]
    if sorted(perm) != list(range(m)):
        raise ValueError(f"order must be a permutation of range({m}), got {perm!r:.80}")
    return perm


def _orders(pp: int, m: int, v: int, order: Sequence[int] | None) -> list[list[Op]]:
    orders = [stage_order(s, pp, m, v) for s in range(pp)]
    if order is None:
        return orders
    perm = _check_order(order, m)
    # slot k of the schedule runs micro-batch perm[k]
    return [[(ph, perm[k], vs) for ph, k, vs in o] for o in orders]


# ---------------------------------------------------------------------- DAG
def build_dag(fwd, bwd, schedule: Schedule = "1f1b", virtual_stages: int = 1, p2p_s=0.0, order=None):
    """The schedule as a networkx DiGraph.

    Nodes are operations (phase, micro_batch, virtual_stage) with attributes `duration` and
    `stage`; edges carry `comm` (p2p seconds on data edges that cross devices, else 0) and
    `weight` = duration of the source + comm, so the longest path ending in the sink
    "end" is the step time.
    """
    import networkx as nx

    f, b, p2p = _validate(fwd, bwd, schedule, virtual_stages, p2p_s)
    pp, v, m = f.shape
    n_virtual = pp * v
    dur = _durations(f, b)
    g = nx.DiGraph()
    for op, d in dur.items():
        g.add_node(op, duration=d, stage=op[2] % pp)
    for seq in _orders(pp, m, v, order):
        for a, c in zip(seq, seq[1:]):
            g.add_edge(a, c, comm=0.0)
    for op in dur:
        for dep in _deps(op, n_virtual):
            comm = float(p2p[op[1]]) if dep[2] % pp != op[2] % pp else 0.0
            if g.has_edge(dep, op):  # same device, consecutive: keep the larger comm
                comm = max(comm, g.edges[dep, op]["comm"])
            g.add_edge(dep, op, comm=comm)
    for op in dur:
        g.add_edge(op, "end", comm=0.0)
    g.add_node("end", duration=0.0, stage=-1)
    for u, w, data in g.edges(data=True):
        data["weight"] = g.nodes[u]["duration"] + data["comm"]
    if not nx.is_directed_acyclic_graph(g):
        raise ValueError(f"schedule {schedule!r} with pp={pp}, v={v}, n_micro={m} has a dependency cycle")
    return g


class _Structure:
    """The schedule's DAG for one (pp, n_micro, v), built once with networkx and cached.

    Holds the operations in a topological order of the networkx DiGraph and, per operation,
    its predecessors (index, whether the edge is a cross-device data edge that pays p2p).
    Durations enter only when a step is evaluated, so one structure serves every step and
    every micro-batch order (running micro-batch perm[k] in slot k = permuting the costs).
    """

    def __init__(self, pp: int, m: int, v: int):
        import networkx as nx

        g = nx.DiGraph()
        n_virtual = pp * v
        ops = [(ph, mb, vs) for vs in range(n_virtual) for mb in range(m) for ph in ("F", "B")]
        g.add_nodes_from(ops)
        for seq in _orders(pp, m, v, None):
            g.add_edges_from(zip(seq, seq[1:]), cross=False)
        for op in ops:
            for dep in _deps(op, n_virtual):
                cross = dep[2] % pp != op[2] % pp
                if g.has_edge(dep, op):
                    cross = cross or g.edges[dep, op]["cross"]
                g.add_edge(dep, op, cross=cross)
        if not nx.is_directed_acyclic_graph(g):
            raise ValueError(f"the schedule with pp={pp}, v={v}, n_micro={m} has a dependency cycle")
        self.graph = g
        self.ops = list(nx.topological_sort(g))
        index = {op: i for i, op in enumerate(self.ops)}
        self.preds = [[(index[u], g.edges[u, op]["cross"]) for u in g.predecessors(op)] for op in self.ops]
        self.pp, self.m, self.v = pp, m, v
        self.is_fwd = np.array([op[0] == "F" for op in self.ops])
        self.stage = np.array([op[2] % pp for op in self.ops], dtype=np.int64)
        self.chunk = np.array([op[2] // pp for op in self.ops], dtype=np.int64)
        self.slot = np.array([op[1] for op in self.ops], dtype=np.int64)

    def durations(self, f: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.where(self.is_fwd, f[self.stage, self.chunk, self.slot], b[self.stage, self.chunk, self.slot])

    def longest_path(self, dur: np.ndarray, p2p: np.ndarray, want_path: bool = False):
        """Earliest start of every operation = longest path to it (durations + p2p on
        cross-device data edges). Returns (step_time, starts, critical path indices)."""
        d = dur.tolist()
        comm = p2p[self.slot].tolist()
        start = [0.0] * len(d)
        end = [0.0] * len(d)
        arg = [-1] * len(d)
        for i, preds in enumerate(self.preds):
            t, a = 0.0, -1
            for j, cross in preds:
                tj = end[j] + (comm[i] if cross else 0.0)
                if tj > t:
                    t, a = tj, j
            start[i], end[i], arg[i] = t, t + d[i], a
        last = int(np.argmax(end)) if end else 0
        path = []
        if want_path and end:
            k = last
            while k >= 0:
                path.append(k)
                k = arg[k]
            path.reverse()
        return (end[last] if end else 0.0), start, path


@functools.lru_cache(maxsize=128)
def _structure(pp: int, m: int, v: int) -> _Structure:
    return _Structure(pp, m, v)


def _permute(f, b, p2p, order, m):
    if order is None:
        return f, b, p2p, np.arange(m)
    perm = np.asarray(_check_order(order, m), dtype=np.int64)
    return f[:, :, perm], b[:, :, perm], p2p[perm], perm


def simulate_pipeline(fwd, bwd, schedule: Schedule = "1f1b", virtual_stages: int = 1, p2p_s=0.0,
                      order: Sequence[int] | None = None) -> SimResult:
    """Step time of one pipeline replica: the longest path of the schedule's DAG.

    This is the ideal pipeline, in which a send never waits for its receive. The executor's
    interleaved channels run it (`wlb_opt.rendezvous`); its 1F1B groups, in which a rank waits
    for its neighbour to take what it sends, can run slower (up to a few percent where
    micro-batches differ), and `simulate_step`, the simulator's step estimate, times the
    pipeline by the replay of what the executor runs.

    Args:
        fwd, bwd: seconds per operation, shape [stages, micro_batches] (a virtual stage of the
            interleaved schedule then costs 1/v of it) or [stages, v, micro_batches].
        schedule: "1f1b" or "interleaved".
        virtual_stages: model chunks per device (v); 1 for "1f1b".
        p2p_s: seconds to send one micro-batch's activations (or gradients) between adjacent
            stages; a scalar or one value per micro-batch.
        order: optional permutation: schedule slot k runs micro-batch order[k].

    Returns SimResult(step_time_s, bubble_fraction, stage_busy_s, critical_path, timeline).
    The DAG structure is built with networkx once per (stages, micro_batches, v) and cached;
    `build_dag` returns the same DAG with weights for users who want networkx itself.
    """
    f, b, p2p = _validate(fwd, bwd, schedule, virtual_stages, p2p_s)
    pp, v, m = f.shape
    f, b, p2p, perm = _permute(f, b, p2p, order, m)
    st = _structure(pp, m, v)
    dur = st.durations(f, b)
    step, start, path = st.longest_path(dur, p2p, want_path=True)
    relabel = lambda op: (op[0], int(perm[op[1]]), op[2])  # noqa: E731  slot -> micro-batch
    timeline = [dict(stage=int(op[2] % pp), virtual_stage=int(op[2]), phase=op[0], micro_batch=int(perm[op[1]]),
                     start_s=start[i], end_s=start[i] + float(dur[i])) for i, op in enumerate(st.ops)]
    timeline.sort(key=lambda r: (r["stage"], r["start_s"]))
    return _result(float(step), timeline, pp, [relabel(st.ops[i]) for i in path])


def pipeline_step_time(fwd, bwd, schedule: Schedule = "1f1b", virtual_stages: int = 1, p2p_s=0.0,
                       order: Sequence[int] | None = None) -> float:
    """simulate_pipeline's step time only (no timeline): the fast path of the order search."""
    f, b, p2p = _validate(fwd, bwd, schedule, virtual_stages, p2p_s)
    pp, v, m = f.shape
    f, b, p2p, _ = _permute(f, b, p2p, order, m)
    st = _structure(pp, m, v)
    return float(st.longest_path(st.durations(f, b), p2p)[0])


def _replayed(f: np.ndarray, b: np.ndarray, v: int, p2p: np.ndarray, order) -> SimResult:
    """The replay of the executor's p2p ([pp, m] seconds split over v chunks): for 1F1B its
    blocking groups (`step_plan`), for the interleaved schedule its channels; slot k running
    micro-batch order[k]; the timeline names micro-batches as `simulate_pipeline`'s does."""
    from .rendezvous import _replay, _replay_channels
    from .schedule import step_plan

    fc, bc, p2p = _validate(f, b, "interleaved" if v > 1 else "1f1b", v, p2p)
    pp, _, m = fc.shape
    fc, bc, p2p, perm = _permute(fc, bc, p2p, order, m)
    if v > 1:
        res = _replay_channels(fc, bc, p2p)
    else:
        res = _replay(fc, bc, [step_plan(r, pp, m, 1) for r in range(pp)], p2p)
    for row in res.timeline:
        row["micro_batch"] = int(perm[row["micro_batch"]])
    res.timeline.sort(key=lambda r: (r["stage"], r["start_s"]))
    return res


def _result(step: float, timeline: list, pp: int, critical: list) -> SimResult:
    busy = np.zeros(pp)
    for r in timeline:
        busy[r["stage"]] += r["end_s"] - r["start_s"]
    bubble = 1.0 - busy.sum() / pp / step if step > 0 else 0.0  # pp x step could overflow
    return SimResult(step_time_s=step, bubble_fraction=float(bubble), stage_busy_s=busy,
                     critical_path=critical, timeline=timeline)


# ---------------------------------------------------------------------- recurrence twin
def pipeline_recurrence(fwd, bwd, schedule: Schedule = "1f1b", virtual_stages: int = 1, p2p_s=0.0,
                        order: Sequence[int] | None = None) -> SimResult:
    """The same schedule by an event loop, without networkx (the DAG's independent twin).

    Each device keeps a pointer into its operation list; an operation runs when its
    dependencies have finished: start = max(device free, max(dep end + p2p if cross-device)).
    Also the fast path the micro-batch order search uses. critical_path is left empty.
    """
    f, b, p2p = _validate(fwd, bwd, schedule, virtual_stages, p2p_s)
    pp, v, m = f.shape
    n_virtual = pp * v
    dur = _durations(f, b)
    orders = _orders(pp, m, v, order)
    end: dict[Op, float] = {}
    start: dict[Op, float] = {}
    free = [0.0] * pp
    ptr = [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(pp):
            while ptr[s] < len(orders[s]):
                op = orders[s][ptr[s]]
                deps = _deps(op, n_virtual)
                if any(d not in end for d in deps):
                    break
                t = free[s]
                for d in deps:
                    t = max(t, end[d] + (float(p2p[op[1]]) if d[2] % pp != s else 0.0))
                start[op], end[op] = t, t + dur[op]
                free[s] = end[op]
                ptr[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError(f"schedule {schedule!r} with pp={pp}, v={v}, n_micro={m} deadlocks")
    step = max(end.values()) if end else 0.0
    timeline = [dict(stage=int(op[2] % pp), virtual_stage=int(op[2]), phase=op[0], micro_batch=int(op[1]),
                     start_s=start[op], end_s=end[op]) for op in start]
    timeline.sort(key=lambda r: (r["stage"], r["start_s"]))
    return _result(step, timeline, pp, [])


def best_order(fwd, bwd, schedule: Schedule = "1f1b", virtual_stages: int = 1, p2p_s=0.0,
               max_exhaustive: int = 6) -> tuple[list[int], float]:
    """The micro-batch order with the shortest simulated step.

    Exhaustive over permutations for up to `max_exhaustive` micro-batches (720 runs), else
    pairwise-swap hill climbing from the heaviest-first order. Returns (order, step_time_s);
    the identity order is always a candidate, so the result is never worse than it.
    """
    max_exhaustive = check_int("max_exhaustive", max_exhaustive, 0)
    f = _chunk_costs(fwd, "fwd", virtual_stages)
    m = f.shape[2]

    def run(perm):
        return pipeline_step_time(fwd, bwd, schedule, virtual_stages, p2p_s, perm)

    best = list(range(m))
    best_t = run(best)
    if m <= max_exhaustive:
        for perm in itertools.permutations(range(m)):
            t = run(perm)
            if t < best_t - 1e-12:
                best, best_t = list(perm), t
        return best, best_t
    total = np.asarray(fwd, dtype=np.float64).reshape(-1, m).sum(0) + np.asarray(bwd, dtype=np.float64).reshape(-1, m).sum(0)
    cand = [int(x) for x in np.argsort(-total, kind="stable")]
    cand_t = run(cand)
    if cand_t < best_t:
        best, best_t = cand, cand_t
    improved = True
    while improved:
        improved = False
        for i in range(m):
            for j in range(i + 1, m):
                trial = list(best)
                trial[i], trial[j] = trial[j], trial[i]
                t = run(trial)
                if t < best_t - 1e-12:
                    best, best_t, improved = trial, t, True
    return best, best_t


def compare_to_measured(sim: SimResult, measured_step_s: float, measured_stage_busy_s=None) -> dict:
    """Hook for validating the simulator against the executor's measured timings.

    Returns relative errors (predicted / measured - 1) of the step time and, if given, of each
    stage's busy time. The pipeline executor records these per step; a calibration run feeds
    them here.
    """
    if not isinstance(sim, SimResult):
        raise TypeError(f"sim must be a SimResult (simulate_pipeline or simulate_step), got {type(sim).__name__}")
    measured_step_s = check_real("measured_step_s", measured_step_s, strict=True, unit="seconds")
    out = dict(step_rel_error=sim.step_time_s / measured_step_s - 1.0)
    if measured_stage_busy_s is not None:
        meas = _seconds_array(measured_stage_busy_s, "measured_stage_busy_s")
        if meas.shape != sim.stage_busy_s.shape or np.any(meas <= 0) or not np.all(np.isfinite(meas)):
            raise ValueError(f"measured_stage_busy_s must be {sim.stage_busy_s.shape[0]} positive seconds, "
                             f"got {measured_stage_busy_s!r}")
        out["stage_rel_error"] = (sim.stage_busy_s / meas - 1.0).tolist()
    return out


# ---------------------------------------------------------------------- whole step
@dataclass
class StepResult:
    """One training step: the slowest DP replica plus gradient sync. Seconds."""

    step_time_s: float
    replica_step_s: list
    allreduce_s: float
    pipelines: list
    """SimResult per DP replica."""
    mb_fwd_s: np.ndarray
    """Per micro-batch: forward seconds of all layers on its slowest CP rank."""
    mb_bwd_s: np.ndarray
    imbalance_pp: float
    """max / mean over the step's micro-batches of their stage time (max over CP ranks)."""
    imbalance_cp: float
    """Mean over micro-batches of max / mean of the CP rank loads."""
    tokens: int
    orders: list
    """Per replica, the micro-batch order run (indices into the plan's micro-batches)."""


def _phase_split(cost, lengths) -> float:
    """Forward share of a micro-batch's fwd_bwd cost under the cost model."""
    total = cost.micro_batch_cost(lengths, "fwd_bwd")
    return cost.micro_batch_cost(lengths, "fwd") / total if total > 0 else 1.0 / 3.0


def p2p_seconds(tokens, cost, parallel: ParallelSpec) -> np.ndarray:
    """PP send time of one micro-batch's activations: tokens / (tp * cp) x hidden x 2 bytes
    per rank (sequence parallel), over NVLink when a replica's tp x cp x pp GPUs fit in one
    node, else over the inter-node network: some stage boundary then crosses nodes, and every
    boundary is priced alike (the slowest sets the pipeline's pace). 0 when the cost model
    has no model or hardware."""
    if parallel.pp == 1 or cost.model is None or cost.hardware is None:
        return np.zeros(len(np.atleast_1d(tokens)))
    hw = cost.hardware
    intra = parallel.tp * parallel.cp * parallel.pp <= parallel.gpus_per_node
    bw = (hw.nvlink_gbps if intra else hw.network_gbps) * 1e9
    return np.asarray(tokens, dtype=np.float64) / (parallel.tp * parallel.cp) * cost.model.hidden * 2.0 / bw


def allreduce_seconds(cost, parallel: ParallelSpec) -> float:
    """Ring all-reduce of one stage's bf16 gradients over the n = dp x cp ranks that hold the
    same weights (the data-parallel replicas and, within each, the context-parallel ranks:
    the executor sums gradients over both), fully exposed: 2 (n-1)/n x params / (pp tp) x 2
    bytes / network bandwidth. 0 for n = 1."""
    n = parallel.dp * parallel.cp
    if n == 1 or cost.model is None or cost.hardware is None:
        return 0.0
    grads = cost.model.n_params / (parallel.pp * parallel.tp) * 2.0
    return 2.0 * (n - 1) / n * grads / (cost.hardware.network_gbps * 1e9)


def step_layout(plan, cost, parallel: ParallelSpec | None = None) -> ParallelSpec:
    """The layout a step runs under: `parallel`, else the cost model's, else pp = 1 and the
    plan's dp. A `parallel` that disagrees with the cost model's layout raises."""
    from .cost import CostModel

    if not isinstance(cost, CostModel):
        raise ValueError(f"cost must be a wlb_opt.CostModel, got {type(cost).__name__} {cost!r:.40}")
    if parallel is None:
        parallel = cost.parallel if cost.parallel is not None else ParallelSpec(dp=plan.dp)
    elif not isinstance(parallel, ParallelSpec):
        raise ValueError(f"parallel must be a ParallelSpec or None, got {type(parallel).__name__}")
    elif cost.parallel is not None and parallel != cost.parallel:
        raise ValueError(f"parallel={parallel} disagrees with the cost model's layout {cost.parallel}; "
                         "pass parallel=None to use the cost model's")
    return parallel


def _step_shard(shard, j: int, lengths: np.ndarray, cp: int):
    """`shards[j]` of `simulate_step`, checked against micro-batch j (its `lengths`) and the
    layout's CP degree; None (an empty micro-batch, as `solve_shards` gives it) stays None."""
    if shard is None:
        if len(lengths):
            raise ValueError(f"shards[{j}] is None, but micro-batch {j} holds {len(lengths)} pieces "
                             "(None is an empty micro-batch's shard)")
        return None
    if not isinstance(shard, ShardPlan):
        raise TypeError(f"shards[{j}] must be a ShardPlan (or None for an empty micro-batch), "
                        f"got {type(shard).__name__}")
    if len(shard.lengths) != len(lengths) or not np.array_equal(shard.lengths, lengths):
        raise ValueError(f"shards[{j}] shards pieces of lengths {shard.lengths.tolist()[:8]}"
                         f"{'...' if len(shard.lengths) > 8 else ''}, not micro-batch {j}'s "
                         f"{lengths.tolist()[:8]}{'...' if len(lengths) > 8 else ''}")
    if shard.cp != cp:
        raise ValueError(f"shards[{j}] is sharded for cp={shard.cp}, but the layout has cp={cp}")
    return shard


def simulate_step(plan, shards, cost, parallel: ParallelSpec | None = None, *, schedule: Schedule = "interleaved", virtual_stages: int = 2,
                  p2p_s=None, allreduce_s: float | None = None, search_order: bool = False,
                  use_dag: bool = True, blocking_p2p: bool = True) -> StepResult:
    """Simulate one training step of a PackPlan under a 4D layout.

    Args:
        plan: the step's PackPlan (dp x n_micro micro-batches, `replica_of` their replicas).
        shards: one ShardPlan per micro-batch, micro-batch j's (its pieces) for the layout's
            CP degree (its `.loads` are fwd_bwd seconds per CP rank), None in the place of an
            empty micro-batch (as `solve_shards` gives it); or None: CP assumed perfectly
            balanced (the load is `cost.micro_batch_cost` of the micro-batch's lengths).
        cost: the CostModel the plan was made with (seconds for all layers of one replica).
        parallel: ParallelSpec; pp stages per replica (layers split evenly). None: the cost
            model's layout (`cost.parallel`); one that disagrees with it raises.
        schedule, virtual_stages: pipeline schedule ("interleaved" with v = 2 by default;
            v = 1 or pp = 1 falls back to "1f1b").
        p2p_s: PP send seconds per micro-batch (default from `p2p_seconds`).
        allreduce_s: gradient sync seconds over dp x cp ranks (default from `allreduce_seconds`).
        search_order: pick each replica's micro-batch order by simulation (`best_order`).
        use_dag: networkx DAG (with critical path) or the recurrence twin (faster), where the
            DAG times the step (`blocking_p2p=False`, or pp = 1); the replays keep no critical
            path.
        blocking_p2p: the pipeline as the executor runs it (pp > 1): the interleaved schedule
            (v > 1) by the replay of its p2p channels (`wlb_opt.rendezvous.simulate_channels`:
            a message moves once its receive is posted, the receive posted one message ahead),
            which gives the ideal DAG's step time; 1F1B by the replay of its blocking groups
            (`simulate_rendezvous`: a rank waits for each whole group, so a send waits for its
            receiver), which can be slower than the DAG (up to a few percent where the
            micro-batches differ). False: the ideal DAG, in which sends never wait (it also
            gives the critical path). The micro-batch order search runs on the DAG.

    A micro-batch's forward and backward split its fwd_bwd load by the cost model's own
    fwd / fwd_bwd ratio for that micro-batch (ShardPlan loads are fwd_bwd only).
    """
    parallel = step_layout(plan, cost, parallel)
    # checked here too: with pp = 1 the schedule is not otherwise read
    if not isinstance(schedule, str) or schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    virtual_stages = check_int("virtual_stages", virtual_stages, 1)  # so is virtual_stages
    pp = parallel.pp
    n_mb = len(plan.micro_batches)
    if shards is not None and len(shards) != n_mb:
        raise ValueError(f"shards must hold one ShardPlan per micro-batch ({n_mb}), got {len(shards)}")
    if plan.dp != parallel.dp:
        raise ValueError(f"plan has dp={plan.dp} replicas but parallel.dp={parallel.dp}")
    check_replicas(plan)  # PlanError (a ValueError) naming replica_of
    total = np.empty(n_mb)
    cp_imb = np.ones(n_mb)
    fwd_share = np.empty(n_mb)
    for j in range(n_mb):
        lengths = plan.lengths[plan.micro_batches[j]]
        fwd_share[j] = _phase_split(cost, lengths)
        shard = None if shards is None else _step_shard(shards[j], j, lengths, parallel.cp)
        if shard is None:
            total[j] = cost.micro_batch_cost(lengths, "fwd_bwd")
        else:
            loads = np.asarray(shard.loads, dtype=np.float64)
            total[j] = float(loads.max())
            cp_imb[j] = float(loads.max() / loads.mean()) if loads.mean() > 0 else 1.0
    mb_fwd, mb_bwd = total * fwd_share, total * (1.0 - fwd_share)
    if p2p_s is None:
        p2p_all = p2p_seconds(plan.tokens, cost, parallel)
    else:
        p2p_all = _seconds_array(p2p_s, "p2p_s")
        if p2p_all.ndim > 1 or p2p_all.size not in (1, n_mb) or not np.all(np.isfinite(p2p_all)) or np.any(p2p_all < 0):
            raise ValueError(f"p2p_s must be seconds >= 0, a scalar or one per micro-batch ({n_mb}), got {p2p_s!r:.80}")
        p2p_all = np.broadcast_to(p2p_all.reshape(-1), (n_mb,))
    if allreduce_s is None:
        allreduce_s = allreduce_seconds(cost, parallel)
    else:
        allreduce_s = check_real("allreduce_s", allreduce_s, unit="seconds")
    for flag, value in (("search_order", search_order), ("use_dag", use_dag), ("blocking_p2p", blocking_p2p)):
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{flag} must be True or False, got {value!r}")
    v = virtual_stages if (schedule == "interleaved" and pp > 1) else 1
    sched = "interleaved" if v > 1 else "1f1b"
    sim = simulate_pipeline if use_dag else pipeline_recurrence
    pipelines, replica_times, orders = [], [], []
    for r in range(plan.dp):
        idx = plan.replica_micro_batches(r)
        f = np.tile(mb_fwd[idx] / pp, (pp, 1))
        b = np.tile(mb_bwd[idx] / pp, (pp, 1))
        order = None
        if search_order and len(idx) > 1:
            order, _ = best_order(f, b, sched, v, p2p_all[idx])
        if blocking_p2p and pp > 1:
            res = _replayed(f, b, v, p2p_all[idx], order)
        else:
            res = sim(f, b, sched, v, p2p_all[idx], order)
        pipelines.append(res)
        replica_times.append(res.step_time_s)
        orders.append([idx[k] for k in (order or range(len(idx)))])
    return StepResult(step_time_s=float(max(replica_times)) + float(allreduce_s), replica_step_s=replica_times,
                      allreduce_s=float(allreduce_s), pipelines=pipelines, mb_fwd_s=mb_fwd, mb_bwd_s=mb_bwd,
                      imbalance_pp=imbalance(total), imbalance_cp=float(cp_imb.mean()),
                      tokens=int(plan.tokens.sum()), orders=orders)
