"""Nemotron-4 / Minitron (NVIDIA 2024): LayerNorm1p (weight stored as w - 1, applied as 1 + w, with
bias; eps `norm_eps`), serial pre-norm, non-gated squared-ReLU MLP (So et al. 2021, Primer) with
`up_proj`/`down_proj`, partial rotate-half RoPE (`partial_rotary_factor`, 0.5), optional
`attention_bias` / `mlp_bias`, untied head."""
from __future__ import annotations

from archlab.config import AttentionConfig, BiasConfig, MLPConfig, ModelConfig, NormConfig, PositionConfig
from archlab.interop.families.base import Family, HFConfig, register_family
from archlab.interop.families.gpt_neox import PLAIN_ACT_BACK, plain_activation, require_plain_transformer
from archlab.interop.families.rope import partial_rotary, read_rope, write_partial_rope
from archlab.interop.families.tables import PRE_NORMS, Rule, attention, layers, renames


@register_family
class NemotronFamily(Family):
    model_type = "nemotron"
    architecture = "NemotronForCausalLM"
    positions_default = 4096

    def to_config(self, hf: dict) -> ModelConfig:
        c = HFConfig(hf, self.model_type)
        theta, scaling = read_rope(c)
        attn_bias = bool(c.get("attention_bias", False))
        return self.model_config(
            c,
            attention=AttentionConfig(**c.heads(), dropout=float(c.get("attention_dropout", 0.0))),
            mlp=MLPConfig(activation=plain_activation(c, "hidden_act", "relu2"),
                          d_ff=c.require("intermediate_size")),
            norm=NormConfig(kind="layernorm_1p", eps=c.get("norm_eps", 1e-5), position="pre"),
            position=PositionConfig(kind="rope", rope_theta=theta, rope_scaling=scaling,
                                    rotary_fraction=partial_rotary(c, "partial_rotary_factor", 0.5)),
            bias=BiasConfig(qkv=attn_bias, attn_out=attn_bias, mlp=bool(c.get("mlp_bias", False)),
                            norm=True),
            init={"std": c.get("initializer_range", 0.0134)},
        )

    def from_config(self, cfg: ModelConfig) -> dict:
        require_plain_transformer(self, cfg)
        self.require(cfg, "mlp.activation", list(PLAIN_ACT_BACK))
        self.require(cfg, "position.kind", "rope")
        hf = self.base_hf(cfg)
        rope = write_partial_rope(cfg)
        hf.update(
            **self.sizes_hf(cfg), hidden_act=PLAIN_ACT_BACK[cfg.mlp.activation],
            norm_eps=cfg.norm.eps,
            attention_bias=cfg.bias.qkv, mlp_bias=cfg.bias.mlp,
            partial_rotary_factor=cfg.position.rotary_fraction,
            attention_dropout=cfg.attention.dropout, **rope,
        )
        return hf

    def weight_table(self, cfg: ModelConfig) -> list[Rule]:
        layer = {**attention("self_attn."), "mlp.up_proj": "mlp.up_proj", "mlp.down_proj": "mlp.down_proj",
                 **PRE_NORMS}
        return renames({"model.embed_tokens": "embed", "model.norm": "final_norm", "lm_head": "lm_head",
                        **layers(layer, "model.layers.{i}.")}, "weight", "bias")
