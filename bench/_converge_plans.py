"""The orderings of the convergence benchmark: one document stream, four ways to turn it into steps.

Every ordering gets the same global batches (`stream_batches`: the training documents of the
corpus in a seeded order, cut into batches of `tokens_per_batch` tokens, documents longer than
the window cut into window-sized pieces, `wlb_opt.workloads.global_batches`) and returns the plans
of its training steps, each a PackPlan holding that step's micro-batches:

- "single":   `solve_pack(method="fixed")` on each global batch alone: fixed-length micro-batches
              of at most `window` tokens, documents whole, balanced on modelled cost (the
              baseline of the paper's Fig. 16); pieces that do not fit are carried to the next.
- "fixed-8":  the same packing on a pool of 8 global batches at once (8 x n_micro micro-batches),
              emitted n_micro per step in bin order: documents move up to 7 steps earlier or later.
- "wlb":      `WLBPacker(n_micro, 1.25 x window, cost)` with its defaults: variable-length
              micro-batches, outlier documents held in queues (at most max_delay steps), then drained.
- "original": `solve_pack(method="original")` per global batch (Plain-4D): concatenate in data
              order and cut at every `window` boundary, so cut documents lose the context before
              the cut and one target per cut.

The stream is packed until nothing is carried or queued, so every token of every global batch
is trained exactly once (`check_every_token_once`); an ordering may take a few steps more than
there are global batches. Delay and displacement count, per token, the step a piece is trained
at minus the batch it arrived in (computed here from the batches, not from a packer's stats).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..cost import CostModel
from ..packer import WLBPacker
from ..plan import PackPlan, imbalance
from ..step_pack import solve_pack
from ..workloads import GlobalBatch, global_batches
from .data import run_packer

ORDERINGS = ("single", "fixed-8", "wlb", "original")
FIXED_POOL = 8
"""Global batches pooled by "fixed-8" (the paper's worst case in Fig. 16)."""
WLB_MAX_TOKENS_FACTOR = 1.25
"""S_max / window of the variable-length packer (the library's default everywhere)."""
_MAX_DRAIN_POOLS = 64  # a carry that has not drained after this many empty pools is a bug


def document_stream(train_files: np.ndarray, lengths: np.ndarray, n_tokens: int, seed: int):
    """(file, epoch, length) of each stream position, in passes over `train_files`: pass e is a
    permutation of the training files drawn from (seed, e). Stops once `n_tokens` are covered."""
    files, epochs, total, epoch = [], [], 0, 0
    per_epoch = int(lengths[train_files].sum())
    if per_epoch == 0:
        raise ValueError("the corpus has no training tokens")
    while total < n_tokens:
        order = np.random.default_rng([seed, epoch]).permutation(train_files)
        files.append(order)
        epochs.append(np.full(len(order), epoch, dtype=np.int64))
        total += per_epoch
        epoch += 1
    files, epochs = np.concatenate(files), np.concatenate(epochs)
    return files, epochs, lengths[files].astype(np.int64)


def stream_batches(stream_lengths: np.ndarray, window: int, tokens_per_batch: int, n_batches: int) -> list:
    """`n_batches` global batches (pieces, ids, offsets); ids are stream positions."""
    if int(stream_lengths.sum()) < tokens_per_batch * n_batches:
        raise ValueError(f"the stream holds {int(stream_lengths.sum())} tokens, fewer than {n_batches} "
                         f"global batches of {tokens_per_batch}")
    return global_batches("default", window, tokens_per_batch, n_batches, lengths=stream_lengths)


def _pooled_steps(batches: Sequence[GlobalBatch], n_micro: int, window: int, cost: CostModel, method: str,
                  pool: int) -> list[PackPlan]:
    """Pack `pool` global batches at a time into pool x n_micro micro-batches (carried pieces
    first, as `wlb_opt.bench.data.carried_plans`), then empty pools until the carry is gone;
    each pool's plan is cut into steps of n_micro micro-batches in bin order."""
    empty = (np.zeros(0, np.int64),) * 3
    carry, steps, p = empty, [], 0
    n_pools = -(-len(batches) // pool)
    while p < n_pools or len(carry[0]):
        if p >= n_pools + _MAX_DRAIN_POOLS:
            raise RuntimeError(f"{method}: {len(carry[0])} pieces still carried after {_MAX_DRAIN_POOLS} empty pools")
        group = list(batches[p * pool:(p + 1) * pool])
        pieces, ids, offsets = (np.concatenate([carry[f]] + [b[f] for b in group]) for f in range(3))
        plan = solve_pack(pieces, pool * n_micro, window, cost, method, ids=ids, offsets=offsets,
                          carried=len(carry[0]))
        steps += [s for s in split_steps(plan, n_micro) if any(len(mb) for mb in s.micro_batches)]
        carry = (plan.lengths[plan.deferred], plan.doc_ids[plan.deferred], plan.offsets[plan.deferred])
        p += 1
    return steps


def split_steps(plan: PackPlan, n_micro: int) -> list[PackPlan]:
    """The plan's micro-batches, n_micro at a time in bin order, as one plan per step (dp = 1),
    each holding its own pieces alone (a plan in itself: `plan.check_structure`)."""
    mbs = plan.micro_batches
    if len(mbs) % n_micro:
        raise ValueError(f"a plan of {len(mbs)} micro-batches does not split into steps of {n_micro}")
    out = []
    for k in range(0, len(mbs), n_micro):
        group = mbs[k:k + n_micro]
        keep = np.concatenate(group).astype(np.int64)
        index = np.full(len(plan.lengths), -1, dtype=np.int64)
        index[keep] = np.arange(len(keep))
        out.append(plan.replace(doc_ids=plan.doc_ids[keep], lengths=plan.lengths[keep], offsets=plan.offsets[keep],
                                micro_batches=tuple(index[mb] for mb in group), replica_of=np.zeros(n_micro, np.int64),
                                loads=plan.loads[k:k + n_micro], tokens=plan.tokens[k:k + n_micro],
                                n_micro=n_micro, dp=1, deferred=np.zeros(0, np.int64),
                                arrival_step=None if plan.arrival_step is None else plan.arrival_step[keep]))
    return out


def ordering_steps(ordering: str, batches: Sequence[GlobalBatch], n_micro: int, window: int,
                   cost: CostModel) -> tuple[list[PackPlan], dict]:
    """(plans of the training steps, facts about the packing) for one ordering."""
    if ordering == "single":
        return _pooled_steps(batches, n_micro, window, cost, "fixed", 1), {}
    if ordering == "fixed-8":
        return _pooled_steps(batches, n_micro, window, cost, "fixed", FIXED_POOL), {}
    if ordering == "original":
        return _pooled_steps(batches, n_micro, window, cost, "original", 1), {}
    if ordering == "wlb":
        packer = WLBPacker(n_micro, int(WLB_MAX_TOKENS_FACTOR * window), cost)  # its defaults, nothing tuned
        run = run_packer(packer, batches)
        plans = [plan for plan in run.plans + run.drained if any(len(mb) for mb in plan.micro_batches)]
        facts = dict(packer_delay_per_token=run.stats["delay_per_token"], thresholds=packer.thresholds,
                     max_delay=packer.max_delay, release=packer.release, drain_steps=len(run.drained))
        return plans, facts
    raise ValueError(f"unknown ordering {ordering!r}; valid: {list(ORDERINGS)}")


def arrival_batches(batches: Sequence[GlobalBatch]) -> dict[int, int]:
    """Document id -> index of the global batch it arrived in."""
    return {int(i): b for b, (_, ids, _) in enumerate(batches) for i in np.unique(ids).tolist()}


def check_every_token_once(steps: Sequence[PackPlan], batches: Sequence[GlobalBatch]) -> None:
    """RuntimeError unless the steps place every token of every batch exactly once (pieces may
    be re-cut, as "original" does, so tokens are compared as [offset, offset + length) ranges)."""
    want: dict[int, int] = {}
    for pieces, ids, offsets in batches:
        for i, end in zip(ids.tolist(), (offsets + pieces).tolist()):
            want[i] = max(want.get(i, 0), end)
    got: dict[int, list] = {}
    for plan in steps:
        for mb in plan.micro_batches:
            for k in mb.tolist():
                got.setdefault(int(plan.doc_ids[k]), []).append((int(plan.offsets[k]), int(plan.lengths[k])))
    if set(got) != set(want):
        missing, extra = sorted(set(want) - set(got))[:5], sorted(set(got) - set(want))[:5]
        raise RuntimeError(f"documents not trained: {missing}...; trained but never fed: {extra}...")
    for i, ranges in got.items():
        ranges.sort()
        pos = 0
        for off, length in ranges:
            if off != pos:
                raise RuntimeError(f"document {i}: tokens from {pos} trained {'twice' if off < pos else 'never'}")
            pos = off + length
        if pos != want[i]:
            raise RuntimeError(f"document {i}: {pos} of {want[i]} tokens trained")


def displacement(steps: Sequence[PackPlan], arrival: dict[int, int]) -> dict:
    """Per token: mean |trained step - arrival batch| (displacement), mean signed delay, the
    share of tokens trained at another step than their batch's."""
    moved = signed = tokens = shifted = 0
    for s, plan in enumerate(steps):
        for mb in plan.micro_batches:
            if not len(mb):
                continue
            d = s - np.array([arrival[int(i)] for i in plan.doc_ids[mb].tolist()], dtype=np.int64)
            toks = plan.lengths[mb]
            moved += int((np.abs(d) * toks).sum())
            signed += int((d * toks).sum())
            shifted += int(toks[d != 0].sum())
            tokens += int(toks.sum())
    return dict(displacement_per_token=moved / tokens, delay_per_token=signed / tokens,
                moved_token_share=shifted / tokens)


def step_imbalances(steps: Sequence[PackPlan], cost: CostModel) -> np.ndarray:
    """PP imbalance of each step: max / mean over its micro-batches of cost.micro_batch_cost
    (forward + backward), empty micro-batches included at their constant cost."""
    return np.array([imbalance([cost.micro_batch_cost(plan.lengths[mb]) for mb in plan.micro_batches])
                     for plan in steps])


def step_tokens(steps: Sequence[PackPlan]) -> np.ndarray:
    """Tokens trained at each step."""
    return np.array([int(plan.tokens.sum()) for plan in steps], dtype=np.int64)
