"""A CP x DP (x PP x TP) training step over gloo processes equals single-process training on the
same global batch (fp64): loss and every parameter gradient."""
from __future__ import annotations

import datetime

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import wlb_opt as wlb  # noqa: E402
from wlb_opt.executor.fsdp import fsdp_mesh  # noqa: E402
from wlb_opt.executor.train import activation_dtype  # noqa: E402
from test_training import (LAYOUTS, doc_tokens, free_port, in_flight, make_model, make_plan, make_shards,  # noqa: E402
                           masked_doc, reference, sparse_plan)



def _worker(rank, world, port):
    import wlb_opt.executor as ex

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        # plan on rank 0 only (as with an exact solver), broadcast, and check every rank agrees
        mine = make_plan(dp=1)[0] if rank == 0 else None
        got = ex.broadcast_plan(mine, src=0)
        assert ex.check_same_plan(got) == make_plan(dp=1)[0].digest()
        from wlb_opt.schedule import channel_messages, message_key, p2p_schedule

        for cp, pp, dp, v, strategy, kind in LAYOUTS[world]:
            mesh = ex.make_mesh(cp=cp, dp=dp, pp=pp)
            plan, cost = make_plan(dp, cp, pp) if kind == "dense" else sparse_plan(pp)
            model = make_model()
            names = {id(p): n for n, p in model.named_parameters()}
            chunks = ex.split_stages(model, pp, v)[mesh.pp_rank::pp]
            record = ex.StageOutputs()
            shards = make_shards(plan, cost, cp, strategy)
            issued = []  # what really went to torch.distributed: groups (1F1B), messages on channels (v > 1)
            real = dist.batch_isend_irecv, dist.isend, dist.irecv

            def spy(ops, issued=issued):
                issued.append([(o.op.__name__.lstrip("i"), o.peer, tuple(o.tensor.shape), o.tensor.dtype) for o in ops])
                return real[0](ops)

            def spy_one(kind, t, peer, group, issued=issued):
                ranks = tuple(sorted(dist.get_process_group_ranks(group)))
                issued.append([(kind, peer, tuple(t.shape), t.dtype, ranks)])
                return (real[1] if kind == "send" else real[2])(t, peer, group=group)

            if v == 1:
                dist.batch_isend_irecv = spy
            else:  # (P2POp checks that its op is torch's own isend / irecv: only patched without groups)
                dist.isend = lambda t, peer, group=None: spy_one("send", t, peer, group)
                dist.irecv = lambda t, peer, group=None: spy_one("recv", t, peer, group)
            try:
                loss = ex.train_step(chunks, plan, shards, data=doc_tokens, mesh=mesh, backend="torch", record=record)
            finally:
                dist.batch_isend_irecv, dist.isend, dist.irecv = real
            ref_loss, ref_grads = reference(plan)
            where = f"rank {rank} (cp={cp}, pp={pp}, dp={dp}, v={v}, {strategy}, {kind})"
            assert abs(loss - ref_loss) < 1e-10, (where, loss, ref_loss)
            n_micro = plan.n_micro
            assert len(record.ops) == 2 * n_micro * v  # every slot, empty ones too
            # what the executor issued is exactly the schedule, and boundary tensors die early
            schedule = p2p_schedule(pp, n_micro, v)[mesh.pp_rank] if v == 1 else record.groups
            peers = {mesh.global_rank(mesh.dp_rank, p, mesh.cp_rank): p for p in range(pp)}
            mbs = plan.replica_micro_batches(mesh.dp_rank)
            assert len(issued) == len(schedule), where
            for got, want in zip(issued, schedule):
                assert [(kind, peers[peer]) for kind, peer, *_ in got] == [(o.kind, o.peer) for o in want], where
                for (_, peer, shape, dtype, *group), o in zip(got, want):
                    j = mbs[o.micro]
                    local = len(shards[j].rank_indices[mesh.cp_rank]) if len(plan.micro_batches[j]) else 0
                    assert shape == (local, 32) and dtype == torch.float64, (where, o, shape)
                    if group:  # a channel: the two ranks' own group, one per direction
                        me = mesh.global_rank(mesh.dp_rank, mesh.pp_rank, mesh.cp_rank)
                        assert group[0] == tuple(sorted((me, peer))), (where, o, group)
            if v > 1:  # each channel's messages in the order its sender makes them
                for (src, dst), messages in channel_messages(pp, n_micro, v).items():
                    mine = [message_key(g[0], mesh.pp_rank, pp) for g in record.groups
                            if (g[0].kind, g[0].peer) == (("send", dst) if src == mesh.pp_rank else ("recv", src))]
                    if mesh.pp_rank in (src, dst):
                        assert mine == messages, (where, src, dst)
            # sampled while a group's sends and its new receive buffers coexist: the inputs of the
            # micro-batches in flight (the one being received included) and the output being sent.
            # Channels also hold the next receive of each of the two channels into the rank, and a
            # gradient sent back lives until its receiver takes it: each belongs to a chunk that
            # its receiver holds in flight, so at most the most any rank holds.
            limit = in_flight(mesh.pp_rank, pp, n_micro, v) + 1 if v == 1 else (
                max(in_flight(r, pp, n_micro, v) for r in range(pp)) + 3)
            assert max(record.peak_live.values()) <= limit, (where, record.peak_live, limit)
            for chunk in chunks:
                for p in chunk.parameters():
                    name = names[id(p)]
                    torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-8, atol=1e-10,
                                               msg=lambda m: f"{where} {name}: {m}")
            dist.barrier()
        # tensor parallelism inside a stage (DTensor), alone and with CP or PP (interleaved too: two
        # pipelines, one per TP rank, each with its channels): (cp, pp, dp, tp, v)
        for cp, pp, dp, tp, v in {2: [(1, 1, 1, 2, 1)], 4: [(2, 1, 1, 2, 1), (1, 2, 1, 2, 1), (1, 2, 1, 2, 2)]}[world]:
            mesh = ex.make_mesh(cp=cp, pp=pp, dp=dp, tp=tp)
            plan, cost = make_plan(dp, cp, pp)
            model = make_model()
            chunks = ex.split_stages(model, pp, v)[mesh.pp_rank::pp]
            for chunk in chunks:
                ex.apply_tensor_parallel(chunk, mesh.device_mesh["tp"])
            names = {id(p): n for n, p in model.named_parameters()}
            loss = ex.train_step(chunks, plan, make_shards(plan, cost, cp), data=doc_tokens, mesh=mesh, backend="torch")
            ref_loss, ref_grads = reference(plan)
            where = f"rank {rank} (cp={cp}, pp={pp}, dp={dp}, tp={tp}, v={v})"
            assert abs(loss - ref_loss) < 1e-10, (where, loss, ref_loss)
            sharded = 0
            for chunk in chunks:
                for p in chunk.parameters():
                    grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    sharded += hasattr(p, "full_tensor")
                    torch.testing.assert_close(grad, ref_grads[names[id(p)]], rtol=1e-8, atol=1e-10,
                                               msg=lambda m: f"{where} {names[id(p)]}: {m}")
            assert sharded > 0, where  # the projections really are DTensors
            dist.barrier()
        # sharded data parallelism with FSDP2 (over dp x cp), alone and with a pipeline (interleaved
        # too): (cp, pp, dp, v)
        for cp, pp, dp, v in {2: [(1, 1, 2, 1)], 4: [(1, 2, 2, 1), (1, 2, 2, 2), (2, 1, 2, 1)]}[world]:
            mesh = ex.make_mesh(cp=cp, pp=pp, dp=dp)
            plan, cost = make_plan(dp, cp, pp)
            model = make_model()
            names = {id(p): n for n, p in model.named_parameters()}
            chunks = ex.split_stages(model, pp, v)[mesh.pp_rank::pp]
            for chunk in chunks:
                ex.apply_fsdp(chunk, mesh)
            loss = ex.train_step(chunks, plan, make_shards(plan, cost, cp), data=doc_tokens, mesh=mesh, backend="torch")
            ref_loss, ref_grads = reference(plan)
            where = f"rank {rank} FSDP2 (cp={cp}, pp={pp}, dp={dp}, v={v})"
            assert abs(loss - ref_loss) < 1e-10, (where, loss, ref_loss)
            for chunk in chunks:
                for name, p in chunk.named_parameters():
                    assert hasattr(p, "full_tensor"), where  # FSDP2 shards every parameter
            full = {}
            for chunk in chunks:
                for p in chunk.parameters():
                    full[id(p)] = p.grad.full_tensor()
            by_name = {n: p for n, p in model.named_parameters()}
            for n, p in by_name.items():
                if id(p) in full:
                    torch.testing.assert_close(full[id(p)], ref_grads[n], rtol=1e-8, atol=1e-10,
                                               msg=lambda m: f"{where} {n}: {m}")
            dist.barrier()
        if world == 2:  # FSDP2 with a small loss chunk and an empty micro-batch slot on one replica
            mesh = ex.make_mesh(dp=2)
            layout = wlb.ParallelSpec(dp=2)
            cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"), layout, wlb.HardwareSpec.preset("cpu"))
            plan = wlb.solve_pack(np.array([30, 7, 1]), 2, 64, cost, "wlb", ids=np.array([3, 4, 5]))
            assert any(len(plan.micro_batches[j]) == 0 for j in plan.replica_micro_batches(0)) or \
                any(len(plan.micro_batches[j]) == 0 for j in plan.replica_micro_batches(1))
            for loss_chunk in (7, 8192):
                model = make_model()
                stage = ex.split_stages(model, 1)[0]
                ex.apply_fsdp(stage, mesh)
                names = {id(p): n for n, p in model.named_parameters()}  # FSDP2's DTensor parameters
                loss = ex.train_step(stage, plan, make_shards(plan, cost, 1), data=doc_tokens, mesh=mesh,
                                     backend="torch", loss_chunk=loss_chunk)
                ref_loss, ref_grads = reference(plan)
                assert abs(loss - ref_loss) < 1e-10, (loss_chunk, loss, ref_loss)
                for p in stage.parameters():
                    torch.testing.assert_close(p.grad.full_tensor(), ref_grads[names[id(p)]], rtol=1e-8, atol=1e-10)
            dist.barrier()
        if world == 2:  # reduce_grads=False: gradients stay local for the user's own wrapper
            mesh = ex.make_mesh(dp=2)
            plan, cost = make_plan(2)
            model = make_model()
            ex.train_step(model, plan, make_shards(plan, cost, 1), data=doc_tokens, mesh=mesh, backend="torch",
                          reduce_grads=False)
            _, ref_grads = reference(plan)
            differs = False
            for n, p in model.named_parameters():
                local = p.grad.clone()
                dist.all_reduce(p.grad)  # what a DDP-style wrapper would do
                differs |= not torch.allclose(local, ref_grads[n])
                torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-8, atol=1e-10)
            assert differs  # each replica held only its own share before the user's reduction
            dist.barrier()
        if world == 4:  # a user's own 2-D DeviceMesh with torchtitan-style names, and bad meshes
            from torch.distributed.device_mesh import init_device_mesh

            with pytest.raises(ValueError, match="not divisible by pp x cp x tp = 3"):
                ex.make_mesh(pp=3)
            with pytest.raises(ValueError, match="must equal the world size 4"):
                ex.make_mesh(dp=2, cp=4)
            user = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
            with pytest.raises(ValueError, match="each must be one of"):
                ex.Mesh.from_device_mesh(user)
            with pytest.raises(ValueError, match="does not have"):
                ex.Mesh.from_device_mesh(user, names={"fsdp": "dp"})
            # another dimension order, mapped names, FSDP2 over the mapped dims
            flipped = init_device_mesh("cpu", (2, 2), mesh_dim_names=("context", "batch"))
            fmesh = ex.Mesh.from_device_mesh(flipped, names={"context": "cp", "batch": "dp"})
            assert (fmesh.dp, fmesh.cp) == (2, 2) and fmesh.rank == rank
            assert fmesh.global_rank(fmesh.dp_rank, 0, fmesh.cp_rank) == rank
            assert fsdp_mesh(fmesh).size() == 4
            plan, cost = make_plan(2, 2, 1)
            model = make_model()
            stage = ex.split_stages(model, 1)[0]
            ex.apply_fsdp(stage, fmesh)
            names = {id(p): n for n, p in model.named_parameters()}
            loss = ex.train_step(stage, plan, make_shards(plan, cost, 2), data=doc_tokens, mesh=fmesh, backend="torch")
            ref_loss, ref_grads = reference(plan)
            assert abs(loss - ref_loss) < 1e-10
            for p in stage.parameters():
                torch.testing.assert_close(p.grad.full_tensor(), ref_grads[names[id(p)]], rtol=1e-8, atol=1e-10)
            titan = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
            tmesh = ex.Mesh.from_device_mesh(titan, names={"dp_replicate": "dp", "dp_shard": "dp"})
            assert (tmesh.dp, tmesh.cp) == (4, 1) and tmesh.dp_rank == rank
            mesh = ex.Mesh.from_device_mesh(user, names={"dp_shard": "dp"})
            assert (mesh.dp, mesh.pp, mesh.cp, mesh.tp) == (2, 1, 2, 1) and mesh.device_mesh is user
            plan, cost = make_plan(2, 2, 1)
            model = make_model()
            names = {id(p): n for n, p in model.named_parameters()}
            # documents with a loss mask: the count of targets is an all-reduce of local counts
            loss = ex.train_step(model, plan, make_shards(plan, cost, 2), data=masked_doc, mesh=mesh, backend="torch")
            ref_loss, ref_grads = reference(plan, masked=True)
            assert abs(loss - ref_loss) < 1e-10
            for p in model.parameters():
                torch.testing.assert_close(p.grad, ref_grads[names[id(p)]], rtol=1e-8, atol=1e-10)
            with pytest.raises(ValueError, match="timeout"):
                ex.make_mesh(cp=2, tp=2, timeout=-1)
            mesh = ex.make_mesh(cp=2, tp=2, timeout=datetime.timedelta(seconds=90))
            assert mesh.device_mesh.mesh_dim_names == ("dp", "pp", "cp", "tp") and mesh.tp == 2
            assert mesh.global_rank(0, 0, 1, 1) == 3 and mesh.rank == rank
            dist.barrier()
        if world == 2:  # a two-stage pipeline under CPU autocast carries bf16 activations
            mesh = ex.make_mesh(cp=1, dp=1, pp=2)
            plan, cost = make_plan(1, 1, 2)
            model = make_model(torch.float32)
            stage = ex.split_stages(model, 2)[mesh.pp_rank]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert activation_dtype(next(stage.parameters())) == torch.bfloat16
                loss = ex.train_step(stage, plan, make_shards(plan, cost, 1), data=doc_tokens, mesh=mesh,
                                     backend="torch")
            ref_loss, _ = reference(plan)
            assert abs(loss - ref_loss) < 0.05 * abs(ref_loss), (loss, ref_loss)
            assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in stage.parameters())
            # FSDP2 mixed precision (bf16 compute over fp32 shards, torchtitan's default): the
            # pipeline carries the policy's compute dtype, not the shards' fp32
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            stage = ex.split_stages(make_model(torch.float32), 2)[mesh.pp_rank]
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in stage.blocks:
                fully_shard(block, mesh=mesh.device_mesh["dp"], mp_policy=policy)
            fully_shard(stage, mesh=mesh.device_mesh["dp"], mp_policy=policy)
            assert activation_dtype(next(stage.parameters()), stage) == torch.bfloat16
            loss = ex.train_step(stage, plan, make_shards(plan, cost, 1), data=doc_tokens, mesh=mesh, backend="torch")
            assert abs(loss - ref_loss) < 0.05 * abs(ref_loss), (loss, ref_loss)
            assert all(p.grad is not None and torch.isfinite(p.grad.full_tensor()).all() for p in stage.parameters())
            dist.barrier()
    finally:
        dist.destroy_process_group()



@pytest.mark.parametrize("world", [2, 4])
def test_distributed_step_equals_single_process(world):
    """CP, PP (variable-length 1F1B) and DP, alone and combined, against one process."""
    mp.spawn(_worker, args=(world, free_port()), nprocs=world, join=True)
