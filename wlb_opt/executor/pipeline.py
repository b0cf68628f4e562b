"""The pipeline runner: one rank's operations of a step, in the simulator's order, with its
point-to-point messages.

`PipelineRunner.run(forward)` runs the rank's operations in `stage_order` and moves the
boundary tensors in one of two ways:

- 1F1B (one chunk per rank): groups. It walks `step_plan(pp_rank, pp, n_micro, 1)`: before
  each compute operation it posts that operation's group of sends and receives (all of them
  together, waited on together: an order that is deadlock-free without buffering, NCCL's
  rendezvous), then runs the forward or backward of one micro-batch on one virtual stage.
- Interleaved (v > 1): channels. Every (sender, receiver) pair of pipeline ranks has its own
  process group (`channel_groups`), so its messages meet in the sender's order
  (`channel_messages`) without blocking any other pair's. A send is posted as soon as its op
  ends and waited on only at the end of the step; a receiver keeps the next receive of each
  channel posted and posts the following one once it has waited for it. Only an op whose
  input has not arrived waits: no rank waits for a neighbour to take its output, which is
  what stalls interleaved groups (`wlb-opt bench pipeline-replay`; channels replay at the
  ideal pipeline, `wlb_opt.rendezvous.simulate_channels`). The cost: each
  channel holds one receive buffer ahead, and gradients sent back stay alive until their
  receiver takes them.

Every shape is known from the plan (`rows[k]` tokens of this CP rank for slot k, `hidden`
wide), so no shape handshake; an empty slot runs on zero rows. What moves the tensors is a
transport: `DistTransport` (torch.distributed's `batch_isend_irecv` for groups, `isend` and
`irecv` on the channel groups) in `train_step`, a fake one in the unit tests, so the runner
runs in one process.

The runner owns the pipeline's bookkeeping (received and to-be-sent boundary tensors, saved
forward outputs for backward, FSDP2's gradient sync on each chunk's last backward) and its
records (`StageOutputs`); what a forward computes is the caller's `forward(k, vs, x)`.
"""
from __future__ import annotations

import time
import weakref
from contextlib import nullcontext
from typing import Callable

import torch
import torch.distributed as dist

from ..schedule import RECEIVES_AHEAD, P2POp, channel_messages, message_key, stage_order, step_plan
from .fsdp import is_fsdp


class StageOutputs:
    """Per-step record of what a rank ran.

    - `ops`: (phase, micro-batch, virtual stage, seconds) per compute operation. Seconds count
      compute only (after the op's inputs arrived, to the end of the op), so they are the
      per-operation durations `simulate_pipeline` takes; waiting for a neighbour is bubble.
      On a GPU they come from CUDA events (read at the end of the step), not host clocks.
    - `groups`: the point-to-point groups the rank issued, in order (lists of `P2POp`); on
      channels (interleaved) each send or receive is a group of its own, in the order posted.
    - `peak_live`: the most boundary tensors (received or still to be sent) alive at once,
      per direction ("fwd" activations, "bwd" gradients), counted with weak references.
    """

    def __init__(self) -> None:
        self.ops: list[tuple[str, int, int, float]] = []
        self.groups: list[list[P2POp]] = []
        self.peak_live: dict[str, int] = {"fwd": 0, "bwd": 0}

    def busy_s(self) -> float:
        return float(sum(op[-1] for op in self.ops))


class _Timer:
    """Compute-time spans: CUDA events on a GPU (resolved once at the end), else perf_counter."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list = []

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, started) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.spans.append((started, end))
        else:
            self.spans.append(time.perf_counter() - started)

    def seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in self.spans]
        return list(self.spans)


class _Boundary:
    """Weak references to the boundary tensors of a step, to count how many are alive."""

    def __init__(self) -> None:
        self.refs: dict[str, list] = {"fwd": [], "bwd": []}

    def add(self, direction: str, t: torch.Tensor) -> None:
        self.refs[direction].append(weakref.ref(t))

    def forget(self, direction: str, t: torch.Tensor) -> None:
        """Stop counting `t` (a forward send on a channel: it shares the storage of the output
        the stage keeps for its backward, so it holds no memory of its own)."""
        self.refs[direction] = [r for r in self.refs[direction] if r() is not t]

    def alive(self) -> dict[str, int]:
        for d in self.refs:
            self.refs[d] = [r for r in self.refs[d] if r() is not None]
        return {d: len(r) for d, r in self.refs.items()}


def check_boundary_dtype(t: torch.Tensor, expected: torch.dtype, direction: str, stage: int) -> None:
    """ValueError unless a tensor a stage sends has the dtype the pipeline carries."""
    if t.dtype != expected:
        raise ValueError(f"virtual stage {stage} produced a {direction} tensor of dtype {t.dtype} but the pipeline "
                         f"carries {expected} (the autocast dtype when autocast is on, else the parameters'); "
                         "cast the stage's output, or run every stage under the same autocast")


def _no_wait_report(operation):
    return nullcontext()


class _Request:
    """A posted channel message: `wait()` inside the transport's `waiting` report."""

    def __init__(self, work, waiting):
        self.work, self.waiting = work, waiting

    def wait(self) -> None:
        with self.waiting():
            self.work.wait()

    def done(self) -> bool:
        """Whether the message has moved (a send's tensor may then be freed)."""
        return self.work.is_completed()


class DistTransport:
    """Moves the pipeline's messages with torch.distributed. `exchange(group, tensors)`: one
    p2p group, `batch_isend_irecv` in order, then a wait on every request, inside
    `waiting(operation)` so that a wait that fails names the group and its peers.
    `send(op, t)` / `recv(op, t)`: one message on its channel's process group
    (`channels[(sender, receiver)]`, pipeline ranks; `channel_groups`), returning a request
    whose `wait()` names the message if it fails. `peer_rank(p)` is the global rank of
    pipeline rank p, `pp_rank` this rank's; `mbs[k]` the plan's micro-batch of slot k (for
    messages)."""

    def __init__(self, peer_rank: Callable[[int], int], mbs: list[int], waiting=_no_wait_report, *,
                 pp_rank: int = 0, channels: dict | None = None):
        self.peer_rank, self.mbs, self.waiting = peer_rank, mbs, waiting
        self.pp_rank, self.channels = pp_rank, channels or {}

    def send(self, op: P2POp, t: torch.Tensor):
        return _Request(dist.isend(t, self.peer_rank(op.peer), group=self.channels[(self.pp_rank, op.peer)]),
                        self._waiting_for(op))

    def recv(self, op: P2POp, t: torch.Tensor):
        return _Request(dist.irecv(t, self.peer_rank(op.peer), group=self.channels[(op.peer, self.pp_rank)]),
                        self._waiting_for(op))

    def _waiting_for(self, op: P2POp):
        return lambda: self.waiting(lambda: f"the pipeline {op.kind} {op.direction} of micro-batch "
                                            f"{self.mbs[op.micro]} with rank {self.peer_rank(op.peer)}")

    def exchange(self, group: list[P2POp], tensors: list[torch.Tensor]) -> None:
        ops = [dist.P2POp(dist.isend if op.kind == "send" else dist.irecv, t, self.peer_rank(op.peer))
               for op, t in zip(group, tensors)]
        with self.waiting(lambda: "the pipeline p2p group " + ", ".join(
                f"{op.kind} {op.direction} of micro-batch {self.mbs[op.micro]} with rank {self.peer_rank(op.peer)}"
                for op in group)):
            for request in dist.batch_isend_irecv(ops):
                request.wait()


class PipelineRunner:
    """One rank's share of a pipelined step over its v model chunks.

    `chunks[c]` holds virtual stage `c * pp + pp_rank`; `mbs[k]` is the plan's micro-batch of
    slot k and `rows[k]` this rank's tokens of it; boundary tensors are `rows[k] x hidden` of
    `dtype` on `device`. `transport.exchange(group, tensors)` moves one p2p group (a send's
    tensor is what to send, a receive's is the buffer to fill). `waiting(operation)` wraps each
    compute operation (a context manager naming it if a wait inside fails); `record` collects a
    `StageOutputs`.
    """

    def __init__(self, chunks: list[torch.nn.Module], *, pp_rank: int, pp: int, mbs: list[int], rows: list[int],
                 hidden: int | None, dtype: torch.dtype, device: torch.device, transport,
                 waiting=_no_wait_report, record: StageOutputs | None = None):
        self.chunks, self.pp_rank, self.pp, self.mbs, self.rows = chunks, pp_rank, pp, mbs, rows
        self.hidden, self.dtype, self.device, self.transport = hidden, dtype, device, transport
        self.waiting, self.record = waiting, record
        self.n_virtual = pp * len(chunks)
        self.inbox: dict[tuple, torch.Tensor] = {}
        self.outbox: dict[tuple, torch.Tensor] = {}
        self.saved: dict[tuple[int, int], tuple] = {}
        self.boundary = _Boundary()
        self.timer = _Timer(device)

    def post(self, group: list[P2POp]) -> None:
        """Issue one p2p group and wait for it: sends leave the outbox, receives fill the inbox."""
        if not group:
            return
        tensors = []
        for op in group:
            key = message_key(op, self.pp_rank, self.pp)
            if op.kind == "send":
                tensors.append(self.outbox.pop(key))
            else:
                t = torch.empty(self.rows[op.micro], self.hidden, dtype=self.dtype, device=self.device)
                self.boundary.add(op.direction, t)
                self.inbox[key] = t
                tensors.append(t)
        self._note(group)  # the peak: this group's sends and its new receive buffers coexist
        self.transport.exchange(group, tensors)
        del tensors  # the sends' tensors are free once their group completed

    def send_later(self, direction: str, k: int, vs: int, t: torch.Tensor) -> None:
        check_boundary_dtype(t, self.dtype, direction, vs)
        if t.shape[0] != self.rows[k]:  # a short send would leave an NCCL receive waiting forever
            raise ValueError(f"virtual stage {vs} produced a {direction} tensor of {t.shape[0]} rows for micro-batch "
                             f"{self.mbs[k]}, but this CP rank holds {self.rows[k]} of its tokens")
        t = t.detach().contiguous()
        self.boundary.add(direction, t)
        self.outbox[(direction, k, vs)] = t

    def run(self, forward: Callable[[int, int, torch.Tensor | None], torch.Tensor]) -> None:
        """Run the step. `forward(k, vs, x)` runs virtual stage vs on slot k: `x` is the received
        activation (requires grad), None on the first stage; it returns the activations to send,
        or on the last virtual stage the scalar loss to back-propagate."""
        v = len(self.chunks)
        if v > 1:
            io = _Channels(self, channel_messages(self.pp, len(self.mbs), v))
            steps = [(None, op) for op in stage_order(self.pp_rank, self.pp, len(self.mbs), v)]
        else:
            io = None
            steps = step_plan(self.pp_rank, self.pp, len(self.mbs), v)
        fsdp_chunks = [c for c in range(len(self.chunks)) if is_fsdp(self.chunks[c])]
        last_backward = {}  # chunk -> its last backward op (empty slots run too): FSDP2 syncs there
        for i, (_, op) in enumerate(steps):
            if op is not None and op[0] == "B":
                last_backward[op[2] // self.pp] = i
        for c in fsdp_chunks:
            self.chunks[c].set_requires_gradient_sync(False)
        timed: list[tuple[str, int, int]] = []
        if io is not None:
            io.start()
        for i, (group, op) in enumerate(steps):
            if io is None:
                self.post(group)
            else:
                io.take(op)
            if op is None:  # a group of sends alone
                continue
            phase, k, vs = op
            started = self.timer.start()
            waited = (f"the {'forward' if phase == 'F' else 'backward'} of micro-batch {self.mbs[k]} on virtual stage "
                      f"{vs} (its CP all-gather / reduce-scatter, TP or FSDP collectives)")
            with self.waiting(waited):
                # an empty slot runs too, on zero rows: every rank then makes the same collectives
                # (FSDP2's gathers, TP's all-reduces) and sends the zero-row tensors the schedule has
                if phase == "F":
                    self._forward(forward, k, vs)
                else:
                    chunk = vs // self.pp
                    if chunk in fsdp_chunks and last_backward.get(chunk) == i:
                        self.chunks[chunk].set_requires_gradient_sync(True)  # this backward reduce-scatters
                    self._backward(k, vs)
            self.timer.stop(started)
            timed.append((phase, self.mbs[k], vs))
            if io is not None:
                io.send(op)
        if io is not None:
            io.finish()
        if self.inbox or self.outbox or self.saved:  # pragma: no cover - the schedule guarantees it
            raise RuntimeError(f"pipeline step left messages behind: {sorted(self.inbox)} {sorted(self.outbox)} "
                               f"{sorted(self.saved)}")
        if self.record is not None:
            self.record.ops.extend((phase, j, vs, secs) for (phase, j, vs), secs in zip(timed, self.timer.seconds()))

    def _note(self, group: list[P2POp]) -> None:
        """Record a group (or a channel's message) as issued, and the live boundary tensors."""
        if self.record is not None:
            self.record.groups.append(list(group))
            live = self.boundary.alive()
            for d in live:
                self.record.peak_live[d] = max(self.record.peak_live[d], live[d])

    def _forward(self, forward, k: int, vs: int) -> None:
        x = None if vs == 0 else self.inbox.pop(("fwd", k, vs - 1)).requires_grad_()
        out = forward(k, vs, x)
        if vs != self.n_virtual - 1:
            self.send_later("fwd", k, vs, out)
        self.saved[(k, vs)] = (x, out)

    def _backward(self, k: int, vs: int) -> None:
        x, out = self.saved.pop((k, vs))
        if vs == self.n_virtual - 1:
            out.backward()
        else:
            grad = self.inbox.pop(("bwd", k, vs + 1))
            if out.requires_grad:  # a frozen first stage (nothing to train there) has no graph
                torch.autograd.backward(out, grad)
        if vs != 0:
            self.send_later("bwd", k, vs, x.grad if x.grad is not None else torch.zeros_like(x))
        del x, out


class _Channels:
    """The interleaved runner's messages on channels (module docstring): the next
    `RECEIVES_AHEAD` receives of each channel into this rank kept posted, sends posted as
    their op ends and waited on at the end of the step. `messages` is `channel_messages` of
    the step."""

    def __init__(self, runner: PipelineRunner, messages: dict):
        self.runner = runner
        me = runner.pp_rank
        self.incoming = {c: m for c, m in messages.items() if c[1] == me}
        self.taken = {c: 0 for c in self.incoming}
        self.posted: dict[tuple, tuple] = {}  # (channel, index) -> (message key, buffer, request)
        self.sends: list = []  # (request, tensor) until the end of the step

    def start(self) -> None:
        for c in self.incoming:
            for k in range(RECEIVES_AHEAD):
                self._post(c, k)

    def _post(self, c: tuple[int, int], k: int) -> None:
        """Post the receive of message k of channel c (if the step has one)."""
        if k >= len(self.incoming[c]):
            return
        r = self.runner
        direction, micro, vs = self.incoming[c][k]
        consumer = vs + 1 if direction == "fwd" else vs - 1
        op = P2POp("recv", c[0], direction, micro, consumer // r.pp)
        t = torch.empty(r.rows[micro], r.hidden, dtype=r.dtype, device=r.device)
        r.boundary.add(direction, t)
        r._note([op])
        self.posted[(c, k)] = ((direction, micro, vs), t, r.transport.recv(op, t))

    def take(self, op) -> None:
        """Wait for the message `op` needs (if any) and post the next receive of its channel."""
        r = self.runner
        phase, micro, vs = op
        if phase == "F" and vs > 0:
            key, c = ("fwd", micro, vs - 1), ((vs - 1) % r.pp, r.pp_rank)
        elif phase == "B" and vs < r.n_virtual - 1:
            key, c = ("bwd", micro, vs + 1), ((vs + 1) % r.pp, r.pp_rank)
        else:
            return
        k = self.taken[c]
        posted_key, t, request = self.posted.pop((c, k))
        if posted_key != key:  # pragma: no cover - channel_messages is in the order ops take them
            raise RuntimeError(f"pipeline rank {r.pp_rank} needs {key} but channel {c} holds {posted_key} next")
        request.wait()
        r.inbox[key] = t
        self.taken[c] = k + 1
        self._post(c, k + RECEIVES_AHEAD)

    def send(self, op) -> None:
        """Post the sends `op` made."""
        r = self.runner
        _, micro, vs = op
        for key in [key for key in r.outbox if key[1:] == (micro, vs)]:
            direction = key[0]
            peer = (vs + 1) % r.pp if direction == "fwd" else (vs - 1) % r.pp
            message = P2POp("send", peer, direction, micro, vs // r.pp)
            t = r.outbox.pop(key)
            if direction == "fwd":
                r.boundary.forget(direction, t)
            r._note([message])
            self.sends.append((r.transport.send(message, t), t))
        kept = []
        for request, t in self.sends:  # free what has moved: gradients sent back die as soon as taken
            if request.done():
                request.wait()
            else:
                kept.append((request, t))
        self.sends = kept

    def finish(self) -> None:
        """Wait for the sends still in flight (their receivers take them before their step ends)."""
        for request, _ in self.sends:
            request.wait()
        self.sends.clear()
