"""`wlb-opt bench hf-throughput`: examples/train_hf.py on gloo ranks against its `--hf-packed` baseline.

    nice -n 5 wlb-opt bench hf-throughput --out results/hf_throughput           (CPU, minutes)
    wlb-opt bench hf-throughput --configs cp2 --steps 2 --rounds 1 --window 128 --out /tmp/h   (quick)

Each configuration runs examples/train_hf.py under ``python -m torch.distributed.run
--standalone`` (gloo on CPU): "cp2" (2 ranks, ``--cp 2``), "dp2" (2 ranks, ``--dp 2``) and
"cp2_dp2" (4 ranks, ``--cp 2 --dp 2``). Its baseline is the same example with ``--hf-packed
--dp <dp>``: one process, the same corpus, packer and steps (tokens per step = dp x n_micro x
window), each micro-batch one packed row through transformers' sdpa path. Both sides train
the same tiny Llama from the same seed with AdamW, so their per-step losses agree (reported).

The runs go one after another (never two at once), every run of a round in rotating order,
all with ``OMP_NUM_THREADS=1`` so a process's CPU time is one thread's work. The example
writes each step's wall seconds and each process's CPU seconds (``--json``); per step, the
distributed side's CPU time is the sum over its ranks' processes (the DataLoader workers that
plan are not counted, as the baseline plans outside its timer) and its wall time the slowest
rank's. The first `--warmup` steps of every run are dropped; figures are medians over the
remaining steps of all rounds, tokens/s is tokens per step over that median (CPU: tokens per
CPU second of all ranks together), and each ratio is the example's tokens/s over the
baseline's in the same clock. On a machine with fewer cores than ranks the wall figures
measure time-sharing: the load average before and after each run stands beside them, as
context, not as a target.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..cost_args import count, natural, seconds
from ._provenance import provenance

CONFIGS = {"cp2": (2, 1, ("--cp", "2")), "dp2": (2, 2, ("--dp", "2")), "cp2_dp2": (4, 2, ("--cp", "2", "--dp", "2"))}
"""name -> (ranks, dp, flags of examples/train_hf.py)."""
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_hf.py"


def _commands(config: str, common: list[str]) -> tuple[list[str], list[str]]:
    """(the distributed command, its `--hf-packed` baseline) of one configuration."""
    ranks, dp, flags = CONFIGS[config]
    wlb = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           str(EXAMPLE), *flags, *common]
    hf = [sys.executable, str(EXAMPLE), "--hf-packed", "--dp", str(dp), *common]
    return wlb, hf


def _run(cmd: list[str], timeout_s: float) -> dict:
    """Runs one command with its `--json` folder; its steps (per step: tokens, loss, wall_s the
    slowest process's, cpu_s the sum over processes) and the load average before and after."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        load_before, t0 = os.getloadavg(), time.perf_counter()
        res = subprocess.run([*cmd, "--json", tmp], capture_output=True, text=True, env=env, timeout=timeout_s)
        seconds, load_after = time.perf_counter() - t0, os.getloadavg()
        if res.returncode != 0:
            raise RuntimeError(f"{shlex.join(cmd)} exited {res.returncode}:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
        per_process = [[json.loads(line) for line in f.read_text().splitlines()] for f in sorted(Path(tmp).glob("*.jsonl"))]
    if not per_process or len({len(lines) for lines in per_process}) != 1:
        raise RuntimeError(f"{shlex.join(cmd)} wrote uneven or no step logs: {[len(x) for x in per_process]}")
    steps = [dict(step=lines[0]["step"], tokens=lines[0]["tokens"], loss=lines[0]["loss"],
                  wall_s=max(x["wall_s"] for x in lines), cpu_s=sum(x["cpu_s"] for x in lines))
             for lines in zip(*per_process)]
    return dict(steps=steps, processes=len(per_process), run_s=seconds, load_before=load_before[0],
                load_after=load_after[0])


def _side(runs: list[dict], warmup: int) -> dict:
    """Median tokens per step, CPU and wall seconds over the timed steps of all runs of one side."""
    timed = [s for run in runs for s in run["steps"] if s["step"] >= warmup]
    med = lambda key: float(statistics.median(s[key] for s in timed))  # noqa: E731
    return dict(steps=len(timed), tokens=med("tokens"), cpu_s=med("cpu_s"), wall_s=med("wall_s"))


def measure(configs: list[str], common: list[str], rounds: int, warmup: int, timeout_s: float) -> list[dict]:
    """One row per configuration: both sides' tokens/s in CPU and wall time, the ratios, the
    largest per-step loss difference, the load averages and both commands."""
    runs: dict[tuple[str, str], list[dict]] = {}
    jobs = [(config, side) for config in configs for side in ("wlb", "hf")]
    for r in range(rounds):
        turn = r % len(jobs)
        for config, side in jobs[turn:] + jobs[:turn]:
            cmd = _commands(config, common)[side == "hf"]
            runs.setdefault((config, side), []).append(_run(cmd, timeout_s))
    rows = []
    for config in configs:
        wlb_runs, hf_runs = runs[(config, "wlb")], runs[(config, "hf")]
        ours, theirs = _side(wlb_runs, warmup), _side(hf_runs, warmup)
        if ours["tokens"] != theirs["tokens"]:
            raise RuntimeError(f"{config}: unequal tokens per step, {ours['tokens']} against {theirs['tokens']}")
        loss_diff = max(abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-12)
                        for run_a, run_b in zip(wlb_runs, hf_runs) for a, b in zip(run_a["steps"], run_b["steps"]))
        wlb_cmd, hf_cmd = _commands(config, common)
        row = dict(config=config, ranks=CONFIGS[config][0], steps=ours["steps"], tokens_per_step=ours["tokens"])
        for clock in ("cpu", "wall"):
            row[f"wlb_{clock}_tokens_per_s"] = ours["tokens"] / ours[f"{clock}_s"]
            row[f"hf_{clock}_tokens_per_s"] = theirs["tokens"] / theirs[f"{clock}_s"]
            row[f"ratio_{clock}"] = row[f"wlb_{clock}_tokens_per_s"] / row[f"hf_{clock}_tokens_per_s"]
        row["max_loss_rel_diff"] = loss_diff
        row["load_average"] = " ".join(f"{run['load_before']:.1f}>{run['load_after']:.1f}" for run in wlb_runs)
        row["hf_load_average"] = " ".join(f"{run['load_before']:.1f}>{run['load_after']:.1f}" for run in hf_runs)
        # the example's own command lines (the bench adds --json DIR and OMP_NUM_THREADS=1)
        row["command"] = shlex.join(["python", *wlb_cmd[1:]]).replace(str(EXAMPLE), "examples/train_hf.py")
        row["hf_command"] = shlex.join(["python", *hf_cmd[1:]]).replace(str(EXAMPLE), "examples/train_hf.py")
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt bench hf-throughput", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/hf_throughput"), help="folder for hf_throughput.json")
    p.add_argument("--configs", nargs="+", choices=tuple(CONFIGS), default=list(CONFIGS))
    p.add_argument("--steps", type=count, default=4, help="steps per run, the warm-up included (default 4)")
    p.add_argument("--warmup", type=natural, default=1, help="first steps of every run left out (default 1)")
    p.add_argument("--rounds", type=count, default=2, help="runs of every command, in rotating order (default 2)")
    p.add_argument("--window", type=count, default=256, help="the example's --window (default 256)")
    p.add_argument("--timeout", type=seconds, default=600.0, help="seconds per run before it is stopped (default 600)")
    args = p.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup must be in [0, --steps), got {args.warmup} with --steps {args.steps}")
    if not EXAMPLE.is_file():
        p.error(f"{EXAMPLE} is not there: this benchmark runs from a source checkout of the repository")
    common = ["--steps", str(args.steps), "--window", str(args.window)]
    load_start = os.getloadavg()
    try:
        rows = measure(args.configs, common, args.rounds, args.warmup, args.timeout)
    except subprocess.TimeoutExpired as exc:
        print(f"wlb-opt bench hf-throughput: error: {shlex.join(exc.cmd)} ran past --timeout {args.timeout:g} s",
              file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a run that failed, named with its output
        print(f"wlb-opt bench hf-throughput: error: {exc}", file=sys.stderr)
        return 1
    load_end = os.getloadavg()
    result = dict(provenance=provenance("hf_throughput", argv), threads_per_process=1, rounds=args.rounds,
                  warmup=args.warmup, load_average_start_end=[*load_start, *load_end], rows=rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hf_throughput.json").write_text(json.dumps(result, indent=1))
    print(f"{'config':>8} {'ranks':>5} {'tokens':>6} {'clock':>5} {'wlb tok/s':>10} {'hf tok/s':>10} {'ratio':>6} "
          f"{'load avg (1 min, before>after)':>30}")
    for row in rows:
        for clock in ("cpu", "wall"):
            print(f"{row['config']:>8} {row['ranks']:>5} {row['tokens_per_step']:>6.0f} {clock:>5} "
                  f"{row[f'wlb_{clock}_tokens_per_s']:>10,.0f} {row[f'hf_{clock}_tokens_per_s']:>10,.0f} "
                  f"{row[f'ratio_{clock}']:>6.2f} {row['load_average']:>30}")
    print(f"wrote {args.out / 'hf_throughput.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
