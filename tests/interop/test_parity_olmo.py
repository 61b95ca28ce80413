"""OLMo (non-parametric LayerNorm, clip_qkv), OLMo 2 (post-sublayer RMSNorm, full-width QK-norm) and OLMoE
(full-width QK-norm, routed experts): logits equal transformers'."""
import pytest

pytest.importorskip("transformers")


@pytest.mark.parametrize("clip", [None, 0.05])
def test_olmo_logits_match_transformers(hf_parity, hf_roundtrip, tiny_kwargs, clip):
    _, ours, _ = hf_parity("olmo", **tiny_kwargs(attention_bias=True, clip_qkv=clip))
    cfg = ours.config
    assert cfg.norm.kind == "nonparametric" and cfg.attention.clip_qkv == clip
    assert cfg.bias.qkv and cfg.bias.attn_out
    hf_roundtrip(ours, expect_family="olmo")


def test_olmo_clip_qkv_changes_logits(hf_parity, tiny_kwargs):
    """The clip value used in the test above is small enough to bind (else it tests nothing)."""
    import torch

    from archlab import TransformerLM

    _, clipped, _ = hf_parity("olmo", **tiny_kwargs(clip_qkv=0.05))
    plain = TransformerLM(clipped.config.with_overrides({"attention.clip_qkv": None})).eval()
    plain.load_state_dict(clipped.state_dict())
    ids = torch.arange(16)[None]
    with torch.no_grad():
        assert (plain(ids) - clipped(ids)).abs().max() > 1e-3


def test_olmo2_post_sublayer_norms_full_qk_norm(hf_parity, hf_roundtrip, tiny_kwargs):
    _, ours, _ = hf_parity("olmo2", **tiny_kwargs())
    cfg = ours.config
    assert cfg.norm.position == "post_sublayer" and cfg.attention.qk_norm == "full"
    hf_roundtrip(ours, expect_family="olmo2")


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_olmoe_moe_routing_and_full_qk_norm(hf_parity, hf_roundtrip, tiny_kwargs, norm_topk_prob):
    """OLMoE: full-width QK-norm, 4 experts top-2 with and without renormalizing the k weights, attention biases."""
    _, ours, _ = hf_parity("olmoe", **tiny_kwargs(num_experts=4, num_experts_per_tok=2,
                                                  norm_topk_prob=norm_topk_prob, attention_bias=True))
    cfg = ours.config
    assert (cfg.mlp.moe.n_experts, cfg.mlp.moe.top_k, cfg.mlp.moe.normalize_top_k) == (4, 2, norm_topk_prob)
    assert cfg.attention.qk_norm == "full" and cfg.bias.qkv and cfg.bias.attn_out
    hf_roundtrip(ours, expect_family="olmoe")


def test_olmoe_with_clip_qkv_is_refused_naming_the_field():
    """transformers clamps OLMoE's q and k after the QK-norm; archlab's attention clamps before it."""
    from archlab.config import ConfigError
    from archlab.interop.hf import family_for
    hf = {"model_type": "olmoe", "num_experts": 4, "clip_qkv": 8.0, "hidden_size": 64, "num_attention_heads": 4,
          "num_hidden_layers": 2, "intermediate_size": 32, "vocab_size": 128}
    with pytest.raises(ConfigError, match="clip_qkv"):
        family_for(hf).to_config(hf)
