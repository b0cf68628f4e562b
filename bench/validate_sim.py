"""`wlb-opt bench validate-sim`: the simulator and the cost model against real execution,
with the prediction error split into its parts.

    wlb-opt bench validate-sim --steps 3 --out results/validate_sim      (CPU, a few minutes)

Four measured runs of the same steps (same plans, same model, one thread per process):

1. **Single rank, no contention** (pp = 1, one process, the whole model; `train_step`): each
   forward and backward operation is predicted from the plan alone with a cost model profiled
   here (`wlb_opt.profile.profile_block`: one block, plus embedding/LM head/loss), and the
   whole step as their sum. This is the cost model's own error.
2. **Contention**: the same single-rank steps run by two processes at once on the same
   cores (barrier-synchronised, no communication): their slowdown against run 1 is what two
   ranks on the same cores cost, measured.
3. **Communication**: send/recv and all-reduce between 2 gloo ranks, profiled by
   `wlb_opt.profile.profile_comm` (latency + bytes x s/byte), priced per micro-batch
   boundary; and the measured pipeline's wall time minus the DAG on its own op times.
4. **The pipeline** (`--pp` gloo processes, one stage each, or v interleaved chunks): the
   simulator fed the measured per-op times, as `simulate_step` times a pipeline (the replay
   of the executor's p2p: its blocking groups for 1F1B, its channels for the interleaved
   schedule; the DAG beside it), and the prediction from the plan alone, then with the
   measured contention factor, then with the profiled p2p: the breakdown of the prediction
   error.

Run 4 checks the simulator's schedule and dependency model (bubbles, warm-up, 1F1B order)
independently of the cost model; runs 1-3 say where the cost model's prediction goes wrong.
The op times leave out what a step does outside its operations, and run 4 measures that too
(the executor's clocks are read around its pipeline and each p2p group or message; the
ranks share one machine, hence one monotonic clock): the work before the pipeline (reading
the inputs, the plan check, the target count) and after it (the final all-reduces), and the
transfer time of a message, its completion minus the later of its two posts. The replay is
then fed those too: each rank starts when its pipeline did, every receive waits for its
data (the profiled p2p per message, and apart the median measured transfer), and the step ends with the last rank's work after the pipeline. What the replay
still predicts is every wait.
On a shared machine other processes load the cores too: every figure is a median over steps.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import time
from pathlib import Path

import numpy as np

from ..cost_args import count, natural
from ..step_pack import PACK_METHODS
from ._provenance import provenance


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup(args: dict):
    """The model (seeded), its spec and the steps' plans, identical in every process."""
    import torch

    import wlb_opt as wlb
    import wlb_opt.executor as ex
    from wlb_opt.workloads import global_batches

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ex.TinyLM(vocab=512, dim=args["dim"], layers=args["layers"], heads=8, kv_heads=4, ffn=2 * args["dim"])
    spec = wlb.ModelSpec(hidden=args["dim"], layers=args["layers"], heads=8, kv_heads=4, ffn=2 * args["dim"],
                         vocab=512)
    cost = wlb.CostModel.analytic(spec, wlb.ParallelSpec(pp=args["pp"]), wlb.HardwareSpec.preset("cpu"))
    window, n_micro = args["window"], args["n_micro"]
    scale = 131072 // window
    max_tokens = window if args["method"] == "original" else int(1.25 * window)
    plans = []
    for lengths, _, _ in global_batches("default", 131072, n_micro * 131072, args["steps"] + 1, seed=args["seed"]):
        small = np.minimum(np.maximum(1, lengths // scale), max_tokens)
        plan = wlb.solve_pack(small, n_micro, max_tokens, cost, args["method"], ids=np.arange(len(small)))
        shards = [wlb.solve_shard(plan.lengths[mb], 1, "per_seq", cost, offsets=plan.offsets[mb]) if len(mb) else None
                  for mb in plan.micro_batches]
        plans.append((small, plan, shards))
    return model, spec, plans


def _clock_pipeline(spans: list) -> None:
    """Wrap the executor's pipeline run and p2p transport to append perf_counter spans to
    `spans`: ("pipeline", start, end) once per step; for 1F1B ("group", post, done) per group
    of p2p operations in the order posted (the non-empty groups of `step_plan`); for the
    interleaved channels ("message", kind, peer, direction, micro, chunk, posted, waited,
    done) per send or receive (`waited`: when the rank began waiting for it)."""
    import wlb_opt.executor.pipeline as pipeline

    exchange, run = pipeline.DistTransport.exchange, pipeline.PipelineRunner.run
    send, recv = pipeline.DistTransport.send, pipeline.DistTransport.recv

    def timed_exchange(self, group, tensors):
        t = time.perf_counter()
        exchange(self, group, tensors)
        spans.append(("group", t, time.perf_counter()))

    def timed_run(self, forward):
        t = time.perf_counter()
        run(self, forward)
        spans.append(("pipeline", t, time.perf_counter()))

    def timed(method):
        def post(self, op, t):
            posted = time.perf_counter()
            request = method(self, op, t)
            entry = ["message", op.kind, op.peer, op.direction, op.micro, op.chunk, posted, None, None]
            spans.append(entry)
            wait = request.wait

            def timed_wait():
                entry[7] = time.perf_counter()
                wait()
                entry[8] = time.perf_counter()
            request.wait = timed_wait
            return request
        return post

    pipeline.DistTransport.exchange, pipeline.PipelineRunner.run = timed_exchange, timed_run
    pipeline.DistTransport.send, pipeline.DistTransport.recv = timed(send), timed(recv)


def _worker(rank: int, world: int, port: int, args: dict, out_file: str) -> None:
    """One pipeline rank: for each v of args["virtual_stages"], run the steps and record."""
    import torch.distributed as dist

    import wlb_opt.executor as ex

    spans: list = []
    _clock_pipeline(spans)
    model, _, plans = _setup(args)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        mesh = ex.make_mesh(cp=1, dp=1, pp=world)
        records = {}
        for v in args["virtual_stages"]:
            chunks = ex.split_stages(model, mesh.pp, v)[mesh.pp_rank::mesh.pp]
            records[v] = _run(chunks, plans, mesh, dist.barrier, spans)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, records)
        if rank == 0:
            Path(out_file).write_text(json.dumps({str(v): [g[v] for g in gathered] for v in args["virtual_stages"]}))
    finally:
        dist.destroy_process_group()


def _single_worker(rank: int, world: int, barrier, args: dict, out_file: str) -> None:
    """The whole model in this process (pp = 1). Two processes take turns per step: rank 0
    runs it alone while rank 1 waits (the no-contention run), then both run it at once (two
    independent copies sharing the cores); the order alternates from step to step so that
    the machine's other load drifts into both alike. No process group (the executor's
    attention would take a default group for its CP group): a multiprocessing barrier."""
    import types

    import wlb_opt.executor.pipeline as pipeline

    model, _, plans = _setup(args)
    # the executor's op timer reads `time.perf_counter`; here it reads this thread's CPU time
    # (one torch thread: the compute runs in it), the uncontended compute time of each op
    pipeline.time = types.SimpleNamespace(perf_counter=time.thread_time)
    alone, twin = [], []
    for step, (small, plan, shards) in enumerate(plans):
        rounds = ("alone", "twin") if step % 2 == 0 else ("twin", "alone")
        for kind in rounds:
            barrier.wait()
            if kind == "twin" or rank == 0:
                rec = _step([model], small, plan, shards, None)
                if step > 0:  # the first step is a warm-up
                    (alone if kind == "alone" else twin).append(rec)
            barrier.wait()
    Path(f"{out_file}.{rank}").write_text(json.dumps(dict(alone=alone, twin=twin)))


def _step(chunks, small, plan, shards, mesh, spans: list | None = None) -> dict:
    import torch

    import wlb_opt.executor as ex

    def doc_tokens(i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, 512, (int(small[i]),), generator=g)

    rec = ex.StageOutputs()
    if spans is not None:
        spans.clear()
    t0, c0 = time.perf_counter(), time.thread_time()
    ex.train_step(chunks if mesh is not None else chunks[0], plan, shards, data=doc_tokens, mesh=mesh,
                  backend="torch", record=rec, check_plan=False)
    t1, cpu = time.perf_counter(), time.thread_time() - c0
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    out = dict(wall=t1 - t0, cpu=cpu, load_average=os.getloadavg()[0], ops=rec.ops,
               micro_batches=list(range(len(plan.micro_batches))),
               lengths=[plan.lengths[mb].tolist() for mb in plan.micro_batches], tokens=plan.tokens.tolist())
    if spans:  # absolute perf_counter seconds: the step, its pipeline and its groups
        out.update(clock=[t0, t1], pipeline=[list(s[1:]) for s in spans if s[0] == "pipeline"][0],
                   groups=[list(s[1:]) for s in spans if s[0] == "group"],
                   messages=[list(s[1:]) for s in spans if s[0] == "message"])
    return out


def _run(chunks, plans, mesh, barrier, spans: list | None = None) -> list[dict]:
    """The steps on this rank (the first is a warm-up); barrier-aligned across processes."""
    records = []
    for step, (small, plan, shards) in enumerate(plans):
        barrier()
        rec = _step(chunks, small, plan, shards, mesh, spans)
        if step > 0:
            records.append(dict(step=step, **rec))
    return records


def analyse_single(records: list[dict], cost) -> list[dict]:
    """Per step of a single-rank run: per-operation and whole-step errors of `cost`
    (predicted / measured - 1) against the step's CPU time (`cpu`, else its wall time), and
    against its wall time. Ops are (phase, micro-batch, virtual stage, seconds)."""
    rows = []
    for rec in records:
        op_errors = []
        predicted_step = 0.0
        for phase, j, _, secs in rec["ops"]:
            lengths = rec["lengths"][j]
            predicted = cost.micro_batch_cost(lengths, "fwd" if phase == "F" else "bwd") if lengths else 0.0
            predicted_step += predicted
            if secs > 0 and lengths:
                op_errors.append(predicted / secs - 1.0)
        busy = sum(op[3] for op in rec["ops"])
        cpu = rec.get("cpu", rec["wall"])
        rows.append(dict(step=rec["step"], measured_s=rec["wall"], cpu_s=cpu, busy_s=busy, predicted_s=predicted_step,
                         step_rel_error=predicted_step / cpu - 1.0, wall_rel_error=predicted_step / rec["wall"] - 1.0,
                         op_median_abs_error=float(np.median(np.abs(op_errors))) if op_errors else 0.0,
                         op_worst_abs_error=float(np.max(np.abs(op_errors))) if op_errors else 0.0))
    return rows


def predicted_pipeline_s(f: np.ndarray, b: np.ndarray, v: int, p2p_s=0.0) -> float:
    """The simulator's estimate of a pipeline step, as `simulate_step` makes it: the replay of
    the executor's p2p (1F1B: its blocking groups; interleaved: its channels)."""
    from ..simulate import _replayed

    return _replayed(np.asarray(f, dtype=np.float64), np.asarray(b, dtype=np.float64), v,
                     np.broadcast_to(np.asarray(p2p_s, dtype=np.float64), (np.shape(f)[-1],)), None).step_time_s


def breakdown(pipeline_rows: list[dict], contention: float, p2p_s_per_mb) -> list[dict]:
    """The pipeline's prediction from the plan alone, then x the measured contention factor,
    then + the profiled p2p per micro-batch boundary: errors against the measured step."""
    out = []
    for r in pipeline_rows:
        f, b, v = r["_pred_fwd"], r["_pred_bwd"], r["virtual_stages"]
        p2p = np.asarray(p2p_s_per_mb(r["tokens"]), dtype=np.float64)
        with_contention = predicted_pipeline_s(f * contention, b * contention, v)
        with_comm = predicted_pipeline_s(f * contention, b * contention, v, p2p)
        m = r["measured_s"]
        out.append(dict(virtual_stages=v, step=r["step"], measured_s=m, cost_model_error=r["predicted_rel_error"],
                        with_contention_error=with_contention / m - 1.0, with_comm_error=with_comm / m - 1.0,
                        comm_s=with_comm - with_contention))
    return out


def step_overheads(ranks: list[dict], pp: int, v: int) -> dict | None:
    """What one step did outside its operations, from every rank's clocks (`_step`'s `clock`,
    `pipeline` and `groups` or `messages`; None if a record has none): `start_s[r]` the
    seconds from rank r's step start to its pipeline's, `setup_s` the largest of them,
    `teardown_s` the shortest time from a pipeline's end to its step's end (the last rank out
    waits for no one in the final all-reduces), `transfer_s` the time the data took once both
    sides were there: for 1F1B the median over the groups that receive of the group's
    completion minus the later of its own post and its counterparts' posts; for the
    interleaved channels the median over the receives a rank was already waiting for when
    both sides were posted (the others arrived unseen) of their completion minus that
    moment."""
    from ..schedule import message_key, step_plan

    if not all("clock" in r and "groups" in r for r in ranks):
        return None
    start = [rec["pipeline"][0] - rec["clock"][0] for rec in ranks]
    teardown = min(rec["clock"][1] - rec["pipeline"][1] for rec in ranks)
    if v > 1:
        return dict(start_s=start, setup_s=max(start), teardown_s=teardown, transfer_s=_channel_transfer(ranks, pp))
    m = len(ranks[0]["micro_batches"])
    plans = [[group for group, _ in step_plan(r, pp, m, v) if group] for r in range(pp)]
    where = {}
    for r, groups in enumerate(plans):
        if len(groups) != len(ranks[r]["groups"]):
            raise ValueError(f"rank {r} recorded {len(ranks[r]['groups'])} p2p groups, but its schedule has "
                             f"{len(groups)} (pp={pp}, v={v}, {m} micro-batches)")
        for gi, group in enumerate(groups):
            for op in group:
                where[(r, op.kind, message_key(op, r, pp))] = gi
    transfers = []
    for r, groups in enumerate(plans):
        for gi, group in enumerate(groups):
            post, done = ranks[r]["groups"][gi]
            for op in group:
                other = "recv" if op.kind == "send" else "send"
                post = max(post, ranks[op.peer]["groups"][where[(op.peer, other, message_key(op, r, pp))]][0])
            if any(op.kind == "recv" for op in group):
                transfers.append(done - post)
    return dict(start_s=start, setup_s=max(start), teardown_s=teardown,
                transfer_s=float(np.median(transfers)) if transfers else 0.0)


def _channel_transfer(ranks: list[dict], pp: int) -> float:
    """`step_overheads`' transfer time of the interleaved channels (its docstring)."""
    from ..schedule import P2POp, message_key

    posted = {}
    for r, rec in enumerate(ranks):
        for kind, peer, direction, micro, chunk, at, _, _ in rec["messages"]:
            posted[(r, kind, message_key(P2POp(kind, peer, direction, micro, chunk), r, pp))] = at
    transfers = []
    for r, rec in enumerate(ranks):
        for kind, peer, direction, micro, chunk, at, waited, done in rec["messages"]:
            if kind != "recv" or waited is None:
                continue
            both = max(at, posted[(peer, "send", message_key(P2POp(kind, peer, direction, micro, chunk), r, pp))])
            if waited <= both:
                transfers.append(done - both)
    return float(np.median(transfers)) if transfers else 0.0


def replay_with_overheads(fwd: np.ndarray, bwd: np.ndarray, v: int, overheads: dict, p2p_s) -> float:
    """The step the replay of the executor's p2p (1F1B: groups; interleaved: channels) predicts
    from measured op times ([pp, v, m] seconds) and `step_overheads`: each rank starts at its
    `start_s`, every receive waits `p2p_s` (seconds, a scalar or one per micro-batch) for its
    data once both sides are posted, and the step ends `teardown_s` after the last rank's
    pipeline. For 1F1B this replay can be slower than the DAG (`wlb_opt.rendezvous`)."""
    from ..rendezvous import _replay, _replay_channels
    from ..schedule import step_plan

    if v > 1:
        return _replay_channels(fwd, bwd, p2p_s, overheads["start_s"]).step_time_s + overheads["teardown_s"]
    pp, m = fwd.shape[0], fwd.shape[2]
    plans = [step_plan(r, pp, m, v) for r in range(pp)]
    return _replay(fwd, bwd, plans, p2p_s, overheads["start_s"]).step_time_s + overheads["teardown_s"]


def analyse(gathered: list, pp: int, cost=None, virtual_stages: int = 1, p2p_s_per_mb=None) -> list[dict]:
    """Per step: the simulator's step time from measured op durations (as `simulate_step` times
    a pipeline: `predicted_pipeline_s`) and the ideal DAG's, against the measured wall time;
    with the ranks' clocks, the replay fed the measured work outside the ops too
    (`step_overheads`: measured transfer; and with `p2p_s_per_mb(tokens)`, seconds per
    micro-batch, the profiled one); with a cost model, also the step predicted from the
    plan's lengths alone. `gathered[r]` holds rank r's step records; ops are (phase,
    micro-batch, virtual stage, seconds)."""
    from ..simulate import _replayed, compare_to_measured, simulate_pipeline

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
        dag = simulate_pipeline(fwd, bwd, schedule=schedule, virtual_stages=v)
        sim = _replayed(fwd, bwd, v, np.zeros(len(mbs)), None)
        measured = max(gathered[stage][s]["wall"] for stage in range(pp))
        busy = fwd.sum(axis=(1, 2)) + bwd.sum(axis=(1, 2))
        err = compare_to_measured(sim, measured, busy)
        row = dict(virtual_stages=v, step=gathered[0][s]["step"], measured_s=measured, simulated_s=sim.step_time_s,
                   rel_error=err["step_rel_error"], bubble_fraction=sim.bubble_fraction,
                   dag_s=dag.step_time_s, dag_rel_error=dag.step_time_s / measured - 1.0,
                   tokens=gathered[0][s]["tokens"])
        if "load_average" in gathered[0][s]:
            row["load_average"] = gathered[0][s]["load_average"]
        over = step_overheads([gathered[stage][s] for stage in range(pp)], pp, v)
        if over is not None:
            with_measured = replay_with_overheads(fwd, bwd, v, over, over["transfer_s"])
            row.update(setup_s=over["setup_s"], teardown_s=over["teardown_s"], transfer_ms=1e3 * over["transfer_s"],
                       replay_measured_p2p_s=with_measured,
                       replay_measured_p2p_rel_error=with_measured / measured - 1.0)
            if p2p_s_per_mb is not None:
                with_profiled = replay_with_overheads(fwd, bwd, v, over, np.asarray(
                    p2p_s_per_mb(row["tokens"]), dtype=np.float64))
                row.update(replay_s=with_profiled, replay_rel_error=with_profiled / measured - 1.0)
        if cost is not None:
            lengths = gathered[0][s]["lengths"]
            f = np.array([cost.micro_batch_cost(d, "fwd") / pp if d else 0.0 for d in lengths])
            b = np.array([cost.micro_batch_cost(d, "bwd") / pp if d else 0.0 for d in lengths])
            f, b = np.tile(f, (pp, 1)), np.tile(b, (pp, 1))
            pred_s = predicted_pipeline_s(f, b, v)
            row.update(predicted_s=pred_s, predicted_rel_error=pred_s / measured - 1.0,
                       _pred_fwd=f, _pred_bwd=b, _schedule=schedule)
        rows.append(row)
    return rows


def _spawn(fn, nprocs: int, cfg: dict, out_file: Path):
    import torch.multiprocessing as mp

    mp.spawn(fn, args=(nprocs, _free_port(), cfg, str(out_file)), nprocs=nprocs, join=True)
    return json.loads(out_file.read_text())


def _spawn_single(nprocs: int, cfg: dict, out_file: Path) -> list:
    import torch.multiprocessing as mp

    barrier = mp.get_context("spawn").Barrier(nprocs)
    mp.spawn(_single_worker, args=(nprocs, barrier, cfg, str(out_file)), nprocs=nprocs, join=True)
    runs = [json.loads(Path(f"{out_file}.{r}").read_text()) for r in range(nprocs)]
    for run in runs:
        for kind in ("alone", "twin"):
            for i, rec in enumerate(run[kind]):
                rec["step"] = i + 1
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt bench validate-sim", description=" ".join(__doc__.split("\n\n")[0].split()))
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
                   help="skip profiling and the cost-model runs (1-3); only the simulator on measured op times")
    p.add_argument("--virtual-stages", default="1,2",
                   help="comma list of model chunks per rank to run (1: 1F1B, 2: interleaved; default 1,2)")
    p.add_argument("--out", default="results/validate_sim", help="folder for validate_sim.json")
    args = p.parse_args(argv)
    if args.window > 131072:  # the documents are 128K-window ones scaled down by 131072 // window
        p.error(f"--window must be at most 131072 tokens (the stream's 128K documents are scaled down to it), "
                f"got {args.window}")
    try:
        vs_list = sorted({int(x) for x in args.virtual_stages.split(",") if x.strip()})
    except ValueError:
        p.error(f"--virtual-stages must be a comma list of integers, got {args.virtual_stages!r}")
    if not vs_list or vs_list[0] < 1:
        p.error(f"--virtual-stages must be integers >= 1, got {args.virtual_stages!r}")
    for v in vs_list:
        if v > 1 and args.pp < 2:
            p.error(f"--virtual-stages {v} needs --pp >= 2 (chunks of one rank would send to themselves); with --pp "
                    f"{args.pp} give --virtual-stages 1")
        if args.layers < args.pp * v or (v > 1 and args.n_micro % args.pp):
            p.error(f"--virtual-stages {v} needs --layers >= pp x v ({args.pp * v}) and, for v > 1, --n-micro a "
                    f"multiple of --pp (got --layers {args.layers}, --n-micro {args.n_micro})")
    os.environ.setdefault("KINETO_LOG_LEVEL", "99")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(dim=args.dim, layers=args.layers, window=args.window, n_micro=args.n_micro, steps=args.steps,
               method=args.method, seed=args.seed, virtual_stages=vs_list, pp=args.pp)
    cost = comm = None
    result = dict(config=cfg, pp=args.pp)
    if not args.no_predict:
        import torch

        import wlb_opt as wlb
        from wlb_opt.profile import profile_block, profile_comm

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each rank runs
        spec = wlb.ModelSpec(hidden=args.dim, layers=args.layers, heads=8, kv_heads=4, ffn=2 * args.dim, vocab=512)
        cost = profile_block(spec, window=args.window, n_samples=24, n_holdout=8, device="cpu", repeats=3,
                             q_lens=(16, 64, 256), show_progress=False, memory=False)
        torch.set_num_threads(threads)
        cost.save(out / "cost_profiled.json")
        comm = profile_comm(sizes=(1 << 12, 1 << 18, 1 << 20, 4 << 20), repeats=5, world=2)
        runs = _spawn_single(2, cfg, out / "single_raw.json")
        alone = analyse_single(runs[0]["alone"], cost)
        twin_rows = [analyse_single(run["twin"], cost) for run in runs]
        alone_s = float(np.median([r["measured_s"] for r in alone]))
        twin_s = float(np.median([r["measured_s"] for rows in twin_rows for r in rows]))
        contention = float(np.median([t["measured_s"] / a["measured_s"] for a, t in zip(alone, twin_rows[0])]))
        result.update(validation=cost.meta["validation"], comm=comm, single_rank=alone,
                      contention=dict(alone_s=alone_s, twin_s=twin_s, factor=contention))
    p2p_s = None
    if comm is not None:  # fp32 activations of `dim` per token: latency + bytes x s/byte per message
        p2p_fit, act_bytes = comm["p2p"], 4 * args.dim
        p2p_s = lambda tokens: [float(x) for x in  # noqa: E731
                                p2p_fit["latency_s"] + p2p_fit["s_per_byte"] * act_bytes * np.asarray(tokens)]
    load_before = os.getloadavg()[0]
    raw_all = _spawn(_worker, args.pp, cfg, out / "validate_sim_raw.json")
    rows = [r for v in vs_list for r in analyse(raw_all[str(v)], args.pp, cost, v, p2p_s)]
    if cost is not None:  # contention seen inside the pipeline: its ranks' busy time against one rank's
        pipe_busy = [sum(op[3] for rank in raw_all[str(vs_list[0])] for op in rank[s]["ops"])
                     for s in range(len(raw_all[str(vs_list[0])][0]))]
        result["contention"]["pipeline_busy_ratio"] = float(np.median(
            [b / r["busy_s"] for b, r in zip(pipe_busy, result["single_rank"])]))

    print(f"pp={args.pp}, {args.n_micro} micro-batches of <= {args.window} tokens ({args.method}), "
          f"dim {args.dim}, {args.layers} layers, gloo on this machine, one thread per process")
    if cost is not None:
        alone = result["single_rank"]
        print(f"profiled block: {cost.meta['validation']['mape']:.1f}% MAPE on "
              f"{cost.meta['validation']['n']} held-out micro-batches (worst {cost.meta['validation']['worst']:.1f}%)")
        print("1. single rank, no contention (pp=1, one process, whole model):")
        for r in alone:
            print(f"   step {r['step']}: CPU time {r['cpu_s']:.3f} s (wall {r['measured_s']:.3f} s), predicted "
                  f"{r['predicted_s']:.3f} s ({r['step_rel_error']:+.1%} of CPU time, {r['wall_rel_error']:+.1%} of "
                  f"wall); per op median |error| {r['op_median_abs_error']:.1%}, worst {r['op_worst_abs_error']:.1%}")
        c = result["contention"]
        print(f"2. contention: the same steps, two processes at once: median step {c['twin_s']:.3f} s vs "
              f"{c['alone_s']:.3f} s alone (interleaved with it): x{c['factor']:.2f} (median per-step ratio); "
              f"the pipeline's ranks were busy x{c['pipeline_busy_ratio']:.2f} the single rank's compute time "
              f"(v={vs_list[0]})")
        p2p_fit = comm["p2p"]
        print(f"3. communication (2 gloo ranks): p2p {1e6 * p2p_fit['latency_s']:.0f} us + "
              f"{1e9 * p2p_fit['s_per_byte']:.2f} ns/byte: {1e3 * p2p_s([args.window])[0]:.1f} ms per "
              f"{args.window}-token activation; all-reduce {1e6 * comm['all_reduce']['latency_s']:.0f} us + "
              f"{1e9 * comm['all_reduce']['s_per_byte']:.2f} ns/byte")
        result["breakdown"] = breakdown(rows, c["factor"], p2p_s)
    print(f"4. pipeline (1-minute load average {load_before:.2f} before the pipeline runs, "
          f"{os.getloadavg()[0]:.2f} after; per step below):")
    dash = f"{'-':>9} {'-':>7}"
    print(f"{'v':>2} {'step':>4} {'measured s':>10} {'simulator s':>11} {'error':>7} {'bubble':>7} {'DAG s':>9} "
          f"{'error':>7} {'setup s':>7} {'p2p ms':>6} {'+profiled':>9} {'error':>7} {'+measured':>9} {'error':>7} "
          f"{'predicted':>9} {'error':>7} {'load':>5}  tokens per micro-batch")
    for r in rows:
        pair = lambda key: (f"{r[key + '_s']:>9.3f} {r[key + '_rel_error']:>+7.1%}" if key + "_s" in r  # noqa: E731
                            else dash)
        over = (f"{r['setup_s']:>7.3f} {r['transfer_ms']:>6.1f}" if "setup_s" in r else f"{'-':>7} {'-':>6}")
        print(f"{r['virtual_stages']:>2} {r['step']:>4} {r['measured_s']:>10.3f} {r['simulated_s']:>11.3f} "
              f"{r['rel_error']:>+7.1%} {r['bubble_fraction']:>7.1%} {pair('dag')} {over} {pair('replay')} "
              f"{pair('replay_measured_p2p')} {pair('predicted')} {r.get('load_average', float('nan')):>5.2f}  "
              f"{r['tokens']}")
    print("simulator: as simulate_step times a pipeline (the replay of the executor's p2p, 1F1B: its groups; "
          "interleaved: its channels), on measured op times; +profiled / +measured: that replay also fed the measured work before "
          "and after the pipeline and the profiled / measured transfer per message")
    for v in vs_list:
        mine = [r for r in rows if r["virtual_stages"] == v]
        def med(key: str) -> str:
            return f"{float(np.median([r[key] for r in mine])):+.1%}" if all(key in r for r in mine) else "-"

        print(f"v={v}: median error on measured op times: simulator {med('rel_error')}, ideal DAG "
              f"{med('dag_rel_error')}, + measured work outside the ops and profiled p2p "
              f"{med('replay_rel_error')}, and measured p2p {med('replay_measured_p2p_rel_error')}")
    if cost is not None:
        print("breakdown of the prediction from the plan alone (median over steps; error = predicted / measured - 1):")
        print(f"{'':>30} " + " ".join(f"{'v=' + str(v):>9}" for v in vs_list))
        med = lambda key, v: float(np.median([b[key] for b in result["breakdown"] if b["virtual_stages"] == v]))  # noqa: E731
        single = float(np.median([r["step_rel_error"] for r in result["single_rank"]]))
        single_wall = float(np.median([r["wall_rel_error"] for r in result["single_rank"]]))
        lines = [("single rank, no contention", lambda v: single),
                 ("  against its wall time", lambda v: single_wall),
                 ("pipeline: cost model + DAG", lambda v: med("cost_model_error", v)),
                 ("  x measured contention", lambda v: med("with_contention_error", v)),
                 ("  + profiled p2p", lambda v: med("with_comm_error", v)),
                 ("simulator on measured ops",
                  lambda v: float(np.median([r["rel_error"] for r in rows if r["virtual_stages"] == v])))]
        for label, fn in lines:
            print(f"{label:>32} " + " ".join(f"{fn(v):>+9.1%}" for v in vs_list))
    for r in rows:
        for key in ("_pred_fwd", "_pred_bwd", "_schedule"):
            r.pop(key, None)
    result["rows"] = rows
    (out / "validate_sim.json").write_text(json.dumps(dict(provenance=provenance("validate_sim", argv), **result),
                                                       indent=2))
    print(f"wrote {out / 'validate_sim.json'}")
    return 0
