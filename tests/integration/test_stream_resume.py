"""WLBStream resumes exactly from every step, drain included, and refuses what it cannot honour.

"Identical" here means the same plans, shards and token tensors compared value by value
(never a digest of the library's own making). The soak feeds random streams (lookahead 0-4,
documents longer than a step, outliers still queued at the end of data) through random JSON
resumes, and checks with a ledger of its own that every token of every document is trained
exactly once, with the source's values.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

import wlb_opt as wlb
from wlb_opt.stream import cache_bound

torch = pytest.importorskip("torch")


def cost_for(dp: int = 1):
    return wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"), wlb.ParallelSpec(cp=2, dp=dp),
                                  wlb.HardwareSpec.preset("cpu"))


COST = cost_for()


def doc_tokens(doc_id: int, length: int) -> np.ndarray:
    return (doc_id * 7919 + np.arange(length, dtype=np.int64)) % 50_021


def make(docs, *, lookahead=0, n_micro=2, max_tokens=256, per_step=384, dp=1, max_delay=3, window=None, **policy):
    packer = wlb.WLBPacker(n_micro, max_tokens, cost_for(dp), dp=dp,
                           config=wlb.PackerConfig(max_delay=max_delay, lookahead=lookahead, **policy))
    return wlb.WLBStream(docs, packer, per_step, window=window)


def lengths_with_a_tail(rng, n: int, per_step: int) -> list[int]:
    """Short documents, some outliers, and a few documents longer than a step (fed across steps)."""
    lengths = np.clip(rng.lognormal(3.0, 1.0, n).astype(int), 1, None)
    for k in rng.choice(n, size=max(1, n // 60), replace=False):
        lengths[k] = rng.integers(per_step // 2, 3 * per_step)
    return lengths.tolist()


def pairs(lengths, first_id=0):
    return [(first_id + i, doc_tokens(first_id + i, n)) for i, n in enumerate(lengths)]


def values(step) -> tuple:
    """What a step trains on, as plain values: plan arrays, shards and every rank's tensors."""
    plan = step.plan.to_dict()
    plan.pop("info")  # timings
    shards = []
    for j, shard in enumerate(step.shards):
        if shard is None:
            shards.append(None)
            continue
        d = shard.to_dict()
        d.pop("info")
        tensors = [tuple(t.tolist() for t in step.inputs(j, r).values()) for r in range(shard.cp)]
        shards.append((d, tensors))
    return json.dumps(plan, sort_keys=True), shards, step.target_tokens


def resumed_from(state, docs, **kw):
    stream = make(docs, **kw)
    stream.load_state_dict(json.loads(json.dumps(state)))
    return stream


def queued_at_the_end(rng) -> list:
    """Short documents, two documents longer than a step, and 14 outliers at the end that
    the paper rule (release n_micro x dp = 8 at a time) keeps queued: the drain then plans
    two steps from the queues, after the lookahead buffer's."""
    body = np.clip(rng.lognormal(3.0, 0.8, 120).astype(int), 1, 99).tolist()
    body[30], body[70] = 700, 900
    return pairs(body) + pairs([101] * 7 + [121] * 7, first_id=10_000)


QUEUED = dict(thresholds=[100, 120], max_delay=None, release="paper", n_micro=4, max_tokens=128, dp=2)


@pytest.mark.parametrize("lookahead", [0, 1, 2, 4])
def test_every_step_state_resumes_identically_drain_included(lookahead):
    docs = queued_at_the_end(np.random.default_rng(11 + lookahead))
    steps = list(make(docs, lookahead=lookahead, **QUEUED))
    expected = [values(s) for s in steps]
    drain_steps = [s.index for s in steps if s.state["draining"]]
    assert len(drain_steps) >= 2, "the stream should end with several drain steps"
    for k, step in enumerate(steps):
        again = list(resumed_from(step.state, docs, lookahead=lookahead, **QUEUED))
        assert [s.index for s in again] == [s.index for s in steps[k + 1:]]
        assert [values(s) for s in again] == expected[k + 1:], f"resume from step {k} differs"


def test_the_cache_stays_within_its_bound_in_the_drain():
    docs = queued_at_the_end(np.random.default_rng(5))
    for lookahead in (0, 3):
        stream = make(docs, lookahead=lookahead, **QUEUED)
        for step in stream:
            assert stream.cached_tokens <= cache_bound(stream), step.index


# ---------------------------------------------------------------------- the soak

class Ledger:
    """Which token of which document was trained, kept apart from the library's bookkeeping:
    from each step's packed token tensor and the plan's (id, offset, length) triples."""

    def __init__(self, docs):
        self.source = {doc_id: tokens for doc_id, tokens in docs}
        self.trained = {doc_id: np.zeros(len(tokens), dtype=np.int64) for doc_id, tokens in docs}

    def add(self, step) -> int:
        placed = 0
        for j, mb in enumerate(step.plan.micro_batches):
            if not len(mb):
                continue
            packed = step.tokens(j).numpy()
            at = 0
            for i in mb:
                doc_id, off, n = (int(step.plan.doc_ids[i]), int(step.plan.offsets[i]), int(step.plan.lengths[i]))
                assert np.array_equal(packed[at:at + n], self.source[doc_id][off:off + n]), (step.index, doc_id, off)
                self.trained[doc_id][off:off + n] += 1
                at += n
                placed += n
            assert at == len(packed)
        return placed

    def check(self, window: int) -> tuple[int, int, int]:
        """(tokens lost, tokens trained twice, last tokens skipped): a document one token past
        a multiple of `window` ends in a 1-token piece, which holds no target; the stream does
        not yield a step of such pieces alone, so that token may go untrained (nothing is lost:
        no label reads it). Any other untrained token is lost."""
        untrained = {doc_id: t == 0 for doc_id, t in self.trained.items()}
        skipped = sum(int(u[-1]) for u in untrained.values() if len(u) % window == 1)
        lost = sum(int(u.sum()) for u in untrained.values()) - skipped
        twice = sum(int((t > 1).sum()) for t in self.trained.values())
        return lost, twice, skipped


def soak_stream(seed: int, n_docs: int) -> dict:
    rng = np.random.default_rng(seed)
    per_step = int(rng.choice([256, 384, 512]))
    n_micro, dp = int(rng.choice([1, 2, 4])), int(rng.choice([1, 2]))
    max_tokens = max(64, -(-per_step // (n_micro * dp)) + int(rng.integers(0, 64)))
    window = int(min(max_tokens, per_step, rng.choice([64, 128, max_tokens])))
    settings = dict(lookahead=int(rng.integers(0, 5)), n_micro=n_micro, max_tokens=max_tokens, per_step=per_step,
                    dp=dp, max_delay=[None, 1, 2, 4][int(rng.integers(0, 4))], window=window)
    docs = pairs(lengths_with_a_tail(rng, n_docs, per_step), first_id=int(rng.integers(-1000, 1000)))
    if rng.random() < 0.7:  # outliers left queued at the end of data
        docs += pairs(rng.integers(window // 2, window + 1, size=int(rng.integers(1, 6))).tolist(), first_id=50_000)
    ledger, stream = Ledger(docs), make(docs, **settings)
    counts = dict(steps=0, resumes=0, drain_resumes=0, tokens=0)
    it = iter(stream)
    while True:
        step = next(it, None)
        if step is None:
            break
        counts["steps"] += 1
        counts["tokens"] += ledger.add(step)
        assert stream.cached_tokens <= cache_bound(stream)
        if rng.random() < 0.15:
            counts["resumes"] += 1
            counts["drain_resumes"] += bool(step.state["draining"])
            stream = resumed_from(step.state, docs, **settings)
            it = iter(stream)
    lost, twice, skipped = ledger.check(window)
    assert (lost, twice) == (0, 0), f"seed {seed}: {lost} tokens lost, {twice} trained twice ({settings})"
    assert counts["tokens"] + skipped == sum(len(t) for _, t in docs)
    return counts


def test_stream_soak_smoke():
    totals = dict(steps=0, resumes=0, drain_resumes=0, tokens=0)
    for seed in range(40):
        for k, v in soak_stream(seed, 200).items():
            totals[k] += v
    assert totals["drain_resumes"] > 0 and totals["resumes"] > 50


@pytest.mark.slow
def test_stream_soak_ten_thousand_steps_with_resumes():
    n_docs = int(os.environ.get("WLB_STREAM_SOAK_DOCS", 400))
    totals = dict(steps=0, resumes=0, drain_resumes=0, tokens=0)
    seed = 1000
    while totals["steps"] < 10_000:
        for k, v in soak_stream(seed, n_docs).items():
            totals[k] += v
        seed += 1
    print(f"stream soak: {seed - 1000} streams, {totals['steps']} steps, {totals['resumes']} JSON resumes "
          f"({totals['drain_resumes']} from drain steps), {totals['tokens']} tokens, 0 lost, 0 duplicated")
    assert totals["drain_resumes"] > 0


# ---------------------------------------------------------------------- capacity

def capacity_run(lookahead: int, n_steps: int) -> None:
    from wlb_opt.workloads import sample_documents

    lengths = sample_documents(6 * n_steps, "default", seed=17 + lookahead)
    docs = ((i, np.full(int(n), i % 1000, dtype=np.int64)) for i, n in enumerate(lengths))
    packer = wlb.WLBPacker(4, 1024, COST, config=wlb.PackerConfig(lookahead=lookahead))
    stream = wlb.WLBStream(list(docs), packer, packer.capacity_tokens)
    for n, step in enumerate(stream):
        assert stream.cached_tokens <= cache_bound(stream), (lookahead, step.index)
        if n == n_steps:
            break
    assert n == n_steps


@pytest.mark.parametrize("lookahead", [0, 4])
def test_tokens_per_step_equal_to_capacity_works(lookahead):
    capacity_run(lookahead, 150)


@pytest.mark.slow
@pytest.mark.parametrize("lookahead", [0, 1, 2, 3, 4])
def test_tokens_per_step_equal_to_capacity_works_for_a_thousand_steps(lookahead):
    capacity_run(lookahead, 1000)


# ---------------------------------------------------------------------- iteration

def test_a_second_iter_continues_after_the_last_step_and_the_first_then_raises():
    docs = pairs(lengths_with_a_tail(np.random.default_rng(2), 120, 384))
    whole = [values(s) for s in make(docs, lookahead=1)]
    stream = make(docs, lookahead=1)
    first = iter(stream)
    head = [values(next(first)) for _ in range(5)]
    rest = [values(s) for s in stream]
    assert head + rest == whole
    with pytest.raises(ValueError, match="superseded"):
        next(first)
    with pytest.raises(ValueError, match="has ended"):
        iter(stream)


def test_a_stream_resumed_from_its_final_state_yields_nothing():
    docs = pairs([50, 60, 300, 20])
    steps = list(make(docs))
    assert steps[-1].state["ended"]
    resumed = resumed_from(steps[-1].state, docs)
    assert list(resumed) == []
    with pytest.raises(ValueError, match="has ended"):
        list(resumed)


def test_a_step_that_places_nothing_is_not_yielded_and_ended_waits_for_it():
    # the last batches hold only outliers (queued on arrival): the lookahead buffer keeps an
    # empty batch for each, and the drain plans an empty step for it, which is not yielded
    # (a training step needs targets) and keeps `ended` False until the packer has planned it
    lengths = [17, 24, 13, 23, 3, 16, 11, 1, 19, 14, 1, 9, 51, 61, 62, 50, 51, 61, 50, 52]
    docs = pairs(lengths)
    kw = dict(lookahead=2, n_micro=2, max_tokens=64, per_step=128, max_delay=2, thresholds=[40], release="marginal")
    stream = make(docs, **kw)
    steps = list(stream)
    assert all(step.target_tokens for step in steps)
    assert [step.index for step in steps] == list(range(len(steps)))
    assert not any(step.state["ended"] for step in steps) and stream.state_dict()["ended"]
    assert stream.packer.step == len(steps) + 1  # the empty step was planned, its index skipped
    assert sum(step.target_tokens for step in steps) == sum(n - 1 for n in lengths)
    assert list(resumed_from(steps[-1].state, docs, **kw)) == []
    # a state that says ended with empty batches still buffered (as earlier versions wrote)
    # resumes to nothing: their steps place nothing
    old = json.loads(json.dumps(steps[-1].state))
    assert old["packer"]["lookahead_buffer"] == [[]]
    old["ended"] = True
    old["integrity"] = wlb.stream_state.integrity(old)
    assert list(resumed_from(old, docs, **kw)) == []


def test_drain_mid_document_feeds_the_rest_of_the_document_in_flight():
    docs = pairs([40, 1000, 30])  # 1000 tokens: fed across three steps of 384
    stream = make(docs, window=128)
    it = iter(stream)
    first = next(it)
    first_only = {(int(first.plan.doc_ids[i]), int(first.plan.offsets[i])) for mb in first.plan.micro_batches
                  for i in mb}
    trained = set(first_only)
    state = first.state
    for step in stream.drain():
        trained |= {(int(step.plan.doc_ids[i]), int(step.plan.offsets[i])) for mb in step.plan.micro_batches
                    for i in mb}
    assert {off for doc, off in trained if doc == 1} == set(range(0, 1000, 128))
    assert 2 not in {doc for doc, _ in trained}  # not read yet when drain() was called
    # the same from a resumed state that was mid-document
    resumed = resumed_from(state, docs, window=128)
    again = {(int(s.plan.doc_ids[i]), int(s.plan.offsets[i])) for s in resumed.drain() for mb in s.plan.micro_batches
             for i in mb}
    # what the resumed drain trains, with the first step alone, is the whole document, once
    assert not again & first_only
    assert {off for doc, off in again | first_only if doc == 1} == set(range(0, 1000, 128))


# ---------------------------------------------------------------------- the source fingerprint

def _mid_state(docs, k=3, **kw):
    steps = list(make(docs, **kw))
    return steps[k].state


def test_resuming_over_another_source_raises_naming_the_fingerprint():
    lengths = lengths_with_a_tail(np.random.default_rng(4), 150, 384)
    docs = pairs(lengths)
    state = _mid_state(docs)
    other = pairs([n + (i == 3) for i, n in enumerate(lengths)])  # one early document one token longer
    stream = resumed_from(state, other)  # an iterable's prefix is checked once read again
    with pytest.raises(ValueError, match="source differs"):
        next(iter(stream))


def test_a_dataset_with_lengths_is_checked_at_load():
    lengths = np.array(lengths_with_a_tail(np.random.default_rng(4), 150, 384))

    class Data:
        def __init__(self, lengths):
            self.lengths = lengths

        def __len__(self):
            return len(self.lengths)

        def __getitem__(self, i):
            return doc_tokens(i, int(self.lengths[i]))

    def stream(data):
        return wlb.WLBStream.from_dataset(data, wlb.WLBPacker(2, 256, COST, config=wlb.PackerConfig(max_delay=3)), 384)

    steps = list(stream(Data(lengths)))
    state = json.loads(json.dumps(steps[4].state))
    changed = lengths.copy()
    changed[1] += 1
    with pytest.raises(ValueError, match="source differs"):
        stream(Data(changed)).load_state_dict(state)
    fine = stream(Data(lengths))
    fine.load_state_dict(state)
    assert [values(s) for s in fine] == [values(s) for s in steps[5:]]


def test_altered_cached_tokens_raise():
    docs = pairs(lengths_with_a_tail(np.random.default_rng(6), 150, 384))
    state = json.loads(json.dumps(_mid_state(docs, lookahead=2)))
    assert state["cache"], "the state should hold pieces"
    state["cache"][0][2][0] += 1
    with pytest.raises(ValueError, match="cache holds tokens that differ"):
        make(docs, lookahead=2).load_state_dict(state)


def test_a_changed_document_in_flight_raises_before_it_is_trained_as_a_mix():
    docs = pairs([40, 1000, 30])
    steps = list(make(docs, window=128))
    state = next(s.state for s in steps if s.state["pending_from"])
    changed = [docs[0], (1, doc_tokens(1, 1000) + 1), docs[2]]
    stream = resumed_from(state, changed, window=128)
    with pytest.raises(ValueError, match="mix of two sources"):
        next(iter(stream))
    shorter = [docs[0], (1, doc_tokens(1, 900)), docs[2]]
    with pytest.raises(ValueError, match="document in flight"):
        next(iter(resumed_from(state, shorter, window=128)))


# ---------------------------------------------------------------------- tokens where they enter

@pytest.mark.parametrize("tokens, match", [
    (np.array([1, -2, 3]), r"tokens\[1\] = -2 is negative"),
    (np.array([1, 2**63 + 5], dtype=np.uint64), r"does not fit in int64"),
    ([1, 2**64], r"tokens\[1\] = 18446744073709551616 does not fit in int64"),
    ([5, True, 7], r"tokens\[1\] = True is a boolean"),
    (np.array([True, False]), "loss mask goes third"),
    (np.array([1.0, 2.0]), "integer token ids"),
])
def test_bad_token_values_name_the_document_and_value(tokens, match):
    stream = make([(0, [1, 2, 3]), (7, tokens)])
    with pytest.raises(ValueError, match=match) as info:
        list(stream)
    assert "document 7" in str(info.value)


def test_a_loss_mask_of_other_values_than_0_and_1_is_refused():
    with pytest.raises(ValueError, match=r"loss_mask\[1\] = 5"):
        list(make([(3, [1, 2, 3], [1, 5, 0])]))
    steps = list(make([(3, [1, 2, 3], [1, 1, 0])]))  # 0/1 integers are accepted as booleans
    assert steps[0].target_tokens == 1


def test_document_ids_outside_int64_are_refused_by_name():
    with pytest.raises(ValueError, match=r"document id 9223372036854775808 does not fit in int64"):
        list(make([(2**63, [1, 2])]))


def test_the_packer_state_checks_its_id_record():
    packer = wlb.WLBPacker(2, 64, COST, config=wlb.PackerConfig(max_delay=3, lookahead=1))
    packer.pack([10, 20], [5, 9])
    state = json.loads(json.dumps(packer.state_dict()))
    assert state["max_id"] == 9 and state["next_auto_id"] == 10
    for change, match in [({"next_auto_id": 9}, "next_auto_id=9 is not past max_id=9"),
                          ({"max_id": 4}, "above max_id=4"),
                          ({"max_id": None}, "max_id is null")]:
        bad = {**state, **change}
        with pytest.raises(ValueError, match=match):
            wlb.WLBPacker(2, 64, COST, config=wlb.PackerConfig(max_delay=3, lookahead=1)).load_state_dict(bad)
    bad = json.loads(json.dumps(state))
    bad["lookahead_buffer"][0][0][2] = 65  # a buffered piece longer than max_tokens: refused at load
    with pytest.raises(ValueError, match="65 tokens > max_tokens=64"):
        wlb.WLBPacker(2, 64, COST, config=wlb.PackerConfig(max_delay=3, lookahead=1)).load_state_dict(bad)
    bad["lookahead_buffer"][0].append(list(bad["lookahead_buffer"][0][0]))
    bad["lookahead_buffer"][0][0][2] = 10
    bad["lookahead_buffer"][0][1][2] = 10
    with pytest.raises(ValueError, match="twice"):
        wlb.WLBPacker(2, 64, COST, config=wlb.PackerConfig(max_delay=3, lookahead=1)).load_state_dict(bad)


@pytest.mark.parametrize("lookahead", [0, 2])
def test_the_state_of_a_resumed_stream_before_its_first_step_is_the_state_it_loaded(lookahead):
    docs = pairs([40, 1000, 30, 500, 20])
    for step in make(docs, window=128, lookahead=lookahead):
        state = json.loads(json.dumps(step.state))
        again = resumed_from(state, docs, window=128, lookahead=lookahead)
        assert json.loads(json.dumps(again.state_dict())) == state, step.index


# ---------------------------------------------------------------------- what a lengths-only state cannot show

class LengthsData:
    def __init__(self, lengths):
        self.lengths = np.asarray(lengths)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return doc_tokens(i, int(self.lengths[i]))


LENGTHS = [30, 500, 20, 90, 100, 110, 15, 70, 300, 5] * 4


def lengths_stream():
    packer = wlb.WLBPacker(2, 128, COST, config=wlb.PackerConfig(max_delay=3, lookahead=1, thresholds=[80]))
    return wlb.WLBStream.from_dataset(LengthsData(LENGTHS), packer, 200, window=128)


def lengths_state():
    for step in lengths_stream():
        state = json.loads(json.dumps(step.state))
        buffer = state["packer"]["lookahead_buffer"]
        in_flight = state["fingerprint"]["in_flight"]
        if (state["packer"]["queues"][0] and state["pending_from"] is not None and buffer and buffer[0]
                and in_flight["length"] > 128):
            return state
    raise AssertionError("no step with a queued piece, a buffered one and a document of several pieces in flight")


@pytest.mark.parametrize("change, match", [
    (lambda s: s.update(pending_from=s["pending_from"] + (128 if s["pending_from"] < 128 else -128)),
     "section 'position'"),
    (lambda s: s["packer"]["queues"][0].pop(), "section 'packer'"),
    (lambda s: s["packer"]["queues"][0][0].__setitem__(0, -27), "not a piece of the dataset's documents"),
    (lambda s: s["packer"]["queues"][0][0].__setitem__(2, s["packer"]["queues"][0][0][2] - 1),
     "not a piece of the dataset's documents"),
    (lambda s: s["packer"].__setitem__("lookahead_buffer", [[]]), "section 'packer'"),
])
def test_a_lengths_only_state_that_was_changed_is_refused_and_leaves_the_stream_fresh(change, match):
    good = lengths_state()
    bad = json.loads(json.dumps(good))
    change(bad)
    stream = lengths_stream()
    with pytest.raises(ValueError, match=match):
        stream.load_state_dict(bad)
    stream.load_state_dict(good)
    fresh = lengths_stream()
    fresh.load_state_dict(good)
    assert [values(s) for s in stream] == [values(s) for s in fresh]


def test_a_refused_load_leaves_an_auto_threshold_packer_unchanged():
    docs = pairs(lengths_with_a_tail(np.random.default_rng(8), 150, 256))
    settings = dict(thresholds="auto", n_queues=2, n_micro=2, max_tokens=128, per_step=256)
    state = json.loads(json.dumps(list(make(docs, **settings))[3].state))
    state["step"] += 1
    stream = make(docs, **settings)
    with pytest.raises(ValueError, match="state field step"):
        stream.load_state_dict(state)
    assert stream.packer.thresholds is None and stream.packer.step == 0
    assert [values(s) for s in stream] == [values(s) for s in make(docs, **settings)]


def test_after_a_source_error_the_stream_refuses_to_go_on():
    docs = pairs([50] * 40)
    docs[20] = (20, [1, -5, 3])
    stream = make(docs)
    steps = []
    with pytest.raises(ValueError, match=r"tokens\[1\] = -5"):
        for step in stream:
            steps.append(step)
    with pytest.raises(ValueError, match="stopped on an error of its source"):
        iter(stream)
    fixed = list(docs)
    fixed[20] = (20, doc_tokens(20, 3))
    resumed = resumed_from(steps[-1].state, fixed)
    ledger = Ledger(fixed)
    for step in steps + list(resumed):
        ledger.add(step)
    assert ledger.check(resumed.window)[:2] == (0, 0)


def test_an_overloaded_stream_resumes_with_a_larger_backlog_limit():
    from wlb_opt.workloads import sample_documents

    lengths = np.minimum(sample_documents(400, "default", seed=4), 6000)
    docs = pairs(lengths.tolist())
    settings = dict(n_micro=2, max_tokens=1024, per_step=2048, max_delay=3, lookahead=3, release="paper")
    stream, steps = make(docs, **settings), []
    with pytest.raises(ValueError, match="overload"):
        for step in stream:
            steps.append(step)
    resumed = make(docs, **settings)
    resumed.load_state_dict(json.loads(json.dumps(steps[-1].state)), max_backlog_tokens=10**7)
    ledger = Ledger(docs)
    for step in steps + list(resumed):
        ledger.add(step)
    assert ledger.check(resumed.window)[:2] == (0, 0)
