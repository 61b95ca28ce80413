"""Every registered switch, each as a small override of one tiny base config (for parametrized tests)."""
from archlab.config import AttentionConfig, ModelConfig
from archlab.nn.mlp import ACTIVATIONS
from archlab.nn.norms import NORMS
from archlab.nn.position import ATTENTION_POSITIONS

BASE = ModelConfig(vocab_size=97, d_model=32, n_layers=2, max_seq_len=64,
                   attention=AttentionConfig(n_heads=4))

VARIANTS: dict[str, dict] = {"base": {}}
VARIANTS.update({f"norm-{k}": {"norm.kind": k} for k in NORMS.names()})
VARIANTS.update({f"act-{a}": {"mlp.activation": a} for a in ACTIVATIONS})
VARIANTS.update({f"pos-{p}": {"position.kind": p} for p in ATTENTION_POSITIONS.names()})
VARIANTS.update({f"normpos-{p}": {"norm.position": p} for p in ("post", "pre", "sandwich", "post_sublayer")})
VARIANTS.update({
    "layernorm-bias": {"norm.kind": "layernorm", "bias.norm": True},
    "all-biases": {"bias.qkv": True, "bias.attn_out": True, "bias.mlp": True, "bias.head": True},
    "parallel-shared-norm": {"block.parallel": True},
    "parallel-two-norms": {"block.parallel": True, "block.parallel_norms": 2},
    "gqa": {"attention.n_kv_heads": 2},
    "mqa": {"attention.n_kv_heads": 1},
    "head-dim": {"attention.head_dim": 12},
    "window": {"attention.window": 3},
    "local-global": {"attention.window": 3, "attention.layer_pattern": "LG"},
    "rope-local-nope-global": {"attention.window": 3, "attention.layer_pattern": "LG",
                               "position.global_kind": "none"},
    "rope-local-theta": {"attention.window": 3, "attention.layer_pattern": "LG",
                         "position.local_rope_theta": 100.0, "position.rope_theta": 1e6},
    "rope-interleaved": {"position.rope_layout": "interleaved"},
    "rope-partial": {"position.rotary_fraction": 0.5},
    "rope-linear-scaling": {"position.rope_scaling": {"kind": "linear", "factor": 4.0}},
    "rope-llama3-scaling": {"position.rope_scaling": {"kind": "llama3", "factor": 8.0,
                                                      "original_max_seq_len": 16}},
    "learned-offset": {"position.kind": "learned", "position.learned_offset": 2},
    "qk-norm-per-head": {"attention.qk_norm": "per_head"},
    "qk-norm-full": {"attention.qk_norm": "full"},
    "qk-norm-per-head-untied": {"attention.qk_norm": "per_head_untied"},
    "qk-norm-bias": {"norm.kind": "layernorm", "attention.qk_norm": "per_head", "bias.qk_norm": True},
    "softcap": {"attention.logit_softcap": 5.0, "final_logit_softcap": 3.0},
    "query-scalar": {"attention.query_pre_attn_scalar": 4.0},
    "inverse-layer-scale": {"attention.scale_by_inverse_layer": True},
    "clip-qkv": {"attention.clip_qkv": 0.05},
    "gated-attention": {"attention.gated": True},
    "learned-sinks": {"attention.learned_sinks": True},
    "moe": {"mlp.moe": {"n_experts": 4, "top_k": 2, "router_z_loss_coef": 1e-3}},
    "moe-shared": {"mlp.moe": {"n_experts": 3, "top_k": 1, "shared_expert_d_ff": 16}},
    "tied": {"tie_embeddings": True},
    "embed-scale-norm": {"scale_embeddings": True, "norm.embedding_norm": True},
    "logit-scale": {"logit_scale": 0.25},
    "no-final-norm": {"norm.final_norm": False},
    "z-loss": {"z_loss": 1e-4},
    "scaled-trunc-init": {"init.scaled_residual": True, "init.truncated": True},
    "d-ff-ratio": {"mlp.d_ff_ratio": 8 / 3, "mlp.multiple_of": 8},
})


def variant(name: str) -> ModelConfig:
    return BASE.with_overrides(VARIANTS[name])
