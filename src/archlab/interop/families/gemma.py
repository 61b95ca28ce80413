"""Gemma 1, 2 and 3 (text): RMSNorm applied as (1 + w), embeddings scaled by sqrt(d_model),
GeGLU with tanh GeLU, explicit head_dim, tied head.

  gemma        pre-norm; that is all (legacy hidden_act "gelu" means the tanh approximation, as in HF)
  gemma2       sandwich norms (`input_layernorm`, `post_attention_layernorm` on the attention OUTPUT,
               `pre_feedforward_layernorm`, `post_feedforward_layernorm`), attention logit soft-cap
               and final logit soft-cap, scale query_pre_attn_scalar**-0.5, sliding window on
               alternating layers: HF makes layer i local when (i + 1) % 2 != 0, i.e. "LG"
  gemma3_text  gemma2 without soft-caps by default, per-head q/k RMSNorm (1 + w), local layers use
               theta `rope_local_base_freq` (10k) and are never scaled, global layers theta 1e6 and
               optional linear scaling; pattern 5 local : 1 global ("LLLLLG", `sliding_window_pattern`)
"""
from __future__ import annotations

from archlab.config import AttentionConfig, BiasConfig, ConfigError, MLPConfig, ModelConfig, NormConfig, PositionConfig
from archlab.interop.families.base import Family, HFConfig, register_family
from archlab.interop.families.llama import (
    GATED_ACT,
    GATED_ACT_BACK,
    layer_types,
    llama_table,
    pattern_from_types,
    require_serial_full_rope,
)
from archlab.interop.families.rope import read_rope, write_rope
from archlab.interop.families.tables import PRE_NORMS, Rule

SANDWICH_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "attn_post_norm",
                  "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "mlp_post_norm"}


class GemmaLike(Family):
    ties_by_default = True
    save_priority = 100
    version = 1
    act_key = "hidden_act"

    def to_config(self, hf: dict) -> ModelConfig:
        c = HFConfig(hf, self.model_type)
        c.unsupported("use_bidirectional_attention", why="bidirectional (encoder) attention")
        d, n_heads = c.require("hidden_size"), c.require("num_attention_heads")
        n_layers = c.require("num_hidden_layers")
        act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
        if act == "gelu":  # Gemma's released configs say "gelu" but mean the tanh approximation
            act = "gelu_pytorch_tanh"
        if act not in GATED_ACT:
            raise c.error(f"{self.act_key}={act!r} is not supported (supported: {', '.join(GATED_ACT)})")
        attn_bias = bool(c.get("attention_bias", False))
        window, pattern, local_theta = None, None, None
        theta, scaling = read_rope(c)
        if self.version >= 2 and c.get("sliding_window") is not None:
            if c.has("layer_types"):
                types = c.get("layer_types")
            else:
                every = 2 if self.version == 2 else c.get("sliding_window_pattern", 6)
                types = ["sliding_attention" if (i + 1) % every else "full_attention"
                         for i in range(n_layers)]
            if len(types) != n_layers:
                raise c.error(f"layer_types has {len(types)} entries for {n_layers} layers")
            pattern = pattern_from_types(types, c)
            window = c.get("sliding_window") if pattern else None
        if self.version == 3:
            theta, scaling, local_theta = self.read_gemma3_rope(c)
            if pattern is None or (local_theta == theta and scaling is None):
                local_theta = None
        return self.model_config(
            c,
            d_model=d,
            n_layers=n_layers,
            max_seq_len=c.get("max_position_embeddings", 8192),
            attention=AttentionConfig(
                n_heads=n_heads,
                n_kv_heads=c.get("num_key_value_heads", n_heads),
                head_dim=c.get("head_dim", 256),
                window=window,
                layer_pattern=pattern,
                qk_norm="per_head" if self.version == 3 else "none",
                logit_softcap=c.get("attn_logit_softcapping") if self.version >= 2 else None,
                query_pre_attn_scalar=(float(c.get("query_pre_attn_scalar", 256))
                                       if self.version >= 2 else None),
                dropout=float(c.get("attention_dropout", 0.0)),
            ),
            mlp=MLPConfig(activation=GATED_ACT[act], d_ff=c.require("intermediate_size")),
            norm=NormConfig(kind="rmsnorm_1p", eps=c.get("rms_norm_eps", 1e-6),
                            position="sandwich" if self.version >= 2 else "pre"),
            position=PositionConfig(kind="rope", rope_theta=theta, rope_scaling=scaling,
                                    local_rope_theta=local_theta),
            bias=BiasConfig(qkv=attn_bias, attn_out=attn_bias),
            scale_embeddings=True,
            final_logit_softcap=c.get("final_logit_softcapping") if self.version >= 2 else None,
        )

    def read_gemma3_rope(self, c: HFConfig):
        params = c.get("rope_parameters") or {}
        if "full_attention" in params or "sliding_attention" in params:
            full = dict(params.get("full_attention") or {})
            local = dict(params.get("sliding_attention") or {})
        else:  # legacy: rope_theta + rope_scaling (global), rope_local_base_freq (local)
            full = dict(c.get("rope_scaling") or {})
            local = {}
        full.setdefault("rope_theta", c.get("rope_theta", 1_000_000.0))
        local.setdefault("rope_theta", c.get("rope_local_base_freq", 10_000.0))
        theta, scaling = read_rope(c, params=full)
        local_theta, local_scaling = read_rope(c, params=local)
        if local_scaling is not None:
            raise c.error("rope scaling on sliding_attention layers is not supported by archlab "
                          "(Gemma 3 scales global layers only)")
        return theta, scaling, local_theta

    # ---- saving --------------------------------------------------------------------------------
    def from_config(self, cfg: ModelConfig) -> dict:
        req = self.require
        req(cfg, "norm.kind", "rmsnorm_1p")
        req(cfg, "norm.position", "sandwich" if self.version >= 2 else "pre")
        require_serial_full_rope(self, cfg)
        req(cfg, "mlp.activation", list(GATED_ACT_BACK))
        req(cfg, "mlp.moe", None)
        req(cfg, "scale_embeddings", True)
        for key in ("attention.prefix_lm", "attention.gated", "attention.learned_sinks",
                    "bias.head", "bias.mlp"):
            req(cfg, key, False)
        req(cfg, "logit_scale", None)
        req(cfg, "attention.qk_norm", "per_head" if self.version == 3 else "none")
        if cfg.bias.qkv != cfg.bias.attn_out:
            raise ConfigError(f"HF family {self.model_type!r} has one attention_bias for q, k, v and o")
        if self.version == 1:
            for key in ("attention.window", "attention.logit_softcap",
                        "attention.query_pre_attn_scalar", "final_logit_softcap"):
                req(cfg, key, None)
        if self.version < 3:
            req(cfg, "position.local_rope_theta", None)
        hf = self.base_hf(cfg)
        hf.update(
            **self.sizes_hf(cfg),
            rms_norm_eps=float(cfg.norm.eps), attention_bias=cfg.bias.qkv,
            attention_dropout=float(cfg.attention.dropout),
        )
        hf[self.act_key] = GATED_ACT_BACK[cfg.mlp.activation]
        if self.version == 1:
            hf.update(write_rope(cfg.position.rope_theta, cfg.position.rope_scaling))
            return hf
        scalar = cfg.attention.query_pre_attn_scalar or cfg.head_dim
        if not float(scalar).is_integer():
            raise ConfigError(f"HF family {self.model_type!r} cannot express "
                              f"attention.query_pre_attn_scalar={scalar!r} (transformers types it int)")
        softcap = lambda v: None if v is None else float(v)  # noqa: E731
        hf.update(
            # transformers 5 validates types: query_pre_attn_scalar is an int there
            query_pre_attn_scalar=int(scalar),
            attn_logit_softcapping=softcap(cfg.attention.logit_softcap),
            final_logit_softcapping=softcap(cfg.final_logit_softcap),
            sliding_window=cfg.attention.window,
            layer_types=layer_types(cfg),
        )
        if self.version == 2:
            hf.update(write_rope(cfg.position.rope_theta, cfg.position.rope_scaling))
            return hf
        pos = cfg.position
        has_local = any(cfg.is_local(i) for i in range(cfg.n_layers))
        if pos.local_rope_theta is None and pos.rope_scaling is not None and has_local:
            raise ConfigError("HF family 'gemma3_text' never scales local layers: set "
                              "position.local_rope_theta when position.rope_scaling is set")
        local_theta = pos.local_rope_theta or pos.rope_theta
        full = write_rope(pos.rope_theta, pos.rope_scaling)
        hf.update(
            rope_parameters={"full_attention": full["rope_parameters"],
                             "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}},
            rope_theta=pos.rope_theta, rope_local_base_freq=local_theta,
            rope_scaling=full["rope_scaling"],
        )
        if cfg.attention.window is None:
            hf["sliding_window"] = 4096  # unused: every layer is global, but HF wants an int
        return hf

    def weight_table(self, cfg: ModelConfig) -> list[Rule]:
        return llama_table(SANDWICH_NORMS if self.version >= 2 else PRE_NORMS)


@register_family
class GemmaFamily(GemmaLike):
    model_type = "gemma"
    architecture = "GemmaForCausalLM"
    version = 1
    act_key = "hidden_act"


@register_family
class Gemma2Family(GemmaLike):
    model_type = "gemma2"
    architecture = "Gemma2ForCausalLM"
    version = 2
    act_key = "hidden_activation"


@register_family
class Gemma3TextFamily(GemmaLike):
    model_type = "gemma3_text"
    architecture = "Gemma3ForCausalLM"
    version = 3
    act_key = "hidden_activation"
