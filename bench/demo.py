"""`wlb-opt demo`: the main job. The quick end-to-end benchmark on the embedded default workload.

Runs `wlb-opt bench e2e --quick`: paper Table 1's eight configurations (550M to 70B, 64K and
128K windows) x four methods (Plain-4D, Fixed-4D, WLB-LLM, and the best this library has),
each step planned by the real packer and CP sharding and timed by the pipeline simulator.
Prints the table and the paper's figures beside ours, and says where the PNGs are.
"""
from __future__ import annotations

import argparse
import logging
import warnings

from . import e2e
from ..cost_args import count, natural
from ..documents import load_lengths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/demo", help="folder for e2e.json and the PNGs (default results/demo)")
    p.add_argument("--steps", type=count, default=None, help="global batches per configuration (default 24)")
    p.add_argument("--lengths", metavar="FILE", help="your document lengths (.npy/.txt/.jsonl) instead of the default")
    p.add_argument("--configs", default=None, help="subset of configurations, e.g. 7B-128K (default: all 8)")
    p.add_argument("--seed", type=natural, default=0)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:  # checked here, so that an error shows this command's usage, not the benchmark's it runs
        e2e.parse_configs(args.configs)
        if args.lengths:
            load_lengths(args.lengths)
    except ValueError as exc:
        p.error(str(exc))
    data = f"the document lengths of {args.lengths}" if args.lengths else "the default document-length distribution"
    print(f"wlb-opt demo: simulated training steps of paper Table 1's configurations on {data}\n(cost model: "
          "analytic, H100; see docs/benchmarks.md, 'What the simulator models').")
    forward = ["--quick", "--out", args.out, "--seed", str(args.seed)]
    for flag, value in (("--steps", args.steps), ("--lengths", args.lengths), ("--configs", args.configs)):
        if value is not None:
            forward += [flag, str(value)]
    if args.no_progress:
        forward.append("--no-progress")
    rc = _quiet_about_own_settings(lambda argv: e2e.main(argv, prog="wlb-opt demo"), forward)
    if rc == 0:
        print(f"\nPictures: {args.out}/speedup.png (speedup per configuration) and {args.out}/gantt_*.png "
              "(one step, Plain-4D above WLB-LLM).\nFull run with the 7B-128K breakdown and the context sweep: "
              "wlb-opt bench e2e --out results/e2e")
    return rc


def _quiet_about_own_settings(run, argv: list[str]) -> int:
    """`run(argv)` without the packer's notice about the share of outlier tokens.

    The Fixed-4D and WLB-LLM rows use the paper's explicit outlier thresholds on purpose (they
    reproduce the paper's methods); the notice advises other thresholds, which is meant for a
    user's own packer, not for the demo's rows. Every other notice and warning still shows."""
    logger = logging.getLogger("wlb_opt")
    notice = _OUTLIER_NOTICE

    def drop(record: logging.LogRecord) -> bool:
        return notice not in record.getMessage()

    logger.addFilter(drop)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=f".*{notice}", category=UserWarning)
            return run(argv)
    finally:
        logger.removeFilter(drop)


_OUTLIER_NOTICE = "of the batch's tokens are in outliers"
"""The words of the packer's notice that a batch is mostly outliers (wlb_opt.packer)."""
