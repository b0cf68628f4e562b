"""Ranks that must agree are checked before a step, and every rank raises alike.

- Tokens: the ranks of one model replica (its CP and PP ranks here) read the same
  micro-batches; two gloo ranks with the same plan but one token (or one loss mask) of one
  document changed on one of them raise on both, naming the step, the micro-batch and the
  document (the piece's offset too).
- Vocabulary: a token id outside the first stage's embedding raises a ValueError on every
  rank, the ranks that do not read it included, naming the document and the value.
- Reading: a rank whose data fails re-raises its own error; the other names it.
- Stages split for another pipeline degree raise a ValueError on every rank, naming the
  rank and chunk whose virtual stage may not hold (or must hold) the embedding or the head.
- Weights: DP replicas (or TP ranks, for what TP does not shard) that start from different
  weights raise at the first step naming the parameter; `check_weights=False` skips it,
  None checks once per stage module and again after a `load_state_dict`, True forces it.
"""
from __future__ import annotations

import datetime
import logging
import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from conftest import free_port  # noqa: E402
import wlb_opt as wlb  # noqa: E402
from test_training import VOCAB, doc_tokens, make_model, make_plan, make_shards  # noqa: E402


def _changed(doc_id: int, position: int, value: int):
    def data(i):
        tokens = doc_tokens(i)
        if i == doc_id:
            tokens = tokens.clone()
            tokens[position] = value
        return tokens
    return data


def _masked(doc_id: int):
    def data(i):
        tokens = doc_tokens(i)
        mask = torch.ones(len(tokens), dtype=torch.bool)
        if i == doc_id:
            mask[3] = False
        return tokens, mask
    return data


def _unreadable(doc_id: int):
    def data(i):
        if i == doc_id:
            raise ValueError(f"document {i} is not in this shard")
        return doc_tokens(i)
    return data


def _outcome(call) -> str:
    try:
        call()
        return "no error"
    except (RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


def _worker(rank: int, port: int, out_dir: str) -> None:
    import wlb_opt.executor as ex

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    seen: dict[str, str] = {}
    try:
        # tokens: CP ranks, then PP ranks, of one replica; rank 1 reads one other token of document 2
        for name, kw in (("cp", dict(cp=2)), ("pp", dict(pp=2))):
            mesh = ex.make_mesh(**kw)
            plan, cost = make_plan(1, kw.get("cp", 1), kw.get("pp", 1))
            plan = plan.replace(step=3)
            stage = ex.split_stages(make_model(), mesh.pp)[mesh.pp_rank]
            data = _changed(2, 35, 9 if doc_tokens(2)[35] != 9 else 10) if rank == 1 else doc_tokens
            seen[f"tokens {name}"] = _outcome(lambda: ex.train_step(
                stage, plan, make_shards(plan, cost, mesh.cp), data=data, mesh=mesh, backend="torch"))
        # stages split for four pipeline ranks on two: rank 1's is not the last, and has no head
        mesh = ex.make_mesh(pp=2)
        plan, cost = make_plan(1, 1, 2)
        seen["stages"] = _outcome(lambda: ex.train_step(ex.split_stages(make_model(), 4)[rank], plan,
                                                        make_shards(plan, cost, 1), data=doc_tokens, mesh=mesh))
        # a loss chunk of 0 on every rank: refused on the first stage too, not only on the last
        seen["loss_chunk"] = _outcome(lambda: ex.train_step(ex.split_stages(make_model(), 2)[rank], plan,
                                                            make_shards(plan, cost, 1), data=doc_tokens, mesh=mesh,
                                                            loss_chunk=0))
        # rank 0 interleaves two chunks, rank 1 runs one stage: each is a valid layout on its own
        stages = ex.split_stages(make_model(), 2, 2)[0::2] if rank == 0 else ex.split_stages(make_model(), 2)[1]
        seen["chunks"] = _outcome(lambda: ex.train_step(stages, plan, make_shards(plan, cost, 1), data=doc_tokens,
                                                        mesh=mesh))
        # replicas: one micro-batch of replica 1's sharded for other offsets; replica 0 raises too
        mesh = ex.make_mesh(dp=2)
        plan, cost = make_plan(2)
        shards = make_shards(plan, cost, 1)
        j = next(j for j in plan.replica_micro_batches(1) if len(plan.micro_batches[j]))
        shards[j] = wlb.solve_shard(plan.lengths[plan.micro_batches[j]], 1, "per_doc",
                                    offsets=plan.offsets[plan.micro_batches[j]] + 1)
        seen["shard"] = _outcome(lambda: ex.train_step(make_model(), plan, shards, data=doc_tokens, mesh=mesh))
        mesh = ex.make_mesh(cp=2)
        plan, cost = make_plan(1, 2)
        shards = make_shards(plan, cost, 2)
        seen["mask"] = _outcome(lambda: ex.train_step(make_model(), plan.replace(step=4), shards,
                                                      data=_masked(6) if rank == 1 else _masked(-1), mesh=mesh))
        seen["read"] = _outcome(lambda: ex.train_step(make_model(), plan, shards, step=5, mesh=mesh,
                                                      data=_unreadable(4) if rank == 1 else doc_tokens))
        seen["same"] = _outcome(lambda: ex.train_step(make_model(), plan, shards, data=doc_tokens, mesh=mesh))
        # vocabulary: document 8 runs on replica 1 only; rank 0 raises too
        mesh = ex.make_mesh(dp=2)
        plan, cost = make_plan(2)
        shards = make_shards(plan, cost, 1)
        seen["vocab"] = _outcome(lambda: ex.train_step(make_model(), plan.replace(step=6), shards,
                                                       data=_changed(8, 5, VOCAB), mesh=mesh))
        # weights: replicas from different seeds
        other = make_model()
        if rank == 1:
            torch.manual_seed(5)
            other = type(other)(vocab=VOCAB, dim=32, layers=4, heads=4, kv_heads=2, ffn=48).double()
        seen["weights"] = _outcome(lambda: ex.train_step(other, plan.replace(step=0), shards, data=doc_tokens,
                                                         mesh=mesh))
        seen["weights off"] = _outcome(lambda: ex.train_step(other, plan, shards, data=doc_tokens, mesh=mesh,
                                                             check_weights=False))
        model = make_model()
        seen["weights once"] = _outcome(lambda: ex.train_step(model, plan, shards, data=doc_tokens, mesh=mesh))
        if rank == 1:
            with torch.no_grad():
                model.blocks[1].w2.weight[0, 0] += 1.0
        seen["weights remembered"] = _outcome(lambda: ex.train_step(model, plan, shards, data=doc_tokens, mesh=mesh))
        seen["weights forced"] = _outcome(lambda: ex.train_step(model, plan, shards, data=doc_tokens, mesh=mesh,
                                                                check_weights=True))
        model.load_state_dict(other.state_dict())  # a different state on rank 1: checked again
        seen["weights loaded"] = _outcome(lambda: ex.train_step(model, plan, shards, data=doc_tokens, mesh=mesh))
        # a checkpoint loaded on rank 1 alone: rank 0, which loaded nothing, compares its weights too
        model = make_model()
        seen["weights before a load on one rank"] = _outcome(lambda: ex.train_step(model, plan, shards,
                                                                                   data=doc_tokens, mesh=mesh))
        if rank == 1:
            state = {k: v.clone() for k, v in model.state_dict().items()}
            state["blocks.0.w1.weight"][0, 0] += 1.0
            model.load_state_dict(state)
        seen["weights loaded on one rank"] = _outcome(lambda: ex.train_step(model, plan, shards, data=doc_tokens,
                                                                            mesh=mesh))
        # ranks that differ in check_weights: the ranks that send checksums are compared, nobody waits
        seen["weights asked by one rank"] = _outcome(lambda: ex.train_step(
            make_model(), plan, shards, data=doc_tokens, mesh=mesh, check_weights=rank == 0))
        # a step without a mesh on rank 0 alone is that process's: no exchange, no roll call
        from wlb_opt.executor.rollcall import RollCall
        if rank == 0:
            calls = RollCall._calls
            alone, alone_cost = make_plan(1)
            seen["alone"] = _outcome(lambda: ex.train_step(make_model(), alone, make_shards(alone, alone_cost, 1),
                                                           data=doc_tokens))
            seen["alone counted"] = str(RollCall._calls - calls)
        dist.barrier()
        # tensor parallelism: TP shards are not compared with each other, replicated norms are
        mesh = ex.make_mesh(tp=2)
        plan, cost = make_plan(1)
        shards = make_shards(plan, cost, 1)
        stage = ex.split_stages(make_model(), 1)[0]
        ex.apply_tensor_parallel(stage, mesh.device_mesh["tp"])
        seen["tp same"] = _outcome(lambda: ex.train_step(stage, plan, shards, data=doc_tokens, mesh=mesh))
        if rank == 1:
            with torch.no_grad():
                stage.norm.weight[0] += 1.0
        seen["tp norm"] = _outcome(lambda: ex.train_step(stage, plan, shards, data=doc_tokens, mesh=mesh,
                                                         check_weights=True))
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write("\n".join(f"{k}\t{v}" for k, v in seen.items()))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as in test_plan_agreement: no interpreter teardown with gloo threads still joinable


def test_ranks_that_must_agree_raise_on_every_rank(tmp_path):
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        seen = dict(line.split("\t", 1) for line in (tmp_path / f"rank{rank}.txt").read_text().split("\n"))
        for name in ("tokens cp", "tokens pp"):
            assert seen[name].startswith("RuntimeError: step 3: ranks read different tokens for micro-batch 0: "
                                         "document 2 (its piece at offset 32, 8 tokens) differs"), (rank, seen[name])
            assert "[[0], [1]]" in seen[name] and "same dataset shard, tokenizer and data order" in seen[name]
        assert seen["mask"].startswith("RuntimeError: step 4: ranks read different tokens for micro-batch 1: "
                                       "document 6 (its piece at offset 0, 31 tokens) differs in its tokens or loss "
                                       "mask"), seen["mask"]
        if rank == 1:
            assert seen["read"] == "ValueError: document 4 is not in this shard", seen["read"]
        else:
            assert seen["read"].startswith("RuntimeError: step 5: rank 1 could not read its micro-batches"), seen
            assert "document 4 is not in this shard" in seen["read"]
        assert seen["same"] == "no error"
        assert seen["stages"].startswith("ValueError: pipeline rank 1's chunk 0 (virtual stage 1 of 2: pp=2 x 1 "
                                         "chunks per rank) is the last virtual stage but has no output projection"), \
            seen["stages"]
        assert seen["stages"].endswith("[pp_rank::2] (found on rank 1)"), seen["stages"]
        assert seen["chunks"].startswith("ValueError: the step of plan ") and seen["chunks"].endswith(
            ": ranks hold different numbers of pipeline chunks (virtual stages per rank): 2 on ranks [0]; 1 on "
            "ranks [1]. Every rank must pass its chunks of one split: split_stages(model, pp=..., "
            "virtual_stages=V)[pp_rank::pp] with the same V"), seen["chunks"]
        assert seen["loss_chunk"] == "ValueError: loss_chunk must be an integer >= 1 (tokens), got 0", seen
        assert seen["shard"].startswith("ValueError: the shard of micro-batch ") and \
            seen["shard"].endswith("(found on rank 1)"), seen["shard"]
        assert seen["vocab"].startswith(f"ValueError: step 6: document 8 holds token id {VOCAB} at position 5 "
                                        "(micro-batch 3), outside the model's vocabulary"), seen["vocab"]
        assert seen["vocab"].endswith("(found on rank 1)") and f"[0, {VOCAB - 1}]" in seen["vocab"]
        assert seen["weights"].startswith("RuntimeError: step 0: ranks that must hold the same weights differ: "
                                          "parameter 'stage 0: embed.weight' differs (ranks grouped by what they "
                                          "hold: [[0], [1]])"), seen["weights"]
        assert "check_weights=False" in seen["weights"]
        assert seen["weights off"] == "no error" and seen["weights once"] == "no error"
        assert seen["weights remembered"] == "no error"  # checked once for this module
        assert "parameter 'stage 0: blocks.1.w2.weight' differs" in seen["weights forced"], seen["weights forced"]
        assert "parameter 'stage 0: embed.weight' differs" in seen["weights loaded"], seen["weights loaded"]
        assert seen["weights before a load on one rank"] == "no error"
        assert "parameter 'stage 0: blocks.0.w1.weight' differs" in seen["weights loaded on one rank"], \
            seen["weights loaded on one rank"]
        assert seen["weights asked by one rank"] == "no error", seen["weights asked by one rank"]
        if rank == 0:
            assert seen["alone"] == "no error" and seen["alone counted"] == "0", (seen["alone"], seen["alone counted"])
        assert seen["tp same"] == "no error", seen["tp same"]
        assert "parameter 'stage 0: norm.weight' differs" in seen["tp norm"], seen["tp norm"]


def test_a_first_stage_without_a_vocabulary_is_logged_once(caplog):
    import wlb_opt.executor as ex

    class Opaque(torch.nn.Module):  # embeds through a plain parameter: no nn.Embedding, no vocab_size
        def __init__(self, base):
            super().__init__()
            self.table = torch.nn.Parameter(base.embed.weight.detach().clone())
            self.base, self.hidden, self.head = base, base.hidden, base.head
            base.embed = None

        def forward(self, x, pos, attend):
            return self.base(self.table[x], pos, attend)

    plan, cost = make_plan(1)
    stage = Opaque(ex.split_stages(make_model(), 1)[0])
    with caplog.at_level(logging.WARNING, logger="wlb_opt"):
        for _ in range(2):
            ex.train_step(stage, plan, make_shards(plan, cost, 1), data=doc_tokens, backend="torch")
    notes = [r for r in caplog.records if "not checked against the vocabulary" in r.getMessage()]
    assert len(notes) == 1 and "Opaque" in notes[0].getMessage()


def test_weight_checksums_see_every_bit_and_not_the_order_of_reduction():
    from wlb_opt.executor.plumbing import bits_checksum

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.int8):
        x = torch.randn(1000, generator=g).mul(50).to(dtype)
        base = int(bits_checksum(x))
        assert base == int(bits_checksum(x.clone().reshape(10, 100)))
        flipped = x.clone()
        flipped.view(torch.uint8)[123] ^= 1  # one bit of one element
        assert int(bits_checksum(flipped)) != base, dtype
        swapped = x.clone()
        swapped[[3, 4]] = swapped[[4, 3]]
        assert (x[3] == x[4]) or int(bits_checksum(swapped)) != base, dtype
    # the chunked sum equals a plain Python one over the bit patterns (wrapping at 64 bits)
    import wlb_opt.executor.plumbing as plumbing

    x = torch.randn(70, generator=g)
    bits = x.view(torch.int32).tolist()
    want = sum(b * (((i * plumbing._MIX) % (1 << 64)) | 1) for i, b in enumerate(bits)) % (1 << 64)
    old = plumbing._CHECKSUM_CHUNK
    try:
        plumbing._CHECKSUM_CHUNK = 16
        got = int(bits_checksum(x)) % (1 << 64)
    finally:
        plumbing._CHECKSUM_CHUNK = old
    assert got == want == int(bits_checksum(x)) % (1 << 64)


def test_fsdp_over_a_tp_shard_counts_as_a_shard_in_the_weight_check():
    """FSDP2 over a TP-sharded parameter places it as a _StridedShard, whose is_shard() is
    False in torch 2.13: it still holds a slice, so its ranks are not compared as replicas."""
    from torch.distributed.tensor.placement_types import Replicate, Shard

    from wlb_opt.executor.plumbing import _sharded

    strided = pytest.importorskip("torch.distributed.tensor.placement_types")._StridedShard
    assert _sharded(Shard(0)) and _sharded(strided(0, split_factor=2)) and not _sharded(Replicate())
