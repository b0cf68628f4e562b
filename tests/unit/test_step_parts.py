"""The parts of `train_step` in one process: a rank's micro-batch inputs, the shard check,
the global target count and the gradient reduction (torch.distributed's all_reduce replaced
by a fake that records its buckets)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import wlb_opt as wlb  # noqa: E402
from wlb_opt import batch  # noqa: E402
from wlb_opt.executor import train  # noqa: E402


def doc_tokens(doc_id: int) -> torch.Tensor:
    return (torch.arange(60) * 7 + doc_id) % 97


def make(cp: int = 2):
    plan = wlb.solve_pack([30, 12, 5, 1, 17], 2, 48, method="wlb", ids=[0, 1, 2, 3, 4])
    shards = [wlb.solve_shard(plan.lengths[mb], cp, "per_doc", offsets=plan.offsets[mb]) if len(mb) else None
              for mb in plan.micro_batches]
    packed = {j: batch.pack_micro_batch(plan, j, doc_tokens) for j, mb in enumerate(plan.micro_batches) if len(mb)}
    return plan, shards, packed


def test_step_inputs_are_the_ranks_rows_of_each_micro_batch():
    plan, shards, packed = make()
    for cp_rank in range(2):
        inputs = train.StepInputs(plan, shards, packed, cp_rank, torch.device("cpu"))
        for j, mb in enumerate(plan.micro_batches):
            rows = inputs.of(j)
            assert inputs.of(j) is rows  # built once
            tokens, labels = packed[j]
            idx = torch.tensor(np.array(shards[j].rank_indices[cp_rank]))
            whole = batch.packed_positions(plan.lengths[mb], plan.offsets[mb])
            assert torch.equal(rows.tokens, tokens[idx]) and torch.equal(rows.labels, labels[idx])
            assert rows.positions.tolist() == whole[idx.numpy()].tolist()
            assert inputs.rows(j) == len(idx) and rows.targets == int((labels[idx] != -100).sum())
    # both CP ranks together hold every target of the global batch once
    total = sum(train.StepInputs(plan, shards, packed, r, torch.device("cpu")).of(j).targets
                for r in range(2) for j in range(len(plan.micro_batches)))
    assert total == batch.target_tokens(plan)


def test_an_empty_slot_has_zero_rows():
    plan, shards, packed = make()
    empty = wlb.PackPlan(doc_ids=plan.doc_ids, lengths=plan.lengths, offsets=plan.offsets,
                         micro_batches=(*plan.micro_batches, np.zeros(0, np.int64)),
                         replica_of=np.zeros(len(plan.micro_batches) + 1, np.int64), deferred=plan.deferred,
                         loads=np.append(plan.loads, 0.0), tokens=np.append(plan.tokens, 0),
                         n_micro=plan.n_micro + 1, max_tokens=plan.max_tokens)
    inputs = train.StepInputs(empty, [*shards, None], packed, 0, torch.device("cpu"))
    j = len(plan.micro_batches)
    assert inputs.rows(j) == 0 and inputs.of(j).targets == 0 and inputs.of(j).tokens.numel() == 0


def test_check_shards_names_the_micro_batch():
    plan, shards, _ = make()
    train.check_shards(plan, shards, range(len(shards)), 2)
    with pytest.raises(ValueError, match="step 3: shard of micro-batch 0 has 2 CP ranks, mesh has 4"):
        train.check_shards(plan, shards, [0], 4, "step 3: ")
    with pytest.raises(ValueError, match="shard of micro-batch 1 has None CP ranks"):
        train.check_shards(plan, [shards[0], None], [0, 1], 2)
    mb = plan.micro_batches[0]
    other = wlb.solve_shard(plan.lengths[mb], 2, "per_doc", offsets=plan.offsets[mb] + 1)
    with pytest.raises(ValueError, match="micro-batch 0 was built for other pieces"):
        train.check_shards(plan, [other, shards[1]], [0, 1], 2)


def test_the_global_target_count_without_a_mesh_is_the_local_one():
    assert train.global_target_count(41, None, torch.device("cpu")) == 41.0


class _FakeMesh:
    stage_group = object()  # not SELF_GROUP: the stage is held by more than one rank


def test_gradient_reduction_sums_in_flat_buckets(monkeypatch):
    calls = []

    def all_reduce(flat, group=None):  # two ranks holding the same gradients
        calls.append((flat.dtype, flat.numel(), group))
        flat.mul_(2)

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    torch.manual_seed(0)
    chunks = [torch.nn.Linear(4, 3), torch.nn.Linear(3, 2).double(), torch.nn.Linear(2, 2)]
    for chunk in chunks[:2]:
        chunk(torch.randn(5, chunk.in_features, dtype=chunk.weight.dtype)).sum().backward()
    before = [[None if p.grad is None else p.grad.clone() for p in c.parameters()] for c in chunks]
    mesh = _FakeMesh()
    train.reduce_gradients(chunks, mesh, skip={2})
    # one bucket per dtype run; the skipped chunk (FSDP2 reduces its own) keeps no gradient
    assert calls == [(torch.float32, 4 * 3 + 3, mesh.stage_group), (torch.float64, 3 * 2 + 2, mesh.stage_group)]
    for chunk, old in zip(chunks[:2], before[:2]):
        for p, g in zip(chunk.parameters(), old):
            assert torch.equal(p.grad, 2 * g)
    assert all(p.grad is None for p in chunks[2].parameters())
    calls.clear()
    train.reduce_gradients(chunks[2:], mesh)  # a chunk without gradients takes zeros: same collectives
    assert calls == [(torch.float32, 2 * 2 + 2, mesh.stage_group)]
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in chunks[2].parameters())


def test_flat_buckets_respect_their_size(monkeypatch):
    sizes = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda flat, group=None: sizes.append(flat.numel()))
    tensors = [torch.ones(n) for n in (3, 4, 5, 1)]
    train._all_reduce_flat(tensors, None, bucket_bytes=8 * 4)  # 8 floats a bucket at most
    assert sizes == [7, 6]
    assert all(torch.equal(t, torch.ones_like(t)) for t in tensors)
    sizes.clear()
    train._all_reduce_flat([], None)
    assert sizes == []
