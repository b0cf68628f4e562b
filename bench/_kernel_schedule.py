"""`wlb-opt bench kernel --schedule`: the kernels' launch order on 132 SMs, modelled on CPU.

    wlb-opt bench kernel --schedule --out results/kernel_schedule     (about 10 s)

For CP-sharded micro-batches (packed 16K and 128K micro-batches of the default distribution,
packed by WLB-LLM and sharded with the adaptive strategy, cp 1..8) and 4 or 32 query heads
with GQA 4:1, it builds each rank's forward/dQ and dK/dV work lists exactly as the launchers
do and list-schedules them (kernels/work_model.py) on 132 SMs x `--programs-per-sm`:

- before: the 2-D grids of the previous kernels, (tiles, heads) launched tile-fastest (all
  of head 0 first), and dK/dV with one program per (key tile, KV head);
- after: the flat work list (heaviest tile first, query heads side by side), long query
  tiles' key loops cut into chunks (split-K, `choose_forward_split`) and dK/dV split over
  the GQA group's heads (`choose_dkdv_split`), each where the model says it pays, as the
  launchers decide at run time.

One JSON row per (window, cp, query heads, kernel) with `makespan_ratio` (after) and
`makespan_ratio_before`, each the worst over the micro-batches and ranks, plus their means.
The ideal is max(total work / slots, the largest (tile, head) unit): see work_model.py.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ..cost import CostModel
from ..cost_args import count, natural
from ..kernels import work_model as wm
from ..shard import solve_shard
from ..specs import HardwareSpec, ModelSpec, ParallelSpec
from ..step_pack import solve_pack
from ..workloads import DEFAULT_SEED, global_batches
from ._provenance import provenance

# The first candidate configs for head dim 128 (kernels/launch.py); one program per SM each
# (aot_check: 128-131 KB shared memory or 193-252 registers x 256 threads).
BLOCKS = {"fwd": (128, 64), "dq": (128, 64), "dkdv": (32, 128)}
TARGET = 1.10


def _micro_batches(window: int, cp: int, n_batches: int, seed: int):
    """(lengths, offsets) of the micro-batches of `n_batches` WLB-packed global batches."""
    cost = CostModel.analytic(ModelSpec.preset("7b"), ParallelSpec(tp=8, cp=cp, pp=4),
                              HardwareSpec.preset("h100"))
    out = []
    for pieces, ids, offsets in global_batches("default", window, 4 * window, n_batches, seed):
        plan = solve_pack(pieces, 4, int(1.25 * window), cost, "wlb", ids=ids, offsets=offsets)
        for mb in plan.micro_batches:
            if len(mb):
                out.append((plan.lengths[mb], plan.offsets[mb], cost))
    return out


def _ratios(seg: np.ndarray, kernel: str, hq: int, group: int, slots: int) -> tuple[float, float, int]:
    """(after, before, split) makespan / ideal of one rank's table; split: the dK/dV head
    shares, or the forward/dQ split-K chunk size in key tiles (0: not split)."""
    block_m, block_n = BLOCKS[kernel]
    hkv = hq // group
    if kernel in ("fwd", "dq"):
        work = wm.forward_work(seg, block_m, block_n)
        if not len(work):
            return 1.0, 1.0, 1
        unit = work.max()
        max_blocks = wm.choose_forward_split(work, hq, slots)
        after = wm.makespan_ratio(wm.forward_order(wm.split_work(work, max_blocks), hq, "flat"), slots, unit)[2]
        before = wm.makespan_ratio(wm.forward_order(work, hq, "head_major"), slots, unit)[2]
        return after, before, 0 if max_blocks is None else int(max_blocks)
    work = wm.dkdv_work(seg, block_m, block_n)
    if not len(work):
        return 1.0, 1.0, 1
    unit = work.max()
    split = wm.choose_dkdv_split(work, hkv, group, slots)
    after = wm.makespan_ratio(wm.dkdv_order(work, hkv, group, split, "flat"), slots, unit)[2]
    before = wm.makespan_ratio(wm.dkdv_order(work, hkv, group, 1, "head_major"), slots, unit)[2]
    return after, before, split


def run(windows=(16384, 131072), cps=(1, 2, 4, 8), heads=(4, 32), group: int = 4, n_sm: int = 132,
        programs_per_sm: int = 1, n_batches: int = 2, seed: int = DEFAULT_SEED) -> list[dict]:
    slots = n_sm * programs_per_sm
    rows = []
    for window in windows:
        for cp in cps:
            tables = []
            for lengths, offsets, cost in _micro_batches(window, cp, n_batches, seed):
                shard = solve_shard(lengths, None, "adaptive", cost, offsets=offsets)
                tables.extend(seg.astype(np.int64) for seg in shard.segments if len(seg))
            for hq in heads:
                for kernel in BLOCKS:
                    res = np.array([_ratios(seg, kernel, hq, group, slots) for seg in tables])
                    splits = sorted({int(s) for s in res[:, 2]})
                    n_split_k = int(np.count_nonzero(res[:, 2])) if kernel != "dkdv" else 0
                    rows.append(dict(window=window, cp=cp, heads=hq, kv_heads=hq // group, kernel=kernel,
                                     block_m=BLOCKS[kernel][0], block_n=BLOCKS[kernel][1], tables=len(tables),
                                     sms=n_sm, programs_per_sm=programs_per_sm,
                                     makespan_ratio=float(res[:, 0].max()),
                                     makespan_ratio_mean=float(res[:, 0].mean()),
                                     makespan_ratio_before=float(res[:, 1].max()),
                                     makespan_ratio_before_mean=float(res[:, 1].mean()),
                                     dkdv_splits=splits if kernel == "dkdv" else None,
                                     split_k_tables=n_split_k if kernel != "dkdv" else None))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt bench kernel --schedule", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/kernel_schedule"), help="folder for the JSON")
    p.add_argument("--sms", type=count, default=132, help="streaming multiprocessors (default 132, H100/H200)")
    p.add_argument("--programs-per-sm", type=count, default=1,
                   help="programs resident per SM (default 1: the head-dim-128 configs, see aot_check)")
    p.add_argument("--batches", type=count, default=2, help="global batches per (window, cp) (default 2)")
    p.add_argument("--seed", type=natural, default=DEFAULT_SEED, help="length-stream seed")
    args = p.parse_args(argv)
    rows = run(n_sm=args.sms, programs_per_sm=args.programs_per_sm, n_batches=args.batches, seed=args.seed)
    print(f"{'window':>7} {'cp':>3} {'heads':>5} {'kernel':>6} {'before':>7} {'after':>6} {'mean':>6}  split")
    for r in rows:
        split = f"heads in {r['dkdv_splits']} shares" if r["kernel"] == "dkdv" else \
            f"split-K in {r['split_k_tables']}/{r['tables']} tables"
        print(f"{r['window']:>7} {r['cp']:>3} {r['heads']:>5} {r['kernel']:>6} {r['makespan_ratio_before']:>7.2f} "
              f"{r['makespan_ratio']:>6.2f} {r['makespan_ratio_mean']:>6.2f}  {split}")
    worst = max(r["makespan_ratio"] for r in rows)
    print(f"worst makespan / ideal: {worst:.3f} (target <= {TARGET}); before: "
          f"{max(r['makespan_ratio_before'] for r in rows):.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel_schedule.json").write_text(json.dumps(dict(
        provenance=provenance("kernel", ["--schedule", *(sys.argv[1:] if argv is None else argv)]),
        sms=args.sms, programs_per_sm=args.programs_per_sm, target=TARGET, rows=rows), indent=1))
    print(f"wrote {args.out / 'kernel_schedule.json'}")
    return 0
