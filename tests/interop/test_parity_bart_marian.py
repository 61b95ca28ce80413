"""BART and Marian: tiny random BartForConditionalGeneration / MarianMTModel -> save_pretrained -> load_hf -> the
same logits on a right-padded source batch (fp32); save_hf -> transformers -> the same logits. The released
facebook/bart-large and Helsinki-NLP/opus-mt-en-de config.json files translate to the presets `bart-large` and
`marian`, whose counts equal transformers' num_parameters() on the meta device (Marian's frozen sinusoid tables
count, the final_logits_bias buffer does not)."""
import pytest
import torch

from archlab.config import ConfigError
from archlab.interop import FAMILIES, load_hf, save_hf
from archlab.interop.families.base import config_diff
from archlab.models import build_model, presets
from archlab.models.accounting import param_count
from archlab.nn.position import sinusoid_table

TOLERANCE = 1e-4   # max |ours - theirs| / max |theirs|, fp32

TINY = dict(vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=24,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
            eos_token_id=2)
BART = dict(decoder_start_token_id=2, scale_embedding=False, activation_function="gelu")
MARIAN = dict(decoder_start_token_id=1, scale_embedding=True, activation_function="swish")

# facebook/bart-large config.json (the fields BartConfig reads)
BART_LARGE = {"model_type": "bart", "architectures": ["BartModel"], "activation_dropout": 0.1,
              "activation_function": "gelu", "add_bias_logits": False, "add_final_layer_norm": False,
              "attention_dropout": 0.1, "bos_token_id": 0, "classif_dropout": 0.1, "classifier_dropout": 0.0,
              "d_model": 1024, "decoder_attention_heads": 16, "decoder_ffn_dim": 4096, "decoder_layerdrop": 0.0,
              "decoder_layers": 12, "decoder_start_token_id": 2, "dropout": 0.1, "early_stopping": True,
              "encoder_attention_heads": 16, "encoder_ffn_dim": 4096, "encoder_layerdrop": 0.0,
              "encoder_layers": 12, "eos_token_id": 2, "forced_eos_token_id": 2, "init_std": 0.02,
              "is_encoder_decoder": True, "max_position_embeddings": 1024, "no_repeat_ngram_size": 3,
              "normalize_before": False, "num_beams": 4, "num_hidden_layers": 12, "pad_token_id": 1,
              "scale_embedding": False, "use_cache": True, "vocab_size": 50265}
# Helsinki-NLP/opus-mt-en-de config.json
OPUS_MT_EN_DE = {"model_type": "marian", "architectures": ["MarianMTModel"], "activation_dropout": 0.0,
                 "activation_function": "swish", "add_bias_logits": False, "add_final_layer_norm": False,
                 "attention_dropout": 0.0, "bad_words_ids": [[58100]], "bos_token_id": 0, "classif_dropout": 0.0,
                 "classifier_dropout": 0.0, "d_model": 512, "decoder_attention_heads": 8, "decoder_ffn_dim": 2048,
                 "decoder_layerdrop": 0.0, "decoder_layers": 6, "decoder_start_token_id": 58100,
                 "decoder_vocab_size": 58101, "dropout": 0.1, "encoder_attention_heads": 8,
                 "encoder_ffn_dim": 2048, "encoder_layerdrop": 0.0, "encoder_layers": 6, "eos_token_id": 0,
                 "forced_eos_token_id": 0, "init_std": 0.02, "is_encoder_decoder": True, "max_length": 512,
                 "max_position_embeddings": 512, "normalize_before": False, "normalize_embedding": False,
                 "num_beams": 4, "num_hidden_layers": 6, "pad_token_id": 58100, "scale_embedding": True,
                 "share_encoder_decoder_embeddings": True, "static_position_embeddings": True,
                 "use_cache": True, "vocab_size": 58101}


def _hf_model(kind: str):
    """A random HF model with every 1-d parameter (norms, biases) and final_logits_bias randomised (HF
    initialises them to 1 / 0)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "bart":
        model = transformers.BartForConditionalGeneration(transformers.BartConfig(**TINY, **BART))
    else:
        model = transformers.MarianMTModel(transformers.MarianConfig(**TINY, **MARIAN))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        model.final_logits_bias.copy_(torch.randn(model.final_logits_bias.shape, generator=gen))
    return model.eval()


def _batch():
    """A right-padded source batch (row 1: 3 padded slots), decoder ids, the source mask."""
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(3, TINY["vocab_size"], (2, 9), generator=gen)
    dec = torch.randint(3, TINY["vocab_size"], (2, 7), generator=gen)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    src[mask == 0] = TINY["pad_token_id"]
    return src, dec, mask


def _rel_error(ours, theirs) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


@torch.no_grad()
def _assert_same_logits(ours, hf_model):
    src, dec, mask = _batch()
    theirs = hf_model(input_ids=src, attention_mask=mask, decoder_input_ids=dec, use_cache=False).logits
    mine = ours(src, dec, attention_mask=mask)
    assert mine.shape == theirs.shape == (2, 7, TINY["vocab_size"])
    err = _rel_error(mine, theirs)
    assert err < TOLERANCE, f"logits differ: max relative error {err:.2e}"


@pytest.mark.parametrize("kind", ["bart", "marian"])
def test_logits_match_transformers_and_round_trip(tmp_path, kind):
    transformers = pytest.importorskip("transformers")
    hf_model = _hf_model(kind)
    hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours = load_hf(tmp_path / "hf")
    cfg = ours.config
    assert type(ours).__name__ == "EncoderDecoderLM" and not ours.training
    assert cfg.position.per_stack and cfg.bias.head_buffer and cfg.norm.position == "post"
    assert cfg.stack_depth("cross_decoder") == 3 and cfg.n_layers == 2
    assert cfg.scale_embeddings == (kind == "marian") and cfg.norm.embedding_norm == (kind == "bart")
    assert "lm_head.bias" not in dict(ours.named_parameters())           # a buffer, as transformers holds it
    assert torch.equal(ours.lm_head.bias, hf_model.final_logits_bias[0])
    assert ours.num_params() == hf_model.num_parameters()
    _assert_same_logits(ours, hf_model)

    fam = save_hf(ours, tmp_path / "ours")
    assert fam.model_type == kind
    cls = transformers.BartForConditionalGeneration if kind == "bart" else transformers.MarianMTModel
    back = cls.from_pretrained(tmp_path / "ours").eval()
    _assert_same_logits(ours, back)
    assert config_diff(load_hf(tmp_path / "ours").config, cfg) == []


def test_marian_table_is_transformers_split_sinusoid():
    """All sines, then all cosines (not interleaved), as MarianSinusoidalPositionalEmbedding.create_weight."""
    pytest.importorskip("transformers")
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    for d in (8, 9):
        theirs = MarianSinusoidalPositionalEmbedding(12, d).create_weight()
        assert torch.allclose(sinusoid_table(12, d, "split"), theirs, atol=1e-6)
    cfg = presets.tiny("marian")
    model = build_model(cfg)
    plain = build_model(cfg.with_overrides({"position.sinusoid_table": False}))   # computed per call
    pos = torch.arange(10)[None]
    assert torch.allclose(model.abs_position(pos), plain.abs_position(pos), atol=1e-5)
    assert not model.abs_position.table.requires_grad and model.decoder_abs_position is not None


@pytest.mark.parametrize("hf, preset, family", [(BART_LARGE, "bart-large", "bart"),
                                                (OPUS_MT_EN_DE, "marian", "marian")])
def test_released_configs_are_the_presets_with_transformers_counts(hf, preset, family):
    """MarianMTModel / BartForConditionalGeneration(config).num_parameters() on the meta device."""
    transformers = pytest.importorskip("transformers")
    cfg = FAMILIES.get(family).to_config(dict(hf))
    assert config_diff(cfg, presets.get(preset)) == []
    fields = {k: v for k, v in hf.items() if k not in ("model_type", "architectures")}
    with torch.device("meta"):
        if family == "bart":
            model = transformers.BartForConditionalGeneration(transformers.BartConfig(**fields))
        else:
            model = transformers.MarianMTModel(transformers.MarianConfig(**fields))
    assert param_count(presets.get(preset)) == param_count(cfg) == model.num_parameters()


@pytest.mark.parametrize("family, field, value", [("bart", "decoder_ffn_dim", 1000),
                                                  ("bart", "activation_function", "tanh"),
                                                  ("marian", "share_encoder_decoder_embeddings", False),
                                                  ("marian", "decoder_vocab_size", 100)])
def test_unsupported_fields_are_named(family, field, value):
    hf = BART_LARGE if family == "bart" else OPUS_MT_EN_DE
    with pytest.raises(ConfigError, match=field):
        FAMILIES.get(family).to_config({**hf, field: value})
