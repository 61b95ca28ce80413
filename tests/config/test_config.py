"""ModelConfig: validation names the field and value; round trips; dotted overrides."""
import pytest

from archlab import ConfigError, ModelConfig
from archlab.config import AttentionConfig, MLPConfig, MoEConfig, PositionConfig


def test_round_trip_dict_and_yaml():
    cfg = ModelConfig(
        vocab_size=300, d_model=96, n_layers=3,
        attention=AttentionConfig(n_heads=6, n_kv_heads=2, window=8, layer_pattern="LLG",
                                  logit_softcap=50.0, qk_norm="per_head"),
        mlp=MLPConfig(activation="geglu", moe=MoEConfig(n_experts=4, top_k=2)),
        position=PositionConfig(rope_layout="interleaved", rotary_fraction=0.5,
                                rope_scaling={"kind": "llama3", "factor": 8.0}),
    )
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert ModelConfig.from_yaml(cfg.to_yaml()) == cfg


@pytest.mark.parametrize("overrides, needle", [
    ({"attention.n_heads": 5}, "n_heads=5 must divide d_model=64"),
    ({"attention.n_kv_heads": 3}, "n_kv_heads=3 must divide n_heads=4"),
    ({"position.rotary_fraction": 0.2}, "rotary dim 3"),
    ({"attention.window": 0}, "window=0"),
    ({"mlp.moe": {"n_experts": 2, "top_k": 3}}, "top_k=3"),
    ({"norm.kind": "groupnorm"}, "norm.kind='groupnorm'"),
    ({"mlp.activation": "tanh"}, "mlp.activation='tanh'"),
    ({"position.kind": "xpos"}, "position.kind='xpos'"),
    ({"d_model": 0}, "d_model=0"),
    ({"n_layers": -1}, "n_layers=-1"),
    ({"attention.logit_softcap": 0.0}, "logit_softcap=0.0"),
    ({"final_logit_softcap": -1.0}, "final_logit_softcap=-1.0"),
    ({"attention.layer_pattern": "LG"}, "attention.window is None"),
    ({"attention.layer_pattern": "LXG", "attention.window": 4}, "layer_pattern='LXG'"),
    ({"block.parallel": True, "norm.position": "post"}, "block.parallel"),
    ({"attention.nheads": 2}, "unknown config key 'attention.nheads'"),
])
def test_impossible_configs_raise_config_error_naming_field(overrides, needle):
    base = ModelConfig(vocab_size=100, d_model=64, n_layers=2, attention=AttentionConfig(n_heads=4))
    with pytest.raises(ConfigError) as err:
        base.with_overrides(overrides)
    assert needle in str(err.value)


def test_overrides_parse_command_line_strings():
    base = ModelConfig(vocab_size=100, d_model=64, n_layers=2, attention=AttentionConfig(n_heads=4))
    cfg = base.with_overrides({
        "attention.n_kv_heads": "1", "z_loss": "1e-4", "tie_embeddings": "true",
        "attention.logit_softcap": "none", "norm.kind": "layernorm", "attention.window": "16",
    })
    assert cfg.n_kv_heads == 1 and cfg.z_loss == 1e-4 and cfg.tie_embeddings
    assert cfg.attention.logit_softcap is None and cfg.norm.kind == "layernorm"
    assert cfg.is_local(0) and cfg.is_local(1)  # a window without a pattern: all layers local


def test_llama_style_d_ff_rounding():
    # LLaMA-7B: int(8/3 * 4096) = 10922, rounded up to a multiple of 256 -> 11008
    mlp = MLPConfig(activation="swiglu", d_ff_ratio=8 / 3, multiple_of=256)
    assert mlp.width(4096) == 11008


def test_layer_pattern_repeats_over_depth():
    cfg = ModelConfig(d_model=64, n_layers=8,
                      attention=AttentionConfig(n_heads=4, window=4, layer_pattern="LLLG"),
                      position=PositionConfig(global_kind="none"))
    assert [cfg.is_local(i) for i in range(8)] == [True, True, True, False] * 2
    assert [cfg.position_kind(i) for i in range(4)] == ["rope", "rope", "rope", "none"]


def test_layer_spec_resolves_every_per_layer_decision_once():
    from archlab.models import presets

    gemma3 = presets.get("gemma3-27b")
    local, glob = gemma3.layer_spec(0), gemma3.layer_spec(5)          # pattern LLLLLG
    assert (local.local, local.window, local.rope_theta, local.rope_scaling) == (True, 1024, 10_000.0, None)
    assert (glob.local, glob.window, glob.rope_theta) == (False, None, 1_000_000.0)
    assert glob.rope_scaling is not None and glob.rope_scaling.factor == 8.0     # global layers scaled
    assert local.attn_scale == glob.attn_scale == 168 ** -0.5                    # query_pre_attn_scalar
    cmd = presets.get("command-a")
    assert [cmd.layer_spec(i).position_kind for i in range(4)] == ["rope", "rope", "rope", "none"]
    gpt2 = ModelConfig().with_overrides({"attention.scale_by_inverse_layer": True, "n_layers": 3})
    scales = [gpt2.layer_spec(i).attn_scale * gpt2.head_dim ** 0.5 for i in range(3)]
    assert scales == pytest.approx([1, 1 / 2, 1 / 3])                           # GPT-2: / (layer + 1)
    assert ModelConfig().layer_spec(0).causal and not ModelConfig().layer_spec(0, "encoder").causal
    with pytest.raises(ConfigError, match="outside"):
        ModelConfig().layer_spec(99)
    with pytest.raises(ConfigError, match="stack role"):
        ModelConfig().layer_spec(0, "sideways")


def test_t5_init_rejects_gpt2s_residual_scaling_and_unknown_kinds():
    with pytest.raises(ConfigError, match="init.scaled_residual is GPT-2's rule"):
        ModelConfig().with_overrides({"init.kind": "t5", "init.scaled_residual": True})
    with pytest.raises(ConfigError, match="init.kind"):
        ModelConfig().with_overrides({"init.kind": "xavier"})
