"""GPT-J: parallel block with one shared norm, interleaved partial RoPE, LM-head bias."""
import pytest

pytest.importorskip("transformers")

GPTJ = dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_inner=96, rotary_dim=8,
            n_positions=64, initializer_range=0.1, bos_token_id=0, eos_token_id=0)


@pytest.mark.parametrize("rotary_dim", [8, 16], ids=["partial", "full"])
def test_gptj_logits_match_transformers(hf_parity, hf_roundtrip, rotary_dim):
    _, ours, _ = hf_parity("gptj", **{**GPTJ, "rotary_dim": rotary_dim})
    cfg = ours.config
    assert cfg.block.parallel and cfg.block.parallel_norms == 1
    assert cfg.position.rope_layout == "interleaved" and cfg.rotary_dim == rotary_dim
    assert ours.lm_head.bias is not None
    hf_roundtrip(ours, expect_family="gptj")
