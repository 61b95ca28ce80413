"""GPT-NeoX (Pythia, GPT-NeoX-20B, StableLM-alpha): LayerNorm with bias, biases everywhere,
partial rotate-half RoPE (`rotary_pct`, 0.25 in Pythia), a fused `query_key_value` laid out per
head as [q_h, k_h, v_h], untied `embed_out`, and parallel residual with two norms
(`use_parallel_residual`, Black et al. 2022) or the serial pre-norm block.

Also holds small helpers shared by the other families of this group (plain activations, the
per-head fused-qkv layout, the switches none of these HF families can express).
"""
from __future__ import annotations

import functools

import torch

from archlab.config import AttentionConfig, BiasConfig, BlockConfig, MLPConfig, ModelConfig, NormConfig, PositionConfig
from archlab.interop.families.base import Family, HFConfig, register_family
from archlab.interop.families.rope import partial_rotary, read_rope, write_partial_rope
from archlab.interop.families.tables import PRE_NORMS, QKV, Rule, fused, fused_params, layers, renames

# HF hidden_act of a plain (non-gated) MLP -> ours. gelu_new / gelu_fast / bloom's gelu are the
# tanh approximation (Hendrycks & Gimpel 2016), equal to torch's approximate="tanh" to rounding.
PLAIN_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
             "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu", "relu2": "relu2",
             "silu": "silu", "swish": "silu"}
PLAIN_ACT_BACK = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "relu2": "relu2",
                  "silu": "silu"}


def plain_activation(c: HFConfig, key: str, default: str) -> str:
    act = c.get(key, default)
    if act not in PLAIN_ACT:
        raise c.error(f"{key}={act!r} is not supported (supported: {', '.join(PLAIN_ACT)})")
    return PLAIN_ACT[act]


def per_head_qkv(ours: list[str], hf: str, n_heads: int, head_dim: int) -> Rule:
    """A fused qkv stored per head, rows [q_0, k_0, v_0, q_1, ...] (GPT-NeoX, BLOOM, Falcon MHA)
    <-> our separate q, k, v projections (weight (3*h*e, d) or bias (3*h*e,))."""
    def pre(t: torch.Tensor) -> torch.Tensor:
        rest = t.shape[1:]
        return t.reshape(n_heads, 3, head_dim, *rest).transpose(0, 1).reshape(3 * n_heads * head_dim, *rest)

    def post(t: torch.Tensor) -> torch.Tensor:
        rest = t.shape[1:]
        return t.reshape(3, n_heads, head_dim, *rest).transpose(0, 1).reshape(3 * n_heads * head_dim, *rest)

    return fused(ours, hf, [n_heads * head_dim] * 3, pre=pre, post=post)


NEOX_MLP = {"mlp.dense_h_to_4h": "mlp.up_proj", "mlp.dense_4h_to_h": "mlp.down_proj"}   # also BLOOM's, Falcon's


def neox_table(cfg: ModelConfig, layer: str, attn: str, top: dict[str, str]) -> list[Rule]:
    """GPT-NeoX's weights, which BLOOM's differ from in names only: in each layer (prefix `layer`) a per-head
    fused `query_key_value` and a `dense` output under `attn`, the 4h MLP and the pre-norms, all with biases;
    `top`: the modules outside the layers."""
    qkv = functools.partial(per_head_qkv, n_heads=cfg.attention.n_heads, head_dim=cfg.head_dim)
    table = {attn + "dense": "attn.o_proj", **NEOX_MLP, **PRE_NORMS}
    return (fused_params(qkv, QKV, f"{layer}{attn}query_key_value")
            + renames(top | layers(table, layer), "weight", "bias"))


def require_plain_transformer(fam: Family, cfg: ModelConfig) -> None:
    """Switches that none of these HF families has: must be off to save."""
    for key in ("attention.prefix_lm", "attention.gated", "attention.learned_sinks",
                "scale_embeddings"):
        fam.require(cfg, key, False)
    for key in ("attention.logit_softcap", "attention.query_pre_attn_scalar",
                "final_logit_softcap", "mlp.moe", "position.local_rope_theta"):
        fam.require(cfg, key, None)


@register_family
class GPTNeoXFamily(Family):
    model_type = "gpt_neox"
    architecture = "GPTNeoXForCausalLM"
    base_prefix = "gpt_neox."

    def to_config(self, hf: dict) -> ModelConfig:
        c = HFConfig(hf, self.model_type)
        d, n_heads = c.require("hidden_size"), c.require("num_attention_heads")
        theta, scaling = read_rope(c, default_theta=float(c.get("rotary_emb_base", 10_000.0)))
        attn_bias = bool(c.get("attention_bias", True))
        parallel = bool(c.get("use_parallel_residual", True))
        return self.model_config(
            c,
            attention=AttentionConfig(n_heads=n_heads, dropout=float(c.get("attention_dropout", 0.0))),
            mlp=MLPConfig(activation=plain_activation(c, "hidden_act", "gelu"),
                          d_ff=c.get("intermediate_size", 4 * d)),
            norm=NormConfig(kind="layernorm", eps=c.get("layer_norm_eps", 1e-5), position="pre"),
            block=BlockConfig(parallel=parallel, parallel_norms=2 if parallel else 1),
            position=PositionConfig(kind="rope", rope_theta=theta, rope_scaling=scaling,
                                    rotary_fraction=partial_rotary(c, "rotary_pct", 0.25)),
            bias=BiasConfig(qkv=attn_bias, attn_out=attn_bias, mlp=True, norm=True),
        )

    def from_config(self, cfg: ModelConfig) -> dict:
        require_plain_transformer(self, cfg)
        req = self.require
        req(cfg, "norm.kind", "layernorm")
        req(cfg, "norm.position", "pre")
        req(cfg, "position.kind", "rope")
        req(cfg, "position.rope_layout", "half")
        req(cfg, "attention.n_kv_heads", [None, cfg.attention.n_heads])
        req(cfg, "mlp.activation", list(PLAIN_ACT_BACK))
        hf = self.base_hf(cfg)
        rope = write_partial_rope(cfg)
        hf.update(
            hidden_size=cfg.d_model, num_attention_heads=cfg.attention.n_heads,
            num_hidden_layers=cfg.n_layers, intermediate_size=cfg.d_ff,
            hidden_act=PLAIN_ACT_BACK[cfg.mlp.activation], layer_norm_eps=cfg.norm.eps,
            max_position_embeddings=cfg.max_seq_len, use_parallel_residual=cfg.block.parallel,
            attention_bias=cfg.bias.qkv, attention_dropout=cfg.attention.dropout,
            hidden_dropout=0.0, rotary_pct=cfg.position.rotary_fraction,
            rotary_emb_base=cfg.position.rope_theta, **rope,
        )
        return hf

    def weight_table(self, cfg: ModelConfig) -> list[Rule]:
        return neox_table(cfg, "gpt_neox.layers.{i}.", "attention.", {
            "gpt_neox.embed_in": "embed", "gpt_neox.final_layer_norm": "final_norm", "embed_out": "lm_head"})

    def ignored_hf(self, cfg: ModelConfig) -> list[str]:
        extra = [r".*attention\.(bias|masked_bias)"]
        return super().ignored_hf(cfg) + extra
