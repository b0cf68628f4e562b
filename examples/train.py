"""Train a tiny model with wlb-opt plans under CP x PP x DP on CPU (gloo) or GPU (nccl).

    torchrun --standalone --nproc_per_node 2 examples/train.py --cp 2 --steps 5
    torchrun --standalone --nproc_per_node 4 examples/train.py --cp 2 --pp 2
    torchrun --standalone --nproc_per_node 4 examples/train.py --cp 2 --dp 2

Every rank runs the same deterministic planner (WLBPacker: variable-length packing with
outlier delay) on the same document stream, checks that all ranks hold the same plan, shards
each micro-batch for CP (solve_shard, adaptive), and runs one training step whose loss is
normalised over the whole global batch. Documents are synthetic token sequences, with
lengths from the built-in "default" distribution (`wlb_opt.data`) scaled to the window.
The layout is built once (a ParallelSpec inside the cost model); the packer and the sharding
read their degrees from `cost.parallel`.
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
from wlb_opt.data import sample_documents
from wlb_opt.shard import SHARD_STRATEGIES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, default=2, help="context-parallel degree (default 2)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1); cp x pp x dp = world size")
    p.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    p.add_argument("--n-micro", type=int, default=2, help="micro-batches per DP replica and step (default 2)")
    p.add_argument("--window", type=int, default=256, help="training context length in tokens (default 256)")
    p.add_argument("--strategy", default="adaptive", choices=[s for s in SHARD_STRATEGIES if s != "cpsat"],
                   help="CP sharding strategy of solve_shard (default adaptive)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    args = p.parse_args()
    layout = wlb.ParallelSpec(cp=args.cp, pp=args.pp, dp=args.dp)  # the one place the layout is built

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    mesh = ex.make_mesh(cp=layout.cp, dp=layout.dp, pp=layout.pp)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    spec = wlb.ModelSpec.preset("tiny")
    cost = wlb.CostModel.analytic(spec, layout, wlb.HardwareSpec.preset("cpu"))
    packer = wlb.WLBPacker(n_micro=args.n_micro, max_tokens=int(1.25 * args.window), cost=cost,
                           thresholds=[args.window // 2], n_queues=1, max_delay=4, seed=0)  # dp: cost.parallel
    torch.manual_seed(0)
    model = ex.TinyLM.from_spec(spec).to(device)
    stage = ex.split_stages(model, layout.pp)[mesh.pp_rank]  # this rank's pipeline stage
    opt = torch.optim.AdamW(stage.parameters(), lr=args.lr)

    # A synthetic stream scaled down to this window (documents cut to the window, so every
    # document is one piece); a document's tokens depend on its id only.
    lengths = np.maximum(1, sample_documents(4000, "default", seed=1) // (131072 // args.window))
    lengths = np.minimum(lengths, args.window)

    def doc_tokens(doc_id: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(doc_id)
        return torch.randint(0, spec.vocab, (int(lengths[doc_id]),), generator=g)

    cursor, per_batch = 0, layout.dp * args.n_micro * args.window
    for step in range(args.steps):
        stop = cursor + int(np.searchsorted(np.cumsum(lengths[cursor:]), per_batch))
        plan = packer.pack(lengths[cursor:stop], np.arange(cursor, stop))
        cursor = stop
        shards = [wlb.solve_shard(plan.lengths[mb], None, args.strategy, cost, offsets=plan.offsets[mb])  # cp: cost's
                  if len(mb) else None for mb in plan.micro_batches]
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
