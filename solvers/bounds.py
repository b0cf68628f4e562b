"""Lower bounds on the largest micro-batch cost, and the token-capacity check.

Every exact model and benchmark measures a plan against these bounds, so they must never
exceed the optimum. They use only sorting and sums, no solver:

- mean load: the bins together carry every item, so the largest carries at least the mean;
- largest item: it sits in some bin;
- pigeonhole pairs: among the m+1 largest items two share a bin, so some bin carries at least
  the m-th plus the (m+1)-th largest (items sorted descending, m bins); more generally some bin
  carries k+1 of the k*m+1 largest, hence at least the k+1 smallest of them (k = 1, 2, ...);
- with deferral allowed (`min_placed_weight`): a plan that places P tokens places at least
  the weight of the cheapest P tokens, counted fractionally by cost per token, so
  `placed_load_bound` = that weight / m. Conversely (`max_placed_weight`) it places at most
  the weight of the densest P tokens, which bounds the mean load of a plan that cannot place
  everything from above.

Each bin also pays `bin_const` (the per-micro-batch constant), added to every bound.
`check_capacity` raises the ValueError the exact models use for infeasible instances: a
document longer than `max_tokens`, or more tokens than `n_bins * max_tokens`.
"""
from __future__ import annotations

import numpy as np


def _as_weights(weights) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or (w.size and (not np.all(np.isfinite(w)) or w.min() < 0)):
        raise ValueError(f"weights must be a 1-D array of finite numbers >= 0, got {weights!r}")
    return w


def _check_bins(n_bins) -> int:
    if isinstance(n_bins, bool) or not isinstance(n_bins, (int, np.integer)) or n_bins < 1:
        raise ValueError(f"n_bins must be an integer >= 1, got {n_bins!r}")
    return int(n_bins)


def mean_bound(weights, n_bins: int) -> float:
    """Total weight / n_bins."""
    return float(_as_weights(weights).sum() / _check_bins(n_bins))


def largest_item_bound(weights) -> float:
    w = _as_weights(weights)
    return float(w.max()) if w.size else 0.0


def pigeonhole_sorted(desc, m: int):
    """max over k >= 1 of desc[k*m - k : k*m + 1].sum() for weights sorted descending; 0 when
    there are fewer than m + 1 items. `desc`: a numpy array (float or integer, the result has
    its dtype), or a list (a Python number: a short list without numpy's overhead, as the
    streaming packer's release rules bound each candidate)."""
    if isinstance(desc, list):
        best, k = 0, 1
        while k * m < len(desc):
            best = max(best, sum(desc[k * m - k:k * m + 1]))
            k += 1
        return best
    csum = np.concatenate([np.zeros(1, dtype=desc.dtype), np.cumsum(desc)])
    k = np.arange(1, (len(desc) - 1) // m + 1)  # every k with k*m + 1 <= len(desc)
    if k.size == 0:
        return desc.dtype.type(0)
    return (csum[k * m + 1] - csum[k * m - k]).max()  # positions [k*m - k, k*m + 1): k+1 items


def pigeonhole_bound(weights, n_bins: int) -> float:
    """max over k >= 1 of the sum of sorted_desc[k*m - k : k*m + 1] (the k+1 smallest of the
    k*m+1 largest items); k = 1 is the classical m-th + (m+1)-th largest."""
    return float(pigeonhole_sorted(np.sort(_as_weights(weights))[::-1], _check_bins(n_bins)))


def makespan_lower_bound(weights, n_bins: int, bin_const: float = 0.0) -> float:
    """The largest of the bounds above (all items placed), plus the per-bin constant."""
    w = _as_weights(weights)
    m = _check_bins(n_bins)
    return max(mean_bound(w, m), largest_item_bound(w), pigeonhole_bound(w, m)) + float(bin_const)


def integer_makespan_lower_bound(weights_int: np.ndarray, n_bins: int) -> int:
    """The same bounds on integer weights, rounded up (the makespan is an integer there)."""
    w = np.asarray(weights_int, dtype=np.int64)
    m = _check_bins(n_bins)
    if w.size == 0:
        return 0
    ws = np.sort(w)[::-1]
    mean = -(-int(w.sum()) // m)
    return max(mean, int(ws[0]), int(pigeonhole_sorted(ws, m)))


def min_placed_weight(lengths, weights, tokens: int) -> float:
    """Least total weight of items holding `tokens` tokens, items taken fractionally in order
    of weight per token (a lower bound for any integral choice)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    w = _as_weights(weights)
    if tokens <= 0 or lengths.size == 0:
        return 0.0
    rate = w / np.maximum(lengths, 1)
    order = rate.argsort(kind="stable")
    cum_tok = lengths[order].cumsum()
    cum_w = w[order].cumsum()
    j = int(cum_tok.searchsorted(tokens))  # first prefix that reaches `tokens`
    if j >= len(order):
        return float(cum_w[-1])
    before_tok = int(cum_tok[j - 1]) if j else 0
    before_w = float(cum_w[j - 1]) if j else 0.0
    return before_w + (tokens - before_tok) * float(rate[order[j]])


def densest_order(lengths, weights) -> np.ndarray:
    """Indices of the items in decreasing weight per token."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return (-_as_weights(weights) / np.maximum(lengths, 1)).argsort(kind="stable")


def densest_first(lengths, weights, order: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Running (tokens, weight) sums from (0, 0), items in decreasing weight per token: with
    `np.interp`, the most weight any choice of items holding a given number of tokens can
    have, items taken fractionally (`max_placed_weight`). `order`: `densest_order` of the
    items, if the caller has it."""
    lengths = np.asarray(lengths, dtype=np.int64)
    w = np.asarray(weights, dtype=np.float64)
    if order is None:
        order = densest_order(lengths, w)
    cum_tokens, cum_weights = np.zeros(len(order) + 1, dtype=np.int64), np.zeros(len(order) + 1)
    lengths[order].cumsum(out=cum_tokens[1:])
    w[order].cumsum(out=cum_weights[1:])
    return cum_tokens, cum_weights


def max_placed_weight(lengths, weights, tokens: int) -> float:
    """Most total weight of items holding at most `tokens` tokens, items taken fractionally
    in decreasing weight per token (an upper bound for any integral choice)."""
    cum_tokens, cum_weights = densest_first(lengths, weights)
    return float(np.interp(max(tokens, 0), cum_tokens, cum_weights))


def placed_load_bound(lengths, weights, n_bins: int, placed_tokens: int, bin_const: float = 0.0) -> float:
    """Lower bound on the largest load of any plan that places at least `placed_tokens`."""
    return min_placed_weight(lengths, weights, placed_tokens) / _check_bins(n_bins) + float(bin_const)


def max_placeable_tokens(lengths, n_bins: int, max_tokens: int) -> int:
    """Upper bound on the tokens any plan can place: min(total, n_bins * max_tokens), counting
    only items that fit a bin at all."""
    lengths = np.asarray(lengths, dtype=np.int64)
    fits = lengths[lengths <= max_tokens]
    return int(min(int(fits.sum()), _check_bins(n_bins) * int(max_tokens)))


def check_capacity(lengths, n_bins: int, max_tokens: int, ids=None) -> None:
    """Raise ValueError when not every item can be placed: one longer than `max_tokens`
    (named by id and position), or more tokens than `n_bins * max_tokens` (the excess)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n_bins = _check_bins(n_bins)
    if lengths.size == 0:
        return
    if lengths.max() > max_tokens:
        i = int(np.argmax(lengths))
        name = f"document {int(ids[i])} (position {i})" if ids is not None else f"document at position {i}"
        raise ValueError(f"{name} has {int(lengths[i])} tokens > max_tokens={max_tokens}; cut it to the window "
                         "with wlb_opt.split_documents, or pass allow_defer=True")
    total = int(lengths.sum())
    capacity = n_bins * int(max_tokens)
    if total > capacity:
        raise ValueError(f"{total} tokens do not fit in {n_bins} micro-batches x {max_tokens} = {capacity} tokens "
                         f"({total - capacity} tokens over); pass allow_defer=True to defer the excess")


def delay_floor(batches, n_micro: int, max_tokens: int) -> float:
    """Least displacement per token of any delay-only plan of a stream (lookahead 0: every
    piece trains at or after the step it arrives in), whatever it does about balance.

    `batches` are the stream's global batches in order (arrays of piece lengths, or the
    (pieces, ids, offsets) tuples of `wlb_opt.workloads.global_batches`); `n_micro` is the
    micro-batches of one step (with dp replicas: dp x n_micro). Two capacity limits force
    waiting, and the floor is the larger of the two:

    - tokens: a step trains at most n_micro x max_tokens tokens, so after step t at least
      backlog_t = max(0, backlog_{t-1} + arrivals_t - n_micro x max_tokens) tokens still
      wait, and each waiting token adds one step of displacement;
    - micro-batches: two pieces longer than max_tokens / 2 never share a micro-batch, so a
      step trains at most n_micro of them. Placing them alone (every other piece on time)
      is an assignment of unit jobs with release dates to n_micro slots per step, weighted
      by length; taking, step by step, the n_micro longest that have arrived is optimal
      (exchange: a longer piece waiting behind a shorter one scheduled earlier can swap
      with it and lowers the weighted wait).

    Displacement per token is the token-weighted mean over all pieces, as
    `WLBPacker.stats()["displacement_per_token"]` counts it (drain included)."""
    import heapq

    from .._validate import check_int, validate_lengths

    n_micro = check_int("n_micro", n_micro, 1)
    max_tokens = check_int("max_tokens", max_tokens, 1)
    streams = []
    for b, batch in enumerate(batches):
        # a (pieces, ids, offsets) tuple of global_batches: three 1-D arrays; otherwise lengths
        triple = isinstance(batch, tuple) and len(batch) == 3 and all(np.ndim(part) == 1 for part in batch)
        pieces = validate_lengths(batch[0] if triple else batch, f"batches[{b}] piece lengths")
        if pieces.size and pieces.max() > max_tokens:
            raise ValueError(f"batches[{b}] holds a piece of {int(pieces.max())} tokens > max_tokens={max_tokens}; "
                             "cut documents to the window with wlb_opt.split_documents")
        streams.append(pieces)
    total = sum(int(p.sum()) for p in streams)
    if total == 0:
        return 0.0
    capacity = n_micro * int(max_tokens)
    heap: list[tuple[int, int]] = []  # (-length, arrival) of the pieces > max_tokens / 2 still waiting
    backlog = token_wait = slot_wait = step = 0
    while step < len(streams) or backlog or heap:  # the stream's steps, then the drain
        pieces = streams[step] if step < len(streams) else np.zeros(0, np.int64)
        backlog = max(0, backlog + int(pieces.sum()) - capacity)
        token_wait += backlog
        for length in pieces[pieces > max_tokens // 2]:
            heapq.heappush(heap, (-int(length), step))
        for _ in range(min(n_micro, len(heap))):
            neg, arrival = heapq.heappop(heap)
            slot_wait += -neg * (step - arrival)
        step += 1
    return max(token_wait, slot_wait) / total
