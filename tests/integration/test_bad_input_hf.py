"""Bad input to the Hugging Face adapter and to tensor parallelism: clear errors of the library's own.

Same contract as `tests/unit/test_bad_input.py` (whose checker this reuses): each case is (id, call,
exception type, message fragment); the fragment names the offending value or what would be
valid, and the exception is raised by this library's code. Models are small and built lazily,
inside the call.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_bad_input import _check  # noqa: E402

from wlb_opt.executor import apply_tensor_parallel  # noqa: E402
from wlb_opt.integrations import hf  # noqa: E402

SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


@functools.lru_cache(maxsize=None)
def _model(family: str = "llama", impl: str = "wlb", **extra):
    hf.register()
    make = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
            "phi3": transformers.Phi3Config, "cohere": transformers.CohereConfig}[family]
    kw = {**SIZES, **({"pad_token_id": 0} if family == "phi3" else {}), **extra}
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(make(**kw), attn_implementation=impl)


def _labels(lengths, n: int = 6):
    return hf.to_hf_labels(torch.arange(n), lengths)


def _tp(family: str, tp, **extra):
    stage = hf.split_hf_stages(_model(family, **extra), 1, self_check=False)[0]
    return apply_tensor_parallel(stage, SimpleNamespace(size=lambda: tp))


def _built(make, **kw):
    """A small model of config class `make` (not cached: some fields are dicts)."""
    hf.register()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(make(**SIZES, **kw), attn_implementation="wlb")


def _split(make, **kw):
    return hf.split_hf_stages(_built(make, **kw), 1)


def _tp_of(make, tp: int, **kw):
    stage = hf.split_hf_stages(_built(make, **kw), 1, self_check=False)[0]
    return apply_tensor_parallel(stage, SimpleNamespace(size=lambda: tp))


LLAMA4 = dict(head_dim=8, num_local_experts=2, intermediate_size_mlp=64)


IDS = torch.zeros(1, 6, dtype=torch.long)

LABEL_CASES = [
    ("to_hf_labels.zero", lambda: _labels([3, 0, 3]), ValueError, "integers >= 1"),
    ("to_hf_labels.negative", lambda: _labels([7, -1]), ValueError, "integers >= 1"),
    ("to_hf_labels.float", lambda: _labels([2.5, 3.5]), ValueError, "sequence of integers"),
    ("to_hf_labels.bool", lambda: _labels([True, True]), ValueError, "sequence of integers"),
    ("to_hf_labels.nested", lambda: _labels([[3], [3]]), ValueError, "1-D sequence of integers"),
    ("to_hf_labels.sum_short", lambda: _labels([2, 3]), ValueError, "sum to the row's 6 tokens, got 5"),
    ("to_hf_labels.sum_long", lambda: _labels([4, 3]), ValueError, "sum to the row's 6 tokens, got 7"),
    ("to_hf_labels.piece_longer_than_row", lambda: _labels([2**40]), ValueError, "sum to the row's 6 tokens"),
    ("to_hf_labels.empty_lengths", lambda: _labels([]), ValueError, "sum to the row's 6 tokens, got 0"),
    ("to_hf_labels.ids_2d", lambda: hf.to_hf_labels(torch.zeros(1, 6, dtype=torch.long), [6]), ValueError,
     "1-D tensor"),
    ("to_hf_labels.ids_list", lambda: hf.to_hf_labels([1, 2, 3], [3]), ValueError, "1-D tensor"),
    ("to_hf_labels.ids_bool", lambda: hf.to_hf_labels(torch.ones(3, dtype=torch.bool), [3]), ValueError,
     "integer token ids, got input_ids of dtype torch.bool"),
    ("to_hf_labels.ids_float", lambda: hf.to_hf_labels(torch.arange(3.0), [3]), ValueError,
     "integer token ids, got input_ids of dtype torch.float32"),
    ("to_hf_labels.bool_among_lengths", lambda: _labels([True, 5]), ValueError, "True and False are no token counts"),
]

SPLIT_CASES = [
    ("split_hf_stages.pp_zero", lambda: hf.split_hf_stages(_model(), 0), ValueError, "pp must be an integer >= 1"),
    ("split_hf_stages.virtual_bool", lambda: hf.split_hf_stages(_model(), 1, True), ValueError,
     "virtual_stages must be an integer >= 1"),
    ("split_hf_stages.self_check_string", lambda: hf.split_hf_stages(_model(), 1, self_check="no"), TypeError,
     "self_check must be True or False"),
    ("split_hf_stages.sdpa_model", lambda: hf.split_hf_stages(_model(impl="sdpa"), 1), ValueError,
     "attn_implementation='wlb'"),
    ("split_hf_stages.not_a_causal_lm", lambda: hf.split_hf_stages(torch.nn.Linear(2, 2), 1), ValueError,
     "causal LM with"),
    ("split_hf_stages.too_many_stages", lambda: hf.split_hf_stages(_model(), 2, 2), ValueError,
     "cannot split 2 decoder layers into 4 stages"),
    ("split_hf_stages.tied_pp2", lambda: hf.split_hf_stages(_model(tie_word_embeddings=True), 2), ValueError,
     "tie_word_embeddings=True"),
    ("split_hf_stages.mistral_window", lambda: hf.split_hf_stages(_model("mistral"), 1), ValueError,
     "sliding_window=None"),
    ("split_hf_stages.mistral_use_sliding_false",
     lambda: hf.split_hf_stages(_model("mistral", use_sliding_window=False), 1), ValueError,
     "use_sliding_window=False alone does not clear it"),
    ("split_hf_stages.attn_softcap", lambda: hf.split_hf_stages(_model(attn_logit_softcapping=30.0), 1), ValueError,
     "attn_logit_softcapping=30.0"),
    ("split_hf_stages.chunked_attention",
     lambda: _split(transformers.Llama4TextConfig, **LLAMA4, attention_chunk_size=16), ValueError,
     "attention_chunk_size=16"),
    ("split_hf_stages.nope_temperature",
     lambda: _split(transformers.Llama4TextConfig, **LLAMA4, attention_chunk_size=None, no_rope_layers=[1, 0]),
     ValueError, "attn_temperature_tuning=True"),
    ("split_hf_stages.dynamic_rope",
     lambda: _split(transformers.LlamaConfig, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                              "rope_theta": 10000.0}), ValueError,
     "rope_type 'dynamic' (rope_parameters)"),
    ("split_hf_stages.router_aux_loss",
     lambda: _split(transformers.MixtralConfig, sliding_window=None, num_local_experts=4, output_router_logits=True,
                    router_aux_loss_coef=0.5), ValueError, "output_router_logits=True, router_aux_loss_coef=0.5"),
    ("split_hf_stages.jetmoe_aux_loss",  # JetMoe names its coefficient aux_loss_coef
     lambda: _split(transformers.JetMoeConfig, output_router_logits=True, aux_loss_coef=0.5, num_local_experts=2,
                    kv_channels=8), ValueError, "output_router_logits=True, aux_loss_coef=0.5"),
]


def _decode_step():
    """A decode step of `generate`: one query against the cached keys of the prompt."""
    model = _model()
    cache = model(IDS, use_cache=True).past_key_values
    return model(IDS[:, :1], past_key_values=cache, use_cache=True)


def _bidirectional_gemma3():
    return _built(transformers.Gemma3TextConfig, head_dim=8, layer_types=["full_attention"] * 2,
                  use_bidirectional_attention=True)(IDS)


def _block_mask():
    """transformers' mask for blocks of tokens that see each other (Molmo 2's images,
    PaliGemma's prefix: `block_sequence_ids`), asked of the "wlb" mask hook."""
    from transformers.masking_utils import create_causal_mask

    cfg = transformers.LlamaConfig(**SIZES)
    cfg._attn_implementation = "wlb"
    hf.register()
    return create_causal_mask(config=cfg, inputs_embeds=torch.zeros(1, 6, 32), attention_mask=None, cache=None,
                              position_ids=torch.arange(6)[None], block_sequence_ids=torch.tensor([[0, 0, 0, -1, -1, -1]]))


def _attention(module, **kwargs):
    q = torch.zeros(1, 2, 6, 8)
    return hf.wlb_attention(module, q, q, q, None, position_ids=torch.arange(6)[None], **kwargs)

FORWARD_CASES = [
    ("wlb_forward.padding_mask",
     lambda: _model()(IDS, attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0]])), ValueError,
     "2 of 6 tokens masked"),
    ("wlb_forward.left_padding_batch",
     lambda: _model()(IDS, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]])), ValueError,
     "padding attention_mask"),
    ("wlb_forward.dense_4d_mask",
     lambda: _model()(IDS, attention_mask=torch.zeros(1, 1, 6, 6)), ValueError, "dense attention mask"),
    ("wlb_forward.pair_mask_with_zeros",
     lambda: _model()(IDS, attention_mask=torch.tril(torch.ones(1, 6, 6))), ValueError,
     "3-D attention_mask of shape (1, 6, 6)"),
    ("wlb_forward.batch_of_two", lambda: _model()(torch.zeros(2, 6, dtype=torch.long)), ValueError,
     "batch of one row"),
    ("wlb_forward.kv_cache", _decode_step, ValueError, "1 queries and 7 keys (a KV cache"),
    ("wlb_forward.sinks", lambda: _built(transformers.GptOssConfig, head_dim=8, num_local_experts=2,
                                         num_experts_per_tok=1, layer_types=["full_attention"] * 2)(IDS),
     ValueError, "attention sinks"),
    ("wlb_forward.bidirectional_mask", _bidirectional_gemma3, ValueError, "mask rules of its own"),
    ("wlb_mask.blocks_that_see_each_other", _block_mask, ValueError, "mask rules of its own"),
    ("wlb_attention.not_causal", lambda: _attention(SimpleNamespace(is_causal=False)), ValueError,
     "attends bidirectionally (is_causal=False)"),
    ("wlb_attention.position_bias", lambda: _attention(torch.nn.Identity(), position_bias=torch.zeros(1)),
     ValueError, "additive position bias"),
]

TP_CASES = [
    ("apply_tensor_parallel.phi3_qkv", lambda: _tp("phi3", 2), ValueError, "self_attn.qkv_proj"),
    ("apply_tensor_parallel.kv_heads", lambda: _tp("llama", 4), ValueError, "key/value heads (2)"),
    ("apply_tensor_parallel.query_heads", lambda: _tp("llama", 3), ValueError, "query heads (4)"),
    ("apply_tensor_parallel.mlp_width",
     lambda: _tp("llama", 4, num_key_value_heads=4, intermediate_size=66), ValueError, "mlp.gate_proj (66)"),
    ("apply_tensor_parallel.cohere_qk_norm", lambda: _tp("cohere", 2, use_qk_norm=True), ValueError,
     "self_attn.q_norm"),
    ("apply_tensor_parallel.mesh_size_zero", lambda: _tp("llama", 0), ValueError, "integer >= 1 (the TP ranks), got 0"),
    ("apply_tensor_parallel.mesh_size_negative", lambda: _tp("llama", -2), ValueError, "got -2"),
    ("apply_tensor_parallel.mesh_size_bool", lambda: _tp("llama", True), ValueError, "got True"),
    ("apply_tensor_parallel.mesh_size_float", lambda: _tp("llama", 2.0), ValueError, "got 2.0"),
    ("apply_tensor_parallel.stablelm_per_head_norms",
     lambda: _tp_of(transformers.StableLmConfig, 2, qk_layernorm=True), ValueError,
     "self_attn.q_layernorm.norms.0: per-head norms"),
    ("apply_tensor_parallel.difflama_attention", lambda: _tp_of(transformers.DiffLlamaConfig, 2), ValueError,
     "self_attn.lambda_q1"),
    ("apply_tensor_parallel.nemotron_mlp", lambda: _tp_of(transformers.NemotronConfig, 2), ValueError,
     "an MLP without a gate projection"),
]

CASES = LABEL_CASES + SPLIT_CASES + FORWARD_CASES + TP_CASES


@pytest.mark.parametrize("call, exc_type, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_adapter_input_raises_a_clear_error(call, exc_type, fragment):
    _check(call, exc_type, fragment)
