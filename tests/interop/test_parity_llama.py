"""LLaMA-like families (llama, mistral, mixtral, qwen2, qwen2_moe, qwen3): logits equal transformers'."""
import pytest

pytest.importorskip("transformers")


@pytest.mark.parametrize("rope", [
    None,
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16, "rope_theta": 500.0},
], ids=["default", "linear", "llama3"])
def test_llama_logits_match_transformers(hf_parity, hf_roundtrip, tiny_kwargs, rope):
    kw = tiny_kwargs(attention_bias=True, mlp_bias=True)
    if rope:
        kw["rope_parameters"] = rope
    _, ours, _ = hf_parity("llama", **kw)
    assert ours.config.bias.qkv and ours.config.bias.attn_out and ours.config.bias.mlp
    if rope:
        assert ours.config.position.rope_scaling.kind == rope["rope_type"]
    hf_roundtrip(ours, expect_family="llama")


def test_llama_tied_embeddings(hf_parity, hf_roundtrip, tiny_kwargs):
    _, ours, _ = hf_parity("llama", **tiny_kwargs(tie_word_embeddings=True))
    assert ours.lm_head.weight is None
    hf_roundtrip(ours, expect_family="llama")


def test_mistral_sliding_window(hf_parity, hf_roundtrip, tiny_kwargs):
    _, ours, _ = hf_parity("mistral", **tiny_kwargs(sliding_window=5))
    assert ours.config.attention.window == 5 and ours.config.is_local(1)
    hf_roundtrip(ours, expect_family="mistral")


def test_mistral_without_window_saves_as_llama(hf_parity, hf_roundtrip, tiny_kwargs):
    """Same switches as llama: save_hf picks the simplest family that expresses them exactly."""
    _, ours, _ = hf_parity("mistral", **tiny_kwargs(sliding_window=None))
    hf_roundtrip(ours, expect_family="llama")


@pytest.mark.parametrize("layers,max_window_layers,pattern", [(2, 1, "GL"), (3, 1, "GLL")])
def test_qwen2_bias_and_window_on_upper_layers(hf_parity, hf_roundtrip, tiny_kwargs,
                                               layers, max_window_layers, pattern):
    _, ours, _ = hf_parity("qwen2", **tiny_kwargs(
        num_hidden_layers=layers, use_sliding_window=True, sliding_window=5,
        max_window_layers=max_window_layers))
    cfg = ours.config
    assert cfg.bias.qkv and not cfg.bias.attn_out
    assert cfg.attention.layer_pattern == pattern and cfg.attention.window == 5
    hf_roundtrip(ours, expect_family="qwen2")


def test_qwen3_per_head_qk_norm(hf_parity, hf_roundtrip, tiny_kwargs):
    _, ours, _ = hf_parity("qwen3", **tiny_kwargs(head_dim=24, attention_bias=False))
    assert ours.config.attention.qk_norm == "per_head" and ours.config.head_dim == 24
    hf_roundtrip(ours, expect_family="qwen3")


def test_mixtral_moe_routing(hf_parity, hf_roundtrip, tiny_kwargs):
    """softmax over experts -> top-k -> renormalize; 4 experts, top-2, window smaller than seq."""
    _, ours, _ = hf_parity("mixtral", **tiny_kwargs(num_local_experts=4, num_experts_per_tok=2,
                                                    sliding_window=7))
    moe = ours.config.mlp.moe
    assert (moe.n_experts, moe.top_k, moe.normalize_top_k) == (4, 2, True)
    hf_roundtrip(ours, expect_family="mixtral")



@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen2_moe_routing_and_gated_shared_expert(hf_parity, hf_roundtrip, tiny_kwargs, norm_topk_prob):
    """Qwen2-MoE: 4 experts top-2 (moe_intermediate_size wide) beside a shared expert scaled by a sigmoid gate."""
    _, ours, _ = hf_parity("qwen2_moe", **tiny_kwargs(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                      shared_expert_intermediate_size=48,
                                                      norm_topk_prob=norm_topk_prob))
    cfg = ours.config
    moe = cfg.mlp.moe
    assert (moe.n_experts, moe.top_k, moe.normalize_top_k, cfg.d_ff) == (4, 2, norm_topk_prob, 32)
    assert moe.shared_expert_d_ff == 48 and moe.shared_expert_gate and cfg.bias.qkv
    hf_roundtrip(ours, expect_family="qwen2_moe")


@pytest.mark.parametrize("field", [{"decoder_sparse_step": 2}, {"mlp_only_layers": [0]}, {"qkv_bias": False}])
def test_qwen2_moe_layouts_archlab_cannot_hold_are_refused(field):
    from archlab.config import ConfigError
    from archlab.interop.hf import family_for
    hf = {"model_type": "qwen2_moe", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
          "vocab_size": 128, **field}
    with pytest.raises(ConfigError, match=next(iter(field))):
        family_for(hf).to_config(hf)
