"""One training step of a PackPlan under CP x DP, with loss normalised over the global batch.

For every micro-batch of its replica (plan.replica_of), a rank gathers its CP shard's token
ids, RoPE positions and labels, runs the model with context_parallel_attention, and
back-propagates `sum(token losses) / (target tokens of the whole global batch)`. Dividing by
the global count, never per micro-batch, keeps variable-length micro-batches from
re-weighting tokens (docs/architecture.md, "Invariants"). Gradients and the loss are then summed over all CP and DP
ranks, which gives exactly the single-process gradient of the global mean loss.

With a pipeline (mesh.pp > 1) each rank holds v model chunks (`split_stages(model, pp, v)`;
v = 1 is plain 1F1B, v > 1 Megatron's interleaved 1F1B) and runs the simulator's order
(`wlb_opt.schedule.stage_order`). Point-to-point traffic follows `p2p_schedule` exactly:
groups of sends and receives posted together (`batch_isend_irecv`) and waited on together,
an order that is deadlock-free without any buffering (NCCL's rendezvous), with every
shape known from the plan (no shape handshake). Every micro-batch slot is scheduled, an
empty one with zero-row tensors, so what runs is always `p2p_schedule(pp, n_micro, v)`.

Before any of it the ranks agree, in one exchange (`plumbing.agree_on_step`): same plan and
shards, same tokens within a replica, token ids inside the vocabulary, and on a first step
the same replicated weights. Every wait names the ranks that did not arrive if it fails
(`rollcall`). docs/reliability.md lists what is checked and what it costs.
"""
from __future__ import annotations

import time
import weakref
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..schedule import P2POp, message_key, step_plan
from .cp_attention import context_parallel_attention, prefetch_kv
from .mesh import SELF_GROUP, Mesh
from .fsdp import is_fsdp
from .tp import local_tensor
from .plumbing import (IGNORE, agree_on_step, out_of_vocabulary, pack_micro_batch, pack_tokens,  # noqa: F401
                       packed_labels, piece_digests, read_micro_batches, token_digest, vocabulary, weight_checksums)
from .rollcall import ROLLCALL_GRACE_S, PeerWaitError, RollCall, reporting_waits, step_words


def packed_positions(lengths, offsets) -> np.ndarray:
    """Position of every packed token inside its document (piece offset + index in the piece)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) - starts + np.repeat(np.asarray(offsets, np.int64), lengths)


def target_tokens(plan) -> int:
    """Target tokens of the whole global batch (all replicas and micro-batches of the plan)."""
    placed = np.concatenate(plan.micro_batches) if plan.micro_batches else np.zeros(0, np.int64)
    return int((plan.lengths[placed] - 1).sum())


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


def activation_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype of what a stage sends and receives: the autocast dtype when autocast is on for
    the parameters' device type, else the parameters' dtype."""
    kind = param.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return param.dtype


class CPAttend:
    """The attention callable a stage gets for one micro-batch: `attend(q, k, v)` is CP
    attention over the micro-batch's ShardPlan; `attend.prefetch(k, v)` (when enabled) starts
    its K/V all-gather early (see `prefetch_kv`)."""

    def __init__(self, shard, group, backend: str, regather: bool | None, prefetch: bool = True):
        self.shard, self.group, self.backend, self.regather = shard, group, backend, regather
        if not prefetch or shard is None:
            self.prefetch = None  # models look the method up with getattr(attend, "prefetch", None)

    def prefetch(self, k, v):
        return prefetch_kv(k, v, self.shard, self.group)

    def __call__(self, q, k, v, prefetched=None, softmax_scale: float | None = None, deterministic: bool = True):
        if self.shard is None:  # an empty micro-batch (every CP rank holds zero rows): no collective
            return q * 0.0
        return context_parallel_attention(q, k, v, self.shard, group=self.group, backend=self.backend,
                                          regather=self.regather, prefetched=prefetched,
                                          softmax_scale=softmax_scale, deterministic=deterministic)


def _all_reduce_flat(tensors: list[torch.Tensor], group, bucket_bytes: int = 32 << 20) -> None:
    """Sum `tensors` over `group` in place, one collective per flat bucket of at most
    `bucket_bytes` (tensors of one dtype and device share a bucket), not one per tensor."""
    bucket: list[torch.Tensor] = []
    size = 0

    def flush():
        if bucket:
            flat = torch.cat([local_tensor(t).reshape(-1) for t in bucket])
            dist.all_reduce(flat, group=group)
            offset = 0
            for t in bucket:
                lt = local_tensor(t)
                lt.copy_(flat[offset: offset + lt.numel()].view_as(lt))
                offset += lt.numel()
            bucket.clear()

    for t in tensors:
        n_bytes = local_tensor(t).numel() * t.element_size()
        if bucket and (t.dtype != bucket[0].dtype or t.device != bucket[0].device or size + n_bytes > bucket_bytes):
            flush()
            size = 0
        bucket.append(t)
        size += n_bytes
    flush()


def check_boundary_dtype(t: torch.Tensor, expected: torch.dtype, direction: str, stage: int) -> None:
    """ValueError unless a tensor a stage sends has the dtype the pipeline carries."""
    if t.dtype != expected:
        raise ValueError(f"virtual stage {stage} produced a {direction} tensor of dtype {t.dtype} but the pipeline "
                         f"carries {expected} (the autocast dtype when autocast is on, else the parameters'); "
                         "cast the stage's output, or run every stage under the same autocast")


DEFAULT_LOSS_CHUNK = 8192
"""Tokens of logits the default loss materialises at once (fp32: 8192 x a 128K vocabulary is
4 GiB; the full 128K-token micro-batch would be 64 GiB)."""


def chunked_cross_entropy(hidden: torch.Tensor, labels: torch.Tensor, head: torch.nn.Module,
                          chunk: int = DEFAULT_LOSS_CHUNK) -> torch.Tensor:
    """Summed next-token cross-entropy of `head(hidden)` against `labels` (-100: no target),
    `chunk` tokens of logits at a time, in fp32 (fp64 stays fp64). Each chunk's logits are
    recomputed in backward (activation checkpointing) instead of being kept, so at most one
    chunk of logits exists at any time, forward or backward."""
    from torch.utils.checkpoint import checkpoint

    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"loss_chunk must be an integer >= 1 (tokens), got {chunk!r}")

    def piece(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = head(h)
        logits = logits if logits.dtype == torch.float64 else logits.float()
        return F.cross_entropy(logits, y, ignore_index=IGNORE, reduction="sum")

    # start from the graph (zero rows still back-propagate, so CP peers meet in backward)
    total = 0.0 * hidden.sum().to(torch.float64 if hidden.dtype == torch.float64 else torch.float32)
    for start in range(0, hidden.shape[0], chunk):
        h, y = hidden[start: start + chunk], labels[start: start + chunk]
        # every chunk runs, even one whose targets are all masked (it adds 0): testing for that
        # would read a device value back on the host, a sync per chunk
        total = total + (checkpoint(piece, h, y, use_reentrant=False) if torch.is_grad_enabled() else piece(h, y))
    return total


def _chunks(model) -> list[torch.nn.Module]:
    from .model import TinyLM, split_stages

    if isinstance(model, TinyLM):  # the whole model as one stage: hidden states + its head
        model = split_stages(model, 1)
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks or not all(isinstance(c, torch.nn.Module) for c in chunks):
        raise ValueError("model must be a torch.nn.Module or a list of this rank's v model chunks "
                         "(split_stages(model, pp, virtual_stages)[pp_rank::pp])")
    return chunks


_WEIGHTS_CHECKED: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()
"""Stage modules whose replicated weights passed the check -> the load_state_dict hooks that
forget them again (registered on every submodule that holds parameters, so that loading
through the stage or through the whole model both count)."""


def _remember_weights_checked(modules) -> None:
    for module in modules:
        if module in _WEIGHTS_CHECKED:
            continue
        ref = weakref.ref(module)

        def forget(_module, _incompatible_keys, ref=ref) -> None:
            owner = ref()
            for handle in (_WEIGHTS_CHECKED.pop(owner, None) or []) if owner is not None else []:
                handle.remove()

        _WEIGHTS_CHECKED[module] = [m.register_load_state_dict_post_hook(forget) for m in module.modules()
                                    if next(m.parameters(recurse=False), None) is not None]


def train_step(stages, plan, shards: list, *, data, mesh: Mesh | None = None,
               loss_fn: Callable | None = None, loss_chunk: int = DEFAULT_LOSS_CHUNK, reduce_grads: bool = True,
               regather_kv: bool | None = None, step: int | None = None, backend: str = "auto",
               check_plan: bool = True, check_weights: bool | None = None, record: StageOutputs | None = None,
               prefetch: bool = True) -> float:
    """Forward and backward of one global batch; returns the global mean token loss.

    `data(id)` returns a whole document's token ids (a 1-D integer tensor), or a pair (token
    ids, loss mask); or `data` is a `WLBStream` step (`data=step`), which holds the pieces of
    its plan (`step.piece(id, offset, length)`). `step` is the step index, used in error
    messages (default `plan.step`; a plan without one is named by its digest).

    Before the step every rank reads its replica's micro-batches, and on the first pipeline
    stage checks every token id against the model's vocabulary (the rows of the first
    stage's nn.Embedding, or its `vocab_size`; neither: skipped, with one log line).
    `check_plan` (default on): the ranks then compare, in one all_gather_object, one digest
    per micro-batch over the PackPlan, the ShardPlan each runs it with (`check_same_plan`)
    and the tokens and loss mask it read (among the ranks of its replica: CP, TP and PP
    ranks read the same micro-batches); what a rank found wrong with its input travels in
    the same exchange. Every rank raises alike: RuntimeError naming the step and the first
    micro-batch whose plan differs, or the document whose tokens differ; ValueError naming
    the document and the token id outside the vocabulary; the reading rank's own error (a
    RuntimeError naming it elsewhere) when a document could not be read.

    `check_weights`: compare the parameters that ranks hold as replicas (the ranks of one
    stage over dp x cp, and over tp for what TP does not shard: one checksum per rank and
    kind of replication, in the same exchange); a mismatch raises RuntimeError on every
    rank naming the parameter. None (default): on the first call with these stage modules,
    and again after a `load_state_dict` reaches them; True: on this call; False: never.
    FSDP2 shards are compared only where replicated (HSDP); docs/reliability.md says what is
    covered.

    A wait that fails (a peer stalled past the group's timeout, see `make_mesh(timeout=...)`,
    or gone) raises RuntimeError naming the step, this rank, the operation (the plan check,
    a p2p group and its peers, a micro-batch's forward or backward with its CP collectives,
    or a final all-reduce) and the rank(s) that did not arrive: those that raised in the
    step (with their error), never started it, or reported nothing, from a check-in each
    rank leaves in the default group's store (`RollCall`; one store operation per step).

    `stages` is this rank's pipeline stage, or its v chunks for the interleaved schedule
    (`split_stages(model, pp, v)[pp_rank::pp]`; the whole model when pp = 1). `shards[j]` is
    the ShardPlan of micro-batch j (cp ranks = mesh.cp; None for an empty micro-batch).
    Micro-batches of this rank's DP replica run in the order of `wlb_opt.schedule.stage_order`
    (the simulator's); activations and their gradients go between stages in the groups of
    `p2p_schedule`, sized from the plan. A send's tensor is released as soon as its group
    completes. Gradients are summed over the ranks that hold the same stage, and left in
    `param.grad`. `regather_kv`: see `context_parallel_attention` (default: on for GPUs).
    `prefetch`: let models that support it start the K/V all-gather before the Q projection.

    The last stage returns hidden states and exposes its output projection as `stage.head`.
    The loss of a micro-batch is `loss_fn(hidden, labels, head)` (a summed loss; labels are
    -100 where a token has no target), by default `chunked_cross_entropy` with `loss_chunk`
    tokens of logits at a time; it is divided by the target tokens of the whole global batch.

    Gradients: chunks sharded with FSDP2 (`apply_fsdp`) reduce-scatter their own over dp x cp,
    once, after their last micro-batch's backward; the others are summed here over the ranks
    that hold the same stage (flat buckets). `reduce_grads=False` leaves every gradient local
    (for a user's own DDP or FSDP wrapper).
    """
    timeout_s = getattr(mesh, "timeout_s", None)
    rollcall = RollCall.begin(ROLLCALL_GRACE_S if timeout_s is None else min(ROLLCALL_GRACE_S, timeout_s))
    try:
        return _train_step(stages, plan, shards, data=data, mesh=mesh, loss_fn=loss_fn, loss_chunk=loss_chunk,
                           reduce_grads=reduce_grads, regather_kv=regather_kv, step=step, backend=backend,
                           check_plan=check_plan, check_weights=check_weights, record=record, prefetch=prefetch,
                           rollcall=rollcall)
    except BaseException as exc:
        if rollcall is not None and not isinstance(exc, PeerWaitError):
            rollcall.raised(exc)  # the ranks waiting on this one name it, with its error
        raise


def _check_step_arguments(stages, plan, shards, data, mesh, check_weights) -> None:
    from ..plan import PackPlan

    if not isinstance(plan, PackPlan):
        raise TypeError(f"plan must be a wlb_opt.PackPlan, got {type(plan).__name__}")
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a wlb_opt.executor.Mesh (make_mesh) or None, got {type(mesh).__name__}")
    if not isinstance(shards, (list, tuple)) or len(shards) != len(plan.micro_batches):
        got = f"{len(shards)} entries" if isinstance(shards, (list, tuple)) else type(shards).__name__
        raise ValueError(f"shards must be a list with one ShardPlan (None for an empty slot) per micro-batch of the "
                         f"plan ({len(plan.micro_batches)}), got {got}")
    if not (callable(data) or callable(getattr(data, "piece", None))):
        raise TypeError("data must be a callable data(id) returning a document's token ids (or (ids, loss mask)), "
                        f"or a WLBStream step, got {type(data).__name__}")
    if check_weights is not None and not isinstance(check_weights, bool):
        raise ValueError(f"check_weights must be None (check on the first call with these stages), True or False, "
                         f"got {check_weights!r}")


def _train_step(stages, plan, shards, *, data, mesh, loss_fn, loss_chunk, reduce_grads, regather_kv, step, backend,
                check_plan, check_weights, record, prefetch, rollcall) -> float:
    model = stages
    doc_tokens = data
    _check_step_arguments(stages, plan, shards, data, mesh, check_weights)
    step = plan.step if step is None else step
    where = "" if step is None else f"step {step}: "
    label = step if step is not None else f"the step of plan {plan.digest()[:12]}"
    chunks = _chunks(model)
    v = len(chunks)
    cp, pp = (mesh.cp, mesh.pp) if mesh else (1, 1)
    cp_rank, pp_rank, dp_rank = (mesh.cp_rank, mesh.pp_rank, mesh.dp_rank) if mesh else (0, 0, 0)
    n_virtual = pp * v
    if mesh and plan.dp != mesh.dp:
        raise ValueError(f"{where}plan has dp={plan.dp} replicas but the mesh has dp={mesh.dp}")
    param = next(iter(chunks[0].parameters()), None)
    if param is None:
        raise ValueError(f"the stage {type(chunks[0]).__name__} has no parameters: train_step needs one to know "
                         "the device and dtype")
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def waiting(operation):  # a wait that names the operation and who did not arrive if it fails
        return reporting_waits(label, rank, operation, rollcall)

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    mbs = plan.replica_micro_batches(dp_rank)  # every slot, empty ones too
    packed, finding, local_error = read_micro_batches(plan, mbs, lambda j: pack_micro_batch(plan, j, doc_tokens),
                                                      report=check_plan and distributed)
    if finding is None and pp_rank == 0:
        vocab = vocabulary(chunks[0])
        problem = out_of_vocabulary(plan, packed, vocab, f"{step_words(label)}: ") if vocab else None
        if problem is not None and not (check_plan and distributed):
            raise ValueError(problem)
        finding = None if problem is None else ("vocab", problem)
    owners = list(stages) if isinstance(stages, (list, tuple)) else [stages]
    weights = None
    if mesh is not None and distributed and check_weights is not False and (
            check_weights or not all(m in _WEIGHTS_CHECKED for m in owners)):
        weights = weight_checksums(chunks, pp_rank, pp)
    if check_plan or weights is not None:
        mine = [shards[j] if int(plan.replica_of[j]) == dp_rank else None  # the other replicas' are not run here
                for j in range(len(plan.micro_batches))]
        tokens = [token_digest(*packed[j]) if j in packed else None
                  for j in range(len(plan.micro_batches))] if check_plan and distributed else None

        def pieces_of(j: int) -> list[str]:
            tokens_j, labels_j = packed[j]
            return piece_digests(tokens_j, labels_j, plan.lengths[plan.micro_batches[j]])

        agree_on_step(plan, mine, step=step, where=f"{step_words(label)}: ", tokens=tokens, pieces_of=pieces_of,
                      finding=finding, local_error=local_error, weights=weights, check_plan=check_plan,
                      waits=lambda: waiting("the plan check (all_gather_object of the plan digests)"))
    if weights is not None:
        _remember_weights_checked(owners)
    device, act_dtype = param.device, activation_dtype(param)
    hidden = getattr(chunks[0], "hidden", None)
    if n_virtual > 1 and hidden is None:
        raise ValueError("pipeline stages need a `hidden` attribute (activation width); use split_stages")

    for j in mbs:
        if len(plan.micro_batches[j]) and (shards[j] is None or len(shards[j].rank_indices) != cp):
            got = None if shards[j] is None else len(shards[j].rank_indices)
            raise ValueError(f"{where}shard of micro-batch {j} has {got} CP ranks, mesh has {cp}")

    def rows(j: int) -> int:
        return len(shards[j].rank_indices[cp_rank]) if len(plan.micro_batches[j]) else 0

    inputs_of: dict[int, tuple] = {}
    targets_of: dict[int, int] = {}  # counted on the host, before the upload (no device read-back)

    def local(j: int):
        if j not in inputs_of and not len(plan.micro_batches[j]):  # an empty slot: zero rows
            empty = torch.zeros(0, dtype=torch.long, device=device)
            inputs_of[j], targets_of[j] = (empty, empty, empty, empty), 0
        if j not in inputs_of:
            lengths = plan.lengths[plan.micro_batches[j]]
            idx = torch.tensor(shards[j].rank_indices[cp_rank], dtype=torch.int64)
            tokens, labels = packed[j]
            positions = torch.from_numpy(packed_positions(lengths, plan.offsets[plan.micro_batches[j]]))
            targets_of[j] = int((labels[idx] != IGNORE).sum())
            inputs_of[j] = tuple(t.to(device) for t in (idx, tokens[idx], positions[idx], labels[idx]))
        return inputs_of[j]

    # The loss is divided by the target tokens of the whole global batch: each last-stage
    # rank (TP rank 0) counts its own micro-batches' targets (labels are -100 elsewhere, loss
    # masks included), and one all-reduce sums the counts.
    holds_loss = pp_rank == pp - 1 and (mesh is None or mesh.tp_rank == 0)
    if holds_loss:
        for j in mbs:
            local(j)
    count = sum(targets_of[j] for j in mbs) if holds_loss else 0
    total_t = torch.tensor(float(count), dtype=torch.float64, device=device)
    if mesh is not None and dist.is_initialized():
        with waiting("the all-reduce of the global batch's target-token count"):
            dist.all_reduce(total_t)
    total = float(total_t)
    if total == 0:
        raise ValueError(f"{where}the global batch has no target tokens (every piece has length 1, or every "
                         "target is masked)")

    def peer_rank(p: int) -> int:
        return mesh.global_rank(dp_rank, p, cp_rank)

    timer = _Timer(device)
    boundary = _Boundary()
    inbox: dict[tuple, torch.Tensor] = {}
    outbox: dict[tuple, torch.Tensor] = {}
    saved: dict[tuple[int, int], tuple] = {}
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    timed: list[tuple[str, int, int]] = []

    def post(group: list[P2POp]) -> None:
        if not group:
            return
        ops = []
        for op in group:
            key = message_key(op, pp_rank, pp)
            if op.kind == "send":
                t = outbox.pop(key)
                ops.append(dist.P2POp(dist.isend, t, peer_rank(op.peer)))
            else:
                t = torch.empty(rows(mbs[op.micro]), hidden, dtype=act_dtype, device=device)
                boundary.add(op.direction, t)
                inbox[key] = t
                ops.append(dist.P2POp(dist.irecv, t, peer_rank(op.peer)))
        if record is not None:  # the peak: this group's sends and its new receive buffers coexist
            record.groups.append(list(group))
            live = boundary.alive()
            for d in live:
                record.peak_live[d] = max(record.peak_live[d], live[d])
        with waiting(lambda: "the pipeline p2p group " + ", ".join(
                f"{op.kind} {op.direction} of micro-batch {mbs[op.micro]} with rank {peer_rank(op.peer)}"
                for op in group)):
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        del ops, t  # the sends' tensors are free once their group completed

    def send_later(direction: str, k: int, vs: int, t: torch.Tensor) -> None:
        check_boundary_dtype(t, act_dtype, direction, vs)
        if t.shape[0] != rows(mbs[k]):  # a short send would leave an NCCL receive waiting forever
            raise ValueError(f"virtual stage {vs} produced a {direction} tensor of {t.shape[0]} rows for micro-batch "
                             f"{mbs[k]}, but this CP rank holds {rows(mbs[k])} of its tokens")
        t = t.detach().contiguous()
        boundary.add(direction, t)
        outbox[(direction, k, vs)] = t

    plan_ops = step_plan(pp_rank, pp, len(mbs), v)
    fsdp_chunks = [c for c in range(v) if is_fsdp(chunks[c])]
    last_backward = {}  # chunk -> its last backward op (empty slots run too): FSDP2 syncs there
    for i, (_, op) in enumerate(plan_ops):
        if op is not None and op[0] == "B":
            last_backward[op[2] // pp] = i
    for c in fsdp_chunks:
        chunks[c].set_requires_gradient_sync(False)
    for i, (group, op) in enumerate(plan_ops):
        post(group)
        if op is None:  # a group of sends alone
            continue
        phase, k, vs = op
        j, chunk = mbs[k], chunks[vs // pp]
        first, last = vs == 0, vs == n_virtual - 1
        started = timer.start()
        waited = (f"the {'forward' if phase == 'F' else 'backward'} of micro-batch {j} on virtual stage {vs} "
                  "(its CP all-gather / reduce-scatter, TP or FSDP collectives)")
        with waiting(waited):
            # an empty slot runs too, on zero rows: every rank then makes the same collectives
            # (FSDP2's gathers, TP's all-reduces) and sends the zero-row tensors the schedule has
            if phase == "F":
                idx, tok, pos, lab = local(j)
                x = tok if first else inbox.pop(("fwd", k, vs - 1)).requires_grad_()

                attend = CPAttend(shards[j], mesh.cp_group if mesh else None, backend, regather_kv, prefetch)
                out = chunk(x, pos, attend)
                if last:
                    head = getattr(chunk, "head", None)
                    if head is None:
                        raise ValueError("the last pipeline stage must return hidden states and expose its output "
                                         "projection as `.head` (split_stages does)")
                    if loss_fn is None:
                        out = chunked_cross_entropy(out, lab, head, loss_chunk) / total
                    else:
                        out = loss_fn(out, lab, head) / total
                    loss_sum += out.detach().to(torch.float64)
                else:
                    send_later("fwd", k, vs, out)
                saved[(k, vs)] = (x, out)
            else:
                if vs // pp in fsdp_chunks and last_backward.get(vs // pp) == i:
                    chunk.set_requires_gradient_sync(True)  # this backward reduce-scatters the step's gradients
                x, out = saved.pop((k, vs))
                if last:
                    out.backward()
                else:
                    torch.autograd.backward(out, inbox.pop(("bwd", k, vs + 1)))
                if not first:
                    send_later("bwd", k, vs, x.grad if x.grad is not None else torch.zeros_like(x))
                del x, out
        timer.stop(started)
        timed.append((phase, j, vs))
    if inbox or outbox or saved:  # pragma: no cover - the schedule guarantees it
        raise RuntimeError(f"pipeline step left messages behind: {sorted(inbox)} {sorted(outbox)} {sorted(saved)}")
    if record is not None:
        record.ops.extend((phase, j, vs, secs) for (phase, j, vs), secs in zip(timed, timer.seconds()))
    if mesh is not None and dist.is_initialized():
        grads = []
        for c, chunk in enumerate(chunks):
            if not reduce_grads or c in fsdp_chunks:
                continue
            for p in chunk.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)  # a DTensor parameter gets a DTensor zero
                grads.append(p.grad)
        if mesh.stage_group != SELF_GROUP:
            with waiting("the gradient all-reduce over the ranks that hold this stage"):
                _all_reduce_flat(grads, mesh.stage_group)
        with waiting("the all-reduce of the loss"):
            dist.all_reduce(loss_sum)  # only last-stage ranks hold a share of the loss ...
        loss_sum /= mesh.tp  # ... and every TP rank of a stage holds the same one
    return float(loss_sum)
