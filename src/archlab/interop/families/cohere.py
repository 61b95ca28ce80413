"""Cohere Command R / R+ (`cohere`) and Command R7B / Command A (`cohere2`): parallel block with one
shared LayerNorm without bias, interleaved RoPE, SwiGLU, tied head, logits * `logit_scale`.

  cohere   `use_qk_norm` (Command R+): LayerNorm over each head's dims with a separate weight per
           head, weight (heads, head_dim) -> attention.qk_norm="per_head_untied".
  cohere2  sliding window on 3 of every 4 layers (`sliding_window_pattern`, or `layer_types`);
           RoPE only on the sliding layers, no position signal on the global ones (NoPE).
           Not supported: `use_qk_norm=True`; transformers' Cohere2Config has no such field and
           its model no q/k norm, so a checkpoint that sets it has no defined meaning there.
"""
from __future__ import annotations

from archlab.config import AttentionConfig, BiasConfig, BlockConfig, MLPConfig, ModelConfig, NormConfig, PositionConfig
from archlab.interop.families.base import Family, HFConfig, register_family
from archlab.interop.families.gpt_neox import require_plain_transformer
from archlab.interop.families.llama import (
    GATED_ACT_BACK,
    LLAMA_LAYER,
    gated_activation,
    layer_types,
    pattern_from_types,
)
from archlab.interop.families.rope import read_rope, write_rope
from archlab.interop.families.tables import Rule, layers, renames


@register_family
class CohereFamily(Family):
    model_type = "cohere"
    architecture = "CohereForCausalLM"
    ties_by_default = True
    positions_default = 8192

    def to_config(self, hf: dict) -> ModelConfig:
        c = HFConfig(hf, self.model_type)
        d, n_heads = c.require("hidden_size"), c.require("num_attention_heads")
        theta, scaling = read_rope(c)
        attn_bias = bool(c.get("attention_bias", False))
        window, pattern, global_kind = self.read_window(c)
        return self.model_config(
            c,
            attention=AttentionConfig(
                n_heads=n_heads, n_kv_heads=c.get("num_key_value_heads", n_heads),
                head_dim=self.read_head_dim(c, d // n_heads), window=window, layer_pattern=pattern,
                qk_norm="per_head_untied" if c.get("use_qk_norm", False) else "none",
                dropout=float(c.get("attention_dropout", 0.0))),
            mlp=MLPConfig(activation=gated_activation(c), d_ff=c.require("intermediate_size")),
            norm=NormConfig(kind="layernorm", eps=c.get("layer_norm_eps", 1e-5), position="pre"),
            block=BlockConfig(parallel=True, parallel_norms=1),
            position=PositionConfig(kind="rope", rope_theta=theta, rope_scaling=scaling,
                                    rope_layout="interleaved", global_kind=global_kind),
            bias=BiasConfig(qkv=attn_bias, attn_out=attn_bias),
            logit_scale=c.get("logit_scale"),
        )

    def read_head_dim(self, c: HFConfig, default: int) -> int:
        return c.get("head_dim", default)

    def read_window(self, c: HFConfig) -> tuple[int | None, str | None, str | None]:
        return None, None, None

    def from_config(self, cfg: ModelConfig) -> dict:
        require_plain_transformer(self, cfg)
        self.require(cfg, "mlp.activation", list(GATED_ACT_BACK))
        if cfg.bias.qkv != cfg.bias.attn_out:
            self.require(cfg, "bias.attn_out", cfg.bias.qkv)   # one attention_bias for q, k, v, o
        hf = self.base_hf(cfg)
        hf.update(
            hidden_size=cfg.d_model, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.attention.n_heads, num_key_value_heads=cfg.n_kv_heads,
            hidden_act=GATED_ACT_BACK[cfg.mlp.activation], layer_norm_eps=cfg.norm.eps,
            max_position_embeddings=cfg.max_seq_len, attention_bias=cfg.bias.qkv,
            logit_scale=cfg.logit_scale, attention_dropout=cfg.attention.dropout,
            pad_token_id=None, **write_rope(cfg.position.rope_theta, cfg.position.rope_scaling),
        )
        hf.update(self.write_extra(cfg))
        return hf

    def write_extra(self, cfg: ModelConfig) -> dict:
        self.require(cfg, "attention.window", None)
        return {"use_qk_norm": cfg.attention.qk_norm == "per_head_untied", "head_dim": cfg.head_dim}

    def weight_table(self, cfg: ModelConfig) -> list[Rule]:
        layer = {**LLAMA_LAYER, "input_layernorm": "attn_norm"}   # no post_attention_layernorm: one norm
        return renames({"model.embed_tokens": "embed", "model.norm": "final_norm", "lm_head": "lm_head",
                        **layers(layer, "model.layers.{i}.")}, "weight", "bias")


@register_family
class Cohere2Family(CohereFamily):
    model_type = "cohere2"
    architecture = "Cohere2ForCausalLM"

    def read_head_dim(self, c: HFConfig, default: int) -> int:
        return default   # Cohere2Config always sets head_dim = hidden_size // num_attention_heads

    def read_window(self, c: HFConfig) -> tuple[int | None, str | None, str | None]:
        c.unsupported("use_qk_norm", why="transformers' Cohere2 model has no QK-norm")
        n = c.require("num_hidden_layers")
        types = c.get("layer_types") or [
            "sliding_attention" if (i + 1) % c.get("sliding_window_pattern", 4) else "full_attention"
            for i in range(n)
        ]
        if len(types) != n:
            raise c.error(f"layer_types has {len(types)} entries for {n} layers")
        pattern = pattern_from_types(types, c) or "G"
        window = c.get("sliding_window") if "L" in pattern else None
        if "L" in pattern and window is None:
            raise c.error("layer_types has sliding layers but sliding_window is null")
        return window, pattern, "none"

    def write_extra(self, cfg: ModelConfig) -> dict:
        self.require(cfg, "attention.qk_norm", "none")
        self.require(cfg, "position.global_kind", "none")
        self.require(cfg, "attention.head_dim", [None, cfg.d_model // cfg.attention.n_heads])
        if cfg.attention.layer_pattern is None:   # no pattern: every layer local, or every layer global
            self.require(cfg, "attention.window", None)
        return {"sliding_window": cfg.attention.window, "layer_types": layer_types(cfg)}
