"""GPT-2 (Radford et al. 2019): learned positions, pre-LayerNorm with biases, biases everywhere,
plain GeLU MLP (tanh approximation, HF's "gelu_new"), tied head.

Weights are stored by HF's Conv1D as (in, out), the transpose of nn.Linear, and q/k/v are one
fused `c_attn` of width 3d: both are undone here. Old checkpoints also store the causal-mask
buffers `attn.bias` / `attn.masked_bias`; they are ignored.

Attention-scale switches: `scale_attn_weights=False` (no 1/sqrt(e)) is query_pre_attn_scalar=1;
`scale_attn_by_inverse_layer_idx` (logits also / (layer + 1), Stanford CRFM's fp16 runs) is
attention.scale_by_inverse_layer; `reorder_and_upcast_attn` only moves the scale onto q @ k in
float32 (an fp16/bf16 overflow guard) and is read as a no-op. Not supported: `add_cross_attention`.
"""
from __future__ import annotations

from archlab.config import AttentionConfig, BiasConfig, MLPConfig, ModelConfig, NormConfig, PositionConfig
from archlab.interop.families.base import Family, HFConfig, register_family
from archlab.interop.families.tables import QKV, Rule, fused, layers, renames, transposed

ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
       "silu": "silu", "swish": "silu"}
ACT_BACK = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}


def _t(x):
    return x.t()


@register_family
class GPT2Family(Family):
    ties_by_default = True
    model_type = "gpt2"
    architecture = "GPT2LMHeadModel"
    base_prefix = "transformer."
    save_priority = 10

    def to_config(self, hf: dict) -> ModelConfig:
        c = HFConfig(hf, self.model_type)
        d = c.require("n_embd")
        act = c.only("activation_function", ACT, "gelu_new")
        c.unsupported("add_cross_attention", why="encoder-decoder cross-attention")
        scaled = bool(c.get("scale_attn_weights", True))
        n_positions = c.get("n_positions", c.get("n_ctx", 1024))
        return self.model_config(
            c,
            d_model=d,
            n_layers=c.require("n_layer"),
            max_seq_len=n_positions,
            attention=AttentionConfig(
                n_heads=c.require("n_head"), query_pre_attn_scalar=None if scaled else 1.0,
                scale_by_inverse_layer=bool(c.get("scale_attn_by_inverse_layer_idx", False)),
                dropout=float(c.get("attn_pdrop", 0.0))),
            mlp=MLPConfig(activation=ACT[act], d_ff=c.get("n_inner") or 4 * d),
            norm=NormConfig(kind="layernorm", eps=c.get("layer_norm_epsilon", 1e-5), position="pre"),
            block={"residual_dropout": float(c.get("resid_pdrop", 0.0))},
            position=PositionConfig(kind="learned"),
            bias=BiasConfig(qkv=True, attn_out=True, mlp=True, norm=True),
            embedding_dropout=float(c.get("embd_pdrop", 0.0)),
            init={"std": c.get("initializer_range", 0.02), "scaled_residual": True},
        )

    def from_config(self, cfg: ModelConfig) -> dict:
        req = self.require
        req(cfg, "norm.kind", "layernorm")
        req(cfg, "norm.position", "pre")
        req(cfg, "norm.final_norm", True)
        req(cfg, "norm.embedding_norm", False)
        req(cfg, "block.parallel", False)
        req(cfg, "position.kind", "learned")
        req(cfg, "position.learned_offset", 0)
        req(cfg, "mlp.activation", list(ACT_BACK))
        req(cfg, "mlp.moe", None)
        for key in ("bias.qkv", "bias.attn_out", "bias.mlp", "bias.norm"):
            req(cfg, key, True)
        for key in ("bias.head", "scale_embeddings", "attention.prefix_lm", "attention.gated",
                    "attention.learned_sinks"):
            req(cfg, key, False)
        for key in ("attention.window", "attention.logit_softcap", "logit_scale",
                    "final_logit_softcap", "position.global_kind"):
            req(cfg, key, None)
        # 1/sqrt(head_dim) (None spells it too) or no scale at all (scale_attn_weights=False)
        req(cfg, "attention.query_pre_attn_scalar", [None, float(cfg.head_dim), 1.0])
        scaled = cfg.attention.query_pre_attn_scalar != 1.0 or cfg.head_dim == 1
        req(cfg, "attention.qk_norm", "none")
        req(cfg, "attention.n_kv_heads", [None, cfg.attention.n_heads])
        req(cfg, "attention.head_dim", [None, cfg.d_model // cfg.attention.n_heads])
        hf = self.base_hf(cfg)
        hf.update(
            n_embd=cfg.d_model, n_layer=cfg.n_layers, n_head=cfg.attention.n_heads,
            n_inner=cfg.d_ff, n_positions=cfg.max_seq_len, n_ctx=cfg.max_seq_len,
            activation_function=ACT_BACK[cfg.mlp.activation], layer_norm_epsilon=float(cfg.norm.eps),
            attn_pdrop=float(cfg.attention.dropout), resid_pdrop=float(cfg.block.residual_dropout),
            embd_pdrop=float(cfg.embedding_dropout), scale_attn_weights=scaled,
            scale_attn_by_inverse_layer_idx=cfg.attention.scale_by_inverse_layer,
            reorder_and_upcast_attn=False,
        )
        return hf

    def weight_table(self, cfg: ModelConfig) -> list[Rule]:
        d, h = cfg.d_model, "transformer.h.{i}."
        conv1d = layers({"attn.c_proj": "attn.o_proj", "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}, h)
        return [fused([f"{o}.weight" for o in QKV], f"{h}attn.c_attn.weight", [d, d, d], pre=_t, post=_t),
                fused([f"{o}.bias" for o in QKV], f"{h}attn.c_attn.bias", [d, d, d]),
                *(transposed(f"{ours}.weight", f"{theirs}.weight") for theirs, ours in conv1d.items()),
                *renames(conv1d, "bias"),
                *renames({"transformer.wte": "embed", "transformer.wpe": "abs_position.embedding",
                          "transformer.ln_f": "final_norm", "lm_head": "lm_head",
                          **layers({"ln_1": "attn_norm", "ln_2": "mlp_norm"}, h)}, "weight", "bias")]
