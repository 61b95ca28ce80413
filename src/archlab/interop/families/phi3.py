"""Phi-3 / Phi-4-mini (Microsoft 2024): LLaMA-like (RMSNorm pre-norm, SwiGLU, no biases) with a
fused `qkv_proj` [q; k; v] and a fused `gate_up_proj` [gate; up], optional partial rotary
(`partial_rotary_factor`) and a sliding window on every layer (`sliding_window`).
RoPE: default or LongRoPE (the 128k variants; transformers' Phi3Config renames "su" and "yarn"
to "longrope" and gives the top-level `original_max_position_embeddings`, default 4096, priority).
Short vs long factors: transformers picks per forward call, long when max(position_ids) + 1 >
original_max_position_embeddings (not by max_position_embeddings); archlab's RotaryEmbedding
does the same. Other rope types are refused, as Phi3Config refuses them."""
from __future__ import annotations

from archlab.config import AttentionConfig, MLPConfig, ModelConfig, NormConfig, PositionConfig
from archlab.interop.families.base import Family, HFConfig, register_family
from archlab.interop.families.gpt_neox import require_plain_transformer
from archlab.interop.families.llama import GATED_ACT_BACK, gated_activation
from archlab.interop.families.rope import partial_rotary, read_rope, write_partial_rope
from archlab.interop.families.tables import PRE_NORMS, QKV, Rule, fused, layers, renames

LONGROPE_ALIASES = {"su": "longrope", "yarn": "longrope"}  # as Phi3Config renames them


@register_family
class Phi3Family(Family):
    model_type = "phi3"
    architecture = "Phi3ForCausalLM"
    positions_default = 4096
    save_priority = 60

    def to_config(self, hf: dict) -> ModelConfig:
        # Phi3Config: a top-level original_max_position_embeddings (default 4096) wins
        c = HFConfig({"original_max_position_embeddings": 4096, **hf}, self.model_type)
        theta, scaling = read_rope(c, aliases=LONGROPE_ALIASES, kinds=("default", "longrope"))
        return self.model_config(
            c,
            attention=AttentionConfig(**c.heads(), window=c.get("sliding_window"),
                                      dropout=float(c.get("attention_dropout", 0.0))),
            mlp=MLPConfig(activation=gated_activation(c), d_ff=c.require("intermediate_size")),
            norm=NormConfig(kind="rmsnorm", eps=c.get("rms_norm_eps", 1e-5), position="pre"),
            position=PositionConfig(kind="rope", rope_theta=theta, rope_scaling=scaling,
                                    rotary_fraction=partial_rotary(c, "partial_rotary_factor", 1.0)),
        )

    def from_config(self, cfg: ModelConfig) -> dict:
        require_plain_transformer(self, cfg)
        self.require(cfg, "mlp.activation", list(GATED_ACT_BACK))
        self.require(cfg, "attention.layer_pattern", [None, "L"])
        self.require(cfg, "position.kind", "rope")
        self.require(cfg, "position.rope_scaling.kind", [None, "longrope"])
        scaling = cfg.position.rope_scaling
        hf = self.base_hf(cfg)
        rope = write_partial_rope(cfg)
        hf.update(
            **self.sizes_hf(cfg), hidden_act=GATED_ACT_BACK[cfg.mlp.activation],
            rms_norm_eps=cfg.norm.eps,
            original_max_position_embeddings=(scaling.original_max_seq_len if scaling
                                              else cfg.max_seq_len),
            sliding_window=cfg.attention.window,
            partial_rotary_factor=cfg.position.rotary_fraction, pad_token_id=None,
            attention_dropout=cfg.attention.dropout, resid_pdrop=0.0, embd_pdrop=0.0, **rope,
        )
        return hf

    def weight_table(self, cfg: ModelConfig) -> list[Rule]:
        q, kv = cfg.attention.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        layer = {"self_attn.o_proj": "attn.o_proj", "mlp.down_proj": "mlp.down_proj", **PRE_NORMS}
        return [fused([f"{o}.weight" for o in QKV], "model.layers.{i}.self_attn.qkv_proj.weight", [q, kv, kv]),
                fused(["blocks.{i}.mlp.gate_proj.weight", "blocks.{i}.mlp.up_proj.weight"],
                      "model.layers.{i}.mlp.gate_up_proj.weight", [cfg.d_ff, cfg.d_ff]),
                *renames({"model.embed_tokens": "embed", "model.norm": "final_norm", "lm_head": "lm_head",
                          **layers(layer, "model.layers.{i}.")}, "weight")]
