"""GPT-NeoX: parallel (two norms) and serial residual, partial rotary, per-head fused qkv; logits
equal transformers', and save_hf writes a folder transformers loads to the same logits."""
import pytest

pytest.importorskip("transformers")


def neox_kwargs(**overrides):
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=64, initializer_range=0.1,
              hidden_act="gelu", tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25})
    kw.update(overrides)
    return kw


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "serial"])
def test_gpt_neox_logits_match_transformers(hf_parity, hf_roundtrip, parallel):
    _, ours, _ = hf_parity("gpt_neox", **neox_kwargs(use_parallel_residual=parallel))
    cfg = ours.config
    assert cfg.block.parallel == parallel and cfg.rotary_dim == 4
    assert cfg.bias.qkv and cfg.bias.mlp and cfg.bias.norm
    hf_roundtrip(ours, expect_family="gpt_neox")


def test_gpt_neox_no_attention_bias_tied_head(hf_parity, hf_roundtrip):
    _, ours, _ = hf_parity("gpt_neox", **neox_kwargs(attention_bias=False, tie_word_embeddings=True,
                                                     hidden_act="gelu_new"))
    assert not ours.config.bias.qkv and ours.lm_head.weight is None
    assert ours.config.mlp.activation == "gelu_tanh"
    hf_roundtrip(ours, family="gpt_neox")
