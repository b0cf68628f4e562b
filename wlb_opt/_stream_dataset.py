"""The `torch.utils.data.IterableDataset` of `WLBStream.as_dataset()`.

A class at module level, so that DataLoader workers started by "spawn" or "forkserver" (macOS,
CUDA jobs, Linux from Python 3.14) can unpickle it; in its own module, so that `wlb_opt.stream`
imports no torch."""
from __future__ import annotations

from torch.utils.data import IterableDataset, get_worker_info


class StepDataset(IterableDataset):
    """Yields the steps of `stream` (a WLBStream) in one DataLoader worker, or in the
    DataLoader's own process with num_workers=0."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def __iter__(self):
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            raise ValueError(f"a WLBStream runs in at most one DataLoader worker, got num_workers={info.num_workers} "
                             "(steps depend on every step before them)")
        self.stream._handed_out = False  # the copy that plans (this process's with num_workers=0)
        return iter(self.stream)
