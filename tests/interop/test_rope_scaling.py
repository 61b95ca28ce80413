"""RoPE context extension as Hugging Face checkpoints use it: YaRN (llama, qwen2), LongRoPE (phi3,
both factor sets) and dynamic NTK give transformers' logits on sequences past the original
context; save_hf round trips; bad scaling configs raise ConfigError naming the field.

Tiny models: original context 16 positions, calls of up to 64 tokens."""
import dataclasses
import math

import pytest
import torch

from archlab import ConfigError, ModelConfig
from archlab.config import AttentionConfig, PositionConfig, RopeScaling, RopeScalingKind
from archlab.interop import FAMILIES
from archlab.interop.families.rope import ROPE_READERS
from archlab.models.decoder import TransformerLM
from archlab.nn.position import ROPE_SCALINGS, RotaryEmbedding

transformers = pytest.importorskip("transformers")

ORIGINAL = 16           # original_max_position_embeddings of the tiny models
LONG = 64               # a call 4x past it
TOLERANCE = 1e-4
PHI3 = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            original_max_position_embeddings=ORIGINAL, initializer_range=0.1,
            pad_token_id=None, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)


def ids(seq: int, vocab: int = 128, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def rel_err(ours, hf_model, seq: int) -> float:
    x = ids(seq, ours.config.vocab_size)
    theirs = hf_model(input_ids=x, use_cache=False).logits
    return float((ours(x) - theirs).abs().max() / theirs.abs().max())


def assert_parity(ours, hf_model, *seqs: int) -> None:
    for seq in seqs:
        err = rel_err(ours, hf_model, seq)
        assert err < TOLERANCE, f"seq {seq}: max relative error {err:.2e}"


def unscaled(ours) -> TransformerLM:
    """The same weights with plain RoPE: shows that the scaling changes the logits we compare."""
    cfg = ours.config
    plain = TransformerLM(dataclasses.replace(
        cfg, position=dataclasses.replace(cfg.position, rope_scaling=None))).eval()
    plain.load_state_dict(ours.state_dict())
    return plain


def factors(n: int, low: float, high: float, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    return (low + (high - low) * torch.rand(n, generator=gen)).tolist()


# ---- YaRN ---------------------------------------------------------------------------------------
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
        "rope_theta": 500.0}


@pytest.mark.parametrize("extra", [
    {},
    {"beta_fast": 8.0, "beta_slow": 0.5, "truncate": False},
    {"attention_factor": 1.3},
    {"mscale": 0.707, "mscale_all_dim": 1.0},        # DeepSeek-style: a ratio of two mscales
    {"factor": None},                                 # implied: max_position_embeddings / original
], ids=["paper_defaults", "betas_no_truncate", "attention_factor", "mscale", "implied_factor"])
def test_llama_yarn_logits_match_transformers(hf_parity, hf_roundtrip, tiny_kwargs, extra):
    rope = {**YARN, **extra}
    hf_model, ours, _ = hf_parity("llama", **tiny_kwargs(rope_parameters=rope))
    scaling = ours.config.position.rope_scaling
    assert scaling.kind == "yarn" and scaling.factor == 4.0 and scaling.original_max_seq_len == ORIGINAL
    assert_parity(ours, hf_model, 12, LONG)
    assert rel_err(unscaled(ours), hf_model, LONG) > 1e-3
    back = hf_roundtrip(ours, expect_family="llama")
    assert_parity(ours, back, LONG)


def test_qwen2_yarn_legacy_rope_scaling_matches_transformers(hf_parity, hf_roundtrip, tiny_kwargs):
    """Qwen2.5 long-context configs: legacy `rope_scaling` {"type": "yarn", ...} + rope_theta."""
    legacy = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
    hf_model, ours, _ = hf_parity("qwen2", **tiny_kwargs(rope_scaling=legacy, rope_theta=500.0))
    assert ours.config.position.rope_scaling.kind == "yarn" and ours.config.bias.qkv
    assert_parity(ours, hf_model, LONG)
    assert rel_err(unscaled(ours), hf_model, LONG) > 1e-3
    back = hf_roundtrip(ours, expect_family="qwen2")
    assert_parity(ours, back, 12, LONG)


def test_yarn_default_attention_factor_scales_cos_and_sin():
    """Hand-computed: at position 0 cos = 0.1 ln(s) + 1 (Peng et al. 2023, eq. 22 as transformers
    applies it: to cos/sin, so q.k by its square)."""
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=1, attention=AttentionConfig(n_heads=2),
                      position=PositionConfig(rope_scaling=RopeScaling(
                          kind="yarn", factor=8.0, original_max_seq_len=ORIGINAL)))
    cos, sin = RotaryEmbedding(cfg, cfg.layer_spec(0)).tables(torch.zeros(1, 1, dtype=torch.long), torch.float32)
    torch.testing.assert_close(cos, torch.full_like(cos, 0.1 * math.log(8.0) + 1))
    assert sin.abs().max() == 0


# ---- LongRoPE -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fraction", [1.0, 0.5], ids=["full_rotary", "partial_rotary"])
def test_phi3_longrope_short_and_long_factors_match_transformers(hf_parity, hf_roundtrip, fraction):
    n = int(16 * fraction) // 2
    rope = {"rope_type": "longrope", "rope_theta": 500.0, "partial_rotary_factor": fraction,
            "short_factor": factors(n, 1.0, 1.5, 0), "long_factor": factors(n, 2.0, 12.0, 1)}
    hf_model, ours, _ = hf_parity("phi3", **PHI3, rope_parameters=rope)
    scaling = ours.config.position.rope_scaling
    assert scaling.kind == "longrope" and scaling.original_max_seq_len == ORIGINAL
    assert scaling.factor == 64 / ORIGINAL and scaling.attention_factor is None  # implied, as HF
    # short factors up to ORIGINAL tokens, long ones from ORIGINAL + 1 (see the next test)
    assert_parity(ours, hf_model, 5, ORIGINAL, ORIGINAL + 1, LONG)
    for seq in (ORIGINAL, LONG):  # each regime's factors change the logits
        assert rel_err(unscaled(ours), hf_model, seq) > 1e-3
    back = hf_roundtrip(ours, family="phi3")
    assert back.config.original_max_position_embeddings == ORIGINAL
    assert_parity(ours, back, ORIGINAL, LONG)


def test_longrope_picks_factors_by_call_length(hf_parity):
    """transformers' rule: per forward call, long factors iff max(position) + 1 > original (not
    by max_position_embeddings): the first 16 positions change when a 17th token joins the call."""
    rope = {"rope_type": "longrope", "rope_theta": 500.0,
            "short_factor": [1.0] * 8, "long_factor": factors(8, 2.0, 12.0, 1)}
    hf_model, ours, _ = hf_parity("phi3", **PHI3, rope_parameters=rope)
    x = ids(ORIGINAL + 1)
    with torch.no_grad():
        for model in (ours, lambda t: hf_model(input_ids=t, use_cache=False).logits):
            short, long = model(x[:, :ORIGINAL]), model(x)[:, :ORIGINAL]
            assert (short - long).abs().max() > 1e-3
    # and the short regime with unit factors is plain RoPE times the attention factor
    rope_ = ours.blocks[0].attn.position
    cos, _ = rope_.tables(torch.arange(ORIGINAL)[None], torch.float32)
    plain = torch.cos(torch.arange(ORIGINAL)[:, None] * rope_.inv_freq)
    factor = math.sqrt(1 + math.log(4.0) / math.log(ORIGINAL))
    torch.testing.assert_close(cos[0, 0, :, :8], plain * factor)


def test_phi3_128k_style_config_reads_su_as_longrope():
    """Phi-3-mini-128k style: legacy "su", top-level original_max_position_embeddings, no factor."""
    hf = {**PHI3, "model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 32,
          "num_key_value_heads": 32, "max_position_embeddings": 131072,
          "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
          "rope_scaling": {"type": "su", "short_factor": [1.0] * 48, "long_factor": [4.0] * 48}}
    scaling = FAMILIES.get("phi3").to_config(hf).position.rope_scaling
    assert scaling.kind == "longrope" and scaling.original_max_seq_len == 4096
    assert scaling.factor == 32.0 and len(scaling.long_factor) == 48


# ---- dynamic NTK --------------------------------------------------------------------------------
def test_llama_dynamic_ntk_matches_transformers(hf_parity, hf_roundtrip, tiny_kwargs):
    """transformers scales past max_position_embeddings. It caches the frequencies of the longest
    call so far and resets them only on a call shorter than the original context; archlab follows
    each call's own length. So they agree on a fresh model, on growing calls (decoding) and after
    any call shorter than the original; not on a shorter-but-still-long call after a longer one."""
    rope = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 500.0}
    hf_model, ours, _ = hf_parity("llama", **tiny_kwargs(rope_parameters=rope,
                                                         max_position_embeddings=ORIGINAL))
    assert ours.config.position.rope_scaling.original_max_seq_len == ORIGINAL
    assert_parity(ours, hf_model, 12, 40, LONG)
    assert rel_err(unscaled(ours), hf_model, LONG) > 1e-3
    assert rel_err(unscaled(ours), hf_model, 12) < TOLERANCE  # within the original: plain RoPE
    back = hf_roundtrip(ours, expect_family="llama")
    assert_parity(ours, back, LONG)


def test_dynamic_saves_original_as_max_position_embeddings(tmp_path):
    """Our max_seq_len may exceed the original context; HF's dynamic NTK reads the original from
    max_position_embeddings, so save_hf writes it there."""
    from archlab.interop import save_hf

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, d_model=64, n_layers=2, max_seq_len=256,
                      attention=AttentionConfig(n_heads=4, n_kv_heads=2), init={"std": 0.1},
                      position=PositionConfig(rope_theta=500.0, rope_scaling=RopeScaling(
                          kind="dynamic", factor=2.0, original_max_seq_len=ORIGINAL)))
    ours = TransformerLM(cfg).eval()
    save_hf(ours, tmp_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32).eval()
    assert hf_model.config.max_position_embeddings == ORIGINAL
    assert_parity(ours, hf_model, 12, LONG)


# ---- other layouts: partial rotary (GPT-NeoX), interleaved pairs (Cohere) -----------------------
OTHER = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=64, initializer_range=0.1,
             pad_token_id=None, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)


@pytest.mark.parametrize("model_type, extra, rope", [
    ("gpt_neox", {"hidden_act": "gelu"}, {**YARN, "partial_rotary_factor": 0.5}),
    ("cohere", {"num_key_value_heads": 2, "logit_scale": 0.5},
     {"rope_type": "longrope", "rope_theta": 500.0, "original_max_position_embeddings": ORIGINAL,
      "short_factor": factors(8, 1.0, 1.5, 0), "long_factor": factors(8, 2.0, 12.0, 1)}),
    ("cohere", {"num_key_value_heads": 2, "logit_scale": 0.5},
     {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 500.0}),
], ids=["neox_partial_yarn", "cohere_interleaved_longrope", "cohere_interleaved_dynamic"])
def test_scaling_in_other_rope_layouts_matches_transformers(hf_parity, hf_roundtrip, model_type,
                                                             extra, rope):
    kw = {**OTHER, **extra, "rope_parameters": rope}
    if rope["rope_type"] == "dynamic":
        kw["max_position_embeddings"] = ORIGINAL
    hf_model, ours, _ = hf_parity(model_type, **kw)
    assert ours.config.position.rope_scaling.kind == rope["rope_type"]
    # a call shorter than ORIGINAL first: it resets transformers' dynamic cache (see below)
    assert_parity(ours, hf_model, ORIGINAL - 4, LONG)
    assert rel_err(unscaled(ours), hf_model, LONG) > 1e-3
    back = hf_roundtrip(ours, expect_family=model_type)
    assert_parity(ours, back, ORIGINAL - 4, LONG)


# ---- registries, serialization, validation ------------------------------------------------------
def test_every_scaling_kind_has_frequencies_and_an_hf_reader():
    kinds = set(RopeScalingKind.__args__)
    assert kinds == set(ROPE_SCALINGS.names()) == set(ROPE_READERS.names())


def test_longrope_config_round_trips_through_yaml():
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=1, attention=AttentionConfig(n_heads=2),
                      position=PositionConfig(rope_scaling={
                          "kind": "longrope", "original_max_seq_len": 8, "factor": 4.0,
                          "short_factor": [1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5],
                          "long_factor": [2.0] * 8}))
    assert cfg.position.rope_scaling.short_factor == (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5)
    assert ModelConfig.from_yaml(cfg.to_yaml()) == cfg
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


LONGROPE = {"kind": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}


@pytest.mark.parametrize("scaling, needle", [
    ({**LONGROPE, "long_factor": [2.0] * 7}, "short_factor has 8 entries and long_factor 7"),
    ({**LONGROPE, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
     "short_factor has 4 entries; rotary dim 16"),
    ({"kind": "longrope", "long_factor": [2.0] * 8}, "short_factor is required"),
    ({**LONGROPE, "long_factor": [2.0] * 7 + [-1.0]}, "long_factor must be a non-empty list of positive"),
    ({**LONGROPE, "short_factor": "ones"}, "short_factor='ones' must be a list"),
    ({**LONGROPE, "attention_factor": 0.0}, "attention_factor=0.0 must be positive"),
    ({"kind": "yarn", "factor": 4.0, "beta_fast": 1.0, "beta_slow": 2.0}, "beta_fast=1.0 must exceed"),
    ({"kind": "yarn", "factor": 4.0, "short_factor": [1.0] * 8}, "short_factor is not read by kind 'yarn'"),
    ({"kind": "linear", "factor": 2.0, "attention_factor": 1.2}, "attention_factor is not read"),
    ({"kind": "yarn", "factor": -4.0}, "factor=-4.0 must be positive"),
    ({"kind": "dynamic", "factor": 2.0, "original_max_seq_len": 0}, "original_max_seq_len=0"),
    ({"kind": "ntk"}, "rope_scaling.kind='ntk'"),
])
def test_bad_rope_scaling_raises_config_error_naming_field(scaling, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        ModelConfig(vocab_size=32, d_model=64, n_layers=1, attention=AttentionConfig(n_heads=4),
                    position=PositionConfig(rope_scaling=scaling))


def test_dynamic_needs_rotary_dim_of_four():
    with pytest.raises(ConfigError, match="rotary dim >= 4"):
        ModelConfig(vocab_size=32, d_model=8, n_layers=1, attention=AttentionConfig(n_heads=4),
                    position=PositionConfig(rope_scaling={"kind": "dynamic", "factor": 2.0}))


@pytest.mark.parametrize("rope, needle", [
    ({"rope_type": "proportional"}, "rope type 'proportional'"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8}, "long_factor"),
])
def test_unsupported_or_incomplete_hf_rope_is_named(tiny_kwargs, rope, needle):
    hf = {"model_type": "llama", **tiny_kwargs(), "rope_parameters": {**rope, "rope_theta": 1e4}}
    with pytest.raises(ConfigError, match=needle):
        FAMILIES.get("llama").to_config(hf)


def test_phi3_cannot_save_yarn(tiny_kwargs):
    """Phi3Config refuses every rope type but longrope: save_hf(family='phi3') says so."""
    cfg = FAMILIES.get("llama").to_config(
        {"model_type": "llama", **tiny_kwargs(), "rope_parameters": {**YARN}})
    with pytest.raises(ConfigError, match="rope_scaling.kind='yarn'"):
        FAMILIES.get("phi3").from_config(cfg)
