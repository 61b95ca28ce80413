"""Falcon (Almazrouei et al. 2023). Two decoder layouts, both LayerNorm with bias, rotate-half
RoPE over the whole head, one `bias` switch for every linear layer, tied head by default:

  old (falcon-7b/rw): `parallel_attn` with one shared `input_layernorm` (or serial with a
      `post_attention_layernorm`); fused `query_key_value` is MQA [q_0..q_h-1, k, v] when
      `multi_query`, else per head [q_i, k_i, v_i].
  new_decoder_architecture (falcon-40b/180b): always parallel, `ln_attn` + `ln_mlp`
      (`num_ln_in_parallel_attn` 2, or one `input_layernorm` when 1); GQA with `num_kv_heads`,
      the fused qkv grouped per kv head [q_g0..q_g(r-1), k_g, v_g].
ALiBi Falcon (`alibi=true`) adds the bias before the 1/sqrt(d) scale: not supported.
"""
from __future__ import annotations

import functools

import torch

from archlab.config import (
    AttentionConfig,
    BiasConfig,
    BlockConfig,
    ConfigError,
    MLPConfig,
    ModelConfig,
    NormConfig,
    PositionConfig,
)
from archlab.interop.families.base import Family, HFConfig, register_family
from archlab.interop.families.gpt_neox import NEOX_MLP, PLAIN_ACT_BACK, plain_activation, require_plain_transformer
from archlab.interop.families.rope import read_rope, write_rope
from archlab.interop.families.tables import PRE_NORMS, QKV, Rule, fused, fused_params, layers, renames


def grouped_qkv(ours: list[str], hf: str, n_heads: int, n_kv: int, head_dim: int) -> Rule:
    """Falcon's fused qkv, rows grouped per kv head: (k, h/k + 2, e, ...). The old layouts are
    its special cases: MQA (k=1) is [q_0..q_h-1, k, v], MHA (k=h) is per head [q_i, k_i, v_i]."""
    r = n_heads // n_kv
    sizes = [n_heads * head_dim, n_kv * head_dim, n_kv * head_dim]

    def pre(t: torch.Tensor) -> torch.Tensor:
        rest = t.shape[1:]
        g = t.reshape(n_kv, r + 2, head_dim, *rest)
        q, k, v = g[:, :r], g[:, r], g[:, r + 1]
        return torch.cat([q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)])

    def post(t: torch.Tensor) -> torch.Tensor:
        rest = t.shape[1:]
        q, k, v = torch.split(t, sizes)
        g = torch.cat([q.reshape(n_kv, r, head_dim, *rest), k.reshape(n_kv, 1, head_dim, *rest),
                       v.reshape(n_kv, 1, head_dim, *rest)], dim=1)
        return g.reshape(-1, *rest)

    return fused(ours, hf, sizes, pre=pre, post=post)


@register_family
class FalconFamily(Family):
    model_type = "falcon"
    architecture = "FalconForCausalLM"
    ties_by_default = True
    base_prefix = "transformer."

    def layout(self, hf: dict) -> tuple[bool, int, int]:
        """(new_decoder_architecture, number of norms in a parallel block, kv heads)."""
        c = HFConfig(hf, self.model_type)
        n_heads = c.get("num_attention_heads") or c.require("n_head")
        new = bool(c.get("new_decoder_architecture", False))
        if new:
            if not c.get("parallel_attn", True):
                raise c.error("new_decoder_architecture=true with parallel_attn=false is not a "
                              "layout transformers can run")
            return True, c.only("num_ln_in_parallel_attn", [1, 2], 2), c.get("num_kv_heads", n_heads)
        c.only("num_ln_in_parallel_attn", [None, 1])
        if c.get("multi_query", True):
            return False, 1, 1
        kv = c.get("num_kv_heads", n_heads)
        if kv != n_heads:
            raise c.error(f"num_kv_heads={kv} with multi_query=false and the old decoder "
                          f"architecture (it stores q, k, v for all {n_heads} heads)")
        return False, 1, n_heads

    def to_config(self, hf: dict) -> ModelConfig:
        c = HFConfig(hf, self.model_type)
        c.unsupported("alibi", why="Falcon's ALiBi is added before the 1/sqrt(head_dim) scale")
        d = c.get("hidden_size") or c.require("n_embed")
        n_heads = c.get("num_attention_heads") or c.require("n_head")
        new, n_norms, kv = self.layout(hf)
        parallel = new or bool(c.get("parallel_attn", True))
        theta, scaling = read_rope(c)
        bias = bool(c.get("bias", False))
        return self.model_config(
            c,
            d_model=d,
            n_layers=c.get("num_hidden_layers") or c.require("n_layer"),
            max_seq_len=c.get("max_position_embeddings", 2048),
            attention=AttentionConfig(n_heads=n_heads, n_kv_heads=kv,
                                      dropout=float(c.get("attention_dropout", 0.0))),
            mlp=MLPConfig(activation=plain_activation(c, "activation", "gelu"),
                          d_ff=c.get("ffn_hidden_size") or 4 * d),
            norm=NormConfig(kind="layernorm", eps=c.get("layer_norm_epsilon", 1e-5), position="pre"),
            block=BlockConfig(parallel=parallel, parallel_norms=n_norms),
            position=PositionConfig(kind="rope", rope_theta=theta, rope_scaling=scaling),
            bias=BiasConfig(qkv=bias, attn_out=bias, mlp=bias, norm=True),
        )

    def from_config(self, cfg: ModelConfig) -> dict:
        require_plain_transformer(self, cfg)
        self.require(cfg, "mlp.activation", list(PLAIN_ACT_BACK))
        kv, h = cfg.n_kv_heads, cfg.attention.n_heads
        if not cfg.block.parallel and kv not in (1, h):
            raise ConfigError("HF family 'falcon': a serial Falcon block has MHA or MQA only, "
                              f"not attention.n_kv_heads={kv}")
        hf = self.base_hf(cfg)
        hf.update(
            hidden_size=cfg.d_model, num_attention_heads=h, num_hidden_layers=cfg.n_layers,
            num_kv_heads=kv, ffn_hidden_size=cfg.d_ff, activation=PLAIN_ACT_BACK[cfg.mlp.activation],
            layer_norm_epsilon=cfg.norm.eps, max_position_embeddings=cfg.max_seq_len,
            bias=cfg.bias.qkv, alibi=False, attention_dropout=cfg.attention.dropout,
            hidden_dropout=0.0, new_decoder_architecture=cfg.block.parallel,
            parallel_attn=cfg.block.parallel, multi_query=kv == 1,
            num_ln_in_parallel_attn=cfg.block.parallel_norms if cfg.block.parallel else None,
            **write_rope(cfg.position.rope_theta, cfg.position.rope_scaling),
        )
        return hf

    def weight_table(self, cfg: ModelConfig) -> list[Rule]:
        qkv = functools.partial(grouped_qkv, n_heads=cfg.attention.n_heads, n_kv=cfg.n_kv_heads,
                                head_dim=cfg.head_dim)
        layer = {"self_attention.dense": "attn.o_proj", **NEOX_MLP}
        if cfg.block.parallel and cfg.block.parallel_norms == 2:   # new architecture
            layer.update(ln_attn="attn_norm", ln_mlp="mlp_norm")
        else:
            layer.update(PRE_NORMS)
        return (fused_params(qkv, QKV, "transformer.h.{i}.self_attention.query_key_value")
                + renames({"transformer.word_embeddings": "embed", "transformer.ln_f": "final_norm",
                           "lm_head": "lm_head", **layers(layer, "transformer.h.{i}.")}, "weight", "bias"))
