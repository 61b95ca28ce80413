"""BLOOM (ALiBi, embedding LayerNorm, per-head fused qkv) and OPT (learned positions offset by 2,
pre- and post-norm, ReLU): logits equal transformers', save_hf round trips."""
import pytest

from archlab.config import ConfigError

pytest.importorskip("transformers")

BLOOM = dict(vocab_size=128, hidden_size=64, n_layer=2, n_head=4, initializer_range=0.1,
             bos_token_id=0, eos_token_id=0)
OPT = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=96,
           max_position_embeddings=64, init_std=0.1, pad_token_id=1, bos_token_id=0, eos_token_id=0)


@pytest.mark.parametrize("n_head", [4, 6], ids=["pow2_heads", "6_heads"])
def test_bloom_logits_match_transformers(hf_parity, hf_roundtrip, n_head):
    # 6 heads: ALiBi slopes for a non-power-of-two head count (interleaved from the next power)
    _, ours, _ = hf_parity("bloom", **{**BLOOM, "n_head": n_head, "hidden_size": 16 * n_head})
    cfg = ours.config
    assert cfg.position.kind == "alibi" and cfg.norm.embedding_norm and ours.lm_head.weight is None
    hf_roundtrip(ours, expect_family="bloom")


@pytest.mark.parametrize("pre", [True, False], ids=["pre_norm", "post_norm"])
def test_opt_logits_match_transformers(hf_parity, hf_roundtrip, pre):
    _, ours, _ = hf_parity("opt", **OPT, do_layer_norm_before=pre)
    cfg = ours.config
    assert cfg.position.learned_offset == 2 and cfg.norm.position == ("pre" if pre else "post")
    assert cfg.norm.final_norm == pre
    hf_roundtrip(ours, expect_family="opt")


def test_opt_projection_dim_is_refused():
    from archlab.interop.families import FAMILIES

    hf = {"model_type": "opt", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "ffn_dim": 96, "word_embed_proj_dim": 32}
    with pytest.raises(ConfigError, match="word_embed_proj_dim"):
        FAMILIES.get("opt").to_config(hf)
