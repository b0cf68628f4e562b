"""`wlb-opt demo`: the main job on the embedded default workload.

Packs one global batch of the default distribution (7B, 128K window, N = 4) with the
paper's three methods and prints the table. (The simulator work grows this into the
end-to-end benchmark.)
"""
from __future__ import annotations

import argparse

from ..cost import CostModel
from ..pack import solve_pack
from ..specs import HardwareSpec, ModelSpec, ParallelSpec
from .data import global_batch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt demo", description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    window, n_micro = 131072, 4
    cost = CostModel.analytic(ModelSpec.preset("7b"), ParallelSpec(tp=8, cp=2, pp=4), HardwareSpec.preset("h100"))
    lengths, ids, offsets = global_batch("default", window, n_micro * window, seed=args.seed)
    print(f"one global batch: {len(lengths)} documents, {int(lengths.sum())} tokens (7B, window {window}, N={n_micro})")
    print(f"{'method':>9} {'max_tokens':>10} {'imbalance':>9} {'deferred tok':>12}  micro-batch ms")
    for method in ("original", "fixed", "wlb"):
        max_tokens = int(1.25 * window) if method == "wlb" else window
        plan = solve_pack(lengths, n_micro, max_tokens, cost, method, ids=ids, offsets=offsets)
        ms = " ".join(f"{1e3 * x:7.1f}" for x in plan.loads)
        print(f"{method:>9} {max_tokens:>10} {plan.imbalance:>9.3f} {plan.deferred_tokens:>12}  {ms}")
    return 0
