"""Train a tiny model with wlb-opt plans under CP x PP x DP on CPU (gloo) or GPU (nccl).

    torchrun --standalone --nproc_per_node 2 examples/train.py --cp 2 --steps 5
    torchrun --standalone --nproc_per_node 4 examples/train.py --cp 2 --pp 2
    torchrun --standalone --nproc_per_node 4 examples/train.py --cp 2 --dp 2

Every rank runs the same deterministic planner (WLBPacker: variable-length packing with
outlier delay) on the same document stream, checks that all ranks hold the same plan, shards
each micro-batch for CP (solve_shard, adaptive), and runs one training step whose loss is
normalised over the whole global batch. Documents are synthetic token sequences.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist

import wlb_opt as wlb
import wlb_opt.executor as ex
from wlb_opt.bench.data import sample_documents


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--n-micro", type=int, default=2)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--strategy", default="adaptive")
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    mesh = ex.make_mesh(cp=args.cp, dp=args.dp, pp=args.pp)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    spec = wlb.ModelSpec.preset("tiny")
    cost = wlb.CostModel.analytic(spec, wlb.ParallelSpec(cp=args.cp, pp=args.pp, dp=args.dp), wlb.HardwareSpec.preset("cpu"))
    packer = wlb.WLBPacker(n_micro=args.n_micro, max_tokens=int(1.25 * args.window), cost=cost, dp=args.dp,
                           thresholds=[args.window // 2], n_queues=1, max_delay=4, seed=0)
    torch.manual_seed(0)
    model = ex.TinyLM.from_spec(spec).to(device)
    stage = ex.split_stages(model, args.pp)[mesh.pp_rank]  # this rank's pipeline stage
    opt = torch.optim.AdamW(stage.parameters(), lr=args.lr)

    # A synthetic stream scaled down to this window (documents cut to the window, so every
    # document is one piece); a document's tokens depend on its id only.
    lengths = np.maximum(1, sample_documents(4000, "default", seed=1) // (131072 // args.window))
    lengths = np.minimum(lengths, args.window)

    def doc_tokens(doc_id: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(doc_id)
        return torch.randint(0, spec.vocab, (int(lengths[doc_id]),), generator=g)

    cursor, per_batch = 0, args.dp * args.n_micro * args.window
    for step in range(args.steps):
        stop = cursor + int(np.searchsorted(np.cumsum(lengths[cursor:]), per_batch))
        plan = packer.pack(lengths[cursor:stop], np.arange(cursor, stop))
        cursor = stop
        shards = [wlb.solve_shard(plan.lengths[mb], args.cp, args.strategy, cost, offsets=plan.offsets[mb]) if len(mb) else None
                  for mb in plan.micro_batches]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = ex.train_step(stage, plan, shards, doc_tokens, mesh=mesh)
        opt.step()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss:.4f}, {len(plan.micro_batches)} micro-batches, "
                  f"tokens {plan.tokens.tolist()}, PP imbalance {plan.imbalance:.3f}, "
                  f"queued {len(packer.queued_ids())}, {time.perf_counter() - t0:.2f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
