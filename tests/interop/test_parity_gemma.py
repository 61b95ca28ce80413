"""Gemma 1/2/3: (1 + w) RMSNorm, sqrt(d) embedding scale, tanh-GeGLU, explicit head_dim; Gemma 2
sandwich norms, soft-caps, query_pre_attn_scalar, alternating windows; Gemma 3 per-head qk-norm,
local rope theta, linear scaling on global layers only, 5:1 local/global."""
import pytest

pytest.importorskip("transformers")


def gemma_kwargs(tiny_kwargs, **kw):
    return tiny_kwargs(head_dim=24, tie_word_embeddings=True, **kw)


def test_gemma_logits_match_transformers(hf_parity, hf_roundtrip, tiny_kwargs):
    _, ours, _ = hf_parity("gemma", **gemma_kwargs(tiny_kwargs, hidden_act="gelu_pytorch_tanh"))
    cfg = ours.config
    assert cfg.norm.kind == "rmsnorm_1p" and cfg.scale_embeddings and cfg.head_dim == 24
    assert cfg.mlp.activation == "geglu_tanh"
    hf_roundtrip(ours, expect_family="gemma")


def test_gemma2_sandwich_softcaps_alternating_window(hf_parity, hf_roundtrip, tiny_kwargs):
    _, ours, _ = hf_parity("gemma2", **gemma_kwargs(
        tiny_kwargs, query_pre_attn_scalar=20, sliding_window=5, attn_logit_softcapping=3.0,
        final_logit_softcapping=2.0))
    cfg = ours.config
    assert cfg.norm.position == "sandwich"
    assert cfg.attention.layer_pattern == "LG"   # HF: layer i local when (i + 1) % 2 != 0
    assert (cfg.attention.logit_softcap, cfg.final_logit_softcap) == (3.0, 2.0)
    assert cfg.attention.query_pre_attn_scalar == 20
    hf_roundtrip(ours, expect_family="gemma2")


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}])
def test_gemma3_text(hf_parity, hf_roundtrip, tiny_kwargs, scaling):
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0, **(scaling or {})},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
    _, ours, _ = hf_parity("gemma3_text", **gemma_kwargs(
        tiny_kwargs, num_hidden_layers=6, sliding_window=5, query_pre_attn_scalar=24,
        rope_parameters=rope))
    cfg = ours.config
    assert cfg.attention.layer_pattern == "LLLLLG" and cfg.attention.qk_norm == "per_head"
    assert cfg.position.local_rope_theta == 100.0 and cfg.position.rope_theta == 1_000_000.0
    assert (cfg.position.rope_scaling is None) == (scaling is None)
    hf_roundtrip(ours, expect_family="gemma3_text")
