"""Bad input to the executor's step answers with a clear error of the library's own.

The same table form as tests/unit/test_bad_input.py (id, call, exception type, message fragment),
checked by its `_check`: the type, a fragment that names the value or what would be valid,
and an exception raised by this library's code. These run on one process; the cases that
need several ranks (tokens that differ between ranks, replicas with other weights, a rank
that fails or stalls) are in tests/distributed/test_rank_agreement.py and tests/distributed/test_culprit.py.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_bad_input import _check  # noqa: E402
from test_rank_agreement import _changed  # noqa: E402
from test_training import VOCAB, doc_tokens, make_model, make_plan, make_shards  # noqa: E402


class _Opaque(torch.nn.Module):
    """A first stage that embeds through a plain parameter and declares `vocab_size`."""

    def __init__(self, vocab_size=None):
        super().__init__()
        import wlb_opt.executor as ex

        base = ex.split_stages(make_model(), 1)[0]
        self.table = torch.nn.Parameter(base.embed.weight.detach().clone())
        base.embed = None
        self.base, self.hidden, self.head = base, base.hidden, base.head
        if vocab_size is not None:
            self.vocab_size = vocab_size

    def forward(self, x, pos, attend):
        return self.base(self.table[x], pos, attend)


class _Empty(torch.nn.Module):
    def forward(self, x, pos, attend):  # pragma: no cover - never reached
        return x


def _without_hidden():
    """Two stages of one rank (interleaved) with no `hidden` attribute: the width they send is unknown."""
    import wlb_opt.executor as ex

    stages = ex.split_stages(make_model(), 1, 2)
    for stage in stages:
        del stage.hidden
    return stages


def _bad_rank(shards):
    """The shards with micro-batch 0's first chunk moved to a CP rank the mesh has not."""
    import dataclasses

    chunks = shards[0].chunks.copy()
    chunks[0, 0] = 1
    return [dataclasses.replace(shards[0], chunks=chunks)] + list(shards[1:])


def _cases():
    import wlb_opt.executor as ex

    plan, cost = make_plan(1)
    shards = make_shards(plan, cost, 1)
    plan2, cost2 = make_plan(2)
    moved = np.zeros(len(plan.micro_batches), dtype=np.int64)
    moved[-1] = 1  # a micro-batch dealt to a replica the plan does not have

    def per_token(h, labels, head):  # the losses of the tokens, not their sum
        return torch.nn.functional.cross_entropy(head(h), labels.clamp(min=0), reduction="none")

    def step(model=None, plan=plan, shards=shards, data=doc_tokens, **kw):
        return ex.train_step(make_model() if model is None else model, plan, shards, data=data, backend="torch", **kw)

    return [
        ("train_step.plan_none", lambda: step(plan=None), TypeError, "plan must be a wlb_opt.PackPlan, got NoneType"),
        ("train_step.plan_dict", lambda: step(plan=plan.to_dict()), TypeError, "plan must be a wlb_opt.PackPlan"),
        ("train_step.shards_none", lambda: step(shards=None), ValueError, "shards must be a list with one ShardPlan"),
        ("train_step.shards_short", lambda: step(shards=shards[:1]), ValueError,
         f"per micro-batch of the plan ({len(plan.micro_batches)}), got 1 entries"),
        ("train_step.data_list", lambda: step(data=[1, 2, 3]), TypeError, "data must be a callable"),
        # checked on every rank before anything runs (the last stage would find them alone, the others waiting)
        ("train_step.shard_dict", lambda: step(shards=[s.to_dict() for s in shards]), TypeError,
         "shards[0] must be a wlb_opt.ShardPlan (or None for an empty slot), got dict"),
        ("train_step.loss_fn_string", lambda: step(loss_fn="ce"), TypeError,
         "loss_fn must be None (chunked cross-entropy) or a callable loss_fn(hidden, labels, head), got 'ce'"),
        ("train_step.record_list", lambda: step(record=[]), TypeError, "record must be None or a StageOutputs, got list"),
        ("train_step.reduce_grads_string", lambda: step(reduce_grads="no"), TypeError,
         "reduce_grads must be True or False, got 'no'"),
        ("train_step.check_plan_string", lambda: step(check_plan="off"), TypeError, "check_plan must be True or False"),
        ("train_step.backend", lambda: ex.train_step(make_model(), plan, shards, data=doc_tokens, backend="cuda"),
         ValueError, "backend must be one of ['auto', 'triton', 'torch'], got 'cuda'"),
        ("train_step.stages_without_hidden", lambda: step(model=_without_hidden()), ValueError,
         "pipeline stages need a `hidden` attribute"),
        ("train_step.mesh_string", lambda: step(mesh="dp=2"), TypeError, "mesh must be a wlb_opt.executor.Mesh"),
        ("train_step.check_weights_string", lambda: step(check_weights="yes"), ValueError,
         "check_weights must be None (check on the first call with these stages), True or False, got 'yes'"),
        ("train_step.check_weights_int", lambda: step(check_weights=1), ValueError, "got 1"),
        ("train_step.model_string", lambda: step(model="tiny"), ValueError, "model must be a torch.nn.Module"),
        ("train_step.no_parameters", lambda: step(model=_Empty()), ValueError, "has no parameters"),
        ("train_step.token_past_vocab", lambda: step(data=_changed(4, 3, VOCAB)), ValueError,
         f"document 4 holds token id {VOCAB} at position 3"),
        ("train_step.token_far_past_vocab", lambda: step(data=_changed(4, 3, 2**40)), ValueError,
         f"token id {2**40} at position 3"),
        ("train_step.token_negative", lambda: step(data=_changed(2, 33, -1)), ValueError,
         "document 2 holds token id -1 at position 33"),
        ("train_step.vocab_range", lambda: step(data=_changed(2, 0, -5)), ValueError, f"must be in [0, {VOCAB - 1}]"),
        ("train_step.vocab_size_attribute", lambda: step(model=_Opaque(vocab_size=10)), ValueError,
         "the first stage's vocab_size is 10, so token ids must be in [0, 9]"),
        ("train_step.float_tokens", lambda: step(data=lambda i: doc_tokens(i).double() + 0.5), ValueError,
         "token ids must be integers, got dtype torch.float64"),
        ("train_step.bool_tokens", lambda: step(data=lambda i: doc_tokens(i) > 3), ValueError,
         "token ids must be integers, got dtype torch.bool"),
        ("train_step.uint64_tokens", lambda: step(data=lambda i: torch.from_numpy(
            (doc_tokens(i).numpy().astype(np.uint64) + np.uint64(2**63)))), ValueError, "token ids must fit in int64"),
        ("train_step.short_document", lambda: step(data=lambda i: doc_tokens(i)[:3]), ValueError,
         "a 1-D tensor of at least"),
        ("train_step.loss_mask_shape", lambda: step(data=lambda i: (doc_tokens(i), torch.ones(2, dtype=torch.bool))),
         ValueError, "document 2: loss mask of 2 entries for 300 tokens"),
        ("train_step.loss_chunk_zero", lambda: step(loss_chunk=0), ValueError, "loss_chunk must be an integer >= 1"),
        ("train_step.dp_without_mesh", lambda: step(plan=plan2, shards=make_shards(plan2, cost2, 1)), ValueError,
         "plan has dp=2 replicas; without a mesh train_step runs one replica"),
        ("train_step.replica_of", lambda: step(plan=plan.replace(replica_of=moved)), ValueError,
         "plan.replica_of must give each of the plan's dp=1 replicas"),
        ("train_step.loss_fn_per_token", lambda: step(loss_fn=per_token), ValueError,
         "loss_fn must return the micro-batch's summed loss as a scalar tensor"),
        ("train_step.stage_without_embedding", lambda: step(model=ex.split_stages(make_model(), 2)[1]), ValueError,
         "chunk 0 (virtual stage 0 of 1: pp=1 x 1 chunks per rank) is the first virtual stage but has no token "
         "embedding (`embed` is None): the stages were split for another pipeline"),
        ("train_step.stage_without_head", lambda: step(model=ex.split_stages(make_model(), 2)[0]), ValueError,
         "is the last virtual stage but has no output projection"),
        ("train_step.two_whole_models", lambda: step(model=ex.split_stages(make_model(), 1) * 2), ValueError,
         "chunk 0 (virtual stage 0 of 2: pp=1 x 2 chunks per rank) holds the output projection (`head`), which "
         "only the last virtual stage (1) may"),
        ("train_step.shard_rank_past_cp", lambda: step(shards=_bad_rank(shards)), ValueError,
         "the shard of micro-batch 0: chunk row 0"),
        ("make_mesh.timeout_not_initialised", lambda: ex.make_mesh(timeout=-1), ValueError,
         "needs torch.distributed initialised"),
        ("split_stages.pp_zero", lambda: ex.split_stages(make_model(), 0), ValueError,
         "pp must be an integer >= 1 (the pipeline stages), got 0"),
        ("split_stages.pp_float", lambda: ex.split_stages(make_model(), 2.0), ValueError, "got 2.0"),
        ("apply_tensor_parallel.not_a_mesh", lambda: ex.apply_tensor_parallel(ex.split_stages(make_model(), 1)[0],
                                                                            object()), ValueError,
         "tp_mesh must be a 1-D DeviceMesh of the TP ranks"),
        ("apply_tensor_parallel.whole_mesh", lambda: ex.apply_tensor_parallel(
            ex.split_stages(make_model(), 1)[0], SimpleNamespace(ndim=2, size=lambda: 4)), ValueError,
         "got SimpleNamespace of 2 dimensions"),
    ]


_CASE_IDS = [c[0] for c in _cases()]


@pytest.mark.parametrize("case_id", _CASE_IDS)
def test_bad_step_input_raises_a_clear_error(case_id):
    case = {c[0]: c for c in _cases()}[case_id]
    _check(*case[1:])


def test_the_vocabulary_check_passes_good_tokens_and_a_declared_vocabulary():
    import wlb_opt.executor as ex

    plan, cost = make_plan(1)
    shards = make_shards(plan, cost, 1)
    loss = ex.train_step(_Opaque(vocab_size=VOCAB), plan, shards, data=doc_tokens, backend="torch")
    assert loss > 0
    # unsigned token arrays (a tokenized dataset's uint16) train as their int64 values
    plain = ex.train_step(make_model(), plan, shards, data=doc_tokens, backend="torch")
    narrow = ex.train_step(make_model(), plan, shards, data=lambda i: doc_tokens(i).numpy().astype(np.uint16),
                           backend="torch")
    assert narrow == plain
