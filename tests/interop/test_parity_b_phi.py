"""Phi-2 (parallel, shared LayerNorm, partial rotary, head bias), Phi-3 (fused qkv and gate_up,
sliding window) and Nemotron (LayerNorm1p, squared ReLU, partial rotary): logits equal
transformers', save_hf round trips."""
import pytest

from archlab.config import ConfigError

pytest.importorskip("transformers")

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, initializer_range=0.1,
            pad_token_id=None, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)


def test_phi_logits_match_transformers(hf_parity, hf_roundtrip):
    rope = {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}
    _, ours, _ = hf_parity("phi", **BASE, num_key_value_heads=2, rope_parameters=rope)
    cfg = ours.config
    assert cfg.block.parallel and cfg.block.parallel_norms == 1 and cfg.rotary_dim == 8
    assert ours.lm_head.bias is not None and cfg.n_kv_heads == 2
    hf_roundtrip(ours, expect_family="phi")


def test_phi3_logits_match_transformers(hf_parity, hf_roundtrip):
    rope = {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.75}
    _, ours, _ = hf_parity("phi3", **BASE, num_key_value_heads=2, sliding_window=7,
                           rope_parameters=rope)
    cfg = ours.config
    assert cfg.attention.window == 7 and cfg.rotary_dim == 12 and cfg.mlp.activation == "swiglu"
    hf_roundtrip(ours, expect_family="phi3")


def test_phi3_refuses_rope_types_its_hf_config_refuses():
    """Phi3Config accepts only default and longrope (su, yarn renamed); longrope parity lives in
    test_rope_scaling.py."""
    from archlab.interop.families import FAMILIES

    hf = {**BASE, "model_type": "phi3", "rope_scaling": {"type": "linear", "factor": 2.0}}
    with pytest.raises(ConfigError, match="linear"):
        FAMILIES.get("phi3").to_config(hf)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_nemotron_logits_match_transformers(hf_parity, hf_roundtrip, bias):
    _, ours, _ = hf_parity("nemotron", **BASE, num_key_value_heads=2, attention_bias=bias,
                           mlp_bias=bias)
    cfg = ours.config
    assert cfg.norm.kind == "layernorm_1p" and cfg.mlp.activation == "relu2" and cfg.rotary_dim == 8
    hf_roundtrip(ours, expect_family="nemotron")
