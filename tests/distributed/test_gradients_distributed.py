"""The gradients a DP step leaves, against one process running the same plans.

- A replica whose micro-batch slots are all empty (the packer leaves one so at a stream's
  end) still gives every parameter a gradient: FSDP2's reduce-scatters then match across
  replicas (they used to differ in size and abort).
- Gradients accumulated over two `train_step` calls without `zero_grad` are the sum of the
  two steps' (the earlier gradient is not summed over the replicas again).
- A frozen parameter (requires_grad False) keeps no gradient, as in one process; a frozen
  first pipeline stage (pp = 2) leaves the second stage's gradients as in one process.
- `train_step` without a mesh runs this process's step alone, even where torch.distributed
  is initialised with several ranks.
"""
from __future__ import annotations

import datetime
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from conftest import free_port  # noqa: E402
from test_training import doc_tokens, make_model, make_plan, make_shards  # noqa: E402


def _plans():
    import wlb_opt as wlb

    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"), wlb.ParallelSpec(dp=2), wlb.HardwareSpec.preset("cpu"))
    # one document, two replicas of one slot each: replica 1 holds nothing
    lonely = wlb.solve_pack([40], 1, 96, cost, "wlb", ids=[3])
    assert [len(mb) for mb in lonely.micro_batches] == [1, 0]
    a, cost2 = make_plan(2)
    b = a.replace(doc_ids=a.doc_ids + 10)  # other documents, the same shape
    return dict(lonely=(lonely, cost), a=(a, cost2), b=(b, cost2))


def _grads(model) -> dict:
    return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}


def _reference(kind: str) -> dict:
    """One process: the plan(s) run whole (every replica) by `train_step` without a mesh."""
    import wlb_opt.executor as ex

    plans = _plans()
    model = make_model()
    if kind == "frozen":
        model.embed.weight.requires_grad_(False)
    if kind == "frozen_stage":
        for param in ex.split_stages(model, 2)[0].parameters():
            param.requires_grad_(False)
    steps = {"lonely": ["lonely"], "accumulate": ["a", "b"], "frozen": ["a"], "frozen_stage": ["a"],
             "no_mesh": ["a"]}[kind]
    for name in steps:
        plan, cost = plans[name]
        one = plan.replace(replica_of=np.zeros(len(plan.micro_batches), dtype=np.int64), dp=1,
                           n_micro=len(plan.micro_batches))
        ex.train_step(model, one, make_shards(one, cost, 1), data=doc_tokens, backend="torch", check_plan=False)
    return _grads(model)


def _worker(rank: int, port: int, out_dir: str) -> None:
    import wlb_opt.executor as ex

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        plans = _plans()
        mesh = ex.make_mesh(dp=2)
        got = {}
        # FSDP2 with a replica of empty slots
        model = make_model()
        stage = ex.split_stages(model, 1)[0]
        ex.apply_fsdp(stage, mesh)
        plan, cost = plans["lonely"]
        ex.train_step(stage, plan, make_shards(plan, cost, 1), data=doc_tokens, mesh=mesh, backend="torch")
        got["lonely"] = {n: (None if p.grad is None else p.grad.full_tensor().detach().clone())
                         for n, p in model.named_parameters()}
        # two steps, no zero_grad between them
        model = make_model()
        for name in ("a", "b"):
            plan, cost = plans[name]
            ex.train_step(model, plan, make_shards(plan, cost, 1), data=doc_tokens, mesh=mesh, backend="torch")
        got["accumulate"] = _grads(model)
        # a frozen embedding
        model = make_model()
        model.embed.weight.requires_grad_(False)
        plan, cost = plans["a"]
        ex.train_step(model, plan, make_shards(plan, cost, 1), data=doc_tokens, mesh=mesh, backend="torch")
        got["frozen"] = _grads(model)
        # pp = 2 with the first stage frozen (fine-tuning): its output has no graph, nothing to send back
        model = make_model()
        stages = ex.split_stages(model, 2)
        for param in stages[0].parameters():
            param.requires_grad_(False)
        one = plan.replace(replica_of=np.zeros(len(plan.micro_batches), dtype=np.int64), dp=1,
                           n_micro=len(plan.micro_batches))
        pp_mesh = ex.make_mesh(pp=2)
        mine = stages[pp_mesh.pp_rank]
        ex.train_step(mine, one, make_shards(one, cost, 1), data=doc_tokens, mesh=pp_mesh, backend="torch")
        held = {id(param) for param in mine.parameters()}
        got["frozen_stage"] = {n: g for (n, g), param in zip(_grads(model).items(), model.parameters())
                               if id(param) in held}
        # no mesh: this process's step alone (every replica of the plan, as one), with no exchange
        # with the other rank (which runs another plan here)
        model = make_model()
        one = plan.replace(replica_of=np.zeros(len(plan.micro_batches), dtype=np.int64), dp=1,
                           n_micro=len(plan.micro_batches))
        other = one.replace(step=rank)  # the ranks' plans differ: a plan check across them would refuse
        ex.train_step(model, other, make_shards(other, cost, 1), data=doc_tokens, backend="torch")
        got["no_mesh"] = _grads(model)
        torch.save(got, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown with gloo threads still joinable


def test_dp_gradients_equal_one_process(tmp_path):
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for kind in ("lonely", "accumulate", "frozen", "frozen_stage", "no_mesh"):
        want = _reference(kind)
        held = set()
        for rank in range(2):
            got = torch.load(tmp_path / f"rank{rank}.pt")[kind]
            held |= set(got)
            for name, grad in want.items():
                if name not in got:  # a pipeline rank holds its own stage's parameters only
                    assert kind == "frozen_stage", (kind, rank, name)
                    continue
                if grad is None:
                    assert got[name] is None, (kind, rank, name)
                else:
                    assert torch.allclose(got[name], grad, rtol=0, atol=1e-12), (kind, rank, name)
        assert held == set(want), kind
