"""Soak test of WLBPacker: long adversarial streams, random JSON checkpoint restores, and a
conservation checker written here, independent of the library (not `check_pack`).

Each configuration of the grid (queue count x max_delay x dp x release rule) runs one
stream of adversarial global batches: edge lengths (1, max_tokens, each threshold and its
neighbours), 63-bit and negative ids, pieces of one document sent in different batches,
empty batches and bursts of several steps' capacity. At random steps the packer's state
goes through JSON into a fresh packer; the old packer runs a few more steps first, and the
fresh one must emit the same plans for them. A batch the packer refuses (overload) must
leave the state unchanged and is not counted as sent; `pack([])` after it must succeed.

The checker keeps its own ledger of what was sent and what each plan placed: every piece
comes out exactly once (none lost, none duplicated, none invented), no micro-batch holds
more than max_tokens, a plan holds the right number of micro-batches, what the packer
still holds is exactly what was sent and not yet placed, and after `drain()` nothing is
left.

    pytest -m slow tests/integration/test_soak.py -s          # the full soak (>= 100,000 global batches)
    WLB_SOAK_STEPS=200 pytest -m slow tests/integration/test_soak.py -s   # shorter streams

The same checks run the no-tuning defaults on steps of 16 to 64 micro-batches, with lookahead
0, 2 and 4 (`run_large_stream`): most pieces a few tokens long, so that the planner's paths for
large steps run (candidates and the plan's short tail in lumps, the sparse groups, the bounded
search), and the compiled and Python loops must plan such a stream alike.

The default run keeps a small smoke of the same code (`test_soak_smoke`,
`test_soak_smoke_of_the_defaults_on_large_steps`).
"""
from __future__ import annotations

import itertools
import json
import os
import time
from collections import Counter

import numpy as np
import pytest

import wlb_opt as wlb
from conftest import unit_cost
from wlb_opt.solvers.greedy import compiled_available, use_compiled


COST = unit_cost(attn=1e-6, linear=1e-3, doc_const=1e-4)
MAX_TOKENS = 256
THRESHOLDS = {0: [], 1: [128], 2: [96, 180], 3: [64, 128, 200]}
GRID = list(itertools.product(sorted(THRESHOLDS), [None, 1, 2, 8], [1, 2], ["paper", "balance", "group", "marginal"]))
ID_MULTIPLIER = 0x9E3779B97F4A7C15  # odd: a bijection on 64-bit words, so ids never repeat


def signed_id(counter: int) -> int:
    """The counter-th document id: all over the signed 64-bit range (negative ones too)."""
    word = (counter * ID_MULTIPLIER) % 2**64
    return word - 2**64 if word >= 2**63 else word


class Stream:
    """Adversarial global batches of (id, offset, length) pieces for one configuration."""

    def __init__(self, rng: np.random.Generator, capacity: int, thresholds: list[int], max_tokens: int = MAX_TOKENS,
                 log_short: bool = False):
        """`log_short`: the short documents' lengths log-uniform (most of a step's pieces a few
        tokens long, as in real streams) instead of uniform."""
        self.rng, self.capacity, self.max_tokens, self.log_short = rng, capacity, max_tokens, log_short
        edges = [1, 2, max_tokens - 1, max_tokens] + [t + d for t in thresholds for d in (-1, 0, 1)]
        self.edges = [e for e in edges if 1 <= e <= max_tokens]
        self.next_doc = 0
        self.pending: list[tuple[int, int, int]] = []  # later pieces of split documents

    def _document(self) -> list[tuple[int, int, int]]:
        doc = signed_id(self.next_doc)
        self.next_doc += 1
        r = self.rng.random()
        top = self.max_tokens
        edge, outlier = (0.05, 0.1) if self.log_short else (0.15, 0.35)
        if r < edge:
            length = int(self.rng.choice(self.edges))
        elif r < outlier:
            length = int(self.rng.integers(top // 3, top + 1))  # outliers
        elif self.log_short:
            length = int(np.exp(self.rng.uniform(0.0, np.log(top // 4))))
        else:
            length = int(self.rng.integers(1, top // 4))
        if self.rng.random() < (0.02 if self.log_short else 0.1):  # a long document cut into window pieces
            total = int(self.rng.integers(top + 1, 4 * top))
            pieces, _, offsets = wlb.split_documents([total], top)
            return [(doc, int(o), int(n)) for o, n in zip(offsets, pieces)]
        return [(doc, 0, length)]

    def batch(self) -> list[tuple[int, int, int]]:
        kind = self.rng.random()
        target = 0 if kind < 0.05 else int(self.capacity * (3.0 if kind > 0.97 else self.rng.uniform(0.3, 0.95)))
        out, tokens = [], 0
        # pieces of documents split in earlier batches arrive first, some held back again
        keep = []
        for piece in self.pending:
            (out if self.rng.random() < 0.7 else keep).append(piece)
        self.pending = keep
        tokens = sum(p[2] for p in out)
        while tokens < target:
            pieces = self._document()
            out.append(pieces[0])
            self.pending.extend(pieces[1:])
            tokens += pieces[0][2]
        order = self.rng.permutation(len(out))
        return [out[i] for i in order]


class Ledger:
    """Independent bookkeeping of a stream: sent pieces, placed pieces, checks per plan."""

    def __init__(self, n_mb: int, max_tokens: int = MAX_TOKENS):
        self.n_mb, self.max_tokens = n_mb, max_tokens
        self.sent: Counter = Counter()
        self.placed: Counter = Counter()
        self.plans = self.pieces = 0

    def send(self, batch) -> None:
        self.sent.update(batch)

    def record(self, plan) -> None:
        assert len(plan.micro_batches) == self.n_mb
        positions = [int(i) for mb in plan.micro_batches for i in mb] + [int(i) for i in plan.deferred]
        assert sorted(positions) == list(range(len(plan.doc_ids))), "a position is used twice or never"
        for mb in plan.micro_batches:
            pieces = [(int(plan.doc_ids[i]), int(plan.offsets[i]), int(plan.lengths[i])) for i in mb]
            assert sum(n for _, _, n in pieces) <= self.max_tokens, f"micro-batch over max_tokens: {pieces}"
            for piece in pieces:
                self.placed[piece] += 1
                assert self.placed[piece] <= self.sent[piece], f"{piece} placed more often than sent"
            self.pieces += len(pieces)
        self.plans += 1

    def outstanding(self) -> Counter:
        return self.sent - self.placed

    def check_held(self, packer) -> None:
        held = Counter()
        for q in packer._queues:
            held.update((p.id, p.offset, p.length) for p in q)
        held.update((p.id, p.offset, p.length) for p in packer._carry)
        held.update((p.id, p.offset, p.length) for p in packer._ahead.pieces())  # seen ahead (lookahead)
        assert held == self.outstanding(), "the packer holds something other than sent minus placed"

    def check_done(self) -> None:
        assert self.placed == self.sent, (f"lost {sorted((self.sent - self.placed).elements())[:5]}, "
                                          f"extra {sorted((self.placed - self.sent).elements())[:5]}")
        assert max(self.placed.values(), default=1) == 1


def run_stream(n_queues: int, max_delay, dp: int, release: str, steps: int, seed: int) -> dict:
    """One configuration's stream; returns its counts. Raises AssertionError on a violation."""
    rng = np.random.default_rng(seed)
    kw = dict(n_micro=2, max_tokens=MAX_TOKENS, cost=COST, dp=dp, seed=seed % 1000,
              config=wlb.PackerConfig(thresholds=THRESHOLDS[n_queues], max_delay=max_delay, release=release))
    packer = wlb.WLBPacker(**kw)
    stream = Stream(rng, packer.capacity_tokens, THRESHOLDS[n_queues])
    ledger = Ledger(dp * 2)
    restores = overloads = 0
    step = 0
    while step < steps:
        if rng.random() < 0.02:  # checkpoint: the old packer runs ahead, the fresh one must agree
            state = json.loads(json.dumps(packer.state_dict()))
            ahead = [stream.batch() for _ in range(3)]
            old_plans = [_step(packer, None, batch, 0)[0] for batch in ahead]
            fresh = wlb.WLBPacker(**kw)
            fresh.load_state_dict(state)
            packer = fresh
            restores += 1
            for batch, expected in zip(ahead, old_plans):
                got, step = _step(packer, ledger, batch, step)
                overloads += got.startswith("overload")
                assert got == expected, f"resumed packer differs at step {step}"
            continue
        got, step = _step(packer, ledger, stream.batch(), step)
        overloads += got.startswith("overload")
        if step % 50 == 0:
            ledger.check_held(packer)
    for piece in stream.pending:  # the rest of the split documents, then the end of data
        if piece not in ledger.sent:
            _step(packer, ledger, [piece], step)
    for plan in packer.drain():
        ledger.record(plan)
    ledger.check_done()
    stats = packer.stats()
    if max_delay is not None:
        assert stats["queue_wait_max"] <= max_delay
    return dict(batches=ledger.plans, pieces=ledger.pieces, restores=restores, overloads=overloads)


def _step(packer, ledger: Ledger | None, batch, step: int):
    """Pack one batch (or refuse it, leaving the state as it was, then pack nothing);
    returns (digest, or "overload" + the empty step's digest, next step count). Without a
    ledger nothing is recorded (a packer that is about to be replaced)."""
    before = packer.state_dict() if len(batch) and packer.held_tokens else None
    try:
        plan = packer.pack([n for _, _, n in batch], [i for i, _, _ in batch], [o for _, o, _ in batch])
    except ValueError as exc:
        assert "overload" in str(exc), str(exc)
        if before is not None:
            assert packer.state_dict() == before, "a refused batch changed the state"
        plan = packer.pack([])  # never refused
        if ledger is not None:
            ledger.record(plan)
        return "overload " + plan.digest(), step + 1
    if ledger is not None:
        ledger.send(batch)
        if plan is not None:  # None: with lookahead, one of the first K batches
            ledger.record(plan)
    return ("ahead" if plan is None else plan.digest()), step + 1


LARGE_MAX_TOKENS = 2048
LARGE_COST = wlb.CostModel(coef={"fwd": dict(attn=1e-6, linear=1e-3, comm=0.0, doc_const=1e-4, mb_const=1e-3),
                                 "bwd": dict(attn=2.5e-6, linear=1.5e-3, comm=0.0, doc_const=1e-4, mb_const=1e-3)},
                           attn_flops_per_pair=1.0)
"""Forward and backward weigh attention differently, so `wlb_phases` balances two phases."""
LARGE_GRID = list(itertools.product([(32, 1), (16, 2), (64, 1)], [0, 2, 4]))
"""(n_micro, dp), lookahead: the default planner's paths for large steps (candidates in lumps
from 16 micro-batches, sparse groups, a bounded search and the plan's tail in lumps from 32)."""


def run_large_stream(n_micro: int, dp: int, lookahead: int, steps: int, seed: int) -> dict:
    """`run_stream` for the no-tuning defaults (`PackerConfig(lookahead=...)`) on steps of
    dp x n_micro >= 16 micro-batches, with most pieces a few tokens long (log-uniform) and
    costs whose phases differ; returns its counts and the digest of every step."""
    rng = np.random.default_rng(seed)
    kw = dict(n_micro=n_micro, max_tokens=LARGE_MAX_TOKENS, cost=LARGE_COST, dp=dp, seed=seed % 1000,
              config=wlb.PackerConfig(lookahead=lookahead))
    packer = wlb.WLBPacker(**kw)
    cutoff = int(0.3 * LARGE_MAX_TOKENS)  # the default pool's cutoff, and the lumps' boundary
    stream = Stream(rng, packer.capacity_tokens, [cutoff, LARGE_MAX_TOKENS // 40], LARGE_MAX_TOKENS, log_short=True)
    ledger = Ledger(dp * n_micro, LARGE_MAX_TOKENS)
    digests, restores, overloads, step = [], 0, 0, 0
    while step < steps:
        if step and rng.random() < 0.03:  # the old packer runs ahead; the one resumed from JSON must agree
            state = json.loads(json.dumps(packer.state_dict()))
            ahead = [stream.batch() for _ in range(lookahead + 2)]
            old = [_step(packer, None, batch, 0)[0] for batch in ahead]
            packer = wlb.WLBPacker(**kw)
            packer.load_state_dict(state)
            restores += 1
            for batch, expected in zip(ahead, old):
                got, step = _step(packer, ledger, batch, step)
                assert got == expected, f"resumed packer differs at step {step}"
                digests.append(got)
                overloads += got.startswith("overload")
            continue
        got, step = _step(packer, ledger, stream.batch(), step)
        digests.append(got)
        overloads += got.startswith("overload")
        if step % 20 == 0:
            ledger.check_held(packer)
    for piece in stream.pending:
        if piece not in ledger.sent:
            digests.append(_step(packer, ledger, [piece], step)[0])
    for plan in packer.drain():
        ledger.record(plan)
        digests.append(plan.digest())
    ledger.check_done()
    assert packer.stats()["queue_wait_max"] <= packer.max_delay
    return dict(batches=ledger.plans, pieces=ledger.pieces, restores=restores, overloads=overloads,
                digests=digests)


def test_soak_smoke():
    totals = Counter()
    for n_queues, max_delay, dp, release in [(2, None, 1, "paper"), (1, 1, 2, "balance"), (3, 2, 1, "group"),
                                             (0, 8, 2, "paper"), (1, 8, 1, "marginal")]:
        totals.update(run_stream(n_queues, max_delay, dp, release, steps=120, seed=7))
    assert totals["batches"] >= 600 and totals["restores"] >= 1


def test_the_checker_catches_a_lost_a_duplicated_and_an_oversized_piece():
    ledger = Ledger(2)
    plan = wlb.solve_pack([100, 50], 2, MAX_TOKENS, COST, ids=[1, 2])
    ledger.send([(1, 0, 100), (2, 0, 50)])
    ledger.record(plan)
    ledger.check_done()
    with pytest.raises(AssertionError, match="placed more often"):
        ledger.record(plan)
    lost = Ledger(2)
    lost.send([(1, 0, 100), (2, 0, 50), (3, 0, 7)])
    lost.record(plan)
    with pytest.raises(AssertionError, match="lost"):
        lost.check_done()
    big = wlb.solve_pack([200, 200], 1, 400, COST, ids=[1, 2], dp=2)
    over = Ledger(2)
    over.send([(1, 0, 200), (2, 0, 200)])
    with pytest.raises(AssertionError, match="over max_tokens"):
        over.record(big.replace(micro_batches=(np.array([0, 1]), np.array([], np.int64))))


@pytest.mark.parametrize("n_micro, dp, lookahead", [(32, 1, 0), (16, 2, 2), (32, 1, 4)])
def test_soak_smoke_of_the_defaults_on_large_steps(n_micro, dp, lookahead):
    counts = run_large_stream(n_micro, dp, lookahead, steps=120, seed=11)
    assert counts["batches"] >= 120 and counts["restores"] >= 1


@pytest.mark.skipif(not compiled_available(), reason="numba (the `fast` extra) is not installed")
def test_the_compiled_and_python_loops_plan_an_adversarial_large_stream_alike():
    with use_compiled(False):
        python = run_large_stream(32, 1, 4, steps=80, seed=12)
    with use_compiled(True):
        compiled = run_large_stream(32, 1, 4, steps=80, seed=12)
    assert compiled["digests"] == python["digests"]


@pytest.mark.slow
def test_soak_of_the_defaults_on_large_steps():
    steps = int(os.environ.get("WLB_SOAK_STEPS", 800)) // 2
    totals = Counter()
    for k, ((n_micro, dp), lookahead) in enumerate(LARGE_GRID):
        counts = run_large_stream(n_micro, dp, lookahead, steps=steps, seed=2000 + k)
        totals.update({key: value for key, value in counts.items() if key != "digests"})
    print("\nlarge-step soak:", json.dumps(dict(totals)))
    assert totals["restores"] >= len(LARGE_GRID)


@pytest.mark.slow
def test_soak_conservation_over_100k_global_batches():
    steps = int(os.environ.get("WLB_SOAK_STEPS", 800))
    totals, started = Counter(), time.perf_counter()
    for k, (n_queues, max_delay, dp, release) in enumerate(GRID):
        totals.update(run_stream(n_queues, max_delay, dp, release, steps=steps, seed=1000 + k))
    totals["configurations"] = len(GRID)
    totals["seconds"] = round(time.perf_counter() - started)
    print("\nsoak:", json.dumps(dict(totals)))
    if "WLB_SOAK_STEPS" not in os.environ:
        assert totals["batches"] >= 100_000


def test_a_repaired_step_defers_no_more_than_half_the_carry_limit(monkeypatch):
    # the repair packs a step without the pieces it deferred and adds them back deferred: what
    # its packing may defer beside them is bounded by half the carry limit, as every other
    # rule of "marginal" bounds a step's deferred tokens
    from wlb_opt.packer import release as release_module
    repaired = release_module.MarginalRelease._repaired
    seen = []

    def spy(self, chosen, *args):
        out = repaired(self, chosen, *args)
        if out is not chosen:
            seen.append((release_module.as_pack_plan(out.plan).deferred_tokens, self.max_backlog_tokens // 2))
        return out

    monkeypatch.setattr(release_module.MarginalRelease, "_repaired", spy)
    cost = wlb.CostModel(coef={"fwd": dict(attn=1e-6, linear=1e-3, comm=0.0, doc_const=1e-4, mb_const=1e-3),
                               "bwd": dict(attn=2.5e-6, linear=1.5e-3, comm=0.0, doc_const=1e-4, mb_const=1e-3)},
                         attn_flops_per_pair=1.0)
    for seed in range(5):
        rng = np.random.default_rng(seed)
        packer = wlb.WLBPacker(2, MAX_TOKENS, cost, 2, config=wlb.PackerConfig(method="wlb", thresholds=(96, 180)),
                               seed=1)
        stream = Stream(rng, packer.capacity_tokens, [96, 180])
        for _ in range(60):
            batch = stream.batch()
            try:
                packer.pack([n for _, _, n in batch], [i for i, _, _ in batch], [o for _, o, _ in batch])
            except ValueError:  # a batch the packer refuses: an empty step instead
                packer.pack([])
    assert sum(1 for deferred, _ in seen if deferred > 0) >= 5  # repaired steps that defer
    assert all(deferred <= half for deferred, half in seen), seen
