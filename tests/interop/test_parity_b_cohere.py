"""Cohere (parallel, bias-free LayerNorm, interleaved RoPE, logit_scale, per-head-weight QK-norm)
and Cohere2 (sliding window on 3 of 4 layers, NoPE on the global ones): logits equal
transformers', save_hf round trips."""
import pytest
import torch

pytest.importorskip("transformers")

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            initializer_range=0.1, pad_token_id=None, bos_token_id=0, eos_token_id=0,
            logit_scale=0.5, rope_parameters={"rope_type": "default", "rope_theta": 500.0})


def test_cohere_logits_match_transformers(hf_parity, hf_roundtrip):
    _, ours, _ = hf_parity("cohere", **BASE)
    cfg = ours.config
    assert cfg.position.rope_layout == "interleaved" and cfg.logit_scale == 0.5
    assert cfg.block.parallel and not cfg.bias.norm and ours.lm_head.weight is None
    hf_roundtrip(ours, expect_family="cohere")


def test_cohere_qk_norm_has_a_weight_per_head(tmp_path, hf_roundtrip):
    import transformers

    from archlab.interop import load_hf

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("cohere", **BASE, use_qk_norm=True)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():   # every norm weight random, the (heads, head_dim) QK-norm ones included
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours = load_hf(tmp_path / "hf")
    assert ours.config.attention.qk_norm == "per_head_untied"
    assert ours.blocks[0].attn.q_norm.weight.shape == (4, 16)
    ids = torch.randint(0, 128, (2, 24), generator=gen)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
        err = float((ours(ids) - theirs).abs().max() / theirs.abs().max())
    assert err < 1e-4, err
    hf_roundtrip(ours, expect_family="cohere")


@pytest.mark.parametrize("layers", [4, 5])
def test_cohere2_logits_match_transformers(hf_parity, hf_roundtrip, layers):
    _, ours, _ = hf_parity("cohere2", **{**BASE, "num_hidden_layers": layers}, sliding_window=6)
    cfg = ours.config
    assert cfg.attention.layer_pattern == "LLLG" and cfg.attention.window == 6
    assert [cfg.position_kind(i) for i in range(4)] == ["rope", "rope", "rope", "none"]
    hf_roundtrip(ours, expect_family="cohere2")
