"""OPT (Zhang et al. 2022): learned absolute positions stored shifted by 2 rows, LayerNorm pre-norm
(`do_layer_norm_before`, all sizes but 350m) or post-norm, ReLU MLP, biases (`enable_bias`), final
LayerNorm in pre-norm models, tied head. HF computes positions from the attention mask; archlab
takes them as the `positions` argument (0..t-1 by default, -1 for padding), the same rows for
unpadded or left-padded input.

Not supported: `word_embed_proj_dim != hidden_size` (opt-350m's project_in/project_out).
"""
from __future__ import annotations

from archlab.config import AttentionConfig, BiasConfig, MLPConfig, ModelConfig, NormConfig, PositionConfig
from archlab.interop.families.base import Family, HFConfig, register_family
from archlab.interop.families.gpt_neox import (
    PLAIN_ACT_BACK,
    plain_activation,
    require_plain_transformer,
)
from archlab.interop.families.tables import Rule, attention, layers, renames

OFFSET = 2   # OPTLearnedPositionalEmbedding.offset


@register_family
class OPTFamily(Family):
    ties_by_default = True
    model_type = "opt"
    architecture = "OPTForCausalLM"

    def to_config(self, hf: dict) -> ModelConfig:
        c = HFConfig(hf, self.model_type)
        d = c.require("hidden_size")
        c.unsupported("word_embed_proj_dim", lambda v: v != d,
                      f"project_in/project_out between the embedding and hidden_size={d}")
        pre = bool(c.get("do_layer_norm_before", True))
        affine = bool(c.get("layer_norm_elementwise_affine", True))
        bias = bool(c.get("enable_bias", True))
        return self.model_config(
            c,
            attention=AttentionConfig(n_heads=c.require("num_attention_heads"),
                                      dropout=float(c.get("attention_dropout", 0.0))),
            mlp=MLPConfig(activation=plain_activation(c, "activation_function", "relu"),
                          d_ff=c.require("ffn_dim")),
            norm=NormConfig(kind="layernorm" if affine else "nonparametric", eps=1e-5,
                            position="pre" if pre else "post",
                            final_norm=pre and not c.get("_remove_final_layer_norm", False)),
            position=PositionConfig(kind="learned", learned_offset=OFFSET),
            bias=BiasConfig(qkv=bias, attn_out=bias, mlp=bias, norm=affine),
            block={"residual_dropout": float(c.get("dropout", 0.0))},
            init={"std": c.get("init_std", 0.02)},
        )

    def from_config(self, cfg: ModelConfig) -> dict:
        require_plain_transformer(self, cfg)
        self.require(cfg, "attention.n_kv_heads", [None, cfg.attention.n_heads])
        self.require(cfg, "mlp.activation", list(PLAIN_ACT_BACK))
        self.require(cfg, "norm.position", ["pre", "post"])
        hf = self.base_hf(cfg)
        pre = cfg.norm.position == "pre"
        hf.update(
            hidden_size=cfg.d_model, word_embed_proj_dim=cfg.d_model,
            num_attention_heads=cfg.attention.n_heads, num_hidden_layers=cfg.n_layers,
            ffn_dim=cfg.d_ff, max_position_embeddings=cfg.max_seq_len,
            activation_function=PLAIN_ACT_BACK[cfg.mlp.activation], do_layer_norm_before=pre,
            _remove_final_layer_norm=pre and not cfg.norm.final_norm, enable_bias=cfg.bias.qkv,
            layer_norm_elementwise_affine=cfg.norm.kind != "nonparametric",
            dropout=cfg.block.residual_dropout, attention_dropout=cfg.attention.dropout,
            init_std=cfg.init.std, layerdrop=0.0,
        )
        return hf

    def weight_table(self, cfg: ModelConfig) -> list[Rule]:
        layer = {**attention("self_attn.", "q_proj k_proj v_proj out_proj"), "self_attn_layer_norm": "attn_norm",
                 "fc1": "mlp.up_proj", "fc2": "mlp.down_proj", "final_layer_norm": "mlp_norm"}
        return renames({"model.decoder.embed_tokens": "embed", "model.decoder.final_layer_norm": "final_norm",
                        "model.decoder.embed_positions": "abs_position.embedding", "lm_head": "lm_head",
                        **layers(layer, "model.decoder.layers.{i}.")}, "weight", "bias")
