"""ModelSpec.from_hf_config: Llama / Qwen / Mistral config.json dicts and transformers configs."""
import json

import pytest

import wlb_opt as wlb

# the architecture fields of the published config.json files (other keys trimmed or kept as in
# the file: they must be ignored, not rejected)
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
             "num_key_value_heads": 32, "vocab_size": 32000, "rms_norm_eps": 1e-05, "torch_dtype": "float16"}
LLAMA31_70B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
               "num_hidden_layers": 80, "num_key_value_heads": 8, "vocab_size": 128256,
               "rope_scaling": {"factor": 8.0, "rope_type": "llama3"}, "tie_word_embeddings": False}
MISTRAL_7B = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32000, "sliding_window": None}
QWEN3_4B = {"model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728, "num_attention_heads": 32,
            "num_hidden_layers": 36, "num_key_value_heads": 8, "vocab_size": 151936, "head_dim": 128,
            "tie_word_embeddings": True}


def test_llama2_7b_config_equals_the_7b_preset():
    spec = wlb.ModelSpec.from_hf_config(LLAMA2_7B)
    preset = wlb.ModelSpec.preset("7b")
    assert (spec.hidden, spec.layers, spec.heads, spec.kv_heads, spec.ffn, spec.vocab, spec.head_dim) == (
        preset.hidden, preset.layers, preset.heads, preset.kv_heads, preset.ffn, preset.vocab, preset.head_dim)
    assert spec.n_params == preset.n_params
    assert spec.name == "llama"


def test_gqa_configs_keep_their_kv_heads():
    llama = wlb.ModelSpec.from_hf_config(LLAMA31_70B)
    assert (llama.kv_heads, llama.head_dim, llama.kv_dim) == (8, 128, 1024)
    assert llama.n_params == wlb.ModelSpec.preset("70b").n_params + 2 * (128256 - 32000) * 8192
    mistral = wlb.ModelSpec.from_hf_config(MISTRAL_7B)
    assert (mistral.kv_heads, mistral.ffn) == (8, 14336)


def test_explicit_head_dim_differs_from_hidden_over_heads():
    qwen = wlb.ModelSpec.from_hf_config(QWEN3_4B)
    assert qwen.head_dim == 128 and qwen.hidden // qwen.heads == 80
    assert qwen.q_dim == 32 * 128 and qwen.kv_dim == 8 * 128
    # Q and O are hidden x q_dim; K and V hidden x kv_dim (Qwen3-4B: 4.02 B weights untied)
    assert qwen.params_per_layer == 2 * 2560 * 4096 + 2 * 2560 * 1024 + 3 * 2560 * 9728
    # the analytic attention cost follows q_dim, not hidden
    hw, par = wlb.HardwareSpec.preset("h100"), wlb.ParallelSpec()
    plain = wlb.ModelSpec(hidden=2560, layers=36, heads=32, kv_heads=8, ffn=9728, vocab=151936)
    ratio = (wlb.CostModel.analytic(qwen, par, hw).coef["fwd"]["attn"]
             / wlb.CostModel.analytic(plain, par, hw).coef["fwd"]["attn"])
    assert ratio == pytest.approx(128 / 80)


def test_missing_kv_heads_or_null_means_multi_head():
    for config in ({k: v for k, v in LLAMA2_7B.items() if k != "num_key_value_heads"},
                   {**LLAMA2_7B, "num_key_value_heads": None}):
        assert wlb.ModelSpec.from_hf_config(config).kv_heads == 32


def test_round_trips_through_json_and_to_dict():
    spec = wlb.ModelSpec.from_hf_config(json.loads(json.dumps(QWEN3_4B)))
    assert wlb.ModelSpec(**spec.to_dict()) == spec


def test_nested_text_config_is_read():
    spec = wlb.ModelSpec.from_hf_config({"model_type": "llava", "text_config": MISTRAL_7B})
    assert spec.hidden == 4096 and spec.kv_heads == 8


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                                 "vocab_size"])
def test_missing_key_is_named(key):
    config = {k: v for k, v in LLAMA2_7B.items() if k != key}
    with pytest.raises(ValueError, match=key):
        wlb.ModelSpec.from_hf_config(config)


@pytest.mark.parametrize("key, value", [("hidden_size", 0), ("num_hidden_layers", "32"), ("vocab_size", 3.5),
                                        ("num_key_value_heads", True), ("head_dim", -1)])
def test_invalid_value_is_named(key, value):
    with pytest.raises(ValueError, match=f"{key}.*{value!r}"):
        wlb.ModelSpec.from_hf_config({**LLAMA2_7B, key: value})


def test_inconsistent_shape_is_refused():
    with pytest.raises(ValueError, match="kv_heads"):
        wlb.ModelSpec.from_hf_config({**LLAMA2_7B, "num_key_value_heads": 5})
    with pytest.raises(ValueError, match="divisible"):
        wlb.ModelSpec.from_hf_config({**LLAMA2_7B, "num_attention_heads": 30, "num_key_value_heads": None})


def test_not_a_config_is_a_type_error():
    with pytest.raises(TypeError, match="PretrainedConfig or a dict"):
        wlb.ModelSpec.from_hf_config("config.json")


def test_transformers_llama_config():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_attention_heads=8,
                                      num_key_value_heads=2, num_hidden_layers=3, vocab_size=1000)
    spec = wlb.ModelSpec.from_hf_config(config)
    assert (spec.hidden, spec.layers, spec.heads, spec.kv_heads, spec.ffn, spec.vocab, spec.head_dim) == (
        256, 3, 8, 2, 688, 1000, 32)


def test_tiny_lm_follows_an_explicit_head_dim():
    torch = pytest.importorskip("torch")
    from wlb_opt.executor.model import TinyLM

    spec = wlb.ModelSpec(hidden=32, layers=1, heads=4, kv_heads=2, ffn=64, vocab=50, head_dim=16)
    model = TinyLM.from_spec(spec)
    assert sum(p.numel() for n, p in model.named_parameters() if n.startswith("blocks")) == (
        spec.params_per_layer + 2 * spec.hidden)  # + the two RMSNorm weights
    assert model.blocks[0].wq.out_features == 64 and torch.is_tensor(model.blocks[0].wq.weight)
