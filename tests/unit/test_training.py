"""A CP x DP training step over gloo equals single-process training on the same global batch.

The reference runs every micro-batch of the plan on one process with whole-sequence
document-masked attention and the same global-token loss normalisation; the distributed
step runs each replica's micro-batches with context_parallel_attention on CP shards and
sums gradients over all ranks. Loss and every parameter gradient must agree (fp64).
"""
from __future__ import annotations

import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import wlb_opt as wlb  # noqa: E402
from wlb_opt import batch  # noqa: E402
from wlb_opt.kernels import doc_attention  # noqa: E402
from wlb_opt.kernels.segments import segments_from_lengths  # noqa: E402

VOCAB = 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def doc_tokens(doc_id: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + doc_id)
    return torch.randint(0, VOCAB, (300,), generator=g)


def make_plan(dp: int, cp: int = 1, pp: int = 1):
    lengths = np.array([23, 5, 40, 2, 17, 9, 31, 1, 12, 6])
    pieces, ids, offsets = wlb.split_documents(lengths, window=32)
    layout = wlb.ParallelSpec(cp=cp, pp=pp, dp=dp)
    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"), layout, wlb.HardwareSpec.preset("cpu"))
    plan = wlb.solve_pack(pieces, 2, 96, cost, "wlb", ids=ids, offsets=offsets)  # the layout is the cost's
    assert len(plan.deferred) == 0
    return plan, cost


def make_model(dtype=torch.float64):
    from wlb_opt.executor import TinyLM

    torch.manual_seed(0)
    return TinyLM(vocab=VOCAB, dim=32, layers=4, heads=4, kv_heads=2, ffn=48).to(dtype)


def make_shards(plan, cost, cp, strategy="per_doc"):
    out = []
    for mb in plan.micro_batches:
        lengths = plan.lengths[mb]
        offsets = plan.offsets[mb]
        out.append(wlb.solve_shard(lengths, None, strategy, cost, offsets=offsets, token_skew=1.0)
                   if len(lengths) else None)
    return out


def sparse_plan(pp: int):
    """Three documents over 2 x pp micro-batch slots: some slots stay empty."""
    layout = wlb.ParallelSpec(pp=pp)
    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"), layout, wlb.HardwareSpec.preset("cpu"))
    plan = wlb.solve_pack(np.array([30, 7, 1]), 2 * pp, 64, cost, "wlb", ids=np.array([3, 4, 5]))
    assert sum(len(mb) == 0 for mb in plan.micro_batches) >= 1
    return plan, cost


def in_flight(rank: int, pp: int, n_micro: int, v: int) -> int:
    """Most micro-batch chunks a rank holds at once under its schedule: from the moment their
    input's receive is posted (or, on the first virtual stage, their forward starts) until
    their backward ends. Walked from `step_plan` alone, not from the executor."""
    from wlb_opt.schedule import step_plan

    held, peak = set(), 0
    for group, op in step_plan(rank, pp, n_micro, v):
        held |= {(o.micro, o.chunk * pp + rank) for o in group if o.kind == "recv" and o.direction == "fwd"}
        if op is not None:
            phase, k, vs = op
            if phase == "F":
                held.add((k, vs))
            peak = max(peak, len(held))
            if phase == "B":
                held.discard((k, vs))
        peak = max(peak, len(held))
    return peak


def masked_doc(doc_id: int):
    """A document with a loss mask: its first 7 tokens (a "prompt") are not targets."""
    tokens = doc_tokens(doc_id)
    mask = torch.ones(len(tokens), dtype=torch.bool)
    mask[:7] = False
    return tokens, mask


def reference(plan, masked: bool = False):
    from wlb_opt.batch import pack_tokens, packed_labels, packed_positions, target_tokens

    model = make_model()
    total = target_tokens(plan)
    if masked:  # labels by hand: a target only where the next token's mask is True
        total = sum(int(((plan.offsets[i] + np.arange(1, plan.lengths[i])) >= 7).sum())
                    for mb in plan.micro_batches for i in mb)
    loss_sum = 0.0
    for j, mb in enumerate(plan.micro_batches):
        if len(mb) == 0:
            continue
        lengths = plan.lengths[mb]
        tokens = pack_tokens(plan, j, doc_tokens)
        seg = segments_from_lengths(lengths)
        logits = model(tokens, torch.from_numpy(packed_positions(lengths, plan.offsets[mb])),
                       lambda q, k, v: doc_attention(q, k, v, seg, backend="torch"))
        labels = packed_labels(tokens, lengths)
        if masked:
            within = np.concatenate([plan.offsets[i] + np.arange(plan.lengths[i]) for i in mb])
            nxt = torch.from_numpy(np.concatenate([within[1:], [0]]) >= 7)
            labels = labels.masked_fill(~nxt, -100)
        loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / total
        loss.backward()
        loss_sum += float(loss.detach())
    return loss_sum, {n: p.grad.clone() for n, p in model.named_parameters()}


# (cp, pp, dp, virtual stages, CP strategy, plan) per world size; hybrid gives ranks unequal
# token counts, "sparse" a plan with empty micro-batch slots
LAYOUTS = {2: [(2, 1, 1, 1, "per_doc", "dense"), (1, 2, 1, 1, "per_doc", "dense"), (1, 2, 1, 2, "per_doc", "dense"),
               (1, 2, 1, 1, "per_doc", "sparse"), (1, 2, 1, 2, "per_doc", "sparse")],
           4: [(2, 2, 1, 1, "hybrid", "dense"), (1, 2, 2, 1, "per_doc", "dense"), (2, 1, 2, 1, "per_doc", "dense"),
               (2, 2, 1, 2, "hybrid", "dense"), (1, 2, 2, 2, "per_doc", "dense")]}


def test_a_stage_that_sends_the_wrong_dtype_is_a_clear_error():
    from wlb_opt.executor.train import check_boundary_dtype

    check_boundary_dtype(torch.zeros(2, dtype=torch.bfloat16), torch.bfloat16, "fwd", 0)
    with pytest.raises(ValueError, match="dtype torch.float32 but the pipeline carries torch.bfloat16"):
        check_boundary_dtype(torch.zeros(2), torch.bfloat16, "fwd", 1)


def test_loss_is_normalised_over_the_global_batch_not_per_micro_batch():
    from wlb_opt.batch import target_tokens

    plan, _ = make_plan(dp=1)
    # every placed piece of length d contributes d - 1 targets
    assert target_tokens(plan) == int(sum(plan.lengths[mb].sum() - len(mb) for mb in plan.micro_batches))


def test_positions_and_labels():
    from wlb_opt.batch import packed_labels, packed_positions

    assert packed_positions([3, 2], [0, 32]).tolist() == [0, 1, 2, 32, 33]
    assert packed_labels(torch.tensor([5, 6, 7, 8, 9]), [3, 2]).tolist() == [6, 7, -100, 9, -100]


def test_chunked_cross_entropy_equals_the_full_loss_and_its_gradients():
    from wlb_opt.executor.train import chunked_cross_entropy

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, generator=g).requires_grad_()
    head = torch.nn.Linear(16, 50, bias=False).double()
    labels = torch.randint(0, 50, (37,), generator=g)
    labels[5:21] = -100  # a masked run: chunks of only masked tokens add nothing
    full = torch.nn.functional.cross_entropy(head(hidden), labels, ignore_index=-100, reduction="sum")
    want = torch.autograd.grad(full, (hidden, head.weight))
    for chunk in (1, 4, 8, 16, 37, 100):
        got_loss = chunked_cross_entropy(hidden, labels, head, chunk)
        got = torch.autograd.grad(got_loss, (hidden, head.weight))
        torch.testing.assert_close(got_loss, full, rtol=1e-12, atol=1e-12)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert float(chunked_cross_entropy(hidden, torch.full((37,), -100), head, 8).detach()) == 0.0
    with pytest.raises(ValueError, match="loss_chunk"):
        chunked_cross_entropy(hidden, labels, head, 0)


def test_chunked_cross_entropy_of_fp16_states_whose_sum_passes_fp16s_range_is_finite():
    from wlb_opt.executor.train import chunked_cross_entropy

    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(512, 256, generator=g) * 0.1 + 1.0).half().requires_grad_()  # sums to about 131072
    assert torch.isinf(hidden.detach().sum())
    head = torch.nn.Linear(256, 32, bias=False).half()
    labels = torch.randint(0, 32, (512,), generator=g)
    want = torch.nn.functional.cross_entropy(head(hidden).float(), labels, reduction="sum")
    got = chunked_cross_entropy(hidden, labels, head, 128)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)
    got.backward()
    assert torch.isfinite(hidden.grad).all()


def test_train_step_takes_the_users_loss_and_the_models_softmax_scale():
    """One process: a custom summed loss replaces the default, and an attention scale the
    model passes reaches CP attention (checked against the same model and scale by hand)."""
    import wlb_opt.executor as ex

    plan, cost = make_plan(1)
    shards = make_shards(plan, cost, 1)
    seen = []

    def loss_fn(hidden, labels, head):
        seen.append(hidden.shape[0])
        return torch.nn.functional.cross_entropy(head(hidden), labels, ignore_index=-100, reduction="sum")

    model = make_model()
    loss = ex.train_step(model, plan, shards, data=doc_tokens, backend="torch", loss_fn=loss_fn, check_plan=False)
    ref_loss, _ = reference(plan)
    assert abs(loss - ref_loss) < 1e-12 and len(seen) == sum(len(mb) > 0 for mb in plan.micro_batches)

    class Scaled(torch.nn.Module):  # a one-block stage whose attention uses its own scale
        def __init__(self, base):
            super().__init__()
            self.base, self.hidden, self.head = base, base.hidden, base.head

        def forward(self, x, pos, attend):
            return self.base(x, pos, lambda q, k, v, **kw: attend(q, k, v, softmax_scale=0.05))

    stage = Scaled(ex.split_stages(make_model(), 1)[0])
    loss = ex.train_step(stage, plan, shards, data=doc_tokens, backend="torch", check_plan=False)
    by_hand, total = 0.0, batch.target_tokens(plan)
    model = make_model()
    for j, mb in enumerate(plan.micro_batches):
        lengths = plan.lengths[mb]
        tokens = batch.pack_tokens(plan, j, doc_tokens)
        seg = segments_from_lengths(lengths)
        logits = model(tokens, torch.from_numpy(batch.packed_positions(lengths, plan.offsets[mb])),
                       lambda q, k, v: doc_attention(q, k, v, seg, softmax_scale=0.05, backend="torch"))
        by_hand += float(torch.nn.functional.cross_entropy(logits.detach(), batch.packed_labels(tokens, lengths),
                                                           ignore_index=-100, reduction="sum")) / total
    assert abs(loss - by_hand) < 1e-12 and abs(loss - ref_loss) > 1e-6


_RECORDED = __import__("json").loads(
    (__import__("pathlib").Path(__file__).parents[1] / "data" / "train_reference_losses.json").read_text())["layouts"]




def test_a_hand_built_mesh_names_the_group_its_gradients_are_summed_over():
    from wlb_opt.executor import Mesh
    from wlb_opt.executor.mesh import SELF_GROUP

    with pytest.raises(ValueError, match=r"stage_group=None \(the default group, every rank\) with pp=2, tp=1"):
        Mesh(cp=1, dp=1, cp_rank=0, dp_rank=0, cp_group=SELF_GROUP, dp_group=SELF_GROUP, pp=2, pp_rank=1)
    with pytest.raises(ValueError, match="with pp=1, tp=2"):
        Mesh(cp=1, dp=1, cp_rank=0, dp_rank=0, cp_group=SELF_GROUP, dp_group=SELF_GROUP, tp=2)
    # one stage and TP shard: every rank holds it, and the default group is the right one
    assert Mesh(cp=2, dp=1, cp_rank=0, dp_rank=0, cp_group=None, dp_group=SELF_GROUP).stage_group is None
    assert Mesh(cp=1, dp=1, cp_rank=0, dp_rank=0, cp_group=SELF_GROUP, dp_group=SELF_GROUP, pp=2,
                stage_group=SELF_GROUP).pp == 2
