"""Phi-1/1.5/2 (Microsoft 2023): parallel block with one shared LayerNorm, partial rotate-half RoPE
(`partial_rotary_factor`, 0.4 in phi-2), biases on every linear layer and on the LM head,
gelu_new. `qk_layernorm` (no released Phi checkpoint sets it) is a LayerNorm with bias over each
head's dims, one weight shared by all heads, before RoPE: attention.qk_norm='per_head' with
bias.qk_norm."""
from __future__ import annotations

from archlab.config import AttentionConfig, BiasConfig, BlockConfig, MLPConfig, ModelConfig, NormConfig, PositionConfig
from archlab.interop.families.base import Family, HFConfig, register_family
from archlab.interop.families.gpt_neox import PLAIN_ACT_BACK, plain_activation, require_plain_transformer
from archlab.interop.families.rope import partial_rotary, read_rope, write_partial_rope
from archlab.interop.families.tables import Rule, attention, layers, renames


@register_family
class PhiFamily(Family):
    model_type = "phi"
    architecture = "PhiForCausalLM"

    def to_config(self, hf: dict) -> ModelConfig:
        c = HFConfig(hf, self.model_type)
        qk_norm = bool(c.get("qk_layernorm", False))
        n_heads = c.require("num_attention_heads")
        theta, scaling = read_rope(c)
        return self.model_config(
            c,
            attention=AttentionConfig(n_heads=n_heads, n_kv_heads=c.get("num_key_value_heads", n_heads),
                                      qk_norm="per_head" if qk_norm else "none",
                                      dropout=float(c.get("attention_dropout", 0.0))),
            mlp=MLPConfig(activation=plain_activation(c, "hidden_act", "gelu_new"),
                          d_ff=c.require("intermediate_size")),
            norm=NormConfig(kind="layernorm", eps=c.get("layer_norm_eps", 1e-5), position="pre"),
            block=BlockConfig(parallel=True, parallel_norms=1),
            position=PositionConfig(kind="rope", rope_theta=theta, rope_scaling=scaling,
                                    rotary_fraction=partial_rotary(c, "partial_rotary_factor", 0.5)),
            bias=BiasConfig(qkv=True, attn_out=True, mlp=True, norm=True, head=True, qk_norm=qk_norm),
        )

    def from_config(self, cfg: ModelConfig) -> dict:
        require_plain_transformer(self, cfg)
        self.require(cfg, "mlp.activation", list(PLAIN_ACT_BACK))
        self.require(cfg, "position.kind", "rope")
        self.require(cfg, "attention.head_dim", [None, cfg.d_model // cfg.attention.n_heads])
        self.require(cfg, "attention.qk_norm", ["none", "per_head"])
        qk_norm = cfg.attention.qk_norm == "per_head"
        self.require(cfg, "bias.qk_norm", qk_norm)   # HF's qk_layernorm always has a bias
        hf = self.base_hf(cfg)
        rope = write_partial_rope(cfg)
        hf.update(
            hidden_size=cfg.d_model, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.attention.n_heads, num_key_value_heads=cfg.n_kv_heads,
            hidden_act=PLAIN_ACT_BACK[cfg.mlp.activation], layer_norm_eps=cfg.norm.eps,
            max_position_embeddings=cfg.max_seq_len, partial_rotary_factor=cfg.position.rotary_fraction,
            qk_layernorm=qk_norm, attention_dropout=cfg.attention.dropout, resid_pdrop=0.0,
            embd_pdrop=0.0, **rope,
        )
        return hf

    def weight_table(self, cfg: ModelConfig) -> list[Rule]:
        layer = {**attention("self_attn.", "q_proj k_proj v_proj dense"), "input_layernorm": "attn_norm",
                 "self_attn.q_layernorm": "attn.q_norm", "self_attn.k_layernorm": "attn.k_norm",
                 "mlp.fc1": "mlp.up_proj", "mlp.fc2": "mlp.down_proj"}
        return renames(                    # lm_head's bias is the head bias (the model's lm_head.bias)
            {"model.embed_tokens": "embed", "model.final_layernorm": "final_norm", "lm_head": "lm_head",
             **layers(layer, "model.layers.{i}.")}, "weight", "bias")
