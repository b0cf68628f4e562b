"""One training step of a PackPlan under CP x DP, with loss normalised over the global batch.

For every micro-batch of its replica (plan.replica_of), a rank gathers its CP shard's token
ids, RoPE positions and labels, runs the model with context_parallel_attention, and
back-propagates `sum(token losses) / (target tokens of the whole global batch)`. Dividing by
the global count, never per micro-batch, keeps variable-length micro-batches from
re-weighting tokens (docs/architecture.md, "Invariants"). Gradients and the loss are then summed over all CP and DP
ranks, which gives exactly the single-process gradient of the global mean loss.

With a pipeline (mesh.pp > 1) each rank holds v model chunks (`split_stages(model, pp, v)`;
v = 1 is plain 1F1B, v > 1 Megatron's interleaved 1F1B) and runs the simulator's order
(`wlb_opt.schedule.stage_order`). Point-to-point traffic of 1F1B follows `p2p_schedule`
exactly: groups of sends and receives posted together (`batch_isend_irecv`) and waited on
together, an order that is deadlock-free without any buffering (NCCL's rendezvous), with
every shape known from the plan (no shape handshake); the interleaved pipeline sends on one
channel per pair of neighbouring ranks (`mesh.channel_groups`) in `channel_messages`
order. Every micro-batch slot is scheduled, an empty one with zero-row tensors, so what runs
is always the schedule of (pp, n_micro, v).

Before any of it the ranks agree, in one exchange (`plumbing.agree_on_step`): same plan and
shards, same tokens within a replica, token ids inside the vocabulary, and on a first step
the same replicated weights. Every wait names the ranks that did not arrive if it fails
(`rollcall`). docs/reliability.md lists what is checked and what it costs.

The step in parts, each testable in one process (tests/unit/test_step_parts.py,
tests/unit/test_pipeline_runner.py): `StepInputs`, a rank's rows of its micro-batches
(`wlb_opt.batch`; positions from the ShardPlan); `global_target_count`, the loss
denominator; `PipelineRunner` (`pipeline.py`), the schedule over a transport;
`reduce_gradients`, the sums over the ranks that hold a stage. `train_step` wires them.
"""
from __future__ import annotations

import os
import warnings
import weakref
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import batch as _batch
from ..batch import RankInputs, rank_inputs
from ..plan import chunk_table_problem
from .cp_attention import context_parallel_attention, prefetch_kv
from .mesh import SELF_GROUP, Mesh, channel_groups
from .fsdp import is_fsdp
from .pipeline import (DistTransport, PipelineRunner, StageOutputs, _no_wait_report,  # noqa: F401 - re-exported
                       check_boundary_dtype)
from .tp import local_tensor
from .plumbing import (agree_on_step, out_of_vocabulary, piece_digests, read_micro_batches, stage_layout_problem,
                       token_digest, vocabulary, weight_checksums)
from .rollcall import ROLLCALL_GRACE_S, PeerWaitError, RollCall, reporting_waits, step_words


def activation_dtype(param: torch.Tensor, stage: torch.nn.Module | None = None) -> torch.dtype:
    """The dtype of what a stage sends and receives: the autocast dtype when autocast is on for
    the parameters' device type; else, for a `stage` sharded by FSDP2 with a mixed-precision
    policy (torchtitan's default: bf16 compute over fp32 shards), the policy's output dtype or
    its compute dtype; else the parameters' dtype."""
    kind = param.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    policy = None if stage is None else _mixed_precision(stage)
    if policy is not None and (policy.output_dtype or policy.param_dtype) is not None:
        return policy.output_dtype or policy.param_dtype
    return param.dtype


def _mixed_precision(stage: torch.nn.Module):
    """The mixed-precision policy of the outermost FSDP2 module of `stage` (itself, the model
    part it adapts: `fsdp_root`, or the first in its modules), or None."""
    from torch.distributed.fsdp import FSDPModule

    root = getattr(stage, "fsdp_root", None)
    for module in ([root] if root is not None else []) + list(stage.modules()):
        if isinstance(module, FSDPModule):
            # FSDP2 keeps the policy on its state (no public accessor in torch 2.13)
            return getattr(module._get_fsdp_state(), "_mp_policy", None)
    return None


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
            # k and v in the graph too: their projections get a (zero) gradient, as on every rank
            # that runs a micro-batch (FSDP2 reduce-scatters only parameters that have one)
            return q * 0.0 + 0.0 * (k.sum() + v.sum())
        return context_parallel_attention(q, k, v, self.shard, group=self.group, backend=self.backend,
                                          regather=self.regather, prefetched=prefetched,
                                          softmax_scale=softmax_scale, deterministic=deterministic)


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
        return F.cross_entropy(logits, y, ignore_index=_batch.IGNORE, reduction="sum")

    # start from the graph (zero rows still back-propagate, so CP peers meet in backward)
    # (summed in the loss's dtype: an fp16 sum of many hidden states overflows to inf, and 0 x inf is NaN)
    total = 0.0 * hidden.sum(dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32)
    if hidden.shape[0] == 0:  # no chunk runs: the head joins the graph anyway (a zero gradient)
        total = total + 0.0 * head(hidden).sum().to(total.dtype)
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


class StepInputs:
    """This CP rank's inputs of the micro-batches it runs (`RankInputs`, on `device`), built
    once per micro-batch on first use from the host-side `packed` (token ids, labels) and the
    micro-batch's ShardPlan; an empty slot has zero rows. Target tokens are counted on the
    host, before the upload (no device read-back)."""

    def __init__(self, plan, shards: list, packed: dict, cp_rank: int, device: torch.device):
        self.plan, self.shards, self.packed, self.cp_rank, self.device = plan, shards, packed, cp_rank, device
        self._of: dict[int, RankInputs] = {}

    def rows(self, j: int) -> int:
        """This rank's tokens of micro-batch j (0 for an empty slot)."""
        return int(self.shards[j].tokens[self.cp_rank]) if len(self.plan.micro_batches[j]) else 0

    def of(self, j: int) -> RankInputs:
        if j not in self._of:
            if not len(self.plan.micro_batches[j]):
                self._of[j] = RankInputs.empty(self.device)
            else:
                tokens, labels = self.packed[j]
                self._of[j] = rank_inputs(tokens, labels, self.shards[j], self.cp_rank).to(self.device)
        return self._of[j]


def check_shards(plan, shards: list, mbs, cp: int, where: str = "") -> None:
    """ValueError unless every non-empty micro-batch of `mbs` has a ShardPlan over `cp` ranks
    built for its pieces (their lengths and offsets, the source of its RoPE positions)."""
    for j in mbs:
        mb = plan.micro_batches[j]
        if not len(mb):
            continue
        if shards[j] is None or shards[j].cp != cp:
            got = None if shards[j] is None else shards[j].cp
            raise ValueError(f"{where}shard of micro-batch {j} has {got} CP ranks, mesh has {cp}")
        if not (np.array_equal(shards[j].lengths, plan.lengths[mb]) and np.array_equal(shards[j].offsets,
                                                                                        plan.offsets[mb])):
            raise ValueError(f"{where}the shard of micro-batch {j} was built for other pieces (lengths "
                             f"{shards[j].lengths.tolist()}, offsets {shards[j].offsets.tolist()}) than the plan's "
                             f"(lengths {plan.lengths[mb].tolist()}, offsets {plan.offsets[mb].tolist()}); build it "
                             "with solve_shard(plan.lengths[mb], ..., offsets=plan.offsets[mb])")
        problem = chunk_table_problem(shards[j].lengths, cp, shards[j].chunks, tiling=False)  # the cheap part
        if problem is not None:
            raise ValueError(f"{where}the shard of micro-batch {j}: {problem}")


def global_target_count(local_count: int, mesh: Mesh | None, device: torch.device, waiting=None) -> float:
    """Target tokens of the whole global batch: each last-stage rank (TP rank 0) passes its own
    micro-batches' count (labels are -100 elsewhere, loss masks included), the others 0, and
    one all-reduce sums them (none without a mesh)."""
    total = torch.tensor(float(local_count), dtype=torch.float64, device=device)
    if mesh is not None and dist.is_initialized():
        with (waiting or _no_wait_report)("the all-reduce of the global batch's target-token count"):
            dist.all_reduce(total)
    return float(total)


def _all_reduce_flat(tensors: list[torch.Tensor], group, bucket_bytes: int = 32 << 20) -> None:
    """Sum `tensors` over `group` in place, one collective per flat bucket of at most
    `bucket_bytes` (tensors of one dtype and device share a bucket), not one per tensor."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        n_bytes = local_tensor(t).numel() * t.element_size()
        if bucket and (t.dtype != bucket[0].dtype or t.device != bucket[0].device or size + n_bytes > bucket_bytes):
            _reduce_bucket(bucket, group)
            bucket, size = [], 0
        bucket.append(t)
        size += n_bytes
    _reduce_bucket(bucket, group)


def _reduce_bucket(bucket: list[torch.Tensor], group) -> None:
    if not bucket:
        return
    flat = torch.cat([local_tensor(t).reshape(-1) for t in bucket])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in bucket:
        lt = local_tensor(t)
        lt.copy_(flat[offset: offset + lt.numel()].view_as(lt))
        offset += lt.numel()


def _set_aside_gradients(chunks, skip) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, gradient) of every parameter of `chunks` (but the indices in `skip`) that
    holds a gradient, each parameter's `.grad` then cleared."""
    out = []
    for c, chunk in enumerate(chunks):
        if c in skip:
            continue
        for p in chunk.parameters():
            if p.grad is not None:
                out.append((p, p.grad))
                p.grad = None
    return out


def reduce_gradients(chunks: list[torch.nn.Module], mesh: Mesh, *, skip=(), waiting=None) -> None:
    """Sum the gradients of `chunks` (but the indices in `skip`: FSDP2 chunks reduce their own)
    over the ranks that hold the same stage (`mesh.stage_group`), in flat buckets. A trainable
    parameter without a gradient takes zeros, so every rank of the group makes the same
    collectives; a frozen one (requires_grad False, alike on every rank) is left alone."""
    grads = []
    for c, chunk in enumerate(chunks):
        if c in skip:
            continue
        for p in chunk.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # a DTensor parameter gets a DTensor zero
            grads.append(p.grad)
    if mesh.stage_group != SELF_GROUP:
        with (waiting or _no_wait_report)("the gradient all-reduce over the ranks that hold this stage"):
            _all_reduce_flat(grads, mesh.stage_group)


class _StageForward:
    """`forward(k, vs, x)` of the pipeline runner: virtual stage vs on slot k with CP attention
    over the micro-batch's ShardPlan; on the last virtual stage the micro-batch's summed loss
    divided by the global batch's target tokens (`total`), accumulated in `loss_sum`."""

    def __init__(self, chunks, inputs: StepInputs, mbs, *, pp: int, cp_group, backend, regather_kv, prefetch,
                 loss_fn, loss_chunk, total: float):
        self.chunks, self.inputs, self.mbs, self.pp, self.cp_group = chunks, inputs, mbs, pp, cp_group
        self.backend, self.regather_kv, self.prefetch = backend, regather_kv, prefetch
        self.loss_fn, self.loss_chunk, self.total = loss_fn, loss_chunk, total
        self.n_virtual = pp * len(chunks)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=inputs.device)

    def __call__(self, k: int, vs: int, x: torch.Tensor | None) -> torch.Tensor:
        j, chunk = self.mbs[k], self.chunks[vs // self.pp]
        inputs = self.inputs.of(j)
        attend = CPAttend(self.inputs.shards[j], self.cp_group, self.backend, self.regather_kv, self.prefetch)
        out = chunk(inputs.tokens if x is None else x, inputs.positions, attend)
        if vs != self.n_virtual - 1:
            return out
        head = getattr(chunk, "head", None)
        if head is None:
            raise ValueError("the last pipeline stage must return hidden states and expose its output "
                             "projection as `.head` (split_stages does)")
        if self.loss_fn is None:
            out = chunked_cross_entropy(out, inputs.labels, head, self.loss_chunk) / self.total
        else:
            loss = self.loss_fn(out, inputs.labels, head)
            if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
                got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise ValueError(f"loss_fn must return the micro-batch's summed loss as a scalar tensor (train_step "
                                 f"divides by the global batch's target tokens), got {got}")
            out = loss / self.total
        self.loss_sum += out.detach().to(torch.float64)
        return out


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
    the document and the token id outside the vocabulary, or a chunk that holds the
    embedding or the head where its virtual stage may not (stages split for another `pp`), or
    a ShardPlan that does not fit its micro-batch or the mesh's cp; the reading rank's own error (a
    RuntimeError naming it elsewhere) when a document could not be read.

    `check_weights`: compare the parameters that ranks hold as replicas (the ranks of one
    stage over dp x cp, and over tp for what TP does not shard: one checksum per rank and
    kind of replication, in the same exchange); a mismatch raises RuntimeError on every
    rank naming the parameter. None (default): on the first call with these stage modules,
    and again after a `load_state_dict` reaches them (on any rank: with `check_plan` the ranks
    that did not load compare theirs too); True: on this call; False: never.
    FSDP2 shards are compared only where replicated (HSDP); docs/reliability.md says what is
    covered. With `check_plan=False` the exchange runs only for this check, which each rank
    decides from its own modules under None: load a state on every rank alike, or pass True
    or False on every rank, or the ranks wait in different collectives.

    A wait that fails (a peer stalled past the group's timeout, or gone) raises RuntimeError naming the step, this rank, the operation (the plan check,
    a p2p group and its peers, a micro-batch's forward or backward with its CP collectives,
    or a final all-reduce) and the rank(s) that did not arrive: those that raised in the
    step (with their error), never started it, or reported nothing, from a check-in each
    rank leaves in the default group's store (`RollCall`; one store operation per step). The
    mesh's groups wait `make_mesh(timeout=...)`; what runs on the default group (the 1F1B
    pipeline's p2p groups, the global batch's target count and the loss all-reduce) waits the
    timeout given to init_process_group.

    `stages` is this rank's pipeline stage, or its v chunks for the interleaved schedule
    (`split_stages(model, pp, v)[pp_rank::pp]`; the whole model when pp = 1). `shards[j]` is
    the ShardPlan of micro-batch j (cp ranks = mesh.cp; None for an empty micro-batch).
    Micro-batches of this rank's DP replica run in the order of `wlb_opt.schedule.stage_order`
    (the simulator's); activations and their gradients go between stages in the groups of
    `p2p_schedule` (interleaved: on the channels of `channel_messages`), sized from the plan.
    A send's tensor is released as soon as its group completes. Gradients are summed over the
    ranks that hold the same stage, and left in `param.grad`. `regather_kv`: see `context_parallel_attention` (default: on for GPUs).
    `prefetch`: let models that support it start the K/V all-gather before the Q projection.

    The last stage returns hidden states and exposes its output projection as `stage.head`.
    The loss of a micro-batch is `loss_fn(hidden, labels, head)` (a summed loss; labels are
    -100 where a token has no target), by default `chunked_cross_entropy` with `loss_chunk`
    tokens of logits at a time; it is divided by the target tokens of the whole global batch.

    Gradients: chunks sharded with FSDP2 (`apply_fsdp`) reduce-scatter their own over dp x cp,
    once, after their last micro-batch's backward (whatever `reduce_grads` says: FSDP2 is the
    reduction); the others are summed here over the ranks that hold the same stage (flat
    buckets). `reduce_grads=False` leaves those others local (for a user's own DDP wrapper).
    """
    timeout_s = getattr(mesh, "timeout_s", None)
    # without a mesh the step is this process's alone: no roll call (each rank counts the steps it takes together)
    rollcall = None if mesh is None else RollCall.begin(ROLLCALL_GRACE_S if timeout_s is None
                                                        else min(ROLLCALL_GRACE_S, timeout_s))
    try:
        return _train_step(stages, plan, shards, data=data, mesh=mesh, loss_fn=loss_fn, loss_chunk=loss_chunk,
                           reduce_grads=reduce_grads, regather_kv=regather_kv, step=step, backend=backend,
                           check_plan=check_plan, check_weights=check_weights, record=record, prefetch=prefetch,
                           rollcall=rollcall)
    except BaseException as exc:
        if rollcall is not None and not isinstance(exc, PeerWaitError):
            rollcall.raised(exc)  # the ranks waiting on this one name it, with its error
        raise


def _check_step_arguments(stages, plan, shards, data, mesh, check_weights, loss_chunk, *, loss_fn=None, record=None,
                          backend="auto", flags=()) -> None:
    """The arguments every rank checks alike before anything is exchanged: a bad one raises on
    every rank at once, not on the one rank that first reads it while the others wait."""
    from ..plan import PackPlan, ShardPlan, check_replicas

    if not isinstance(plan, PackPlan):
        raise TypeError(f"plan must be a wlb_opt.PackPlan, got {type(plan).__name__}")
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a wlb_opt.executor.Mesh (make_mesh) or None, got {type(mesh).__name__}")
    if not isinstance(shards, (list, tuple)) or len(shards) != len(plan.micro_batches):
        got = f"{len(shards)} entries" if isinstance(shards, (list, tuple)) else type(shards).__name__
        raise ValueError(f"shards must be a list with one ShardPlan (None for an empty slot) per micro-batch of the "
                         f"plan ({len(plan.micro_batches)}), got {got}")
    bad = next(((j, s) for j, s in enumerate(shards) if s is not None and not isinstance(s, ShardPlan)), None)
    if bad is not None:
        raise TypeError(f"shards[{bad[0]}] must be a wlb_opt.ShardPlan (or None for an empty slot), got "
                        f"{type(bad[1]).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be None (chunked cross-entropy) or a callable loss_fn(hidden, labels, head), "
                        f"got {loss_fn!r}")
    if record is not None and not isinstance(record, StageOutputs):
        raise TypeError(f"record must be None or a StageOutputs, got {type(record).__name__}")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be one of ['auto', 'triton', 'torch'], got {backend!r}")
    for name, value in flags:
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if not (callable(data) or callable(getattr(data, "piece", None))):
        raise TypeError("data must be a callable data(id) returning a document's token ids (or (ids, loss mask)), "
                        f"or a WLBStream step, got {type(data).__name__}")
    if isinstance(loss_chunk, bool) or not isinstance(loss_chunk, int) or loss_chunk < 1:  # on every rank
        raise ValueError(f"loss_chunk must be an integer >= 1 (tokens), got {loss_chunk!r}")
    if check_weights is not None and not isinstance(check_weights, bool):
        raise ValueError(f"check_weights must be None (check on the first call with these stages), True or False, "
                         f"got {check_weights!r}")
    if mesh is None and plan.dp != 1:
        raise ValueError(f"plan has dp={plan.dp} replicas; without a mesh train_step runs one replica: pass "
                         "make_mesh(dp=...), or plan with dp=1")
    check_replicas(plan)  # PlanError, a ValueError



def _shard_problem(plan, shards, mbs, cp: int, where: str) -> str | None:
    try:
        check_shards(plan, shards, mbs, cp, where)
    except ValueError as exc:
        return str(exc)
    return None


def _agree_before_step(stages, chunks, plan, shards, packed, finding, local_error, *, mbs, mesh, dp_rank, pp_rank,
                       pp, cp, where, step, label, check_plan, check_weights, distributed, waiting) -> None:
    """This rank's checks of its own input (the stages' layout, the shards it runs, the first
    stage's vocabulary), then the one exchange of `agree_on_step` (plan and shard digests,
    token digests within a replica, findings, replicated weights): what one rank finds wrong
    every rank raises alike."""
    if finding is None:
        problem = stage_layout_problem(chunks, pp_rank, pp) or _shard_problem(plan, shards, mbs, cp, where)
        if problem is not None and not (check_plan and distributed):
            raise ValueError(problem)
        finding = None if problem is None else ("input", problem)
    if finding is None and pp_rank == 0:
        vocab = vocabulary(chunks[0])
        problem = out_of_vocabulary(plan, packed, vocab, f"{step_words(label)}: ") if vocab else None
        if problem is not None and not (check_plan and distributed):
            raise ValueError(problem)
        finding = None if problem is None else ("vocab", problem)
    owners = list(stages) if isinstance(stages, (list, tuple)) else [stages]
    weights = None
    checks_weights = mesh is not None and distributed and check_weights is not False
    if checks_weights and (check_weights or not all(m in _WEIGHTS_CHECKED for m in owners)):
        weights = weight_checksums(chunks, pp_rank, pp)
    if check_plan or weights is not None:
        mine = [shards[j] if int(plan.replica_of[j]) == dp_rank else None  # the other replicas' are not run here
                for j in range(len(plan.micro_batches))]
        tokens = [token_digest(*packed[j]) if j in packed else None
                  for j in range(len(plan.micro_batches))] if check_plan and distributed else None

        def pieces_of(j: int) -> list[str]:
            tokens_j, labels_j = packed[j]
            return piece_digests(tokens_j, labels_j, plan.lengths[plan.micro_batches[j]])

        # another rank loaded a checkpoint: this one's weights are compared too
        weights = agree_on_step(
            plan, mine, step=step, where=f"{step_words(label)}: ", tokens=tokens, pieces_of=pieces_of,
            finding=finding, local_error=local_error, weights=weights, check_plan=check_plan,
            waits=lambda: waiting("the plan check (all_gather_object of the plan digests)"), exchange=distributed,
            weights_if_asked=(lambda: weight_checksums(chunks, pp_rank, pp)) if checks_weights else None,
            chunks=len(chunks))
    if weights is not None:
        _remember_weights_checked(owners)


def _train_step(stages, plan, shards, *, data, mesh, loss_fn, loss_chunk, reduce_grads, regather_kv, step, backend,
                check_plan, check_weights, record, prefetch, rollcall) -> float:
    _check_step_arguments(stages, plan, shards, data, mesh, check_weights, loss_chunk, loss_fn=loss_fn, record=record,
                          backend=backend, flags=(("reduce_grads", reduce_grads), ("check_plan", check_plan),
                                                  ("prefetch", prefetch)))
    step = plan.step if step is None else step
    where = "" if step is None else f"step {step}: "
    label = step if step is not None else f"the step of plan {plan.digest()[:12]}"
    chunks = _chunks(stages)
    cp, pp = (mesh.cp, mesh.pp) if mesh else (1, 1)
    cp_rank, pp_rank, dp_rank = (mesh.cp_rank, mesh.pp_rank, mesh.dp_rank) if mesh else (0, 0, 0)
    if mesh and plan.dp != mesh.dp:
        raise ValueError(f"{where}plan has dp={plan.dp} replicas but the mesh has dp={mesh.dp}")
    param = next(iter(chunks[0].parameters()), None)
    if param is None:
        raise ValueError(f"the stage {type(chunks[0]).__name__} has no parameters: train_step needs one to know "
                         "the device and dtype")
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def waiting(operation):  # a wait that names the operation and who did not arrive if it fails
        return reporting_waits(label, rank, operation, rollcall)

    # without a mesh the step is this process's alone: no exchange with the other ranks
    distributed = mesh is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    mbs = plan.replica_micro_batches(dp_rank)  # every slot, empty ones too
    packed, finding, local_error = read_micro_batches(plan, mbs, lambda j: _batch.pack_micro_batch(plan, j, data),
                                                      report=check_plan and distributed)
    _agree_before_step(stages, chunks, plan, shards, packed, finding, local_error, mbs=mbs, mesh=mesh,
                       dp_rank=dp_rank, pp_rank=pp_rank, pp=pp, cp=cp, where=where, step=step, label=label,
                       check_plan=check_plan, check_weights=check_weights, distributed=distributed, waiting=waiting)
    device, act_dtype = param.device, activation_dtype(param, chunks[0])
    hidden = getattr(chunks[0], "hidden", None)  # checked with the layout, on every rank (stage_layout_problem)

    inputs = StepInputs(plan, shards, packed, cp_rank, device)
    holds_loss = pp_rank == pp - 1 and (mesh is None or mesh.tp_rank == 0)
    total = global_target_count(sum(inputs.of(j).targets for j in mbs) if holds_loss else 0, mesh, device, waiting)
    if total == 0:
        raise ValueError(f"{where}the global batch has no target tokens (every piece has length 1, or every "
                         "target is masked)")
    # without a mesh the step is this process's alone, whatever torch.distributed holds
    forward = _StageForward(chunks, inputs, mbs, pp=pp, cp_group=mesh.cp_group if mesh else SELF_GROUP, backend=backend,
                            regather_kv=regather_kv, prefetch=prefetch, loss_fn=loss_fn, loss_chunk=loss_chunk,
                            total=total)
    channels = None
    if pp > 1 and len(chunks) > 1:  # the interleaved schedule's
        with waiting("the creation of the interleaved pipeline's channel groups (new_group on every rank)"):
            channels = channel_groups(mesh, device)
    if channels and device.type == "cuda" and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        warnings.warn("CUDA_DEVICE_MAX_CONNECTIONS=1: the interleaved pipeline's channels post receives ahead on "
                      "their own NCCL streams, which one hardware queue may serialize in launch order (a receive "
                      "waiting on one channel could hold back another's send); unset it or set it above 1",
                      RuntimeWarning, stacklevel=3)
    transport = DistTransport(lambda p: mesh.global_rank(dp_rank, p, cp_rank), mbs, waiting, pp_rank=pp_rank,
                              channels=channels)
    reducing = mesh is not None and dist.is_initialized() and reduce_grads
    fsdp_chunks = {c for c in range(len(chunks)) if is_fsdp(chunks[c])}
    # gradients left from an earlier step (accumulation without zero_grad) are set aside, so that
    # only this step's are summed over the replicas, and added back after (FSDP2 keeps its own)
    earlier = _set_aside_gradients(chunks, fsdp_chunks) if reducing else []
    try:
        PipelineRunner(chunks, pp_rank=pp_rank, pp=pp, mbs=mbs, rows=[inputs.rows(j) for j in mbs], hidden=hidden,
                       dtype=act_dtype, device=device, transport=transport, waiting=waiting,
                       record=record).run(forward)
    except BaseException:
        for p, grad in earlier:  # a failed step leaves the earlier gradients as they were
            p.grad = grad
        raise
    loss_sum = forward.loss_sum
    if mesh is not None and dist.is_initialized():
        if reduce_grads:  # else every gradient stays local (the user's own DDP or FSDP wrapper)
            reduce_gradients(chunks, mesh, skip=fsdp_chunks, waiting=waiting)
            for p, grad in earlier:
                p.grad = grad if p.grad is None else p.grad.add_(grad)
        with waiting("the all-reduce of the loss"):
            dist.all_reduce(loss_sum)  # only last-stage ranks hold a share of the loss ...
        loss_sum /= mesh.tp  # ... and every TP rank of a stage holds the same one
    return float(loss_sum)


_MOVED = {name: "wlb_opt.batch" for name in ("IGNORE", "pack_micro_batch", "pack_tokens", "packed_labels",
                                              "packed_positions", "target_tokens")}


def __getattr__(name: str):
    """Names that moved to `wlb_opt.batch`: still importable from here for one release."""
    if name in _MOVED:
        import importlib
        import warnings

        warnings.warn(f"wlb_opt.executor.train.{name} moved to {_MOVED[name]}.{name}; import it from there",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
