"""BLOOM (BigScience 2022): ALiBi (Press et al. 2021) instead of positions, a LayerNorm right after
the token embedding (`word_embeddings_layernorm`), per-head fused qkv [q_i, k_i, v_i], biases
everywhere, tanh-approximated GeLU, MLP width 4d, tied head.

HF adds slope_h * key_position to the logits; archlab's ALiBi adds -slope_h * (q - k). They differ
by slope_h * q, constant along each softmax row, so the attention probabilities are identical.

Not supported: `apply_residual_connection_post_layernorm=True`, where each sublayer computes
n(x) + f(n(x)) (the residual taken after the LayerNorm). No archlab norm.position computes that:
post-norm is n(x + f(x)), and re-reading it as a shifted post-norm would need an extra norm
before the first layer and weights moved between layers.
"""
from __future__ import annotations

from archlab.config import AttentionConfig, BiasConfig, MLPConfig, ModelConfig, NormConfig, PositionConfig
from archlab.interop.families.base import Family, HFConfig, register_family
from archlab.interop.families.gpt_neox import neox_table, require_plain_transformer
from archlab.interop.families.tables import Rule


@register_family
class BloomFamily(Family):
    model_type = "bloom"
    architecture = "BloomForCausalLM"
    ties_by_default = True
    base_prefix = "transformer."

    def to_config(self, hf: dict) -> ModelConfig:
        c = HFConfig(hf, self.model_type)
        c.unsupported("apply_residual_connection_post_layernorm",
                      why="the residual taken after the LayerNorm, n(x) + f(n(x)), "
                          "is no archlab norm.position")
        d = c.get("hidden_size") or c.require("n_embed")
        return self.model_config(
            c,
            d_model=d,
            n_layers=c.get("n_layer") or c.require("num_hidden_layers"),
            max_seq_len=c.get("seq_length", 2048),
            attention=AttentionConfig(n_heads=c.get("n_head") or c.require("num_attention_heads"),
                                      dropout=float(c.get("attention_dropout", 0.0))),
            mlp=MLPConfig(activation="gelu_tanh", d_ff=4 * d),
            norm=NormConfig(kind="layernorm", eps=c.get("layer_norm_epsilon", 1e-5), position="pre",
                            embedding_norm=True),
            position=PositionConfig(kind="alibi"),
            bias=BiasConfig(qkv=True, attn_out=True, mlp=True, norm=True),
        )

    def from_config(self, cfg: ModelConfig) -> dict:
        require_plain_transformer(self, cfg)
        self.require(cfg, "attention.n_kv_heads", [None, cfg.attention.n_heads])
        hf = self.base_hf(cfg)
        hf.update(hidden_size=cfg.d_model, n_head=cfg.attention.n_heads, n_layer=cfg.n_layers,
                  layer_norm_epsilon=cfg.norm.eps, apply_residual_connection_post_layernorm=False,
                  attention_dropout=cfg.attention.dropout, hidden_dropout=0.0,
                  pretraining_tp=1, slow_but_exact=False, seq_length=cfg.max_seq_len)
        return hf

    def weight_table(self, cfg: ModelConfig) -> list[Rule]:
        return neox_table(cfg, "transformer.h.{i}.", "self_attention.", {
            "transformer.word_embeddings": "embed", "transformer.word_embeddings_layernorm": "embed_norm",
            "transformer.ln_f": "final_norm", "lm_head": "lm_head"})
