"""GPT-2: fused Conv1D c_attn, learned positions, LayerNorm biases; logits equal transformers'."""
import pytest

pytest.importorskip("transformers")

GPT2 = dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=32, initializer_range=0.1,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


@pytest.mark.parametrize("tied", [True, False])
def test_gpt2_logits_match_transformers(hf_parity, hf_roundtrip, tied):
    _, ours, _ = hf_parity("gpt2", **GPT2, tie_word_embeddings=tied)
    assert ours.config.position.kind == "learned" and ours.config.tie_embeddings == tied
    hf_roundtrip(ours, expect_family="gpt2")


def test_gpt2_bare_base_model_checkpoint_loads(tmp_path):
    """A checkpoint saved from GPT2Model (no 'transformer.' prefix, no lm_head) loads tied."""
    import torch
    import transformers

    from archlab.interop import load_hf

    config = transformers.GPT2Config(**GPT2)
    torch.manual_seed(0)
    full = transformers.GPT2LMHeadModel(config).eval()
    full.transformer.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    ids = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        err = (ours(ids) - full(ids).logits).abs().max() / full(ids).logits.abs().max()
    assert err < 1e-4
