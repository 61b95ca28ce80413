"""T5: tiny random T5ForConditionalGeneration (v1.0: ReLU, tied head rescaled by d**-0.5; v1.1: gated-GeLU, a
separate head, a deeper decoder) -> save_pretrained -> load_hf -> the same logits on a padded source batch;
save_hf -> transformers -> the same logits. The released t5-11b and t5-v1_1-xxl config.json files translate
to the presets, with transformers' parameter counts (built on the meta device)."""
import pytest
import torch

from archlab.config import ConfigError
from archlab.interop import FAMILIES, load_hf, save_hf
from archlab.interop.families.base import config_diff
from archlab.models import build_model, presets
from archlab.models.accounting import param_count

TOLERANCE = 1e-4   # max |ours - theirs| / max |theirs|, fp32

TINY = dict(vocab_size=128, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
            decoder_start_token_id=0)
V10 = dict(feed_forward_proj="relu")
V11 = dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False, num_decoder_layers=3)

# google-t5/t5-11b and google/t5-v1_1-xxl config.json (the fields T5Config reads)
T5_11B = {"model_type": "t5", "architectures": ["T5WithLMHeadModel"], "d_ff": 65536, "d_kv": 128, "d_model": 1024,
          "decoder_start_token_id": 0, "dropout_rate": 0.1, "eos_token_id": 1, "initializer_factor": 1.0,
          "is_encoder_decoder": True, "layer_norm_epsilon": 1e-06, "n_positions": 512, "num_heads": 128,
          "num_layers": 24, "output_past": True, "pad_token_id": 0, "relative_attention_num_buckets": 32,
          "vocab_size": 32128}
T5_V11_XXL = {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_ff": 10240, "d_kv": 64,
              "d_model": 4096, "decoder_start_token_id": 0, "dropout_rate": 0.1, "eos_token_id": 1,
              "feed_forward_proj": "gated-gelu", "initializer_factor": 1.0, "is_encoder_decoder": True,
              "layer_norm_epsilon": 1e-06, "num_decoder_layers": 24, "num_heads": 64, "num_layers": 24,
              "output_past": True, "pad_token_id": 0, "relative_attention_num_buckets": 32,
              "tie_word_embeddings": False, "vocab_size": 32128}


def _hf_t5(untie: bool, **config):
    """A random HF T5 with every norm weight randomised (HF initialises them to 1); `untie`: a head of its own
    (transformers 5 builds every T5 tied; v1.1 checkpoints hold a separate lm_head, untied at load)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**TINY, **config))
    if untie:
        model.lm_head.weight = torch.nn.Parameter(torch.randn(TINY["vocab_size"], TINY["d_model"]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _batch(side: str = "right"):
    """A source batch whose second row has 3 padded slots, decoder ids, the source mask."""
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(1, TINY["vocab_size"], (2, 9), generator=gen)
    dec = torch.randint(1, TINY["vocab_size"], (2, 7), generator=gen)
    mask = torch.ones(2, 9, dtype=torch.long)
    if side == "right":
        mask[1, 6:] = 0
    else:
        mask[1, :3] = 0
    src[mask == 0] = 0
    return src, dec, mask


def _rel_error(ours, theirs) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


@torch.no_grad()
def _assert_same_logits(ours, hf_model, side: str = "right", decoder_mask: bool = False):
    src, dec, mask = _batch(side)
    kw = {}
    if decoder_mask:   # a right-padded decoder row: its real slots compared
        dec_mask = torch.ones_like(dec)
        dec_mask[0, 5:] = 0
        kw = dict(decoder_attention_mask=dec_mask)
    theirs = hf_model(input_ids=src, attention_mask=mask, decoder_input_ids=dec, use_cache=False, **kw).logits
    mine = ours(src, dec, attention_mask=mask, **kw)
    assert mine.shape == theirs.shape == (2, 7, TINY["vocab_size"])
    if decoder_mask:
        mine, theirs = torch.cat([mine[0, :5], mine[1]]), torch.cat([theirs[0, :5], theirs[1]])
    err = _rel_error(mine, theirs)
    assert err < TOLERANCE, f"logits differ: max relative error {err:.2e}"


@pytest.mark.parametrize("version", ["v1.0", "v1.1"])
def test_t5_logits_match_transformers_and_round_trip(tmp_path, version):
    transformers = pytest.importorskip("transformers")
    untie = version == "v1.1"
    hf_model = _hf_t5(untie, **(V11 if untie else V10))
    hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours = load_hf(tmp_path / "hf")
    cfg = ours.config
    assert type(ours).__name__ == "EncoderDecoderLM" and not ours.training
    assert cfg.tie_embeddings == (not untie) and (cfg.logit_scale is None) == untie
    assert cfg.mlp.activation == ("geglu_tanh" if untie else "relu")
    assert cfg.stack_depth("cross_decoder") == (3 if untie else 2) and cfg.attention.query_pre_attn_scalar == 1.0
    for side in ("right", "left"):
        _assert_same_logits(ours, hf_model, side)
    _assert_same_logits(ours, hf_model, decoder_mask=True)

    fam = save_hf(ours, tmp_path / "ours")
    assert fam.model_type == "t5"
    back = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "ours").eval()
    assert (back.lm_head.weight is back.shared.weight) == (not untie)
    _assert_same_logits(ours, back)
    assert config_diff(load_hf(tmp_path / "ours").config, cfg) == []


def test_t5_tied_head_without_rescale_as_transformers_5_builds_v11(tmp_path):
    """transformers 5 ties every T5 and writes tie_word_embeddings=true with scale_decoder_outputs=false for
    v1.1 configs: a tied head without the d**-0.5 rescale."""
    transformers = pytest.importorskip("transformers")
    hf_model = _hf_t5(False, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    if hf_model.lm_head.weight is not hf_model.shared.weight:
        pytest.skip("this transformers keeps an untied v1.1 head")
    hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours = load_hf(tmp_path / "hf")
    assert ours.config.tie_embeddings and ours.config.logit_scale is None
    _assert_same_logits(ours, hf_model)
    save_hf(ours, tmp_path / "ours")
    back = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "ours").eval()
    _assert_same_logits(ours, back)


@pytest.mark.parametrize("name, overrides", [("t5-11b", {}), ("t5-v1.1-xxl", {}),
                                             ("t5-11b", {"mlp.activation": "gelu_tanh"}),
                                             ("t5-v1.1-xxl", {"mlp.activation": "geglu"}),
                                             ("t5-v1.1-xxl", {"mlp.activation": "swiglu", "decoder_layers": 1})])
def test_tiny_t5_presets_save_to_t5(tmp_path, name, overrides):
    """Our tiny twins (and other activations: an exact-GeLU gate is told apart by dense_act_fn) load in
    transformers to the same logits."""
    transformers = pytest.importorskip("transformers")
    model = build_model(presets.tiny(name).with_overrides(overrides)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    assert save_hf(model, tmp_path / name).model_type == "t5"
    back = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / name).eval()
    src, dec, mask = _batch()
    src, dec = src % model.config.vocab_size, dec % model.config.vocab_size
    with torch.no_grad():
        err = _rel_error(model(src, dec, attention_mask=mask),
                         back(input_ids=src, attention_mask=mask, decoder_input_ids=dec).logits)
    assert err < TOLERANCE


@pytest.mark.parametrize("hf, preset, count", [(T5_11B, "t5-11b", 11_307_321_344),
                                               (T5_V11_XXL, "t5-v1.1-xxl", 11_135_332_352)])
def test_released_t5_configs_are_the_presets_with_their_counts(hf, preset, count):
    cfg = FAMILIES.get("t5").to_config(dict(hf))
    assert config_diff(cfg, presets.get(preset)) == []
    assert param_count(cfg) == param_count(presets.get(preset)) == count


@pytest.mark.parametrize("hf", [T5_11B, T5_V11_XXL])
def test_t5_counts_equal_transformers_on_the_meta_device(hf):
    """T5ForConditionalGeneration(config).num_parameters(): transformers 5 builds every T5 tied; a v1.1
    checkpoint's separate lm_head (untied at load) adds vocab x d_model."""
    transformers = pytest.importorskip("transformers")
    fields = {k: v for k, v in hf.items() if k not in ("model_type", "architectures")}
    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(**fields))
    expected = model.num_parameters()
    if not hf.get("tie_word_embeddings", True) and model.lm_head.weight is model.shared.weight:
        expected += hf["vocab_size"] * hf["d_model"]
    assert param_count(FAMILIES.get("t5").to_config(dict(hf))) == expected


@pytest.mark.parametrize("field, value", [("feed_forward_proj", "gated-gelu-x"), ("feed_forward_proj", "tanh"),
                                          ("is_encoder_decoder", False)])
def test_unsupported_t5_fields_are_named(field, value):
    with pytest.raises(ConfigError, match=field if field != "feed_forward_proj" else "feed_forward_proj|tanh"):
        FAMILIES.get("t5").to_config({**T5_11B, field: value})


def test_a_decoder_only_config_is_not_a_t5():
    with pytest.raises(ConfigError, match="arch"):
        FAMILIES.get("t5").from_config(presets.tiny("lamda-137b"))


def test_verify_and_run_folder_round_trip_of_a_t5_folder(tmp_path):
    """`archlab verify` compares with AutoModelForSeq2SeqLM; `convert --from-hf` then `--to-hf` gives a folder
    transformers reads to the same logits."""
    pytest.importorskip("transformers")
    from archlab.interop.convert import compare_with_transformers, convert_from_hf, convert_to_hf

    _hf_t5(True, **V11).save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert compare_with_transformers(tmp_path / "hf")["max_rel"] < TOLERANCE
    run = convert_from_hf(tmp_path / "hf", tmp_path / "run")
    assert convert_to_hf(run, tmp_path / "back") == "t5"
    assert compare_with_transformers(tmp_path / "back")["max_rel"] < TOLERANCE


@pytest.mark.parametrize("name", ["t5-11b", "t5-v1.1-xxl"])
def test_t5_presets_initialize_at_the_scales_of_transformers_t5(tmp_path, name):
    """init.kind="t5": every tensor's spread equals that of the same tensor in a T5ForConditionalGeneration that
    transformers initializes from the exported config (queries (d e)^-0.5, keys / values / MLP inputs d^-0.5,
    outputs (h e)^-0.5 and d_ff^-0.5, embeddings 1, bias tables d^-0.5)."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from archlab.models import build_model, presets

    cfg = presets.get(name)
    cfg = cfg.with_overrides({"vocab_size": 512, "d_model": 64, "n_layers": 2, "attention.n_heads": 16,
                              "attention.head_dim": 4, "mlp.d_ff": 256,     # 16 heads: 512-entry bias tables
                              "logit_scale": None if cfg.logit_scale is None else 64 ** -0.5})
    assert cfg.init.kind == "t5"
    save_hf(build_model(cfg), tmp_path / "ours")
    ours = load_file(next((tmp_path / "ours").glob("*.safetensors")))
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(transformers.T5Config.from_pretrained(tmp_path / "ours"))
    theirs = hf.state_dict()
    checked = 0
    for key, tensor in ours.items():
        if tensor.dim() < 2 or key not in theirs:       # norms are ones in both
            continue
        a, b = float(tensor.float().std()), float(theirs[key].float().std())
        tolerance = 0.1 if tensor.numel() >= 4096 else 0.3
        assert abs(a / b - 1) < tolerance, (key, a, b)
        checked += 1
    assert checked >= 20
