"""Instructions per `WLBPacker.pack`, counted under valgrind.

    python scripts/pack_instructions.py heavy --n-micro 4 --lookahead 4
    python scripts/pack_instructions.py real,heavy --n-micro 4,32 --lookahead 0,4 --out docs/results/pack_instructions

A count of instructions does not move with the load of a shared machine, as CPU times do, and
it repeats exactly from run to run, so it is the measure for exact changes to the streaming
planner (changes that keep every plan: the digests tests check that). Each distribution,
micro-batch count and lookahead given (comma-separated) is one row; with --out the rows go to
FOLDER/pack_instructions.json (with the command, the code and the machine), which
`wlb-opt bench report` renders into docs/results.md.

The stream is `wlb-opt bench stream-speed`'s first seed of the distribution: the same window,
max_tokens and default cost model. The packer plans its first --steps steps; --sample steps,
evenly spaced after a 20-step warm-up, are kept with the packer's state before each
(`state_dict`). A child process under valgrind's callgrind packs every kept step once (imports,
caches), leaves the objects alive then out of the garbage collector (`gc.freeze`, as `bench
stream-speed` does), then loads each state again and packs its step through `operator.call`:
callgrind counts only while that C function runs (`--toggle-collect`), so the total is what
the `pack` calls ran, nothing else. Packing loops in pure Python (the default install); hash
seed 0.

Needs valgrind (Debian: `apt-get install valgrind`) and a Python whose symbols valgrind can
read (it finds `_operator_call`; a stripped interpreter counts nothing, and the script says
so). Run it from the repository root, or with PYTHONPATH naming the checkout whose code to count.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import operator
import os
import pickle
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

WARM_UP = 20
"""Steps planned before the first kept one (bench parity's warm-up)."""


def _stream(dist: str, n_micro: int, steps: int):
    from wlb_opt.bench.stream_speed import SEED_OFFSET
    from wlb_opt.cost_args import add_cost_args, cost_from_args
    from wlb_opt.workloads import DEFAULT_SEED, global_batches

    parser = argparse.ArgumentParser()
    add_cost_args(parser, layout=("tp", "cp", "pp", "dp"))
    cost = cost_from_args(parser.parse_args([]), parser=parser)
    window = 131072
    max_tokens = int(1.25 * window)  # bench stream-speed's
    batches = global_batches(dist, window, n_micro * window, steps, seed=DEFAULT_SEED + SEED_OFFSET)
    return batches, max_tokens, cost


def snapshot(dist: str, n_micro: int, lookahead: int, steps: int, sample: int) -> dict:
    """The kept steps: (packer state before the step, its batch), with what rebuilds the packer."""
    from wlb_opt.packer import PackerConfig, WLBPacker

    if steps < WARM_UP + sample:
        raise ValueError(f"steps must be at least {WARM_UP} + sample = {WARM_UP + sample}, got {steps}")
    batches, max_tokens, cost = _stream(dist, n_micro, steps)
    packer = WLBPacker(n_micro, max_tokens, cost, config=PackerConfig(lookahead=lookahead))
    stride = (steps - WARM_UP) / sample
    keep = {WARM_UP + int(i * stride) for i in range(sample)}
    kept = []
    for step, batch in enumerate(batches):
        if step in keep:
            kept.append((copy.deepcopy(packer.state_dict()), batch))
        packer.pack(*batch)
    return dict(n_micro=n_micro, lookahead=lookahead, max_tokens=max_tokens, cost=cost, steps=kept,
                kept=sorted(keep))


def replay(path: str) -> None:
    """The child: every kept step packed once, then each state loaded again and its step packed
    through `operator.call`, where callgrind counts."""
    from wlb_opt.packer import PackerConfig, WLBPacker

    with open(path, "rb") as f:
        snap = pickle.load(f)
    packer = WLBPacker(snap["n_micro"], snap["max_tokens"], snap["cost"],
                       config=PackerConfig(lookahead=snap["lookahead"]))
    for state, batch in snap["steps"]:
        packer.load_state_dict(state)
        packer.pack(*batch)
    gc.collect()
    gc.freeze()  # as bench stream-speed: a collection does not walk the harness's objects
    for state, batch in snap["steps"]:
        packer.load_state_dict(state)
        operator.call(packer.pack, *batch)


def _instructions(path: str, tmp: str) -> int:
    """Instructions callgrind counted inside `operator.call` in the child."""
    env = dict(os.environ, PYTHONHASHSEED="0", WLB_OPT_COMPILED="0")
    out_file = str(Path(tmp) / "callgrind.out")
    cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=_operator_call",
           f"--callgrind-out-file={out_file}", sys.executable, __file__, "--replay", path]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"valgrind run failed:\n{out.stderr[-2000:]}")
    found = re.search(r"^summary:\s+(\d+)", Path(out_file).read_text(), re.MULTILINE)
    count = int(found.group(1)) if found else 0
    if count == 0:
        raise SystemExit("callgrind counted no instruction inside operator.call: valgrind cannot read this "
                         "Python's symbols (install its debug symbols, or use a Python built with them)")
    return count


def _list(text: str, name: str, kind=int, choices=None) -> list:
    """The distinct values of a comma-separated option, in their given order."""
    try:
        values = list(dict.fromkeys(kind(x) for x in text.split(",") if x))
    except ValueError:
        raise SystemExit(f"{name} must be comma-separated {kind.__name__}s, got {text!r}") from None
    if not values:
        raise SystemExit(f"{name} must name at least one value, got {text!r}")
    if choices is not None and any(v not in choices for v in values):
        raise SystemExit(f"{name} must be among {', '.join(choices)}, got {text!r}")
    return values


def count(dist: str, n_micro: int, lookahead: int, steps: int, sample: int) -> dict:
    """One row: instructions per `pack` over the kept steps of one stream."""
    snap = snapshot(dist, n_micro, lookahead, steps, sample)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "steps.pkl")
        with open(path, "wb") as f:
            pickle.dump(snap, f)
        per_step = _instructions(path, tmp) / len(snap["steps"])
    return dict(dist=dist, n_micro=n_micro, lookahead=lookahead, steps=steps, counted=len(snap["steps"]),
                m_instructions_per_pack=round(per_step / 1e6, 3), instructions_per_pack=per_step,
                counted_steps=snap["kept"])


def main(argv=None) -> None:
    from wlb_opt.workloads import DISTRIBUTIONS

    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--replay":
        replay(sys.argv[2])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dists", help="comma-separated length distributions of the streams "
                                 f"({', '.join(sorted(DISTRIBUTIONS))})")
    p.add_argument("--n-micro", default="4", help="comma-separated micro-batches per step (default 4)")
    p.add_argument("--lookahead", default="0", help="comma-separated PackerConfig.lookahead values (default 0)")
    p.add_argument("--steps", type=int, default=600, help="steps of each stream planned (default 600)")
    p.add_argument("--sample", type=int, default=16, help="steps counted, evenly spaced (default 16)")
    p.add_argument("--out", help="folder for pack_instructions.json (default: none, printed only)")
    args = p.parse_args(argv)
    dists = _list(args.dists, "dists", str, sorted(DISTRIBUTIONS))
    n_micros = _list(args.n_micro, "--n-micro")
    lookaheads = _list(args.lookahead, "--lookahead")
    if min(n_micros) < 1 or min(lookaheads) < 0 or args.sample < 1:
        raise SystemExit(f"--n-micro and --sample must be >= 1 and --lookahead >= 0, got {args.n_micro}, "
                         f"{args.sample}, {args.lookahead}")
    if args.steps < WARM_UP + args.sample:
        raise SystemExit(f"--steps must be at least {WARM_UP} + --sample = {WARM_UP + args.sample}, got {args.steps}")
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (Debian: apt-get install valgrind)")
    rows = []
    for dist in dists:
        for n_micro in n_micros:
            for lookahead in lookaheads:
                rows.append(count(dist, n_micro, lookahead, args.steps, args.sample))
                print(f"{dist}, {n_micro} micro-batches, lookahead {lookahead}: "
                      f"{rows[-1]['m_instructions_per_pack']:.2f} M instructions per pack "
                      f"({args.sample} steps of {args.steps})", flush=True)
    if args.out:
        from wlb_opt._provenance import code, machine

        argv_used = sys.argv[1:] if argv is None else list(argv)
        provenance = dict(command=shlex.join(["python", "scripts/pack_instructions.py", *argv_used]), code=code(),
                          machine=machine())
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "pack_instructions.json").write_text(json.dumps(dict(
            provenance=provenance, valgrind=_valgrind_version(), steps=args.steps, sample=args.sample, warm_up=WARM_UP,
            rows=rows), indent=1) + "\n")
        print(f"wrote {out / 'pack_instructions.json'}")


def _valgrind_version() -> str:
    out = subprocess.run(["valgrind", "--version"], capture_output=True, text=True)
    return out.stdout.strip()


if __name__ == "__main__":
    main()
