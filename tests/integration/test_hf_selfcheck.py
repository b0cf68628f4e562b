"""What the Hugging Face adapter proves before it trains, and what it refuses.

`split_hf_stages` chains its stages on a short input and compares them with the model's own
forward (sdpa or eager, one document per call); a deliberately broken stage must be named.
Models are built from small configs, nothing is downloaded.
"""
from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf import SIZES, first_step  # noqa: E402

from wlb_opt.executor import apply_tensor_parallel, train_step  # noqa: E402
from wlb_opt.integrations import hf  # noqa: E402

SMALL = {**SIZES, "num_hidden_layers": 3}
FULL = ["full_attention"] * SMALL["num_hidden_layers"]


def build(cfg, dtype=torch.float64, impl="wlb", seed=0):
    hf.register()
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl, dtype=dtype)


def cohere(**kw):
    return transformers.CohereConfig(**SMALL, logit_scale=0.25, **kw)


FIXED = {  # families whose stages re-apply something around the layers
    "cohere": lambda: cohere(),  # logits * logit_scale
    "granite": lambda: transformers.GraniteConfig(**SMALL, embedding_multiplier=3.0, logits_scaling=4.0,
                                                  residual_multiplier=0.5, attention_multiplier=0.3),
    "hyperclovax": lambda: transformers.HyperCLOVAXConfig(**SMALL, pad_token_id=0, embedding_multiplier=2.0,
                                                          logits_scaling=3.0),  # multiplies its logits
    "gemma": lambda: transformers.GemmaConfig(**SMALL, head_dim=8),  # sqrt(hidden) inside its embedding
    "gemma2": lambda: transformers.Gemma2Config(**SMALL, head_dim=8, layer_types=FULL, attn_logit_softcapping=None,
                                                final_logit_softcapping=0.5),  # cap * tanh(logits / cap)
}


# ---------------------------------------------------------------------- what the stages re-apply
def test_cohere_trains_as_transformers_own_loss_and_gradients():
    """The stage used to drop `logits * logit_scale`: loss and gradients now match transformers'
    own training loss (labels=, its shift and mean), piece by piece, not the adapter with itself."""
    model, ref = build(cohere()), build(cohere(), impl="sdpa")
    ref.load_state_dict(model.state_dict())
    step = first_step(1, 1, 1)
    loss = train_step(hf.split_hf_stages(model, 1)[0], step.plan, step.shards, data=step, backend="torch")
    plan, total, ref_loss = step.plan, step.target_tokens, 0.0
    for i in (int(i) for mb in plan.micro_batches for i in mb):
        n, off = int(plan.lengths[i]), int(plan.offsets[i])
        if n < 2:
            continue
        tokens = torch.as_tensor(step.piece(int(plan.doc_ids[i]), off, n)[0])[None]
        own = ref(tokens, position_ids=(off + torch.arange(n))[None], labels=tokens).loss * (n - 1) / total
        own.backward()
        ref_loss += float(own.detach())
    # transformers' loss upcasts fp64 logits to fp32: agreement is to fp32 precision (the dropped
    # scale was off by 1.3e-2 in the loss and up to 18x in the gradients)
    assert abs(loss - ref_loss) < 1e-6 * abs(ref_loss)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-8, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", sorted(FIXED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_families_with_scales_or_caps_pass_the_self_check(family, dtype):
    model = build(FIXED[family](), dtype=dtype)
    pp = 1 if model.lm_head.weight is model.model.embed_tokens.weight else 2  # tied: one stage
    assert len(hf.split_hf_stages(model, pp)) == pp


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_a_dropped_logit_scale_is_named_as_the_head(monkeypatch, dtype):
    monkeypatch.setattr(hf, "_head_scaling", lambda model: {})  # the stage as it was: no logit_scale
    with pytest.raises(ValueError, match=r"first output that differs is the head \(lm_head"):
        hf.split_hf_stages(build(cohere(), dtype=dtype), 1)


def test_a_dropped_soft_cap_is_named_as_the_head(monkeypatch):
    monkeypatch.setattr(hf, "_head_scaling", lambda model: {})
    with pytest.raises(ValueError, match="the head"):
        hf.split_hf_stages(build(FIXED["gemma2"](), dtype=torch.float32), 1)


def test_a_dropped_embedding_multiplier_is_named_as_the_embeddings(monkeypatch):
    monkeypatch.setattr(hf, "_embedding_scale", lambda model: 1.0)
    with pytest.raises(ValueError, match=r"the embeddings \(model.embed_tokens"):
        hf.split_hf_stages(build(FIXED["granite"]()), 2)


@pytest.mark.parametrize("pp", [1, 3])
def test_a_layer_that_differs_under_the_stage_is_named(pp):
    model = build(transformers.LlamaConfig(**SMALL))
    layer = model.model.layers[1]
    plain = layer.forward

    def broken(*args, **kwargs):  # wrong only when the stage calls it
        out = plain(*args, **kwargs)
        return out * 1.001 if "wlb_attend" in kwargs else out

    layer.forward = broken
    with pytest.raises(ValueError, match=r"first output that differs is model\.layers\.1 \(max \|difference\|"):
        hf.split_hf_stages(model, pp)


def test_a_decoder_layer_that_drops_the_stage_attention_is_refused_by_name():
    # StableLM's decoder layer calls its attention without the keyword arguments it is given,
    # so the stage's attention (documents, CP shards) never reaches it: refused, not trained
    model = build(transformers.StableLmConfig(**SMALL), dtype=torch.float32)
    with pytest.raises(ValueError, match="StableLmAttention was called inside a pipeline stage without the stage's "
                                         "attention"):
        hf.split_hf_stages(model, 1)


def test_a_model_that_does_not_pass_positions_to_its_attention_is_refused_in_its_own_forward():
    # GPT-BigCode's attention gets neither position_ids nor cu_seq_lens_q: a packed row's
    # documents cannot be told apart, so its own forward under "wlb" is refused
    model = build(transformers.GPTBigCodeConfig(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=512,
                                                attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
                  dtype=torch.float32)
    ids = torch.arange(12)[None] % 97
    with pytest.raises(ValueError, match="got neither position_ids nor cu_seq_lens_q in GPTBigCodeAttention"):
        model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]]), use_cache=False)


def test_latent_attention_with_values_of_another_head_size_is_refused_by_name():
    cfg = transformers.DeepseekV3Config(**{**SMALL, "num_key_value_heads": 4}, n_routed_experts=2,
                                        first_k_dense_replace=3, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                                        qk_nope_head_dim=8, v_head_dim=16, moe_intermediate_size=16, n_group=1,
                                        topk_group=1, num_experts_per_tok=1)
    with pytest.raises(ValueError, match="DeepseekV3Attention has keys of 12 and values of 16 channels per head"):
        hf.split_hf_stages(build(cfg, dtype=torch.float32), 1)


def test_skipping_the_check_returns_unproven_stages(monkeypatch):
    monkeypatch.setattr(hf, "_head_scaling", lambda model: {})
    assert len(hf.split_hf_stages(build(cohere()), 1, self_check=False)) == 1


# ---------------------------------------------------------------------- what the check leaves alone
def test_the_check_leaves_rng_training_flags_and_grads_as_they_were(monkeypatch):
    model = build(cohere(attention_dropout=0.0))
    model.train()
    model.model.layers[0].eval()  # a mixed state, restored module by module
    model(torch.arange(6)[None], labels=torch.arange(6)[None]).loss.backward()
    grads = {n: (p.grad, p.grad.clone()) for n, p in model.named_parameters()}
    flags = [m.training for m in model.modules()]
    # the final norm, which both the model's own forward and the stages run, draws from the
    # global RNG (as dropout in training would) and, where autograd records, back-propagates
    # into the weights: the check must leave neither trace
    norm, calls = model.model.norm, []

    def drawing(hidden):
        calls.append(float(torch.rand(())))
        out = type(norm).forward(norm, hidden)
        if torch.is_grad_enabled():
            out.sum().backward(retain_graph=True)
        return out

    monkeypatch.setattr(norm, "forward", drawing)
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    hf.split_hf_stages(model, 1)
    assert calls, "the check ran the final norm"
    assert torch.equal(torch.get_rng_state(), rng)
    assert [m.training for m in model.modules()] == flags
    for n, p in model.named_parameters():
        assert p.grad is grads[n][0] and torch.equal(p.grad, grads[n][1]), n
    assert model.config._attn_implementation == "wlb"


def test_a_model_on_the_meta_device_skips_the_check_with_one_notice(caplog):
    hf.register()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMALL),
                                                              attn_implementation="wlb")
    with caplog.at_level(logging.INFO, logger="wlb_opt"):
        stages = hf.split_hf_stages(model, 1)
    notes = [r for r in caplog.records if r.name == "wlb_opt"]
    assert len(stages) == 1 and len(notes) == 1 and "meta device" in notes[0].getMessage()


# ---------------------------------------------------------------------- masks and windows
def test_a_padding_mask_is_refused_and_an_all_ones_mask_accepted():
    model = build(transformers.LlamaConfig(**SMALL))
    ids = torch.randint(0, SMALL["vocab_size"], (1, 8))
    with pytest.raises(ValueError, match=r"padding attention_mask \(2 of 8 tokens masked\)"):
        model(ids, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]]))
    plain = model(ids).logits
    torch.testing.assert_close(model(ids, attention_mask=torch.ones(1, 8, dtype=torch.long)).logits, plain,
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="cannot apply a dense attention mask"):
        model(ids, attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool))


def test_sliding_windows_are_refused_at_the_split_with_a_hint_that_works():
    mistral = build(transformers.MistralConfig(**SMALL))  # sliding_window=4096 by default
    with pytest.raises(ValueError, match=r"sliding_window=4096 in layers 0, 1, 2\).*sliding_window=None"):
        hf.split_hf_stages(mistral, 1)
    # use_sliding_window=False alone leaves Mistral's window in place
    with pytest.raises(ValueError, match="sliding-window"):
        hf.split_hf_stages(build(transformers.MistralConfig(**SMALL, use_sliding_window=False)), 1)
    assert hf.split_hf_stages(build(transformers.MistralConfig(**SMALL, sliding_window=None)), 1)
    qwen = dict(use_sliding_window=True, max_window_layers=0)
    with pytest.raises(ValueError, match="sliding_window=None"):
        hf.split_hf_stages(build(transformers.Qwen2Config(**SMALL, sliding_window=16, **qwen)), 1)
    assert hf.split_hf_stages(build(transformers.Qwen2Config(**SMALL, sliding_window=None, **qwen)), 1)
    # families with layer_types (Gemma 2, Cohere 2): their own forward builds sliding masks from those
    gemma = dict(**SMALL, head_dim=8, attn_logit_softcapping=None)
    with pytest.raises(ValueError, match=r"layer_types=\['full_attention'\] \* num_hidden_layers"):
        hf.split_hf_stages(build(transformers.Gemma2Config(**gemma, sliding_window=16)), 1)
    assert hf.split_hf_stages(build(transformers.Gemma2Config(**gemma, sliding_window=16, layer_types=FULL)), 1)


def _llama4(**kw):
    return transformers.Llama4TextConfig(**SMALL, head_dim=8, num_local_experts=2, intermediate_size_mlp=64, **kw)


# what the stages cannot compute from a packed row as transformers does from one document:
# (config, the field the message names, the config its hint gives, which must pass the check)
POSITION_DEPENDENT = {
    "chunked_attention": (lambda: _llama4(attention_chunk_size=16, attn_temperature_tuning=False),
                          "attention_chunk_size=None",
                          lambda: _llama4(attention_chunk_size=None, attn_temperature_tuning=False)),
    "chunked_layer_types": (lambda: _llama4(attention_chunk_size=16, attn_temperature_tuning=False,
                                            layer_types=["chunked_attention"] * 3),
                            r"layer_types=\['full_attention'\] \* num_hidden_layers",
                            lambda: _llama4(attention_chunk_size=16, attn_temperature_tuning=False, layer_types=FULL)),
    "nope_temperature": (lambda: _llama4(attention_chunk_size=None, no_rope_layers=[1, 0, 1], floor_scale=4),
                         "attn_temperature_tuning=False",
                         lambda: _llama4(attention_chunk_size=None, no_rope_layers=[1, 0, 1], floor_scale=4,
                                         attn_temperature_tuning=False)),
    "dynamic_rope": (lambda: transformers.LlamaConfig(**SMALL, rope_parameters={
                         "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), "rope_type 'dynamic'",
                     lambda: transformers.LlamaConfig(**SMALL, rope_parameters={
                         "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    "longrope": (lambda: transformers.Phi3Config(**SMALL, pad_token_id=0, rope_parameters={
                     "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                     "long_factor": [4.0] * 4, "original_max_position_embeddings": 16}), "rope_type 'longrope'",
                 lambda: transformers.Phi3Config(**SMALL, pad_token_id=0)),
    "router_aux_loss": (lambda: transformers.MixtralConfig(**SMALL, sliding_window=None, num_local_experts=4,
                                                           output_router_logits=True, router_aux_loss_coef=0.5),
                        "output_router_logits=False",
                        lambda: transformers.MixtralConfig(**SMALL, sliding_window=None, num_local_experts=4,
                                                           router_aux_loss_coef=0.5)),
}


@pytest.mark.parametrize("case", sorted(POSITION_DEPENDENT))
def test_what_packing_would_change_is_refused_with_a_hint_that_works(case):
    make, hint, fixed = POSITION_DEPENDENT[case]
    with pytest.raises(ValueError, match=hint):
        hf.split_hf_stages(build(make(), dtype=torch.float32), 1)
    assert len(hf.split_hf_stages(build(fixed(), dtype=torch.float32), 1)) == 1


def test_the_check_restores_rotary_state_a_length_dependent_rope_changes(monkeypatch):
    """Dynamic rope rewrites `inv_freq` and `max_seq_len_cached` on a sequence past
    max_position_embeddings; with its refusal lifted, the check (which then fails) leaves both."""
    monkeypatch.setattr(hf, "_STATIC_ROPE", hf._STATIC_ROPE + ("dynamic",))
    cfg = transformers.LlamaConfig(**{**SMALL, "max_position_embeddings": 4}, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    model = build(cfg, dtype=torch.float32)
    rotary = model.model.rotary_emb
    buffer, values, cached = rotary.inv_freq, rotary.inv_freq.clone(), rotary.max_seq_len_cached
    with pytest.raises(ValueError, match="self-check"):
        hf.split_hf_stages(model, 1)
    assert rotary.inv_freq is buffer and torch.equal(rotary.inv_freq, values)
    assert rotary.max_seq_len_cached == cached


def test_a_mask_of_any_rank_with_zeros_is_refused():
    model = build(transformers.LlamaConfig(**SMALL))
    ids = torch.randint(0, SMALL["vocab_size"], (1, 6))
    pairs = torch.ones(1, 6, 6)
    pairs[0, 5, :3] = 0
    with pytest.raises(ValueError, match=r"3-D attention_mask of shape \(1, 6, 6\) \(3 of 36 entries zero\)"):
        model(ids, attention_mask=pairs)
    torch.testing.assert_close(model(ids, attention_mask=torch.ones(1, 6, 6)).logits, model(ids).logits,
                               rtol=0, atol=0)


# ---------------------------------------------------------------------- tensor parallelism
def _tp(stage, tp: int):
    """apply_tensor_parallel's checks over a tp-rank mesh stand-in: every refusal comes before
    the first collective or DTensor, so no process group is needed for it."""
    return apply_tensor_parallel(stage, SimpleNamespace(size=lambda: tp))


def _stage(cfg):
    return hf.split_hf_stages(build(cfg, dtype=torch.float32), 1, self_check=False)[0]


TP_REFUSALS = {  # id: (config, tp, what the message names)
    "phi3_fused_qkv": (lambda: transformers.Phi3Config(**SMALL, pad_token_id=0), 2,
                       "model.layers.0.self_attn.qkv_proj: a fused projection"),
    "kv_heads": (lambda: transformers.LlamaConfig(**SMALL), 4, "key/value heads (2) to divide by tp (model.layers.0)"),
    "query_heads": (lambda: transformers.LlamaConfig(**{**SMALL, "hidden_size": 48, "num_attention_heads": 6,
                                                        "num_key_value_heads": 6}), 4, "query heads (6) to divide by tp"),
    "mlp_width": (lambda: transformers.LlamaConfig(**{**SMALL, "num_key_value_heads": 4, "intermediate_size": 66}), 4,
                  "output width of model.layers.0.mlp.gate_proj (66)"),
    "norm_over_all_heads": (lambda: transformers.Olmo2Config(**SMALL, pad_token_id=0), 2,
                            "model.layers.0.self_attn.q_norm"),
    "per_head_norm_rows": (lambda: cohere(use_qk_norm=True), 2, "model.layers.0.self_attn.q_norm"),
    "moe_experts": (lambda: transformers.MixtralConfig(**SMALL, sliding_window=None, num_local_experts=4), 2,
                    "model.layers.0.mlp: a mixture-of-experts layer"),
    "moe_feed_forward": (lambda: _llama4(attention_chunk_size=None, attn_temperature_tuning=False), 2,
                         "model.layers.0.feed_forward: a mixture-of-experts layer"),
    "norm_shared_by_all_heads": (lambda: transformers.Qwen3Config(**SMALL, head_dim=8), 2,  # its gradient is partial
                                 "model.layers.0.self_attn.q_norm: a weight shared by all heads"),
    "per_head_norm_modules": (lambda: transformers.StableLmConfig(**SMALL, qk_layernorm=True), 2,
                              "model.layers.0.self_attn.q_layernorm.norms.0: per-head norms"),
    "untested_attention_class": (lambda: transformers.GemmaConfig(**SMALL, head_dim=8), 2,
                                 "model.layers.0.self_attn: its class GemmaAttention is not one"),
    "head_axis_weights": (lambda: transformers.DiffLlamaConfig(**SMALL), 2,  # it also chunks the global head axis
                          "model.layers.0.self_attn: a weight shared by all heads (self_attn.lambda_q1"),
    "mlp_without_gate": (lambda: transformers.NemotronConfig(**SMALL), 2,
                         "model.layers.0.mlp: an MLP without a gate projection"),
    "latent_attention": (lambda: transformers.DeepseekV3Config(**SMALL, n_routed_experts=2,
                                                               first_k_dense_replace=3), 2,
                         "model.layers.0.self_attn: multi-head latent attention"),
}


@pytest.mark.parametrize("case", sorted(TP_REFUSALS))
def test_tensor_parallelism_refuses_what_it_cannot_shard_naming_the_module(case):
    make, tp, fragment = TP_REFUSALS[case]
    stage = _stage(make())
    before = {n: (type(p), p.shape) for n, p in stage.named_parameters()}
    with pytest.raises(ValueError) as info:
        _tp(stage, tp)
    assert fragment in str(info.value), str(info.value)
    assert {n: (type(p), p.shape) for n, p in stage.named_parameters()} == before  # nothing sharded


def test_a_fused_gate_up_projection_is_refused_by_name():
    stage = _stage(transformers.LlamaConfig(**SMALL))
    for layer in stage.blocks:
        mlp = layer.mlp
        mlp.gate_up_proj = torch.nn.Linear(SMALL["hidden_size"], 2 * SMALL["intermediate_size"], bias=False)
        del mlp.gate_proj, mlp.up_proj
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_up_proj: a fused projection"):
        _tp(stage, 2)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tensor_parallelism_accepts_what_it_shards(family, monkeypatch):
    import torch.distributed.tensor.parallel as parallel

    calls = []
    monkeypatch.setattr(parallel, "parallelize_module", lambda block, mesh, plan: calls.append(block))
    cfg = transformers.LlamaConfig(**SMALL) if family == "llama" else transformers.Qwen2Config(**SMALL)
    stage = _stage(cfg)
    _tp(stage, 2)
    assert calls == list(stage.blocks)
