"""train_step through the Hugging Face adapter on gloo processes equals transformers' own loss and
gradients on every layout."""
from __future__ import annotations

import datetime

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from wlb_opt.integrations import hf  # noqa: E402
from test_hf import CASES, first_step, free_port, models, reference  # noqa: E402



def _worker(rank: int, world: int, port: int) -> None:
    import wlb_opt.executor as ex

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=180))
    try:
        for family, dp, cp, pp, tp, fsdp in CASES[world]:
            where = f"rank {rank} {family} (dp={dp}, cp={cp}, pp={pp}, tp={tp}, fsdp={fsdp})"
            mesh = ex.make_mesh(dp=dp, cp=cp, pp=pp, tp=tp)
            model, ref = models(family)
            step = first_step(dp, cp, pp)
            chunks = hf.split_hf_stages(model, pp)[mesh.pp_rank::pp]
            for chunk in chunks:
                if tp > 1:
                    ex.apply_tensor_parallel(chunk, mesh.device_mesh["tp"])
                if fsdp:
                    ex.apply_fsdp(chunk, mesh)
            names = {id(p): n for n, p in model.named_parameters()}
            loss = ex.train_step(chunks, step.plan, step.shards, data=step, mesh=mesh, backend="torch")
            ref_loss, ref_grads = reference(ref, step)
            assert abs(loss - ref_loss) < 1e-8, (where, loss, ref_loss)
            checked = 0
            for chunk in chunks:
                for p in chunk.parameters():
                    grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    name = names[id(p)]
                    torch.testing.assert_close(grad, ref_grads[name], rtol=1e-8, atol=1e-10,
                                               msg=lambda m: f"{where} {name}: {m}")
                    checked += 1
            assert checked > 0, where
            if tp > 1 or fsdp:
                assert any(hasattr(p, "full_tensor") for c in chunks for p in c.parameters()), where
            dist.barrier()
    finally:
        dist.destroy_process_group()



@pytest.mark.parametrize("world", [2, 4])
def test_train_step_through_the_adapter_equals_hf_on_every_layout(world):
    mp.spawn(_worker, args=(world, free_port()), nprocs=world, join=True)
