"""`wlb-opt bench validate-sim`: the simulator against a real pipeline run.

Spawns `--pp` gloo processes on this machine, each holding one stage (or, with
`--virtual-stages 2`, two interleaved chunks) of a small Llama-style model, and runs real
training steps of packed micro-batches through the executor's variable-length pipeline
(`wlb_opt.executor.train_step`: 1F1B for v = 1, Megatron's interleaved 1F1B for v > 1).
Every rank records the compute time of each of its forward and backward operations
(`StageOutputs`). Rank 0 then feeds those per-operation times to `simulate_pipeline` with the
same schedule and compares the predicted step time and per-stage busy time with the
measured ones (`simulate.compare_to_measured`), for every v asked for; and replays the
executor's own p2p groups under rendezvous semantics (`wlb_opt.rendezvous`), where a send
waits for its receiver, which the DAG does not model.

This checks the simulator's schedule and dependency model (bubbles, warm-up, 1F1B order) on
real execution, independently of the cost model. With `--predict` (the default) it also
profiles one block of the same model here (`wlb_opt.profile.profile_block`, one thread, like
each pipeline rank), and predicts every step from the plan alone: per-stage times =
`cost.micro_batch_cost(lengths, phase) / pp`, then `simulate_pipeline`. That closes the loop
profile -> cost model -> simulator -> measured step. The profile covers transformer blocks
only (not the embedding, LM head and loss), and on a shared CPU the processes also compete
for cores, which the simulator does not model; the report says how far apart they are.
"""
from __future__ import annotations

import argparse
import datetime
import json
import socket
import time
from pathlib import Path

import numpy as np

from ..pack import PACK_METHODS
from ..cost_args import count, natural


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, args: dict, out_file: str) -> None:
    """One pipeline rank: for each v of args["virtual_stages"], run the steps and record."""
    import torch
    import torch.distributed as dist

    import wlb_opt as wlb
    import wlb_opt.executor as ex
    from wlb_opt.data import global_batches

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        mesh = ex.make_mesh(cp=1, dp=1, pp=world)
        torch.manual_seed(0)
        model = ex.TinyLM(vocab=512, dim=args["dim"], layers=args["layers"], heads=8, kv_heads=4,
                          ffn=2 * args["dim"])
        window, n_micro = args["window"], args["n_micro"]
        spec = wlb.ModelSpec(hidden=args["dim"], layers=args["layers"], heads=8, kv_heads=4, ffn=2 * args["dim"],
                             vocab=512)
        cost = wlb.CostModel.analytic(spec, wlb.ParallelSpec(pp=world), wlb.HardwareSpec.preset("cpu"))
        scale = 131072 // window
        records = {}
        batches = global_batches("default", 131072, n_micro * 131072, args["steps"] + 1, seed=args["seed"])
        for v in args["virtual_stages"]:
            records[v] = _run(ex, wlb, dist, torch, mesh, model, cost, batches, scale, args, v)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, records)
        if rank == 0:
            Path(out_file).write_text(json.dumps({str(v): [g[v] for g in gathered] for v in args["virtual_stages"]}))
    finally:
        dist.destroy_process_group()


def _run(ex, wlb, dist, torch, mesh, model, cost, batches, scale, args, v: int) -> list[dict]:
    """The steps of one schedule (v chunks per rank) on this rank; the first is a warm-up."""
    window, n_micro = args["window"], args["n_micro"]  # noqa: F841 - window used by max_tokens
    chunks = ex.split_stages(model, mesh.pp, v)[mesh.pp_rank::mesh.pp]
    records = []
    for step, (lengths, ids, offsets) in enumerate(batches):
        small = np.maximum(1, lengths // scale)
        max_tokens = window if args["method"] == "original" else int(1.25 * window)
        small = np.minimum(small, max_tokens)
        plan = wlb.solve_pack(small, n_micro, max_tokens, cost, args["method"], ids=np.arange(len(small)))
        shards = [wlb.solve_shard(plan.lengths[mb], 1, "per_seq", cost) if len(mb) else None
                  for mb in plan.micro_batches]

        def doc_tokens(i: int, small=small) -> torch.Tensor:
            g = torch.Generator().manual_seed(i)
            return torch.randint(0, 512, (int(small[i]),), generator=g)

        rec = ex.StageOutputs()
        dist.barrier()
        t0 = time.perf_counter()
        ex.train_step(chunks, plan, shards, data=doc_tokens, mesh=mesh, backend="torch", record=rec,
                      check_plan=False)
        wall = time.perf_counter() - t0
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        if step == 0:
            continue  # warm-up
        records.append(dict(step=step, wall=wall, ops=rec.ops, micro_batches=list(range(len(plan.micro_batches))),
                            lengths=[plan.lengths[mb].tolist() for mb in plan.micro_batches],
                            tokens=plan.tokens.tolist()))
    return records


def analyse(gathered: list, pp: int, cost=None, virtual_stages: int = 1) -> list[dict]:
    """Per step: simulated step time from measured op durations vs the measured wall time;
    with a cost model, also the step predicted from the plan's lengths alone. `gathered[r]`
    holds rank r's step records; ops are (phase, micro-batch, virtual stage, seconds)."""
    from ..rendezvous import simulate_rendezvous
    from ..simulate import compare_to_measured, simulate_pipeline

    v = virtual_stages
    schedule = "interleaved" if v > 1 else "1f1b"
    rows = []
    for s in range(len(gathered[0])):
        mbs = gathered[0][s]["micro_batches"]
        col = {j: c for c, j in enumerate(mbs)}
        fwd = np.zeros((pp, v, len(mbs)))
        bwd = np.zeros((pp, v, len(mbs)))
        for stage in range(pp):
            for phase, j, vs, secs in gathered[stage][s]["ops"]:
                (fwd if phase == "F" else bwd)[vs % pp, vs // pp, col[j]] = secs
        sim = simulate_pipeline(fwd, bwd, schedule=schedule, virtual_stages=v)
        measured = max(gathered[stage][s]["wall"] for stage in range(pp))
        busy = fwd.sum(axis=(1, 2)) + bwd.sum(axis=(1, 2))
        err = compare_to_measured(sim, measured, busy)
        rdv = simulate_rendezvous(fwd, bwd, virtual_stages=v).step_time_s
        row = dict(virtual_stages=v, step=gathered[0][s]["step"], measured_s=measured, simulated_s=sim.step_time_s,
                   rel_error=err["step_rel_error"], bubble_fraction=sim.bubble_fraction,
                   rendezvous_s=rdv, rendezvous_rel_error=rdv / measured - 1.0,
                   tokens=gathered[0][s]["tokens"])
        if cost is not None:
            lengths = gathered[0][s]["lengths"]
            f = np.array([cost.micro_batch_cost(d, "fwd") / pp if d else 0.0 for d in lengths])
            b = np.array([cost.micro_batch_cost(d, "bwd") / pp if d else 0.0 for d in lengths])
            pred = simulate_pipeline(np.tile(f, (pp, 1)), np.tile(b, (pp, 1)), schedule=schedule, virtual_stages=v)
            row.update(predicted_s=pred.step_time_s, predicted_rel_error=pred.step_time_s / measured - 1.0)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt bench validate-sim", description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=count, default=2, help="pipeline stages = processes (default 2)")
    p.add_argument("--n-micro", type=count, default=4, help="micro-batches per step (default 4)")
    p.add_argument("--window", type=count, default=2048, help="tokens per micro-batch (default 2048)")
    p.add_argument("--dim", type=count, default=256, help="model width (default 256)")
    p.add_argument("--layers", type=count, default=4, help="transformer blocks, split over the stages (default 4)")
    p.add_argument("--steps", type=count, default=4, help="measured steps after one warm-up step (default 4)")
    p.add_argument("--method", default="original", choices=sorted(PACK_METHODS),
                   help="packing method (default original: unequal micro-batches)")
    p.add_argument("--seed", type=natural, default=0, help="stream seed (default 0)")
    p.add_argument("--no-predict", action="store_true",
                   help="skip profiling a block here and predicting steps from the cost model")
    p.add_argument("--virtual-stages", default="1,2",
                   help="comma list of model chunks per rank to run (1: 1F1B, 2: interleaved; default 1,2)")
    p.add_argument("--out", default="results/validate_sim", help="folder for validate_sim.json")
    args = p.parse_args(argv)
    try:
        vs_list = sorted({int(x) for x in args.virtual_stages.split(",") if x.strip()})
    except ValueError:
        p.error(f"--virtual-stages must be a comma list of integers, got {args.virtual_stages!r}")
    for v in vs_list:
        if v < 1 or args.layers < args.pp * v or (v > 1 and args.n_micro % args.pp):
            p.error(f"--virtual-stages {v} needs --layers >= pp x v ({args.pp * v}) and, for v > 1, --n-micro a "
                    f"multiple of --pp (got --layers {args.layers}, --n-micro {args.n_micro})")
    import torch.multiprocessing as mp

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "validate_sim_raw.json"
    cfg = dict(dim=args.dim, layers=args.layers, window=args.window, n_micro=args.n_micro, steps=args.steps,
               method=args.method, seed=args.seed, virtual_stages=vs_list)
    cost = None
    if not args.no_predict:
        import torch

        import wlb_opt as wlb
        from wlb_opt.profile import profile_block

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each pipeline rank runs
        spec = wlb.ModelSpec(hidden=args.dim, layers=args.layers, heads=8, kv_heads=4, ffn=2 * args.dim, vocab=512)
        cost = profile_block(spec, window=args.window, n_samples=8, device="cpu", repeats=2, q_lens=(16, 64, 256),
                             show_progress=False)
        torch.set_num_threads(threads)
        cost.save(out / "cost_profiled.json")
    mp.spawn(_worker, args=(args.pp, _free_port(), cfg, str(raw)), nprocs=args.pp, join=True)
    raw_all = json.loads(raw.read_text())
    rows = [r for v in vs_list for r in analyse(raw_all[str(v)], args.pp, cost, v)]
    print(f"pp={args.pp}, {args.n_micro} micro-batches of <= {args.window} tokens ({args.method}), "
          f"dim {args.dim}, {args.layers} layers, gloo on this machine")
    print(f"{'v':>2} {'step':>4} {'measured s':>10} {'sim(measured ops) s':>19} {'error':>7} {'bubble':>7} "
          f"{'rendezvous s':>12} {'error':>7} {'predicted s':>11} {'error':>7}  tokens per micro-batch")
    for r in rows:
        pred = (f"{r['predicted_s']:>11.3f} {r['predicted_rel_error']:>+7.1%}" if "predicted_s" in r
                else f"{'-':>11} {'-':>7}")
        print(f"{r['virtual_stages']:>2} {r['step']:>4} {r['measured_s']:>10.3f} {r['simulated_s']:>19.3f} "
              f"{r['rel_error']:>+7.1%} {r['bubble_fraction']:>7.1%} {r['rendezvous_s']:>12.3f} "
              f"{r['rendezvous_rel_error']:>+7.1%} {pred}  {r['tokens']}")
    for v in vs_list:
        mine = [r for r in rows if r["virtual_stages"] == v]
        errs = np.array([r["rel_error"] for r in mine])
        rdv = np.array([r["rendezvous_rel_error"] for r in mine])
        print(f"v={v}: median |error| on measured op times: DAG simulator {np.median(np.abs(errs)):.1%}, "
              f"rendezvous replay of the executor's schedule {np.median(np.abs(rdv)):.1%}" + (
            f"; profiled cost model + simulator {np.median(np.abs([r['predicted_rel_error'] for r in mine])):.1%}"
            if cost is not None else ""))
    (out / "validate_sim.json").write_text(json.dumps(dict(config=cfg, pp=args.pp, rows=rows), indent=2))
    print(f"wrote {out / 'validate_sim.json'}")
    return 0
