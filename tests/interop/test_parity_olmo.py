"""OLMo (non-parametric LayerNorm, clip_qkv) and OLMo 2 (post-sublayer RMSNorm, full-width
QK-norm): logits equal transformers'."""
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
