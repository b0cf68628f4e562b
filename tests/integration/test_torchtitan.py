"""The torchtitan adapter in one process: WLB's step over torchtitan's decoders equals
torchtitan's own path (each piece its own sequence, causal SDPA) in fp64, on llama3 and qwen3
with fused and separate Q/K/V, pieces that continue a document included; the attention's
mask is the document mask even where positions of two documents continue; the stage split;
the data loader's state and what it yields a stock Trainer."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan")

import wlb_opt as wlb  # noqa: E402
from wlb_opt.executor import train_step  # noqa: E402
from wlb_opt.executor.train import CPAttend  # noqa: E402
from wlb_opt.integrations import torchtitan as tt  # noqa: E402

VOCAB = 97


def fp64(model):
    """The model in fp64 with its RoPE tables rebuilt (a cast drops the imaginary part of
    llama3's complex table)."""
    from torchtitan.models.common.rope import RoPE

    model.to(torch.float64)
    for module in model.modules():
        if isinstance(module, RoPE):
            module._init_self_buffers(buffer_device=torch.device("cpu"))
    return model


def models(family: str, fuse_qkv: bool, layers: int = 2):
    """(WLB model, torchtitan's own model) with the same fp64 weights."""
    config = tt.small_config(family, dim=32, layers=layers, heads=4, kv_heads=2, vocab=VOCAB, max_seq_len=512,
                             fuse_qkv=fuse_qkv)
    ref = fp64(tt.reference_model(config))
    tt.use_wlb_attention(config)
    torch.manual_seed(1)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    model = fp64(model)
    ref.load_state_dict(model.state_dict())
    return model, ref, config


def stream(config, lengths, tokens_per_step=100, n_micro=2, max_tokens=64):
    rng = np.random.default_rng(0)
    docs = [(i, rng.integers(0, VOCAB, int(n))) for i, n in enumerate(lengths)]
    cost = wlb.CostModel.analytic(wlb.ModelSpec.from_torchtitan(config), None,
                                  wlb.HardwareSpec.preset("cpu")).without_layout()
    packer = wlb.WLBPacker(n_micro, max_tokens, cost, config=wlb.PackerConfig(thresholds=[]))
    return wlb.WLBStream(docs, packer, tokens_per_step, window=max_tokens)


LENGTHS = [40, 150, 7, 90, 33, 60, 200, 5, 17]


@pytest.mark.parametrize("family, fuse_qkv", [("llama3", True), pytest.param("llama3", False, marks=pytest.mark.slow),
                                              pytest.param("qwen3", True, marks=pytest.mark.slow), ("qwen3", False)])
def test_train_step_over_titan_stages_equals_torchtitans_own_path(family, fuse_qkv):
    model, ref, config = models(family, fuse_qkv)
    continued = 0
    for k, step in zip(range(4), stream(config, LENGTHS)):
        continued += int((step.plan.offsets > 0).sum())
        for p in [*model.parameters(), *ref.parameters()]:
            p.grad = None
        loss = train_step(tt.titan_stages(model, 1), step.plan, step.shards, data=step, backend="torch")
        want = tt.reference_loss(ref, step)
        want.backward()
        assert abs(loss - float(want)) <= 1e-12 * abs(float(want))
        grads = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            scale = float(grads[name].grad.abs().max()) + 1e-300
            assert float((p.grad - grads[name].grad).abs().max()) <= 1e-10 * scale, name
    assert continued >= 2  # pieces whose positions continue their document's were trained


def test_the_attention_mask_is_the_document_mask_where_positions_of_two_documents_continue():
    """Pieces [document 0: offsets 0..3] and [document 1 at offset 4: positions 4..6] look like
    one document to a positions-based mask; the adapter's mask keeps them apart, and a piece
    at offset 3 attends only to itself."""
    lengths, offsets = np.array([4, 3, 5]), np.array([0, 4, 3])
    from wlb_opt.cost import default_cost

    shard = wlb.solve_shard(lengths, 1, "per_doc", default_cost(), offsets=offsets)
    attend = CPAttend(shard, None, "torch", None, prefetch=False)
    attention = tt.WLBAttention()
    torch.manual_seed(0)
    t, heads, dim = int(lengths.sum()), 4, 8
    q, k, v = (torch.randn(1, t, heads, dim, dtype=torch.float64) for _ in range(3))
    out = attention(q, k, v, attention_masks=tt.Boundaries(attend), scale=0.3)[0]
    doc = np.repeat(np.arange(len(lengths)), lengths)
    idx = np.arange(t)
    mask = torch.from_numpy((doc[:, None] == doc[None, :]) & (idx[None, :] <= idx[:, None]))
    scores = torch.einsum("thd,shd->hts", q[0], k[0]) * 0.3
    want = torch.einsum("hts,shd->thd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v[0])
    assert torch.allclose(out, want, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="document boundaries"):
        attention(q, k, v, attention_masks=None)


def test_stages_split_layers_evenly_and_chain_to_the_whole_model():
    model, _, config = models("llama3", True, layers=4)
    stages = tt.titan_stages(model, 2, 2)
    assert [len(s.blocks) for s in stages] == [1, 1, 1, 1]
    assert stages[0].embed is model.tok_embeddings and stages[-1].head is model.lm_head
    assert all(s.head is None for s in stages[:-1]) and all(s.embed is None for s in stages[1:])
    step = next(iter(stream(config, LENGTHS)))
    j = next(j for j, mb in enumerate(step.plan.micro_batches) if len(mb))
    inputs = step.inputs(j)
    attend = CPAttend(step.shards[j], None, "torch", None, prefetch=False)
    h = inputs["input_ids"]
    for s in stages:
        h = s(h, inputs["position_ids"], attend)
    whole = tt.titan_stages(model, 1)[0](inputs["input_ids"], inputs["position_ids"], attend)
    assert torch.equal(h, whole)
    assert tt.stage_bounds(5, 2) == [0, 2, 5]


def test_a_piece_past_the_rope_table_is_refused_by_the_stage():
    model, _, config = models("llama3", True)
    step = next(iter(stream(config, [600], tokens_per_step=600, max_tokens=600, n_micro=1)))
    with pytest.raises(ValueError, match="RoPE table holds 512 positions"):
        train_step(tt.titan_stages(model, 1), step.plan, step.shards, data=step, backend="torch")


def test_model_spec_from_torchtitan():
    spec = wlb.ModelSpec.from_torchtitan(tt.small_config("qwen3", dim=64, layers=3, heads=4, kv_heads=2, vocab=300))
    assert (spec.hidden, spec.layers, spec.heads, spec.kv_heads, spec.head_dim, spec.ffn, spec.vocab) == \
        (64, 3, 4, 2, 16, 256, 300)
    from torchtitan.models.llama3 import model_registry

    spec = wlb.ModelSpec.from_torchtitan(model_registry("8B").model)
    assert (spec.hidden, spec.layers, spec.heads, spec.kv_heads, spec.ffn, spec.vocab) == \
        (4096, 32, 32, 8, 14336, 128256)


def test_the_loader_resumes_at_the_step_after_the_one_it_handed_out():
    config = tt.small_config("llama3", dim=32, layers=2, vocab=VOCAB)
    loader = tt.WLBDataLoader(tt.WLBDataLoader.Config(stream=stream(config, LENGTHS * 3)), seq_len=512)
    steps = loader.steps()
    for _ in range(3):
        next(steps)
    saved = json.loads(json.dumps(loader.state_dict()))  # what DCP stores: a string
    fourth = next(steps)
    again = tt.WLBDataLoader(stream(config, LENGTHS * 3), seq_len=512)  # the stream itself: the same loader
    again.load_state_dict(saved)
    resumed = next(again.steps())
    assert resumed.index == fourth.index
    assert resumed.plan.digest() == fourth.plan.digest()


def test_a_stock_trainer_gets_batch_one_micro_batches_with_positions_restarting_per_piece():
    config = tt.small_config("llama3", dim=32, layers=2, vocab=VOCAB)
    loader = tt.WLBDataLoader(tt.WLBDataLoader.Config(stream=stream(config, LENGTHS)), seq_len=512,
                              local_batch_size=1)
    items = iter(loader)
    step = next(iter(stream(config, LENGTHS)))
    for j in step.local(0):
        inputs, labels = next(items)
        if not len(step.plan.micro_batches[j]):
            assert labels.tolist() == [[-100]]
            continue
        lengths = step.plan.lengths[step.plan.micro_batches[j]]
        assert inputs["input"].shape == labels.shape == (1, int(lengths.sum()))
        assert torch.equal(inputs["positions"][0], torch.cat([torch.arange(int(n)) for n in lengths]))
        assert torch.equal(inputs["input"][0], step.tokens(j))


def _items(loader, n=None):
    out = []
    for k, (inputs, labels) in enumerate(loader):
        if n is not None and k == n:
            break
        out.append((inputs["input"].clone(), inputs["positions"].clone(), labels.clone(), loader.state_dict()))
    return out


def test_a_stock_trainer_resumed_within_a_step_gets_exactly_the_micro_batches_it_had_not():
    """One micro-batch per optimizer step: a checkpoint after any of them resumes with the next."""
    config = tt.small_config("llama3", dim=32, layers=2, vocab=VOCAB)
    whole = _items(tt.WLBDataLoader(stream(config, LENGTHS * 2), seq_len=512, local_batch_size=1))
    assert len(whole) >= 6
    for cut in range(1, len(whole)):
        saved = json.loads(json.dumps(whole[cut - 1][3]))  # the state after item cut - 1
        loader = tt.WLBDataLoader(stream(config, LENGTHS * 2), seq_len=512, local_batch_size=1)
        loader.load_state_dict(saved)
        rest = _items(loader)
        assert len(rest) == len(whole) - cut, cut
        for (a, pa, la, _), (b, pb, lb, _) in zip(rest, whole[cut:]):
            assert torch.equal(a, b) and torch.equal(pa, pb) and torch.equal(la, lb)


def test_a_loop_left_within_a_step_and_entered_again_goes_on_where_it_stopped():
    """A second iter() (a `for` loop left with break, then entered again) hands out the rest of
    the step the first one stopped in, then the next steps whole: the items of one pass."""
    config = tt.small_config("llama3", dim=32, layers=2, vocab=VOCAB)
    whole = _items(tt.WLBDataLoader(stream(config, LENGTHS * 2), seq_len=512, local_batch_size=1))
    loader = tt.WLBDataLoader(stream(config, LENGTHS * 2), seq_len=512, local_batch_size=1)
    got = []
    for cut in (1, 2, 5):  # leave the loop after 1, then 1 more, then 3 more items
        for inputs, labels in loader:
            got.append((inputs["input"].clone(), labels.clone(), loader.state_dict()))
            if len(got) == cut:
                break
    got += [(inputs["input"].clone(), labels.clone(), loader.state_dict()) for inputs, labels in loader]
    assert len(got) == len(whole)
    for (a, la, sa), (b, _, lb, sb) in zip(got, whole):
        assert torch.equal(a, b) and torch.equal(la, lb) and sa == sb


def test_a_stock_trainer_reads_documents_longer_than_seq_len_in_pieces_that_fit():
    """Through the iterator positions restart at each piece: only a piece must fit the RoPE table."""
    config = tt.small_config("llama3", dim=32, layers=2, vocab=VOCAB)
    loader = tt.WLBDataLoader(stream(config, LENGTHS), seq_len=64, local_batch_size=1)
    positions = [p for _, p, _, _ in _items(loader)]
    assert max(int(p.max()) for p in positions) <= 63
    with pytest.raises(ValueError, match="past training.seq_len=64.*the longest document's length"):
        for _ in tt.WLBDataLoader(stream(config, LENGTHS), seq_len=64).steps():  # positions continue there
            pass


def _fake_trainer(step, loss, monkeypatch):
    """WLBTrainer.train_step's collaborators, with the step's loss given."""
    from types import SimpleNamespace

    import wlb_opt.executor as executor
    from torchtitan.distributed import utils as dist_utils

    monkeypatch.setattr(executor, "train_step", lambda *a, **k: loss)
    monkeypatch.setattr(dist_utils, "clip_grad_norm_", lambda *a, **k: torch.tensor(0.0))
    calls = []
    noop = lambda *a, **k: calls.append(a)  # noqa: E731
    return SimpleNamespace(
        step=3, ntokens_seen=0, wlb_stages=[], wlb_mesh=SimpleNamespace(dp_rank=1), model_parts=[],
        optimizers=SimpleNamespace(zero_grad=noop, step=noop), lr_schedulers=SimpleNamespace(get_metrics=dict,
                                                                                              step=noop),
        metrics_processor=SimpleNamespace(data_loading_times=[], ntokens_since_last_log=0,
                                          should_log=lambda s: False),
        checkpointer=SimpleNamespace(maybe_wait_for_staging=noop),
        parallel_dims=SimpleNamespace(world_size=4, get_optional_mesh=lambda name: None, ep_enabled=False),
        config=SimpleNamespace(attention_backend="torch", training=SimpleNamespace(disable_cuda_graphs=False,
                                                                                   max_norm=1.0))), calls


def test_the_wlb_trainer_step_stops_at_a_loss_that_is_not_finite_and_counts_its_replicas_tokens(monkeypatch):
    config = tt.small_config("llama3", dim=32, layers=2, vocab=VOCAB)
    docs_stream = stream(config, LENGTHS * 2)
    docs_stream.packer = wlb.WLBPacker(2, 64, docs_stream.packer.cost, 2, config=wlb.PackerConfig(thresholds=[]))
    step = next(iter(wlb.WLBStream([(i, np.zeros(n, dtype=np.int64)) for i, n in enumerate(LENGTHS * 2)],
                                   docs_stream.packer, 200, window=64)))
    trainer, calls = _fake_trainer(step, float("nan"), monkeypatch)
    with pytest.raises(RuntimeError, match="Loss is not finite .* at step 3"):
        tt.WLBTrainer.train_step(trainer, iter([step]))
    assert trainer.ntokens_seen == 0  # nothing after the loss: no optimizer step to checkpoint
    trainer, _ = _fake_trainer(step, 2.5, monkeypatch)
    tt.WLBTrainer.train_step(trainer, iter([step]))
    plan = step.plan
    mine = [i for j in plan.replica_micro_batches(1) for i in plan.micro_batches[j]]
    # torchtitan's metrics count the tokens of the rank's own replica (tokens per second per device
    # divides them by the ranks that are not data-parallel)
    assert trainer.metrics_processor.ntokens_since_last_log == int(plan.lengths[mine].sum()) > 0
    assert trainer.ntokens_seen == int(sum(plan.lengths[mb].sum() for mb in plan.micro_batches))
