"""Train a tiny model with wlb-opt plans under CP x PP x DP on CPU (gloo) or GPU (nccl).

    torchrun --standalone --nproc_per_node 2 examples/train.py --cp 2 --steps 5
    torchrun --standalone --nproc_per_node 4 examples/train.py --cp 2 --pp 2
    torchrun --standalone --nproc_per_node 4 examples/train.py --cp 2 --dp 2
    torchrun --standalone --nproc_per_node 2 examples/train.py --cp 1 --pp 2 --virtual-stages 2 --check-reference
    torchrun --standalone --nproc_per_node 4 examples/train.py --cp 2 --tp 2 --check-reference

Every rank runs the same deterministic planner (WLBPacker: variable-length packing with
outlier delay) on the same document stream, checks that all ranks hold the same plan, shards
each micro-batch for CP (solve_shard, adaptive), and runs one training step whose loss is
normalised over the whole global batch. Documents are synthetic token sequences, with
lengths from the built-in "default" distribution (`wlb_opt.workloads`) scaled to the window.
The layout is built once (a ParallelSpec inside the cost model); the packer and the sharding
read their degrees from `cost.parallel`. After `--steps` steps the packer's `drain()` plans
what it still holds (outliers waiting in its queue), and those steps train too. `--virtual-stages v` runs the interleaved 1F1B
schedule with v model chunks per rank. `--check-reference` trains in fp64 with SGD and then
reruns the same model, documents and steps in one process; its last line is
`reference check: max abs diff <x>` (losses and parameters), and it exits non-zero above 1e-8
(fp64). `--tp t` shards each stage's projections over t ranks (`apply_tensor_parallel`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np
import torch
import torch.distributed as dist

import wlb_opt as wlb
import wlb_opt.executor as ex
from wlb_opt.batch import pack_tokens, packed_labels, packed_positions, target_tokens
from wlb_opt.cost_args import count
from wlb_opt.workloads import sample_documents
from wlb_opt.shard import SHARD_STRATEGIES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=count, default=2, help="context-parallel degree (default 2)")
    p.add_argument("--dp", type=count, default=1, help="data-parallel replicas (default 1)")
    p.add_argument("--pp", type=count, default=1, help="pipeline stages (default 1); dp x pp x cp x tp = world size")
    p.add_argument("--tp", type=count, default=1, help="tensor-parallel degree inside a stage (default 1)")
    p.add_argument("--fsdp", action="store_true", help="shard parameters with FSDP2 over dp x cp (not with --tp)")
    p.add_argument("--steps", type=count, default=5, help="training steps (default 5), then the steps that train "
                   "what the packer still holds")
    p.add_argument("--n-micro", type=count, default=2, help="micro-batches per DP replica and step (default 2)")
    p.add_argument("--window", type=count, default=256, help="training context length in tokens (default 256)")
    p.add_argument("--strategy", default="adaptive", choices=[s for s in SHARD_STRATEGIES if s != "cpsat"],
                   help="CP sharding strategy of solve_shard (default adaptive)")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3; AdamW, or SGD with "
                   "--check-reference)")
    p.add_argument("--virtual-stages", type=count, default=1,
                   help="model chunks per pipeline rank (default 1: 1F1B; > 1: interleaved 1F1B, needs "
                        "--n-micro a multiple of --pp)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp64"],
                   help="parameter dtype (default fp32; --check-reference runs fp64 and refuses bf16)")
    p.add_argument("--check-reference", action="store_true",
                   help="fp64 + SGD, then compare with a single-process rerun of the same steps (rank 0)")
    args = p.parse_args()
    if args.check_reference and args.dtype == "bf16":
        p.error("--check-reference compares in fp64; bf16 is refused there (drop --dtype bf16)")
    if args.fsdp and args.tp > 1:
        p.error("--fsdp with --tp > 1 is not supported yet (2-D FSDP2 + TP)")
    if args.virtual_stages > 1:
        from wlb_opt.schedule import check_pipeline_shape
        try:
            check_pipeline_shape(args.pp, args.n_micro, args.virtual_stages)
        except ValueError as exc:
            p.error(str(exc))
    layout = wlb.ParallelSpec(tp=args.tp, cp=args.cp, pp=args.pp, dp=args.dp)  # the one place the layout is built

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():  # the device first: NCCL point-to-point needs it set
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group(backend)
    mesh = ex.make_mesh(dp=layout.dp, pp=layout.pp, cp=layout.cp, tp=layout.tp)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    tiny = wlb.ModelSpec.preset("tiny")  # 2 blocks; more when the pipeline has more (virtual) stages
    spec = dataclasses.replace(tiny, layers=max(tiny.layers, layout.pp * args.virtual_stages))
    cost = wlb.CostModel.analytic(spec, layout, wlb.HardwareSpec.preset("cpu"))
    # the no-tuning defaults (wlb_opt.packer.defaults); dp comes from cost.parallel
    packer = wlb.WLBPacker(n_micro=args.n_micro, max_tokens=int(1.25 * args.window), cost=cost)
    dtype = torch.float64 if args.check_reference else {"fp32": torch.float32, "bf16": torch.bfloat16,
                                                         "fp64": torch.float64}[args.dtype]
    torch.manual_seed(0)
    model = ex.TinyLM.from_spec(spec).to(device, dtype)
    # this rank's model chunks: virtual stages pp_rank, pp_rank + pp, ... of the pipeline
    chunks = ex.split_stages(model, layout.pp, args.virtual_stages)[mesh.pp_rank::layout.pp]
    if layout.tp > 1:  # column/row-parallel projections over the mesh's tp dimension (DTensor)
        for chunk in chunks:
            ex.apply_tensor_parallel(chunk, mesh.device_mesh["tp"])
    if args.fsdp:  # FSDP2: parameters sharded over dp x cp, gradients reduce-scattered once a step
        for chunk in chunks:
            ex.apply_fsdp(chunk, mesh)
    params = [p for chunk in chunks for p in chunk.parameters()]
    opt = torch.optim.SGD(params, lr=args.lr) if args.check_reference else torch.optim.AdamW(params, lr=args.lr)

    # A synthetic stream scaled down to this window (documents cut to the window, so every
    # document is one piece), long enough for --steps; a document's tokens depend on its id only.
    per_batch = layout.dp * args.n_micro * args.window
    parts, total = [], 0
    while total < args.steps * per_batch + 1:
        part = sample_documents(4000, "default", seed=1 + len(parts)) // max(1, 131072 // args.window)
        parts.append(np.minimum(np.maximum(1, part), args.window))
        total += int(parts[-1].sum())
    lengths = np.concatenate(parts)

    def doc_tokens(doc_id: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(doc_id)
        return torch.randint(0, spec.vocab, (int(lengths[doc_id]),), generator=g)

    plans, losses = [], []

    def train(plan, name: str) -> None:
        if target_tokens(plan) == 0:  # nothing to learn: no piece placed, or only 1-token pieces (no next token)
            if dist.get_rank() == 0:
                print(f"{name}: no target tokens ({len(plan.doc_ids)} pieces of 1 token or none), skipped")
            return
        shards = wlb.solve_shards(plan, None, args.strategy, cost)  # one per micro-batch; cp: the cost model's
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = ex.train_step(chunks, plan, shards, data=doc_tokens, mesh=mesh,
                             backend="torch" if args.check_reference else "auto")  # fp64 runs on torch
        opt.step()
        plans.append(plan)
        losses.append(loss)
        if dist.get_rank() == 0:
            print(f"{name}: loss {loss:.4f}, {len(plan.micro_batches)} micro-batches, "
                  f"tokens {plan.tokens.tolist()}, PP imbalance {plan.imbalance:.3f}, "
                  f"queued {len(packer.queued_ids())}, {time.perf_counter() - t0:.2f} s")

    cursor = 0
    for step in range(args.steps):
        stop = cursor + int(np.searchsorted(np.cumsum(lengths[cursor:]), per_batch))
        train(packer.pack(lengths[cursor:stop], np.arange(cursor, stop)), f"step {step}")
        cursor = stop
    for k, plan in enumerate(packer.drain()):  # what the packer still holds: every document trains once
        train(plan, f"drain step {k}")
    failed = False
    if args.check_reference:
        # every parameter of this rank's chunks, by name; rank 0 merges all ranks' shares
        names = {id(p): n for n, p in model.named_parameters()}
        # full parameters (a DTensor shard is gathered over its TP group)
        mine = {names[id(p)]: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()).cpu()
                for p in params}
        shares: list = [None] * dist.get_world_size()
        dist.all_gather_object(shares, mine)
        if dist.get_rank() == 0:
            trained = {k: v for share in shares for k, v in share.items()}
            diff = reference_check(spec, plans, losses, trained, doc_tokens, args.lr)
            print(f"reference check: max abs diff {diff:.3e}")
            failed = diff > 1e-8  # fp64 (the reference check always runs in fp64)
    dist.destroy_process_group()
    if failed:
        raise SystemExit(1)


def reference_check(spec, plans, losses, trained: dict, doc_tokens, lr: float) -> float:
    """Rerun the same steps in one process (fp64, SGD, whole micro-batches, no parallelism) and
    return the largest absolute difference over the per-step losses and the final parameters."""
    from wlb_opt.kernels import doc_attention
    from wlb_opt.kernels.segments import segments_from_lengths

    torch.manual_seed(0)
    model = ex.TinyLM.from_spec(spec).to(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    worst = 0.0
    for plan, dist_loss in zip(plans, losses):
        opt.zero_grad(set_to_none=True)
        total, loss_sum = target_tokens(plan), 0.0
        for j, mb in enumerate(plan.micro_batches):
            if not len(mb):
                continue
            lengths = plan.lengths[mb]
            tokens = pack_tokens(plan, j, doc_tokens)
            seg = segments_from_lengths(lengths)
            logits = model(tokens, torch.from_numpy(packed_positions(lengths, plan.offsets[mb])),
                           lambda q, k, v, seg=seg: doc_attention(q, k, v, seg, backend="torch"))
            loss = torch.nn.functional.cross_entropy(logits, packed_labels(tokens, lengths), ignore_index=-100,
                                                     reduction="sum") / total
            loss.backward()
            loss_sum += float(loss.detach())
        opt.step()
        worst = max(worst, abs(loss_sum - dist_loss))
    for name, p in model.named_parameters():
        worst = max(worst, float((p.detach() - trained[name].to(torch.float64)).abs().max()))
    return worst


if __name__ == "__main__":
    main()
