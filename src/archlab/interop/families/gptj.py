"""GPT-J (Wang & Komatsuzaki 2021): parallel residual with one shared LayerNorm, interleaved RoPE
("rotate every two") on the first `rotary_dim` dims of each head with a fixed base of 10000,
no q/k/v/out biases, MLP biases, and an LM-head bias. Activation gelu_new (tanh GeLU)."""
from __future__ import annotations

from archlab.config import AttentionConfig, BiasConfig, BlockConfig, MLPConfig, ModelConfig, NormConfig, PositionConfig
from archlab.interop.families.base import Family, HFConfig, register_family
from archlab.interop.families.gpt_neox import (
    PLAIN_ACT_BACK,
    plain_activation,
    require_plain_transformer,
)
from archlab.interop.families.tables import Rule, attention, layers, renames


@register_family
class GPTJFamily(Family):
    model_type = "gptj"
    architecture = "GPTJForCausalLM"
    base_prefix = "transformer."

    def to_config(self, hf: dict) -> ModelConfig:
        c = HFConfig(hf, self.model_type)
        d, n_heads = c.require("n_embd"), c.require("n_head")
        head_dim = d // n_heads
        rotary_dim = c.get("rotary_dim") or head_dim
        fraction = rotary_dim / head_dim
        if int(head_dim * fraction) != rotary_dim or rotary_dim > head_dim:
            raise c.error(f"rotary_dim={rotary_dim} cannot be expressed for head_dim={head_dim}")
        return self.model_config(
            c,
            d_model=d,
            n_layers=c.require("n_layer"),
            max_seq_len=c.get("n_positions", 2048),
            attention=AttentionConfig(n_heads=n_heads, dropout=float(c.get("attn_pdrop", 0.0))),
            mlp=MLPConfig(activation=plain_activation(c, "activation_function", "gelu_new"),
                          d_ff=c.get("n_inner") or 4 * d),
            norm=NormConfig(kind="layernorm", eps=c.get("layer_norm_epsilon", 1e-5), position="pre"),
            block=BlockConfig(parallel=True, parallel_norms=1),
            position=PositionConfig(kind="rope", rope_theta=10_000.0, rope_layout="interleaved",
                                    rotary_fraction=fraction),
            bias=BiasConfig(qkv=False, attn_out=False, mlp=True, norm=True, head=True),
        )

    def from_config(self, cfg: ModelConfig) -> dict:
        require_plain_transformer(self, cfg)
        self.require(cfg, "attention.n_kv_heads", [None, cfg.attention.n_heads])
        self.require(cfg, "mlp.activation", list(PLAIN_ACT_BACK))
        self.require(cfg, "position.kind", "rope")
        hf = self.base_hf(cfg)
        hf.update(
            n_embd=cfg.d_model, n_head=cfg.attention.n_heads, n_layer=cfg.n_layers,
            n_inner=cfg.d_ff, rotary_dim=cfg.rotary_dim, n_positions=cfg.max_seq_len,
            activation_function=PLAIN_ACT_BACK[cfg.mlp.activation],
            layer_norm_epsilon=cfg.norm.eps, attn_pdrop=cfg.attention.dropout,
            resid_pdrop=0.0, embd_pdrop=0.0,
        )
        return hf

    def weight_table(self, cfg: ModelConfig) -> list[Rule]:
        layer = {**attention("attn.", "q_proj k_proj v_proj out_proj"), "ln_1": "attn_norm",
                 "mlp.fc_in": "mlp.up_proj", "mlp.fc_out": "mlp.down_proj"}
        return renames(                    # lm_head's bias is the head bias (the model's lm_head.bias)
            {"transformer.wte": "embed", "transformer.ln_f": "final_norm", "lm_head": "lm_head",
             **layers(layer, "transformer.h.{i}.")}, "weight", "bias")
