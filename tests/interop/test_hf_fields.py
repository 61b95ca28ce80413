"""HF config switches that map onto archlab fields: phi `qk_layernorm`, ministral / mistral / mixtral
`layer_types`, gpt2 `scale_attn_weights` / `scale_attn_by_inverse_layer_idx` /
`reorder_and_upcast_attn`. Each: logits equal transformers' (fp32) and save_hf round trips; the
switches that stay refused name the field."""
import pytest
import torch

from archlab.config import ConfigError, ModelConfig
from archlab.interop.families import FAMILIES

pytest.importorskip("transformers")

PHI = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
           initializer_range=0.1, pad_token_id=None, bos_token_id=0, eos_token_id=0,
           tie_word_embeddings=False,
           rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5})
GPT2 = dict(vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=64, initializer_range=0.1,
            bos_token_id=0, eos_token_id=0)


# ---- phi qk_layernorm ---------------------------------------------------------------------------
def test_phi_qk_layernorm_matches_transformers(hf_parity, hf_roundtrip):
    hf_model, ours, _ = hf_parity("phi", **PHI, qk_layernorm=True)
    cfg = ours.config
    assert cfg.attention.qk_norm == "per_head" and cfg.bias.qk_norm
    attn = ours.blocks[0].attn
    assert attn.q_norm.weight.shape == attn.q_norm.bias.shape == (cfg.head_dim,)
    # the norm's bias was loaded (randomize_norms makes HF's non-zero)
    theirs = hf_model.model.layers[0].self_attn.k_layernorm.bias
    assert torch.equal(attn.k_norm.bias, theirs) and theirs.abs().sum() > 0
    from archlab.models.accounting import param_count
    assert param_count(cfg) == ours.num_params() == sum(p.numel() for p in hf_model.parameters())
    back = hf_roundtrip(ours, expect_family="phi")
    assert back.config.qk_layernorm is True


def test_phi_qk_norm_without_bias_cannot_be_saved_as_phi(tmp_path):
    from archlab.interop import save_hf
    from archlab.models.decoder import TransformerLM

    cfg = FAMILIES.get("phi").to_config({**PHI, "model_type": "phi", "qk_layernorm": True})
    cfg = cfg.with_overrides({"bias.qk_norm": False})
    with pytest.raises(ConfigError, match="bias.qk_norm"):
        save_hf(TransformerLM(cfg), tmp_path, family="phi")


def test_qk_norm_bias_needs_a_layernorm_qk_norm():
    with pytest.raises(ConfigError, match="bias.qk_norm"):
        ModelConfig(norm={"kind": "rmsnorm"}, attention={"qk_norm": "per_head"},
                    bias={"qk_norm": True})
    with pytest.raises(ConfigError, match="bias.qk_norm"):
        ModelConfig(norm={"kind": "layernorm"}, bias={"qk_norm": True})
    with pytest.raises(ConfigError, match="bias.qk_norm"):
        ModelConfig(norm={"kind": "layernorm"}, attention={"qk_norm": "per_head_untied"},
                    bias={"qk_norm": True})


# ---- layer_types: ministral honours it, mistral / mixtral only when it agrees --------------------
def test_ministral_layer_types_match_transformers(hf_parity, hf_roundtrip, tiny_kwargs):
    types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    _, ours, _ = hf_parity("ministral", **tiny_kwargs(head_dim=16, num_hidden_layers=4,
                                                      sliding_window=5, layer_types=types))
    cfg = ours.config
    assert cfg.attention.window == 5
    assert "".join("L" if cfg.is_local(i) else "G" for i in range(4)) == "LGLL"
    back = hf_roundtrip(ours, expect_family="ministral")
    assert back.config.layer_types == types


def test_ministral_window_matters(hf_parity, tiny_kwargs):
    """The parity above would hold vacuously if the window never bit: SEQ tokens > window, so
    making every layer global changes the logits."""
    from archlab.models.decoder import TransformerLM

    types = ["sliding_attention", "full_attention"]
    _, ours, _ = hf_parity("ministral", **tiny_kwargs(head_dim=16, sliding_window=5, layer_types=types))
    global_cfg = ours.config.with_overrides({"attention.window": None, "attention.layer_pattern": None})
    plain = TransformerLM(global_cfg).eval()
    plain.load_state_dict(ours.state_dict())
    ids = torch.arange(24)[None] % ours.config.vocab_size
    with torch.no_grad():
        assert not torch.allclose(ours(ids), plain(ids), atol=1e-4)


@pytest.mark.parametrize("model_type", ["mistral", "mixtral"])
def test_mistral_layer_types_that_agree_are_read(hf_parity, hf_roundtrip, tiny_kwargs, model_type):
    """transformers' Mistral/Mixtral window every layer whatever layer_types says."""
    extra = dict(num_local_experts=4, num_experts_per_tok=2) if model_type == "mixtral" else {}
    _, ours, _ = hf_parity(model_type, **tiny_kwargs(sliding_window=5, **extra,
                                                     layer_types=["sliding_attention"] * 2))
    assert ours.config.attention.window == 5 and all(ours.config.is_local(i) for i in range(2))
    hf_roundtrip(ours, expect_family=model_type)


@pytest.mark.parametrize("model_type", ["mistral", "mixtral"])
def test_mistral_mixed_layer_types_are_refused(model_type, tiny_kwargs):
    hf = {**tiny_kwargs(sliding_window=5, layer_types=["sliding_attention", "full_attention"]),
          "model_type": model_type, "num_local_experts": 4}
    with pytest.raises(ConfigError, match="layer_types.*ministral"):
        FAMILIES.get(model_type).to_config(hf)


@pytest.mark.parametrize("model_type,head_dim", [("mistral", None), ("mixtral", None), ("ministral", 16)])
def test_absent_sliding_window_takes_the_hf_config_default(model_type, head_dim, tiny_kwargs):
    """config.json without `sliding_window`: transformers' config class fills in its default
    (Mistral, Ministral 4096; Mixtral none), and so do we."""
    import transformers
    hf = {**tiny_kwargs(), "model_type": model_type, "num_local_experts": 4}
    hf.pop("sliding_window", None)
    classes = {"mistral": "MistralConfig", "mixtral": "MixtralConfig", "ministral": "MinistralConfig"}
    extra = {"head_dim": head_dim} if head_dim else {}
    expected = getattr(transformers, classes[model_type])(**extra).sliding_window
    cfg = FAMILIES.get(model_type).to_config(hf)
    windows = {cfg.attention.window if cfg.is_local(i) else None for i in range(cfg.n_layers)}
    assert windows == {expected}


def test_interleaved_window_config_saves_as_ministral(hf_roundtrip):
    from archlab.models.decoder import TransformerLM

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, d_model=64, n_layers=3, max_seq_len=64,
                      attention={"n_heads": 4, "n_kv_heads": 2, "window": 6, "layer_pattern": "GL"},
                      mlp={"activation": "swiglu", "d_ff": 96})
    hf_roundtrip(TransformerLM(cfg).eval(), expect_family="ministral")


# ---- gpt2 attention scale -----------------------------------------------------------------------
@pytest.mark.parametrize("scaled, by_layer", [(True, True), (False, False), (False, True)],
                         ids=["inverse_layer", "unscaled", "unscaled_inverse_layer"])
def test_gpt2_attention_scale_matches_transformers(hf_parity, hf_roundtrip, scaled, by_layer):
    """(scaled, not by layer) is the default: tests/interop/test_parity_gpt2.py."""
    _, ours, _ = hf_parity("gpt2", **GPT2, scale_attn_weights=scaled,
                           scale_attn_by_inverse_layer_idx=by_layer)
    e = ours.config.head_dim
    for i, block in enumerate(ours.blocks):
        expected = (e ** -0.5 if scaled else 1.0) / (i + 1 if by_layer else 1)
        assert block.attn.scale == pytest.approx(expected)
    back = hf_roundtrip(ours, expect_family="gpt2")
    assert back.config.scale_attn_weights is scaled
    assert back.config.scale_attn_by_inverse_layer_idx is by_layer


def test_gpt2_reorder_and_upcast_attn_is_a_no_op_in_fp32(hf_parity):
    hf_model, ours, _ = hf_parity("gpt2", **GPT2, reorder_and_upcast_attn=True,
                                  scale_attn_by_inverse_layer_idx=True)
    assert hf_model.config._attn_implementation == "eager"  # the path that reorders
    assert ours.config.attention.scale_by_inverse_layer


def test_inverse_layer_scale_cannot_be_saved_where_hf_has_no_such_switch(tmp_path):
    from archlab.interop import save_hf
    from archlab.models.decoder import TransformerLM

    cfg = ModelConfig(vocab_size=128, d_model=64, n_layers=2, max_seq_len=64,
                      attention={"n_heads": 4, "scale_by_inverse_layer": True},
                      mlp={"activation": "swiglu", "d_ff": 96})
    with pytest.raises(ConfigError, match="scale_by_inverse_layer"):
        save_hf(TransformerLM(cfg), tmp_path, family="llama")


# ---- still refused ------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type, field", [
    ("bloom", "apply_residual_connection_post_layernorm"),
    ("cohere2", "use_qk_norm"),
    ("gpt2", "add_cross_attention"),
])
def test_refused_switches_name_the_field(model_type, field):
    hf = dict(vocab_size=128, hidden_size=64, n_embd=64, n_layer=2, n_head=4,
              num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, sliding_window=4)
    with pytest.raises(ConfigError, match=field):
        FAMILIES.get(model_type).to_config({**hf, field: True})
