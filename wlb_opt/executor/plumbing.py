"""Data plumbing between plans and tensors: what the ranks must agree on before a step, and
waits that say who did not arrive.

- `check_same_plan`: one digest per micro-batch over the PackPlan and its ShardPlan,
  compared across ranks before a step; a mismatch raises on every rank.
- `agree_on_step`: what `train_step` exchanges before a step, in that same one
  all_gather_object: the plan digests, a digest of every micro-batch's tokens (compared
  among the ranks of one model replica), a rank's own finding about its input (a token
  outside the vocabulary, a document it could not read) and, on a first step, one checksum
  per class of replicated parameters (`weight_checksums`). Every rank raises alike.
- `read_micro_batches`, `vocabulary`, `out_of_vocabulary`: a rank's own micro-batches
  (token ids and labels, packed by `wlb_opt.batch`), read on the host before the step, and
  the first stage's check of their token ids.
- `reporting_waits` (from `rollcall`): a wait that fails names who did not arrive.
"""
from __future__ import annotations

import hashlib
import logging
import weakref
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist

from ..batch import IGNORE
from .rollcall import _is_comm_failure, reporting_waits  # noqa: F401 - re-exported, their home until now
from .tp import local_tensor

logger = logging.getLogger("wlb_opt")


def micro_batch_digests(plan, shards=None, tokens=None) -> list[tuple[str, str | None, str | None]]:
    """One (plan digest, shard digest, token digest) triple per micro-batch of `plan`, and a
    last triple for what is not in a micro-batch (the deferred pieces, dp and n_micro).

    The plan part hashes the micro-batch's pieces in packed order (id, offset, length) and
    its replica; the shard part is `shards[j].digest()` (None where `shards` is None, holds
    None, or the micro-batch is empty: an empty slot runs on zero rows whatever its shard);
    the token part is `tokens[j]` (`token_digest` of what this rank read; None where not read).
    """
    out: list[tuple[str, str | None, str | None]] = []
    for j, mb in enumerate(plan.micro_batches):
        h = hashlib.sha256(f"mb {j} replica {int(plan.replica_of[j])}|".encode())
        for arr in (plan.doc_ids[mb], plan.offsets[mb], plan.lengths[mb]):
            h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
            h.update(b"|")
        shard = shards[j] if shards is not None and j < len(shards) and len(mb) else None
        token = tokens[j] if tokens is not None and j < len(tokens) else None
        out.append((h.hexdigest(), None if shard is None else shard.digest(), token))
    h = hashlib.sha256(f"dp {plan.dp} n_micro {plan.n_micro} pieces {len(plan.doc_ids)}|".encode())
    for arr in (plan.doc_ids[plan.deferred], plan.offsets[plan.deferred], plan.lengths[plan.deferred]):
        h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
        h.update(b"|")
    out.append((h.hexdigest(), None, None))
    return out


def token_digest(tokens: torch.Tensor, labels: torch.Tensor) -> str:
    """SHA-256 of a micro-batch's token ids (as int64) and of which of them have a target
    (`labels` != IGNORE, packed to bits): equal on two ranks exactly when they would train on
    the same tokens with the same loss mask."""
    h = hashlib.sha256()
    h.update(_host_array(tokens.to(torch.int64)))
    h.update(np.packbits(_host_array(labels) != IGNORE))
    return h.hexdigest()


def piece_digests(tokens: torch.Tensor, labels: torch.Tensor, lengths) -> list[str]:
    """`token_digest` of every piece of a packed micro-batch (`lengths` in packed order)."""
    out, start = [], 0
    for n in np.asarray(lengths, dtype=np.int64).tolist():
        out.append(token_digest(tokens[start: start + n], labels[start: start + n]))
        start += n
    return out


def _host_array(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().cpu().numpy())


def first_difference(per_rank: list[list[tuple]]) -> str | None:
    """What the first differing entry of `per_rank` (one `micro_batch_digests` list per rank)
    is, in words, or None if every rank agrees on the plan. Shard digests are compared among
    the ranks that hold one; token digests are not compared here (`first_token_difference`)."""
    n = max(len(d) for d in per_rank)
    if any(len(d) != n for d in per_rank):
        return f"the number of micro-batches ({sorted({len(d) - 1 for d in per_rank})} across ranks)"
    for j in range(n):
        what = f"micro-batch {j}" if j < n - 1 else "the deferred pieces (or dp / n_micro)"
        if len({d[j][0] for d in per_rank}) > 1:
            ranks = _ranks_by_value([d[j][0] for d in per_rank])
            return f"{what}: its pieces differ (ranks grouped by what they hold: {ranks})"
        held = [d[j][1] for d in per_rank]
        if len({x for x in held if x is not None}) > 1:
            ranks = _ranks_by_value(held)
            return f"{what}: its CP shard plan differs (ranks grouped by what they hold: {ranks})"
    return None


def first_token_difference(per_rank: list[list[tuple]]) -> int | None:
    """The first micro-batch whose token digests differ among the ranks that read it, or None."""
    for j in range(len(per_rank[0]) - 1):
        read = {d[j][2] for d in per_rank if len(d[j]) > 2 and d[j][2] is not None}
        if len(read) > 1:
            return j
    return None


def _ranks_by_value(values: list) -> list[list[int]]:
    groups: dict = {}
    for rank, value in enumerate(values):
        if value is not None:
            groups.setdefault(value, []).append(rank)
    return sorted(groups.values())


def check_same_plan(plan, shards=None, group=None) -> str:
    """Raise RuntimeError on every rank of `group` unless all of them hold the same plan.

    Each rank hashes every micro-batch of `plan` (its pieces and replica) together with
    `shards[j]`, the ShardPlan it will run it with (`micro_batch_digests`), and the ranks
    exchange the digests (one all_gather_object). A rank that drifted (other data order,
    seed, packer state or CP strategy) would otherwise deadlock or, worse, train silently
    on other tokens: two ranks sharding one micro-batch `per_doc` and `per_seq` make the
    same collectives and a wrong gradient. The error names the step (`plan.step`) and the
    first micro-batch that differs, on every rank alike. Shards are compared among the
    ranks that pass one for a micro-batch (None: not run here).

    Returns `plan.digest()` when `shards` is None, else one SHA-256 over the plan's and
    every shard's digest (equal on every rank once the check passed).
    """
    from ..plan import PackPlan, ShardPlan

    if not isinstance(plan, PackPlan):
        raise ValueError(f"plan must be a wlb_opt.PackPlan, got {type(plan).__name__}")
    if shards is not None and (not isinstance(shards, (list, tuple))
                               or any(s is not None and not isinstance(s, ShardPlan) for s in shards)):
        raise ValueError("shards must be None or a list with one ShardPlan (or None) per micro-batch, got "
                         f"{type(shards).__name__}")
    return _check_same_plan(plan, shards, group, plan.step)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _gather(mine, group=None, waits=None) -> list:
    if not _distributed():
        return [mine]
    per_rank: list = [None] * dist.get_world_size(group)
    with (waits() if waits is not None else nullcontext()):
        dist.all_gather_object(per_rank, mine, group=group)
    return per_rank


def _raise_if_plans_differ(per_rank: list, step) -> None:
    problem = first_difference(per_rank)
    if problem is not None:
        where = "" if step is None else f"step {step}: "
        raise RuntimeError(f"{where}ranks hold different plans; first difference at {problem}. Every rank must "
                           "run the same PackPlan and ShardPlans (same data order, seed, packer state and CP "
                           "strategy); plan on one rank and broadcast_plan it if planning is not deterministic")


def _check_same_plan(plan, shards, group, step) -> str:
    mine = micro_batch_digests(plan, shards)
    _raise_if_plans_differ(_gather(mine, group), step)
    if shards is None:
        return plan.digest()
    h = hashlib.sha256(plan.digest().encode())
    for _, shard_digest, _ in mine:
        h.update((shard_digest or "-").encode())
    return h.hexdigest()


def agree_on_step(plan, shards, *, step, where: str, tokens=None, pieces_of=None, finding=None,
                  local_error: BaseException | None = None, weights=None, check_plan: bool = True,
                  waits=None, exchange: bool = True, weights_if_asked=None, chunks: int | None = None):
    """The ranks' one exchange before a step; raises on every rank alike unless they agree.

    Every rank sends, in one all_gather_object (none when torch.distributed is not
    initialised or has one rank): its `micro_batch_digests` with `tokens` (when
    `check_plan`), its `finding` about its own input ((kind, message): "read" when reading
    a document failed, its exception in `local_error`; "vocab" for a token outside the
    vocabulary; "input" for chunks split for another pipeline or a shard that does not fit),
    and a digest per key of `weights` (`weight_checksums`; None: not checked).
    Then, in this order: the plans must agree (RuntimeError naming the first micro-batch);
    no rank may have a finding (the reading rank re-raises its own exception, the others a
    RuntimeError naming it; any other finding is a ValueError on every rank); the ranks
    that read a micro-batch must have read the same tokens; the ranks of one key of
    `weights` must hold the same parameters. The last two exchange more only on a mismatch,
    `pieces_of(j)` (this rank's `piece_digests` of micro-batch j) to name the document, and
    the per-parameter checksums to name the parameter. `where` prefixes the messages;
    `waits()` is the context each exchange runs in (`reporting_waits`), the verdicts outside it.
    `exchange=False`: this process's step alone (no mesh), its own checks without a gather.
    `weights_if_asked()`, given to a rank that sends no `weights`: its checksums, sent in a
    second exchange that every rank joins when some ranks sent theirs and others did not (a
    checkpoint loaded on some ranks only: those alone ask for the check). Returns this
    rank's weight checksums as compared (None: it sent none).
    """
    summary = None if weights is None else {key: _digest_of(rows) for key, rows in weights.items()}
    mine = {"plan": micro_batch_digests(plan, shards, tokens) if check_plan else None,
            "finding": finding, "weights": summary, "askable": weights_if_asked is not None, "chunks": chunks}
    per_rank = _gather(mine, waits=waits) if exchange else [mine]
    if check_plan:
        _raise_if_plans_differ([p["plan"] for p in per_rank], step)
    counts = _ranks_by_value([p["chunks"] for p in per_rank])
    if len(counts) > 1:
        by_count = "; ".join(f"{per_rank[ranks[0]]['chunks']} on ranks {ranks}" for ranks in counts)
        raise ValueError(f"{where}ranks hold different numbers of pipeline chunks (virtual stages per rank): "
                         f"{by_count}. Every rank must pass its chunks of one split: "
                         "split_stages(model, pp=..., virtual_stages=V)[pp_rank::pp] with the same V")
    found = [(q, p["finding"]) for q, p in enumerate(per_rank) if p["finding"] is not None]
    if local_error is not None:
        raise local_error
    for q, (kind, message) in found:
        if kind == "read":
            raise RuntimeError(f"{where}rank {q} could not read its micro-batches, so every rank stops here: {message}")
    if found:
        q, (_, message) = found[0]
        raise ValueError(message if len(per_rank) == 1 else f"{message} (found on rank {q})")
    if check_plan:
        j = first_token_difference([p["plan"] for p in per_rank])
        if j is not None:
            pieces = _gather(pieces_of(j) if tokens is not None and tokens[j] is not None else None, waits=waits)
            raise RuntimeError(f"{where}{_token_difference(plan, j, pieces)}. Every rank of a model replica (its "
                               "CP, TP and PP ranks) must read the same tokens: the same dataset shard, tokenizer "
                               "and data order")
    sent = [p["weights"] is not None for p in per_rank]
    # decided from what every rank sent, so every rank joins the second exchange or none does
    if any(sent) and any(p["askable"] and p["weights"] is None for p in per_rank):
        if weights is None and weights_if_asked is not None:
            weights = weights_if_asked()
            summary = {key: _digest_of(rows) for key, rows in weights.items()}
        per_rank = [{"weights": theirs} for theirs in _gather(summary, waits=waits)]
    problem = _weight_difference([p["weights"] for p in per_rank])
    if problem is not None:
        key, groups = problem
        rows = _gather(weights.get(key) if weights is not None else None, waits=waits)
        raise RuntimeError(f"{where}ranks that must hold the same weights differ: {_parameter_difference(rows)} "
                           f"(ranks grouped by what they hold: {groups}). Replicas must start from the same weights "
                           "(the same seed, or one checkpoint loaded on every rank); train_step(check_weights=False) "
                           "skips this check")
    return weights


def _token_difference(plan, j: int, per_rank: list) -> str:
    mb = plan.micro_batches[j]
    held = [p for p in per_rank if p is not None]
    for k, i in enumerate(mb):
        digests = [p[k] if p is not None else None for p in per_rank]
        if len({d for d in digests if d is not None}) > 1:
            return (f"ranks read different tokens for micro-batch {j}: document {int(plan.doc_ids[i])} (its piece at "
                    f"offset {int(plan.offsets[i])}, {int(plan.lengths[i])} tokens) differs in its tokens or loss mask "
                    f"(ranks grouped by what they read: {_ranks_by_value(digests)})")
    return f"ranks read different tokens for micro-batch {j} ({len(held)} ranks read it)"  # pragma: no cover


# ---------------------------------------------------------------- a rank's own input
def read_micro_batches(plan, mbs, read, report: bool):
    """(packed, finding, error): `read(j)` ((token ids, labels)) of every non-empty micro-batch
    of `mbs`, on the host before the step. With `report`, an error while reading is returned
    as a finding (kind, message) for `agree_on_step`, with the exception to re-raise here."""
    packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    try:
        for j in mbs:
            if len(plan.micro_batches[j]):
                packed[j] = read(j)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or the others would wait
        if not report:
            raise
        return packed, ("read", f"{type(exc).__name__}: {exc}"), exc
    return packed, None, None


_VOCABULARY_NOTED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_EMBEDDING_NAMES = ("embed", "embed_tokens", "tok_embeddings", "wte")


def vocabulary(stage: torch.nn.Module) -> tuple[int, str] | None:
    """(size, where it comes from) of the vocabulary of a first stage: the rows of its token
    embedding (an nn.Embedding named like one, or its only nn.Embedding), else its
    `vocab_size`; None, logged once per stage, when it has neither."""
    found = [(name, getattr(stage, name, None)) for name in _EMBEDDING_NAMES]
    found = [(name, m) for name, m in found if isinstance(m, torch.nn.Embedding)]
    if not found:
        found = [(name, m) for name, m in stage.named_modules() if isinstance(m, torch.nn.Embedding)]
    if len(found) == 1 or (found and found[0][0] in _EMBEDDING_NAMES):
        name, embedding = found[0]
        rows = int(embedding.weight.shape[0])
        return rows, f"embedding `{name}` has {rows} rows"
    size = getattr(stage, "vocab_size", None)
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool) and size > 0:
        return int(size), f"vocab_size is {int(size)}"
    if stage not in _VOCABULARY_NOTED:
        _VOCABULARY_NOTED.add(stage)
        logger.warning("train_step: the first stage (%s) has %s and no vocab_size attribute, so token ids are not "
                       "checked against the vocabulary", type(stage).__name__,
                       "several nn.Embedding modules" if found else "no nn.Embedding")
    return None


def stage_layout_problem(chunks, pp_rank: int, pp: int) -> str | None:
    """What is wrong with this rank's chunks for a pipeline of `pp` ranks (None: nothing seen):
    chunk c is virtual stage c x pp + pp_rank of pp x len(chunks), so only virtual stage 0 may
    hold a token embedding and only the last an output projection, and they must (`embed`,
    `head`: checked where the chunk has the attribute). Stages split for another pipeline degree fail here, by name,
    instead of deep in a layer."""
    n = pp * len(chunks)
    if n > 1 and getattr(chunks[0], "hidden", None) is None:
        return ("pipeline stages need a `hidden` attribute (the activation width they send); use split_stages, or "
                "set `hidden` on each stage")
    for c, chunk in enumerate(chunks):
        vs = c * pp + pp_rank
        embeds = getattr(chunk, "embed", None) is not None
        heads = getattr(chunk, "head", None) is not None
        wrong = None
        if vs == 0 and hasattr(chunk, "embed") and not embeds:
            wrong = "is the first virtual stage but has no token embedding (`embed` is None)"
        elif vs != 0 and embeds:
            wrong = "holds the token embedding (`embed`), which only the first virtual stage may"
        elif vs != n - 1 and heads:
            wrong = f"holds the output projection (`head`), which only the last virtual stage ({n - 1}) may"
        elif vs == n - 1 and hasattr(chunk, "head") and not heads:
            wrong = "is the last virtual stage but has no output projection (`head` is None)"
        if wrong is not None:
            return (f"pipeline rank {pp_rank}'s chunk {c} (virtual stage {vs} of {n}: pp={pp} x {len(chunks)} "
                    f"chunks per rank) {wrong}: the stages were split for another pipeline; pass "
                    f"split_stages(model, pp={pp}, virtual_stages={len(chunks)})[pp_rank::{pp}]")
    return None


def out_of_vocabulary(plan, packed: dict, vocabulary: tuple[int, str], where: str) -> str | None:
    """The first token id of `packed` outside [0, size), in words naming its document, or None."""
    size, source = vocabulary
    for j in sorted(packed):
        tokens = packed[j][0]
        low, high = torch.aminmax(tokens)
        if int(low) >= 0 and int(high) < size:
            continue
        first = int(torch.nonzero((tokens < 0) | (tokens >= size))[0, 0])
        mb = plan.micro_batches[j]
        ends = np.cumsum(plan.lengths[mb])
        k = int(np.searchsorted(ends, first, side="right"))
        i = int(mb[k])
        position = int(plan.offsets[i]) + first - int(ends[k] - plan.lengths[i])
        return (f"{where}document {int(plan.doc_ids[i])} holds token id {int(tokens[first])} at position {position} "
                f"(micro-batch {j}), outside the model's vocabulary: the first stage's {source}, so token ids must "
                f"be in [0, {size - 1}]; check the tokenizer against the model")
    return None



# ---------------------------------------------------------------- replicated weights
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # an odd 64-bit constant (the golden ratio), as a signed int64
_CHECKSUM_CHUNK = 1 << 22  # elements of a tensor turned into int64 at once


def bits_checksum(t: torch.Tensor) -> torch.Tensor:
    """An int64 scalar (on t's device) over the bits of `t`: the sum of every element's bit
    pattern times an odd weight of its position, in wrapping 64-bit arithmetic. Integer sums
    do not depend on the order of reduction, so equal tensors give equal checksums on every
    rank and device; changing any one element changes it."""
    flat = t.detach().reshape(-1)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(flat.element_size(), torch.uint8)
    bits = flat.view(ints)
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, bits.numel(), _CHECKSUM_CHUNK):
        part = bits[start: start + _CHECKSUM_CHUNK].to(torch.int64)
        weight = torch.arange(start, start + part.numel(), dtype=torch.int64, device=t.device) * _MIX
        total += (part * (weight | 1)).sum()
    return total


def replica_key(param: torch.Tensor, pp_rank: int) -> tuple:
    """Which ranks must hold the same values as this one for `param`: those of the same
    pipeline stage with the same coordinates along every mesh dimension the parameter is
    sharded over (a DTensor's Shard placements). A plain tensor is replicated over the whole
    stage (dp x cp x tp); a TP shard over dp x cp; an FSDP2 shard over dp x cp has a key of
    its own on every rank (nothing to compare), an HSDP shard is compared across replicas."""
    placements = getattr(param, "placements", None)
    if placements is None:
        return (pp_rank,)
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    return (pp_rank,) + tuple((names[i], mesh.size(i), coordinate[i])
                              for i, placement in enumerate(placements) if _sharded(placement))


def _sharded(placement) -> bool:
    """A placement that splits the tensor: Shard, and the _StridedShard of FSDP2 over a TP
    shard (its is_shard() is False in torch 2.13, though it holds a dimension's slice)."""
    return placement.is_shard() or isinstance(getattr(placement, "dim", None), int)


def weight_checksums(chunks, pp_rank: int, pp: int) -> dict[tuple, list[tuple]]:
    """This rank's parameters by `replica_key`: (name, local shape, dtype, `bits_checksum`) of
    each, named "stage {virtual stage}: {parameter name}". One read-back per device."""
    rows, sums = [], []
    for c, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            local = local_tensor(param)
            rows.append((replica_key(param, pp_rank), f"stage {c * pp + pp_rank}: {name}", tuple(local.shape),
                         str(local.dtype)))
            sums.append(bits_checksum(local))
    by_device: dict = {}
    for k, s in enumerate(sums):
        by_device.setdefault(s.device, []).append(k)
    values = [0] * len(sums)
    for device, ks in by_device.items():
        for k, v in zip(ks, torch.stack([sums[k] for k in ks]).cpu().tolist()):
            values[k] = int(v)
    out: dict[tuple, list[tuple]] = {}
    for (key, name, shape, dtype), value in zip(rows, values):
        out.setdefault(key, []).append((name, shape, dtype, value))
    return out


def _digest_of(rows) -> str:
    return hashlib.sha256(repr(rows).encode()).hexdigest()


def _weight_difference(per_rank: list) -> tuple[tuple, list[list[int]]] | None:
    by_key: dict = {}
    for q, summary in enumerate(per_rank):
        for key, digest in (summary or {}).items():
            by_key.setdefault(key, {})[q] = digest
    for key in sorted(by_key, key=repr):
        held = by_key[key]
        if len(set(held.values())) > 1:
            return key, _ranks_by_value([held.get(q) for q in range(len(per_rank))])
    return None


def _parameter_difference(per_rank: list) -> str:
    held = [rows for rows in per_rank if rows is not None]
    if len({len(rows) for rows in held}) > 1:
        return f"they hold different numbers of parameters ({sorted({len(rows) for rows in held})})"
    for k in range(len(held[0])):
        if len({rows[k] for rows in held}) > 1:
            names = sorted({rows[k][0] for rows in held})
            if len(names) > 1:
                return f"their parameters differ in name: {names}"
            shapes = sorted({rows[k][1:3] for rows in held})
            if len(shapes) > 1:
                return f"parameter {names[0]!r} differs in local shape or dtype ({shapes})"
            return f"parameter {names[0]!r} differs"
    return "their parameters differ"  # pragma: no cover


# ---------------------------------------------------------------- plans on one rank
def broadcast_plan(plan, src: int = 0, group=None):
    """Plan on one rank, execute everywhere: rank `src` sends its PackPlan (or ShardPlan) to
    every rank of `group`, which returns an equal plan (same digest). For planners that are
    not deterministic across processes, e.g. an exact solver with a wall-clock limit."""
    if not dist.is_available() or not dist.is_initialized():
        return plan
    payload = [plan.to_dict() if dist.get_rank() == src else None]
    dist.broadcast_object_list(payload, src=src, group=group)
    if dist.get_rank() == src:
        return plan
    return type(plan).from_dict(payload[0]) if plan is not None else _from_dict(payload[0])


def _from_dict(d: dict):
    from ..plan import PackPlan, ShardPlan

    return ShardPlan.from_dict(d) if "chunks" in d else PackPlan.from_dict(d)
