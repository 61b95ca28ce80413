"""Published config.json files (transformers-4 style: rope_theta + rope_scaling, no layer_types)
translate to the architecture they describe; parameter counts match the published sizes.
Needs no transformers: only the config translation is exercised (one test compares with transformers'
models built on the meta device when it is installed, and is skipped otherwise)."""
import pytest

from archlab import ConfigError
from archlab.interop import FAMILIES
from archlab.models import presets
from archlab.models.accounting import param_count

LLAMA31_8B = {  # meta-llama/Llama-3.1-8B
    "model_type": "llama", "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": False, "attention_bias": False,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "vocab_size": 128256,
}
MISTRAL_7B = {  # mistralai/Mistral-7B-v0.1
    "model_type": "mistral", "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "sliding_window": 4096, "tie_word_embeddings": False, "vocab_size": 32000,
}
QWEN25_05B = {  # Qwen/Qwen2.5-0.5B
    "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864,
    "max_position_embeddings": 32768, "max_window_layers": 24, "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
GEMMA2_2B = {  # google/gemma-2-2b
    "model_type": "gemma2", "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
    "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304, "intermediate_size": 9216, "max_position_embeddings": 8192,
    "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "sliding_window": 4096, "vocab_size": 256000,
}
GEMMA3_1B = {  # google/gemma-3-1b-pt
    "model_type": "gemma3_text", "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
    "sliding_window_pattern": 6, "vocab_size": 262144,
}
BERT_BASE_UNCASED = {  # google-bert/bert-base-uncased
    "architectures": ["BertForMaskedLM"], "attention_probs_dropout_prob": 0.1,
    "gradient_checkpointing": False, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
    "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 3072, "layer_norm_eps": 1e-12,
    "max_position_embeddings": 512, "model_type": "bert", "num_attention_heads": 12,
    "num_hidden_layers": 12, "pad_token_id": 0, "position_embedding_type": "absolute",
    "transformers_version": "4.6.0.dev0", "type_vocab_size": 2, "use_cache": True, "vocab_size": 30522,
}
BERT_LARGE_UNCASED = {  # google-bert/bert-large-uncased
    **BERT_BASE_UNCASED, "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16,
    "num_hidden_layers": 24,
}
ROBERTA_BASE = {  # FacebookAI/roberta-base
    "architectures": ["RobertaForMaskedLM"], "attention_probs_dropout_prob": 0.1, "bos_token_id": 0,
    "eos_token_id": 2, "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 768,
    "initializer_range": 0.02, "intermediate_size": 3072, "layer_norm_eps": 1e-05,
    "max_position_embeddings": 514, "model_type": "roberta", "num_attention_heads": 12,
    "num_hidden_layers": 12, "pad_token_id": 1, "type_vocab_size": 1, "vocab_size": 50265,
}
ENCODERS = [(BERT_BASE_UNCASED, "bert-base", 109_514_298), (BERT_LARGE_UNCASED, "bert-large", 335_174_458),
            (ROBERTA_BASE, "roberta-base", 124_697_433)]


def to_config(hf):
    return FAMILIES.get(hf["model_type"]).to_config(dict(hf))


def test_llama31_8b():
    cfg = to_config(LLAMA31_8B)
    scaling = cfg.position.rope_scaling
    assert (scaling.kind, scaling.factor, scaling.original_max_seq_len) == ("llama3", 8.0, 8192)
    assert cfg.position.rope_theta == 500000.0 and cfg.n_kv_heads == 8
    assert param_count(cfg) == 8_030_261_248


def test_mistral_7b_window_on_every_layer():
    cfg = to_config(MISTRAL_7B)
    assert cfg.attention.window == 4096 and all(cfg.is_local(i) for i in range(32))
    assert param_count(cfg) == 7_241_732_096


def test_qwen25_without_sliding_window():
    cfg = to_config(QWEN25_05B)
    assert cfg.attention.window is None and cfg.bias.qkv and not cfg.bias.attn_out
    assert cfg.tie_embeddings
    assert param_count(cfg) == 494_032_768


def test_gemma2_2b_legacy_alternation_starts_local():
    cfg = to_config(GEMMA2_2B)
    assert cfg.attention.layer_pattern == "LG" and cfg.attention.window == 4096
    assert (cfg.attention.logit_softcap, cfg.final_logit_softcap) == (50.0, 30.0)
    assert param_count(cfg) == 2_614_341_888


def test_gemma3_1b_legacy_rope_fields():
    cfg = to_config(GEMMA3_1B)
    assert cfg.attention.layer_pattern == "LLLLLG" and cfg.attention.window == 512
    assert cfg.position.rope_theta == 1e6 and cfg.position.local_rope_theta == 1e4
    assert cfg.attention.qk_norm == "per_head" and cfg.final_logit_softcap is None


@pytest.mark.parametrize("hf,field", [
    ({**LLAMA31_8B, "rope_scaling": {"rope_type": "proportional", "factor": 4.0}}, "proportional"),
    ({**LLAMA31_8B, "pretraining_tp": 2}, "pretraining_tp"),
    ({**LLAMA31_8B, "hidden_act": "tanh"}, "hidden_act"),
    ({**MISTRAL_7B, "mlp_bias": True}, "mlp_bias"),
    ({**GEMMA2_2B, "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({**QWEN25_05B, "use_sliding_window": True, "layer_types": ["chunked"] * 24}, "chunked"),
])
def test_unsupported_fields_are_named(hf, field):
    with pytest.raises(ConfigError, match=field):
        to_config(hf)


@pytest.mark.parametrize("hf,preset,count", ENCODERS, ids=[p for _, p, _ in ENCODERS])
def test_encoders_translate_to_their_preset(hf, preset, count):
    cfg, want = to_config(hf), presets.get(preset)
    assert cfg.arch == "encoder" and param_count(cfg) == param_count(want) == count
    assert (cfg.max_seq_len, cfg.position.learned_offset) == (want.max_seq_len, want.position.learned_offset)
    assert (cfg.norm.eps, cfg.type_vocab_size) == (want.norm.eps, want.type_vocab_size)


@pytest.mark.parametrize("hf,preset,count", ENCODERS, ids=[p for _, p, _ in ENCODERS])
def test_encoders_count_as_transformers_masked_lm(hf, preset, count):
    """transformers' *ForMaskedLM of the same config.json, built on the meta device, has our count."""
    transformers = pytest.importorskip("transformers")
    import torch

    config = transformers.AutoConfig.for_model(**hf)
    with torch.device("meta"):
        model = transformers.AutoModelForMaskedLM.from_config(config)
    assert type(model).__name__ == hf["architectures"][0]
    assert model.num_parameters() == param_count(to_config(hf)) == count
