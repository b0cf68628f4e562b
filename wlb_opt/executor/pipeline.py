"""The pipeline runner: one rank's operations of a step, in the simulator's order, with the
point-to-point groups of `p2p_schedule`.

`PipelineRunner.run(forward)` walks `step_plan(pp_rank, pp, n_micro, v)`: before each
compute operation it posts that operation's group of sends and receives (all of them
together, waited on together: an order that is deadlock-free without buffering, NCCL's
rendezvous), then runs the forward or backward of one micro-batch on one virtual stage.
Every shape is known from the plan (`rows[k]` tokens of this CP rank for slot k, `hidden`
wide), so no shape handshake; an empty slot runs on zero rows. What moves the tensors is a
transport: `DistTransport` (torch.distributed's `batch_isend_irecv`) in `train_step`, a
fake one in the unit tests, so the runner runs in one process.

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

from ..schedule import P2POp, message_key, step_plan
from .fsdp import is_fsdp


class StageOutputs:
    """Per-step record of what a rank ran.

    - `ops`: (phase, micro-batch, virtual stage, seconds) per compute operation. Seconds count
      compute only (after the op's inputs arrived, to the end of the op), so they are the
      per-operation durations `simulate_pipeline` takes; waiting for a neighbour is bubble.
      On a GPU they come from CUDA events (read at the end of the step), not host clocks.
    - `groups`: the point-to-point groups the rank issued, in order (lists of `P2POp`).
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


class DistTransport:
    """Moves one p2p group with torch.distributed: `batch_isend_irecv` of the group in order,
    then a wait on every request, inside `waiting(operation)` so that a wait that fails names
    the group and its peers. `peer_rank(p)` is the global rank of pipeline rank p; `mbs[k]`
    the plan's micro-batch of slot k (for messages)."""

    def __init__(self, peer_rank: Callable[[int], int], mbs: list[int], waiting=_no_wait_report):
        self.peer_rank, self.mbs, self.waiting = peer_rank, mbs, waiting

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
        if self.record is not None:  # the peak: this group's sends and its new receive buffers coexist
            self.record.groups.append(list(group))
            live = self.boundary.alive()
            for d in live:
                self.record.peak_live[d] = max(self.record.peak_live[d], live[d])
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
        plan_ops = step_plan(self.pp_rank, self.pp, len(self.mbs), len(self.chunks))
        fsdp_chunks = [c for c in range(len(self.chunks)) if is_fsdp(self.chunks[c])]
        last_backward = {}  # chunk -> its last backward op (empty slots run too): FSDP2 syncs there
        for i, (_, op) in enumerate(plan_ops):
            if op is not None and op[0] == "B":
                last_backward[op[2] // self.pp] = i
        for c in fsdp_chunks:
            self.chunks[c].set_requires_gradient_sync(False)
        timed: list[tuple[str, int, int]] = []
        for i, (group, op) in enumerate(plan_ops):
            self.post(group)
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
        if self.inbox or self.outbox or self.saved:  # pragma: no cover - the schedule guarantees it
            raise RuntimeError(f"pipeline step left messages behind: {sorted(self.inbox)} {sorted(self.outbox)} "
                               f"{sorted(self.saved)}")
        if self.record is not None:
            self.record.ops.extend((phase, j, vs, secs) for (phase, j, vs), secs in zip(timed, self.timer.seconds()))

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
            torch.autograd.backward(out, self.inbox.pop(("bwd", k, vs + 1)))
        if vs != 0:
            self.send_later("bwd", k, vs, x.grad if x.grad is not None else torch.zeros_like(x))
        del x, out
