"""Segment tables shared by the attention tests (kept free of hypothesis and triton, so the
GPU tier can import it on a machine that has neither)."""
from __future__ import annotations

import numpy as np


def cp_shard_table(lengths, cp: int, rank: int):
    """Rank ``rank``'s segment table of per-document CP sharding: chunks rank and 2cp-1-rank
    of every document, K all-gathered in packed order (overlapping key ranges). Returns
    (segments [n, 4] int64, local query rows, gathered keys)."""
    rows, local, k_off = [], 0, 0
    for d in lengths:
        cuts = np.linspace(0, d, 2 * cp + 1).astype(int)
        for c in (rank, 2 * cp - 1 - rank):
            q_len = int(cuts[c + 1] - cuts[c])
            if q_len:
                rows.append((local, q_len, k_off, int(cuts[c + 1])))
                local += q_len
        k_off += d
    return np.array(rows, dtype=np.int64).reshape(-1, 4), local, k_off
