"""Context-parallel sharding on plain arrays: chunk tables and the hybrid decision.

A *chunk table* says which tokens of a packed micro-batch each CP rank holds. It is four
int64 arrays of equal length (rank, doc, start, length), the column order of
`wlb_opt.plan.CHUNK_COLUMNS`: tokens [start, start + length) of document `doc` (positions
inside the document, 0-based) belong to rank `rank`. The facade
(`wlb_opt.shard`) turns a chunk table into rank indices, segment tables, RoPE positions and
loads; this module only decides the table. No cost model and no torch here: costs come in
as arrays.

- `per_seq_chunks`: Llama 3 head-tail. The packed sequence of T tokens is cut into 2*CP
  contiguous chunks; rank r takes chunks r and 2*CP-1-r. Totals that do not divide by 2*CP
  are handled without padding: every chunk gets floor(T / 2CP) tokens, and the R = T mod 2CP
  extra tokens go one each to the head chunks 0, 1, ..., CP-1 first, then to the tail chunks
  2CP-1, 2CP-2, ..., CP. Rank r therefore gets +1 if r < R and another +1 if r < R - CP, so
  rank token counts differ by at most one.
- `per_doc_chunk_sizes` / `per_doc_chunks`: paper §4.1 and docs/architecture.md ("Invariants"). Each document is cut
  into 2*CP contiguous chunks of floor(d / 2CP) tokens; the d mod 2CP remainder tokens add
  one each to the chunk indices chosen by one round-robin pointer that runs on across the
  documents (pointer p, chunks p, p+1, ... mod 2CP; then p advances by the remainder).
  Rank r takes chunks r and 2*CP-1-r of every document.
- `hybrid_assign`: beyond the paper (§4.3 names it as future work). Each document is either
  cut per document (its cut cost is a fixed row of per-rank costs) or placed whole on one
  rank. See its docstring for the heuristic.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["per_seq_chunks", "per_seq_chunks_many", "per_doc_chunk_sizes", "per_doc_chunks", "head_tail_rank",
           "hybrid_assign", "decision_arrays", "HybridResult"]


def head_tail_rank(cp: int) -> np.ndarray:
    """Rank of each of the 2*CP chunks: chunk k goes to rank k for k < CP, else 2CP-1-k."""
    k = np.arange(2 * cp, dtype=np.int64)
    return np.where(k < cp, k, 2 * cp - 1 - k)


def per_seq_chunks(lengths: np.ndarray, cp: int) -> tuple[np.ndarray, ...]:
    """Head-tail chunks of the whole packed sequence, cut at document boundaries.

    Returns (rank, doc, start, length); a chunk that spans documents becomes one row per
    document it touches.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return tuple(np.zeros(0, np.int64) for _ in range(4))
    chunk_ends = np.cumsum(_seq_chunk_sizes(np.array([total]), cp)[0])
    doc, chunk, start, length = _cut_at(lengths, np.cumsum(lengths), chunk_ends)
    return head_tail_rank(cp)[chunk], doc, start, length


def per_seq_chunks_many(lengths: np.ndarray, counts: np.ndarray, cp: int) -> tuple[np.ndarray, ...]:
    """`per_seq_chunks` of consecutive packed sequences (micro-batches) of `counts` documents
    each (each sequence holds at least one token, or none does): (sequence, rank, doc inside
    it, start, length), the sequences in order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if int(lengths.sum()) == 0:
        return tuple(np.zeros(0, np.int64) for _ in range(5))
    n2 = 2 * cp
    doc_ends = np.cumsum(lengths)
    first_doc = np.cumsum(counts) - counts
    seq_end = doc_ends[first_doc + counts - 1]
    totals = np.diff(np.concatenate([[0], seq_end]))
    chunk_ends = ((seq_end - totals)[:, None] + np.cumsum(_seq_chunk_sizes(totals, cp), axis=1)).reshape(-1)
    doc, chunk, start, length = _cut_at(lengths, doc_ends, chunk_ends)
    seq = chunk // n2
    return seq, head_tail_rank(cp)[chunk % n2], doc - first_doc[seq], start, length


def _seq_chunk_sizes(totals: np.ndarray, cp: int) -> np.ndarray:
    """[sequences, 2*CP] head-tail chunk sizes of sequences of `totals` tokens: T // 2CP each,
    and one more token for the first T % 2CP chunks in rank order (heads first)."""
    n2 = 2 * cp
    base, rem = np.divmod(np.asarray(totals, dtype=np.int64), n2)
    k = np.arange(n2, dtype=np.int64)
    head, ranks, rem = (k < cp)[None, :], head_tail_rank(cp)[None, :], rem[:, None]
    extra = (head & (ranks < rem)) | (~head & (ranks < rem - cp))
    return base[:, None] + extra.astype(np.int64)


def _cut_at(lengths: np.ndarray, doc_ends: np.ndarray, chunk_ends: np.ndarray) -> tuple[np.ndarray, ...]:
    """(doc, chunk, start in the doc, length) of the pieces the document and chunk boundaries
    cut a packed sequence into (`chunk_ends`: non-decreasing, empty chunks repeat an end)."""
    cuts = np.union1d(chunk_ends, doc_ends)
    cuts = cuts[cuts > 0]
    piece_start = np.concatenate([[0], cuts[:-1]]).astype(np.int64)
    doc = np.searchsorted(doc_ends, piece_start, side="right")
    chunk = np.searchsorted(chunk_ends, piece_start, side="right")
    return (doc.astype(np.int64), chunk, (piece_start - (doc_ends[doc] - lengths[doc])).astype(np.int64),
            (cuts - piece_start).astype(np.int64))


def per_doc_chunk_sizes(lengths: np.ndarray, cp: int, pointer: int | np.ndarray = 0) -> np.ndarray:
    """[n, 2*CP] chunk sizes of every document under the round-robin remainder rule.

    The pointer starts at `pointer` and runs on across documents in packed order (an array:
    an offset added to each document's pointer, which lets consecutive micro-batches
    restart it).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n2 = 2 * cp
    base, rem = np.divmod(lengths, n2)
    first = (pointer + np.cumsum(rem) - rem) % n2  # pointer when document i starts
    k = np.arange(n2, dtype=np.int64)
    extra = (k[None, :] - first[:, None]) % n2 < rem[:, None]
    return base[:, None] + extra.astype(np.int64)


def chunks_of(sizes: np.ndarray, docs: np.ndarray, cp: int) -> tuple[np.ndarray, ...]:
    """Chunk table rows of the given documents cut into 2*CP chunks of `sizes` (rows of docs)."""
    n2 = 2 * cp
    starts = np.cumsum(sizes, axis=1) - sizes
    doc = np.repeat(docs.astype(np.int64), n2)
    rank = np.tile(head_tail_rank(cp), len(docs))
    start, length = starts.reshape(-1), sizes.reshape(-1)
    keep = length > 0
    return rank[keep], doc[keep], start[keep], length[keep]


def per_doc_chunks(lengths: np.ndarray, cp: int) -> tuple[np.ndarray, ...]:
    """Per-document head-tail chunks (rank, doc, start, length); empty chunks are dropped."""
    lengths = np.asarray(lengths, dtype=np.int64)
    sizes = per_doc_chunk_sizes(lengths, cp)
    return chunks_of(sizes, np.arange(len(lengths)), cp)


def hybrid_chunks(lengths: np.ndarray, cp: int, cut: np.ndarray, whole_rank: np.ndarray) -> tuple[np.ndarray, ...]:
    """Chunk table of a hybrid decision: cut documents per document, the rest whole.

    Cut documents use the chunk sizes `per_doc_chunk_sizes` gives them with the pointer
    running over *all* documents, so a document's chunks do not depend on which other
    documents are cut (hybrid with every document cut is exactly per_doc).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    cut = np.asarray(cut, dtype=bool)
    sizes = per_doc_chunk_sizes(lengths, cp)
    docs_cut = np.flatnonzero(cut)
    r1, d1, s1, l1 = chunks_of(sizes[docs_cut], docs_cut, cp)
    docs_whole = np.flatnonzero(~cut)
    return (np.concatenate([r1, np.asarray(whole_rank, dtype=np.int64)[docs_whole]]),
            np.concatenate([d1, docs_whole]), np.concatenate([s1, np.zeros(len(docs_whole), np.int64)]),
            np.concatenate([l1, lengths[docs_whole]]))


class HybridResult:
    """Decision of `hybrid_assign`: cut[i] (bool) and whole_rank[i] (-1 where cut)."""

    __slots__ = ("cut", "whole_rank", "makespan", "evaluated")

    def __init__(self, cut, whole_rank, makespan, evaluated):
        self.cut = cut
        self.whole_rank = whole_rank
        self.makespan = makespan
        self.evaluated = evaluated


def _lpt(items, whole_cost, lengths, loads, toks, token_cap, cut_cost, cut_tok):
    """Place `items` (heaviest first) whole on the least-loaded rank whose tokens stay within
    `token_cap`; an item that fits nowhere is cut instead, and if its cut does not fit
    either, return (None, None). Mutates loads/toks (lists)."""
    cp = len(loads)
    ranks = range(cp)
    assign = {}
    cut_extra = []
    for i in items:
        w, d = whole_cost[i], lengths[i]
        best, best_load = -1, float("inf")
        for r in ranks:
            if loads[r] < best_load and toks[r] + d <= token_cap:
                best, best_load = r, loads[r]
        if best < 0:
            row, trow = cut_cost[i], cut_tok[i]
            if any(toks[r] + trow[r] > token_cap for r in ranks):
                return None, None  # neither whole nor cut fits: this k is infeasible
            cut_extra.append(i)
            for r in ranks:
                loads[r] += row[r]
                toks[r] += trow[r]
        else:
            assign[i] = best
            loads[best] += w
            toks[best] += d
    return assign, cut_extra


def _improve(assign, whole_cost, lengths, loads, toks, token_cap, max_moves=64):
    """Move single whole documents off the most-loaded rank while that lowers the maximum."""
    cp = len(loads)
    by_rank = [[] for _ in range(cp)]
    for i, r in assign.items():
        by_rank[r].append(i)
    for _ in range(max_moves):
        hi = max(range(cp), key=loads.__getitem__)
        lo = min(range(cp), key=loads.__getitem__)
        gap = loads[hi] - loads[lo]
        if gap <= 0:
            break
        # the largest document that fits into half the gap moves the maximum down the most
        best, best_w = -1, 0.0
        for i in by_rank[hi]:
            w = whole_cost[i]
            if best_w < w < gap and toks[lo] + lengths[i] <= token_cap:
                best, best_w = i, w
        if best < 0:
            break
        new_max = max(loads[hi] - best_w, loads[lo] + best_w)
        if new_max >= loads[hi]:
            break
        by_rank[hi].remove(best)
        by_rank[lo].append(best)
        assign[best] = lo
        loads[hi] -= best_w
        loads[lo] += best_w
        toks[hi] -= lengths[best]
        toks[lo] += lengths[best]
    return assign


def decision_arrays(whole_cost, cut_cost, lengths, cut_tokens) -> tuple[np.ndarray, ...]:
    """The inputs of a cut-or-whole decision as arrays: whole_cost [n] and cut_cost [n, cp]
    (seconds), lengths [n] and cut_tokens [n, cp] (tokens)."""
    return (np.asarray(whole_cost, dtype=np.float64), np.asarray(cut_cost, dtype=np.float64),
            np.asarray(lengths, dtype=np.int64), np.asarray(cut_tokens, dtype=np.int64))


def hybrid_assign(whole_cost: np.ndarray, cut_cost: np.ndarray, lengths: np.ndarray, cut_tokens: np.ndarray,
                  token_cap: float, patience: int = 3) -> HybridResult:
    """Choose, per document, "cut per document" or "whole on one rank", minimising the
    largest rank load (seconds), with every rank holding at most `token_cap` tokens.

    Args:
        whole_cost: [n] load a document adds to the rank it is placed on whole.
        cut_cost: [n, cp] load a cut document adds to each rank.
        lengths: [n] tokens; cut_tokens: [n, cp] tokens a cut document adds to each rank.

    Heuristic: documents are ranked by whole cost. For k in a small window, the k heaviest
    are cut (their per-rank rows add up) and the rest go whole by longest-processing-time
    (least-loaded rank that keeps the token cap; a document that fits nowhere is cut too),
    followed by a few single-document moves off the most-loaded rank. The window starts
    just below k0 = the number of documents whose whole cost exceeds the mean rank load
    (such a document alone would make its rank the slowest) and stops after `patience`
    values of k that do not improve the best makespan. A k whose documents cannot all be
    placed within `token_cap` is skipped; if none fits, every document is cut, which is
    per_doc (ranks within one token of T / cp, so any cap >= ceil(T / cp) holds).
    O(n log n + window * n * cp).
    """
    whole_cost, cut_cost, lengths, cut_tokens = decision_arrays(whole_cost, cut_cost, lengths, cut_tokens)
    n, cp = cut_cost.shape
    if n == 0:
        return HybridResult(np.zeros(0, bool), np.zeros(0, np.int64), 0.0, 0)
    order = np.argsort(-whole_cost, kind="stable")
    cum_load = np.vstack([np.zeros(cp), np.cumsum(cut_cost[order], axis=0)])
    cum_tok = np.vstack([np.zeros(cp, np.int64), np.cumsum(cut_tokens[order], axis=0)])
    mean_load = (whole_cost.sum()) / cp
    k0 = int(np.count_nonzero(whole_cost > mean_load))
    wc, ln = whole_cost.tolist(), lengths.tolist()
    cc, ct = cut_cost.tolist(), cut_tokens.tolist()
    order_l = order.tolist()

    best = None
    stale, evaluated = 0, 0
    for k in range(max(0, k0 - 1), n + 1):
        evaluated += 1
        toks = cum_tok[k].tolist()
        assign = None
        if max(toks) <= token_cap:  # else the cut documents' remainders alone break the bound
            loads = cum_load[k].tolist()
            assign, cut_extra = _lpt(order_l[k:], wc, ln, loads, toks, token_cap, cc, ct)
        if assign is None:
            makespan = math.inf  # infeasible k
        else:
            assign = _improve(assign, wc, ln, loads, toks, token_cap)
            makespan = max(loads)
        if best is None and assign is None:
            continue
        if best is None or makespan < best[0] * (1 - 1e-12):
            best = (makespan, k, assign, cut_extra)
            stale = 0
        else:
            stale += 1
            if stale >= patience:
                break
    if best is None:  # every document cut is per_doc, within one token of an even split
        return HybridResult(np.ones(n, dtype=bool), np.full(n, -1, dtype=np.int64),
                            float(cum_load[n].max()), evaluated)
    makespan, k, assign, cut_extra = best
    cut = np.zeros(n, dtype=bool)
    cut[order[:k]] = True
    cut[np.asarray(cut_extra, dtype=np.int64)] = True
    whole_rank = np.full(n, -1, dtype=np.int64)
    if assign:
        idx = np.fromiter(assign.keys(), dtype=np.int64, count=len(assign))
        whole_rank[idx] = np.fromiter(assign.values(), dtype=np.int64, count=len(assign))
    return HybridResult(cut, whole_rank, float(makespan), evaluated)
