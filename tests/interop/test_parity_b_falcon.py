"""Falcon: the new decoder architecture (two norms, grouped GQA qkv), the old parallel MQA
(falcon-7b) and the old serial MHA layouts; ALiBi Falcon is refused by name."""
import pytest

from archlab.config import ConfigError

pytest.importorskip("transformers")

FALCON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              ffn_hidden_size=96, max_position_embeddings=64, initializer_range=0.1,
              bos_token_id=0, eos_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 500.0})

LAYOUTS = {
    "new_gqa_2norms": dict(new_decoder_architecture=True, num_kv_heads=2, bias=True),
    "new_gqa_1norm": dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1),
    "old_parallel_mqa": dict(new_decoder_architecture=False, multi_query=True, parallel_attn=True,
                             tie_word_embeddings=False),
    "old_serial_mha": dict(new_decoder_architecture=False, multi_query=False, parallel_attn=False,
                           bias=True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_falcon_logits_match_transformers(hf_parity, hf_roundtrip, layout):
    _, ours, _ = hf_parity("falcon", **FALCON, **LAYOUTS[layout])
    cfg = ours.config
    assert cfg.n_kv_heads == {"new_gqa_2norms": 2, "new_gqa_1norm": 2, "old_parallel_mqa": 1,
                              "old_serial_mha": 4}[layout]
    assert cfg.block.parallel == (layout != "old_serial_mha")
    # a serial MHA Falcon is also exactly a GPT-NeoX; name the family to write a Falcon folder
    hf_roundtrip(ours, family="falcon", expect_family="falcon")


def test_falcon_alibi_is_refused():
    from archlab.interop.families import FAMILIES

    hf = {"model_type": "falcon", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "alibi": True}
    with pytest.raises(ConfigError, match="alibi"):
        FAMILIES.get("falcon").to_config(hf)
