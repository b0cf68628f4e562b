"""Algorithm 1's assignment loop, and the balanced placement of `wlb_phases`, compiled with
numba (the optional `fast` extra).

`wlb_assign` in greedy.py and `phases_assign` in phases.py are pure-Python loops: a few
tenths of a microsecond per item, since every item is a heap operation on Python tuples.
This module holds the same loops for numba, used by `greedy.wlb_assign` and
`phases.phases_assign` when numba imports; without numba the Python loops run, and the
tests hold each pair to identical placements on random and overloaded batches.

Same rules, same arithmetic: each item goes to the bin of least load (ties: lowest index)
if it fits under the cap, else to the bin of fewest tokens (ties: lowest index) if it fits
there, else it is deferred; a bin's load is the float64 sum of its weights in placement
order, as the Python loop adds them. The minima come from two tournament trees (one for
loads, one for tokens) over the bins padded to a power of two: each internal node holds the
bin of least value below it, the left child on ties (left subtrees hold lower indices), so
the root is the minimum with the lowest-index tie-break, and a bin's update walks up
log2(bins) nodes. The token tree is built at the first fallback (most batches have none)
and kept current from then on. The loops share the choice of a bin (`_target`) and its
update (`_taken`).

The first call compiles (about a second); `cache=True` keeps the machine code on disk for
later processes.
"""
from __future__ import annotations

import numba
import numpy as np

_TOKENS_PAD = np.int64(2**62)
"""Token count of a padding leaf: above every real bin's, so it never wins a minimum."""


@numba.njit(cache=True, nogil=True)
def _build(values, n_leaves):
    """Tournament tree over `values` (length n_leaves, a power of two): node i >= 1 holds the
    index of the least value below it, node n_leaves + j is leaf j."""
    node = np.empty(2 * n_leaves, dtype=np.int64)
    for j in range(n_leaves):
        node[n_leaves + j] = j
    for i in range(n_leaves - 1, 0, -1):
        left, right = node[2 * i], node[2 * i + 1]
        node[i] = left if values[left] <= values[right] else right
    return node


@numba.njit(cache=True, nogil=True, inline="always")
def _update(node, values, n_leaves, leaf):
    """Re-run the matches from `leaf` up to the root after values[leaf] changed."""
    i = (n_leaves + leaf) >> 1
    while i >= 1:
        left, right = node[2 * i], node[2 * i + 1]
        node[i] = left if values[left] <= values[right] else right
        i >>= 1


@numba.njit(cache=True, nogil=True, inline="always")
def _target(key_tree, toks, tok_tree, built, n_leaves, d, cap):
    """(the bin an item of `d` tokens goes to, whether the token tree is built): the least
    key's bin (the root of `key_tree`) if the item fits under `cap`, else the fewest tokens'
    if it fits there, else -1 (deferred). The token tree is built into `tok_tree` at the
    first fallback (most batches have none) and kept current from then on (`_taken`)."""
    b = key_tree[1]
    if toks[b] + d <= cap:
        return b, built
    if not built:
        tok_tree[:] = _build(toks, n_leaves)
        built = True
    b = tok_tree[1]  # fallback: fewest tokens (rare but for overloaded steps)
    return (b if toks[b] + d <= cap else -1), built


@numba.njit(cache=True, nogil=True, inline="always")
def _taken(b, d, key_tree, keys, toks, tok_tree, built, n_leaves):
    """Bin `b` took an item of `d` tokens, its key already raised in `keys`: the trees updated."""
    toks[b] += d
    _update(key_tree, keys, n_leaves, b)
    if built:
        _update(tok_tree, toks, n_leaves, b)


@numba.njit(cache=True, nogil=True)
def _empty_bins(n_bins, start):
    """(leaves: n_bins padded to a power of two, each bin's key (`start`; padding: inf), its
    tokens (0; padding: above any bin's), the key tree, room for the token tree)."""
    n_leaves = 1
    while n_leaves < n_bins:
        n_leaves *= 2
    keys = np.full(n_leaves, np.inf)
    toks = np.full(n_leaves, _TOKENS_PAD)
    keys[:n_bins] = start
    toks[:n_bins] = 0
    return n_leaves, keys, toks, _build(keys, n_leaves), np.zeros(2 * n_leaves, dtype=np.int64)


@numba.njit(cache=True, nogil=True)
def wlb_assign_compiled(order, lengths, weights, n_bins, cap):
    """`greedy.wlb_assign`: the bin of each item of `order` (placement order), -1 = deferred."""
    n_leaves, loads, toks, load_tree, tok_tree = _empty_bins(n_bins, 0.0)
    built = False
    placed_bin = np.full(len(order), -1, dtype=np.int64)
    for k in range(len(order)):
        i = order[k]
        b, built = _target(load_tree, toks, tok_tree, built, n_leaves, lengths[i], cap)
        if b < 0:
            continue
        loads[b] = loads[b] + weights[i]
        _taken(b, lengths[i], load_tree, loads, toks, tok_tree, built, n_leaves)
        placed_bin[k] = b
    return placed_bin


@numba.njit(cache=True, nogil=True)
def phases_assign_compiled(sizes, f_share, b_share, f_start, b_start, n_bins, cap):
    """`phases.phases_assign` on items already in placement order: `sizes` their tokens,
    `f_share`, `b_share` their forward and backward seconds over the step's mean of each
    phase, `f_start`, `b_start` the shares every bin starts with (its constants). A bin's key
    is max(forward share, backward share); each item goes to the bin of least key (ties:
    lowest index) if it fits under `cap`, else to the bin of fewest tokens if it fits there,
    else it is deferred (-1). The shares add in placement order, as the Python loop adds them."""
    n_leaves, keys, toks, key_tree, tok_tree = _empty_bins(n_bins, max(f_start, b_start))
    f_load = np.full(n_leaves, f_start)
    b_load = np.full(n_leaves, b_start)
    built = False
    placed_bin = np.full(len(sizes), -1, dtype=np.int64)
    for k in range(len(sizes)):
        b, built = _target(key_tree, toks, tok_tree, built, n_leaves, sizes[k], cap)
        if b < 0:
            continue
        f = f_load[b] + f_share[k]
        g = b_load[b] + b_share[k]
        f_load[b] = f
        b_load[b] = g
        keys[b] = f if f > g else g
        _taken(b, sizes[k], key_tree, keys, toks, tok_tree, built, n_leaves)
        placed_bin[k] = b
    return placed_bin


@numba.njit(cache=True, nogil=True)
def lumped_assign_compiled(head, tail, lump_of, lump_lengths, lump_costs, lengths, weights, n_bins, cap):
    """Algorithm 1 on a candidate whose short tail is packed in lumps (`StepSolver.assign_and_sum`):
    the pieces `head` one by one, then the lumps, lump j holding the pieces of `tail` whose
    `lump_of` is j (consecutive), each placed whole. Returns (the bin of each piece of head
    then tail, -1 = deferred; each bin's cost summed piece by piece in that order, as
    `np.bincount` of the pieces' costs sums them; the deferred pieces' tokens).

    The placements are `wlb_assign_compiled`'s on the items (head pieces, then the lumps with
    their summed tokens and costs); the bins' costs are added piece by piece apart, so that
    they are the floats `TrialPack.loads` sums."""
    n_head, n_lumps = len(head), len(lump_lengths)
    n_leaves, loads, toks, load_tree, tok_tree = _empty_bins(n_bins, 0.0)
    built = False
    item_bin = np.full(n_head + n_lumps, -1, dtype=np.int64)
    for k in range(n_head + n_lumps):  # the items read in place: head pieces, then lumps
        d = lengths[head[k]] if k < n_head else lump_lengths[k - n_head]
        b, built = _target(load_tree, toks, tok_tree, built, n_leaves, d, cap)
        if b < 0:
            continue
        loads[b] = loads[b] + (weights[head[k]] if k < n_head else lump_costs[k - n_head])
        _taken(b, d, load_tree, loads, toks, tok_tree, built, n_leaves)
        item_bin[k] = b
    placed = np.empty(n_head + len(tail), dtype=np.int64)
    sums = np.zeros(n_bins)
    deferred = 0
    for k in range(n_head):
        b = item_bin[k]
        placed[k] = b
        if b >= 0:
            sums[b] += weights[head[k]]
        else:
            deferred += lengths[head[k]]
    for p in range(len(tail)):
        b = item_bin[n_head + lump_of[p]]
        placed[n_head + p] = b
        if b >= 0:
            sums[b] += weights[tail[p]]
        else:
            deferred += lengths[tail[p]]
    return placed, sums, deferred
