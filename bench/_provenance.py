"""Where a benchmark's JSON came from (`wlb_opt._provenance`, which the profiler shares)."""
from wlb_opt._provenance import command, machine, provenance

__all__ = ["command", "machine", "provenance"]
