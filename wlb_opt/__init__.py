"""wlb-opt: workload-balanced 4D parallelism for long-context LLM training.

The planner core (specs, cost model, packing, sharding, simulator) needs only numpy and
networkx. Kernels and the executor need the ``torch`` extra, exact solvers the ``exact``
extra. Public names are resolved lazily so that ``import wlb_opt`` never imports an optional
dependency (and stays cheap in a data-loader process).
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it (relative to this package)
_EXPORTS = {
    "ModelSpec": "specs",
    "ParallelSpec": "specs",
    "HardwareSpec": "specs",
    "CostModel": "cost",
    "MemoryModel": "cost_memory",
    "max_tokens_for": "cost_memory",
    "PackPlan": "plan",
    "ShardPlan": "plan",
    "SolveInfo": "plan",
    "check_pack": "plan",
    "PlanError": "plan",
    "imbalance": "plan",
    "split_documents": "documents",
    "load_lengths": "documents",
    "solve_pack": "step_pack",
    "PACK_METHODS": "step_pack",
    "WLBPacker": "packer",
    "PackerConfig": "packer",
    "WLBStream": "stream",
    "Step": "stream",
    "solve_shard": "shard",
    "solve_shards": "shard",
    "simulate_pipeline": "simulate",
    "simulate_step": "simulate",
    "SimResult": "simulate",
    "simulate_rendezvous": "rendezvous",
    "simulate_channels": "rendezvous",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'wlb_opt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
