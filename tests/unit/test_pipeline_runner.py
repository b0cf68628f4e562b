"""The pipeline runner in one process: each pipeline rank runs in a thread over a fake
transport that replays `p2p_schedule` (it checks every group a rank issues against the
schedule, in order, and hands each send to the receive that matches it). Losses and
gradients must equal the same stages run one micro-batch after another, without a pipeline.
"""
from __future__ import annotations

import queue
import threading

import pytest

torch = pytest.importorskip("torch")

from wlb_opt.executor.pipeline import PipelineRunner, StageOutputs  # noqa: E402
from wlb_opt.schedule import channel_messages, message_key, p2p_schedule  # noqa: E402

HIDDEN = 8


class _Request:
    def __init__(self, on_wait):
        self.on_wait = on_wait

    def wait(self) -> None:
        self.on_wait()

    def done(self) -> bool:
        return False  # kept until the end of the step


class FakeTransport:
    """One rank's end of an in-process exchange: sends are queued by (source, destination,
    message key), receives take from the matching queue. Every group is checked against
    `p2p_schedule(pp, n_micro, v)[rank]`, in order."""

    def __init__(self, hub: dict, lock: threading.Lock, rank: int, pp: int, expected: list,
                 abort: threading.Event):
        self.hub, self.lock, self.rank, self.pp, self.abort = hub, lock, rank, pp, abort
        self.expected, self.issued = expected, 0

    def _queue(self, key) -> queue.Queue:
        with self.lock:
            return self.hub.setdefault(key, queue.Queue())

    def _receive(self, key) -> torch.Tensor:
        q = self._queue(key)
        for _ in range(600):  # a peer that raised never sends: stop waiting then
            if self.abort.is_set():
                raise RuntimeError(f"rank {self.rank}: a peer failed")
            try:
                return q.get(timeout=0.1)
            except queue.Empty:
                continue
        raise TimeoutError(f"rank {self.rank}: nothing arrived for {key}")

    def send(self, op, t):
        """A channel send (interleaved): buffered here, so it is complete at once."""
        self._queue((self.rank, op.peer, message_key(op, self.rank, self.pp))).put(t.clone())
        return _Request(lambda: None)

    def recv(self, op, t):
        """A channel receive: filled when waited on."""
        key = (op.peer, self.rank, message_key(op, self.rank, self.pp))

        def fill():
            got = self._receive(key)
            assert got.shape == t.shape, (got.shape, t.shape)
            t.copy_(got)
        return _Request(fill)

    def exchange(self, group, tensors) -> None:
        assert self.issued < len(self.expected), f"rank {self.rank} issued more groups than the schedule has"
        assert group == self.expected[self.issued], f"rank {self.rank}, group {self.issued}"
        self.issued += 1
        for op, t in zip(group, tensors):  # rendezvous needs no order here: the queues buffer
            if op.kind == "send":
                self._queue((self.rank, op.peer, message_key(op, self.rank, self.pp))).put(t.clone())
        for op, t in zip(group, tensors):
            if op.kind == "recv":
                got = self._receive((op.peer, self.rank, message_key(op, self.rank, self.pp)))
                assert got.shape == t.shape, (got.shape, t.shape)
                t.copy_(got)


def make_stages(pp: int, v: int) -> list[torch.nn.Linear]:
    torch.manual_seed(0)
    return [torch.nn.Linear(HIDDEN, HIDDEN, dtype=torch.float64) for _ in range(pp * v)]


def first_inputs(rows: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(n, HIDDEN, dtype=torch.float64, generator=g) for n in rows]


class Forward:
    """forward(k, vs, x) over one rank's chunks; the last virtual stage returns a summed loss."""

    def __init__(self, chunks, pp: int, inputs: list[torch.Tensor], n_virtual: int, bad_rows: bool = False):
        self.chunks, self.pp, self.inputs, self.n_virtual, self.bad_rows = chunks, pp, inputs, n_virtual, bad_rows
        self.loss = 0.0

    def __call__(self, k, vs, x):
        out = torch.tanh(self.chunks[vs // self.pp](self.inputs[k] if x is None else x))
        if vs == self.n_virtual - 1:
            loss = (out ** 2).sum() / 7.0
            self.loss += float(loss.detach())
            return loss
        return out[1:] if self.bad_rows and len(out) else out


def run_pipeline(pp: int, v: int, rows: list[int], bad_rows: bool = False):
    stages = make_stages(pp, v)
    inputs = first_inputs(rows)
    expected = p2p_schedule(pp, len(rows), v)
    hub, lock, abort = {}, threading.Lock(), threading.Event()
    records, losses, errors = [StageOutputs() for _ in range(pp)], [0.0] * pp, [None] * pp

    def rank_main(rank: int) -> None:
        try:
            chunks = stages[rank::pp]
            transport = FakeTransport(hub, lock, rank, pp, expected[rank], abort)
            forward = Forward(chunks, pp, inputs, pp * v, bad_rows)
            PipelineRunner(chunks, pp_rank=rank, pp=pp, mbs=list(range(len(rows))), rows=rows, hidden=HIDDEN,
                           dtype=torch.float64, device=torch.device("cpu"), transport=transport,
                           record=records[rank]).run(forward)
            if v == 1:  # groups (channels are checked message by message after the run)
                assert transport.issued == len(expected[rank]), "the rank issued fewer groups than the schedule"
            losses[rank] = forward.loss
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            errors[rank] = exc
            abort.set()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(pp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return stages, inputs, sum(losses), records, errors


def sequential(pp: int, v: int, rows: list[int]):
    """The same stages, one micro-batch after another through every virtual stage: the reference."""
    stages = make_stages(pp, v)
    loss_sum = 0.0
    for x in first_inputs(rows):
        for stage in stages:
            x = torch.tanh(stage(x))
        loss = (x ** 2).sum() / 7.0
        loss.backward()
        loss_sum += float(loss.detach())
    return stages, loss_sum


@pytest.mark.parametrize("pp, v, rows", [(1, 1, [5, 3]), (2, 1, [5, 0, 3, 4]), (2, 2, [5, 3, 0, 6]),
                                         (3, 1, [2, 4, 3]), (2, 2, [4, 4, 4, 4, 2, 1]),
                                         (3, 2, [2, 0, 4, 3, 1, 5]), (4, 4, [3, 1, 2, 4])])
def test_runner_over_the_replayed_schedule_equals_the_sequential_run(pp, v, rows):
    stages, _, loss, records, errors = run_pipeline(pp, v, rows)
    assert errors == [None] * pp, errors
    want_stages, want_loss = sequential(pp, v, rows)
    assert loss == pytest.approx(want_loss, rel=1e-12, abs=1e-12)
    for got, want in zip(stages, want_stages):
        for a, b in zip(got.parameters(), want.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    if v == 1:  # groups: exactly the schedule's
        expected = p2p_schedule(pp, len(rows), v)
        for rank, record in enumerate(records):
            assert record.groups == expected[rank]
    else:  # channels: one message at a time, each channel's in the order its sender makes them
        for (src, dst), messages in channel_messages(pp, len(rows), v).items():
            sent = [message_key(g[0], src, pp) for g in records[src].groups if g[0].kind == "send" and g[0].peer == dst]
            taken = [message_key(g[0], dst, pp) for g in records[dst].groups
                     if g[0].kind == "recv" and g[0].peer == src]
            assert sent == messages and taken == messages, (src, dst)
    for rank, record in enumerate(records):
        # one forward and one backward per (slot, virtual stage this rank holds)
        assert sorted((phase, j, vs) for phase, j, vs, _ in record.ops) == sorted(
            (phase, j, c * pp + rank) for phase in "FB" for j in range(len(rows)) for c in range(v))
        assert all(secs >= 0 for *_, secs in record.ops)
        if pp > 1:
            assert max(record.peak_live.values()) >= 1


def test_a_stage_that_sends_the_wrong_number_of_rows_is_a_clear_error():
    _, _, _, _, errors = run_pipeline(2, 1, [5, 3], bad_rows=True)
    assert isinstance(errors[0], ValueError) and "produced a fwd tensor of 4 rows for micro-batch 0" in str(errors[0])


def test_a_stage_that_sends_the_wrong_dtype_is_a_clear_error():
    stages = make_stages(2, 1)
    runner = PipelineRunner(stages[:1], pp_rank=0, pp=2, mbs=[0], rows=[3], hidden=HIDDEN, dtype=torch.float32,
                            device=torch.device("cpu"), transport=None)
    with pytest.raises(ValueError, match="dtype torch.float64 but the pipeline carries torch.float32"):
        runner.send_later("fwd", 0, 0, torch.zeros(3, HIDDEN, dtype=torch.float64))
