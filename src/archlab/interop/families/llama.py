"""LLaMA and its close relatives: llama, mistral, mixtral, qwen2, qwen2_moe, qwen3.

All are pre-norm RMSNorm, rotate-half RoPE, gated MLP, untied (or tied) head, and share one weight
layout (`model.layers.N.self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`). They differ in:
  llama    attention_bias (q, k, v and o), mlp_bias
  mistral  sliding_window on every layer. transformers' Mistral and Mixtral classes ignore
           `layer_types` and window every layer: a `layer_types` list that agrees is read, a mixed
           one is refused (interleaved Mistral models are model_type 'ministral')
  ministral mistral with per-layer `layer_types` (sliding_attention / full_attention), e.g.
           Ministral-8B
  mixtral  mistral + top-k MoE (`block_sparse_moe.gate`, `experts.E.w1/w3/w2`): softmax over all
           experts, top-k, renormalize the k weights (same order of operations as archlab's MoEMLP)
  qwen2    q/k/v bias (not o); sliding window on layers >= max_window_layers (or `layer_types`)
  qwen2_moe qwen2 with top-k experts on every layer (`mlp.gate`, `mlp.experts.E.*`, experts moe_intermediate_size
           wide, the k weights renormalized only with norm_topk_prob) and a shared expert whose output a per-token
           sigmoid gate scales (`mlp.shared_expert`, `mlp.shared_expert_gate`); dense layers between sparse ones
           (decoder_sparse_step > 1, mlp_only_layers) and qkv_bias false are refused
  qwen3    per-head RMSNorm on q and k (`q_norm`, `k_norm`), attention_bias like llama
All read the rope scaling types linear, llama3, yarn (Qwen2.5/Qwen3 long context), longrope and
dynamic (read_rope); other types (e.g. proportional) raise ConfigError.
"""
from __future__ import annotations

from typing import Mapping

from archlab.config import (
    AttentionConfig,
    BiasConfig,
    ConfigError,
    MLPConfig,
    ModelConfig,
    MoEConfig,
    NormConfig,
    PositionConfig,
)
from archlab.interop.families.base import Family, HFConfig, register_family
from archlab.interop.families.rope import read_rope, write_rope
from archlab.interop.families.tables import PRE_NORMS, Rule, attention, layers, renames

# HF hidden_act of a gated MLP -> our gated activation
GATED_ACT = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_pytorch_tanh": "geglu_tanh",
             "gelu_new": "geglu_tanh", "relu": "reglu"}
GATED_ACT_BACK = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_pytorch_tanh", "reglu": "relu"}


def pattern_from_types(layer_types: list[str], c: HFConfig) -> str | None:
    """HF `layer_types` ("sliding_attention"/"full_attention") -> the shortest repeating 'L'/'G'
    pattern reproducing it exactly (None when every layer is global)."""
    letters = []
    for kind in layer_types:
        if kind not in ("sliding_attention", "full_attention"):
            raise c.error(f"layer_types entry {kind!r} is not supported (sliding_attention, full_attention)")
        letters.append("L" if kind == "sliding_attention" else "G")
    full = "".join(letters)
    if "L" not in full:
        return None
    for size in range(1, len(full) + 1):
        unit = full[:size]
        if (unit * (len(full) // size + 1))[: len(full)] == full:
            return unit
    return full


def layer_types(cfg: ModelConfig) -> list[str]:
    return ["sliding_attention" if cfg.is_local(i) else "full_attention" for i in range(cfg.n_layers)]


def gated_activation(c: HFConfig, key: str = "hidden_act", default: str = "silu") -> str:
    act = c.get(key, default)
    if act not in GATED_ACT:
        raise c.error(f"{key}={act!r} is not supported (supported: {', '.join(GATED_ACT)})")
    return GATED_ACT[act]


# one LLaMA layer's modules, HF -> ours (the norms apart: their HF names follow the block's wiring)
LLAMA_LAYER = {**attention("self_attn."), "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm",
               "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.up_proj", "mlp.down_proj": "mlp.down_proj"}


def llama_table(norms: Mapping[str, str] = PRE_NORMS) -> list[Rule]:
    """The weights of the LLaMA-like families (and Gemma, OLMo). `norms` names the block norms (sandwich and
    post-sublayer wirings name them differently)."""
    return (renames({"model.embed_tokens": "embed", "model.norm": "final_norm", "lm_head": "lm_head"}, "weight")
            + renames(layers({**LLAMA_LAYER, **norms}, "model.layers.{i}."), "weight", "bias"))


def require_serial_full_rope(fam: Family, cfg: ModelConfig) -> None:
    """The block and position switches of the LLaMA-style layouts (LLaMA, Gemma) that must hold to
    save: a serial block with a final norm and no embedding norm, rotate-half RoPE over every dim."""
    req = fam.require
    req(cfg, "norm.final_norm", True)
    req(cfg, "norm.embedding_norm", False)
    req(cfg, "block.parallel", False)
    req(cfg, "position.kind", "rope")
    req(cfg, "position.rope_layout", "half")
    req(cfg, "position.rotary_fraction", 1.0)
    req(cfg, "position.global_kind", [None, "rope"])


class LlamaLike(Family):
    """Shared reading/writing of the LLaMA-style config.json fields."""

    architecture = "LlamaForCausalLM"
    has_attention_bias_field = True   # llama/qwen3: attention_bias -> q, k, v, o biases
    qkv_bias = False                  # qwen2: q/k/v biases always
    qk_norm = "none"                  # qwen3: per_head; olmo2: full
    window_style = "none"             # none | all (mistral) | types (ministral: layer_types) |
                                      # qwen (max_window_layers/layer_types)
    default_window: int | None = None  # the HF config class's sliding_window when config.json omits it
    norm_kind = "rmsnorm"             # olmo: nonparametric (LayerNorm, eps fixed at 1e-5)
    norm_position = "pre"             # olmo2: post_sublayer
    norms = PRE_NORMS                 # our block norm name -> HF name
    clip_qkv = False                  # olmo: clamp q, k, v to +-clip_qkv
    routed_experts = False            # mixtral, olmoe: the MLP is a top-k mixture of experts (mlp.moe)

    def to_config(self, hf: dict) -> ModelConfig:
        c = HFConfig(hf, self.model_type)
        theta, scaling = read_rope(c)
        attn_bias = bool(c.get("attention_bias", False)) if self.has_attention_bias_field else False
        if self.model_type != "llama":
            c.unsupported("mlp_bias", why="MLP biases")
        c.unsupported("pretraining_tp", lambda v: v != 1, "tensor-parallel slicing of the MLP")
        window, pattern = self.read_window(c)
        return self.model_config(
            c,
            attention=AttentionConfig(
                **c.heads(),
                window=window,
                layer_pattern=pattern,
                qk_norm=self.qk_norm,
                clip_qkv=c.get("clip_qkv") if self.clip_qkv else None,
                dropout=float(c.get("attention_dropout", 0.0)),
            ),
            mlp=MLPConfig(activation=gated_activation(c), d_ff=c.require("intermediate_size"),
                          moe=self.read_moe(c)),
            norm=NormConfig(kind=self.norm_kind, eps=self.read_eps(c), position=self.norm_position),
            position=PositionConfig(kind="rope", rope_theta=theta, rope_scaling=scaling),
            bias=BiasConfig(qkv=attn_bias or self.qkv_bias, attn_out=attn_bias,
                            mlp=bool(c.get("mlp_bias", False))),
        )

    def read_window(self, c: HFConfig) -> tuple[int | None, str | None]:
        if self.window_style == "none":
            return None, None
        n = c.require("num_hidden_layers")
        if self.window_style == "all":
            window = c.data["sliding_window"] if "sliding_window" in c.data else self.default_window
            kind = "full_attention" if window is None else "sliding_attention"
            types = c.get("layer_types")
            if types is not None and list(types) != [kind] * n:
                raise c.error(
                    f"layer_types={types!r} is not supported by archlab: transformers' "
                    f"{self.architecture} ignores layer_types and makes every layer {kind} "
                    f"(sliding_window={window!r}); per-layer patterns are model_type 'ministral'")
            return window, None
        if self.window_style == "types":   # ministral: HF's defaults when layer_types is absent
            window = c.data["sliding_window"] if "sliding_window" in c.data else self.default_window
            types = c.get("layer_types") or [
                "sliding_attention" if window is not None else "full_attention"] * n
            if len(types) != n:
                raise c.error(f"layer_types has {len(types)} entries for {n} layers")
            pattern = pattern_from_types(types, c)
            if pattern and window is None:
                raise c.error("layer_types has sliding layers but sliding_window is null")
            return (window, pattern) if pattern else (None, None)
        # qwen: the window applies only when use_sliding_window, to layers >= max_window_layers
        if not c.get("use_sliding_window", False) or c.get("sliding_window") is None:
            return None, None
        types = c.get("layer_types") or [
            "sliding_attention" if i >= c.get("max_window_layers", 28) else "full_attention"
            for i in range(n)
        ]
        if len(types) != n:
            raise c.error(f"layer_types has {len(types)} entries for {n} layers")
        pattern = pattern_from_types(types, c)
        return (c.get("sliding_window"), pattern) if pattern else (None, None)

    def read_moe(self, c: HFConfig) -> MoEConfig | None:
        return None

    def read_eps(self, c: HFConfig) -> float:
        return float(c.get("rms_norm_eps", 1e-6))

    # ---- saving --------------------------------------------------------------------------------
    def from_config(self, cfg: ModelConfig) -> dict:
        self.check_switches(cfg)
        hf = self.base_hf(cfg)
        hf.update(
            **self.sizes_hf(cfg), hidden_act=GATED_ACT_BACK[cfg.mlp.activation],
            attention_dropout=float(cfg.attention.dropout),
            **write_rope(cfg.position.rope_theta, cfg.position.rope_scaling),
        )
        if self.norm_kind != "nonparametric":
            hf["rms_norm_eps"] = float(cfg.norm.eps)
        if cfg.attention.clip_qkv is not None:
            hf["clip_qkv"] = float(cfg.attention.clip_qkv)
        if self.has_attention_bias_field:
            hf["attention_bias"] = cfg.bias.qkv
        if self.model_type == "llama":
            hf["mlp_bias"] = cfg.bias.mlp
        hf.update(self.write_window(cfg))
        return hf

    def check_switches(self, cfg: ModelConfig) -> None:
        req = self.require
        req(cfg, "norm.kind", self.norm_kind)
        req(cfg, "norm.position", self.norm_position)
        if self.norm_kind == "nonparametric":
            req(cfg, "norm.eps", 1e-5)
        if not self.clip_qkv:
            req(cfg, "attention.clip_qkv", None)
        require_serial_full_rope(self, cfg)
        req(cfg, "position.local_rope_theta", None)
        req(cfg, "mlp.activation", list(GATED_ACT_BACK))
        for key in ("attention.prefix_lm", "attention.gated", "attention.learned_sinks",
                    "scale_embeddings", "bias.head"):
            req(cfg, key, False)
        for key in ("attention.logit_softcap", "attention.query_pre_attn_scalar", "logit_scale",
                    "final_logit_softcap"):
            req(cfg, key, None)
        req(cfg, "attention.qk_norm", self.qk_norm)
        if self.has_attention_bias_field:
            if cfg.bias.qkv != cfg.bias.attn_out:
                raise ConfigError(f"HF family {self.model_type!r} has one attention_bias for q, k, v "
                                  f"and o: bias.qkv={cfg.bias.qkv} and bias.attn_out="
                                  f"{cfg.bias.attn_out} differ")
        else:
            req(cfg, "bias.qkv", self.qkv_bias)
            req(cfg, "bias.attn_out", False)
        if self.model_type != "llama":
            req(cfg, "bias.mlp", False)
        if not self.routed_experts:
            req(cfg, "mlp.moe", None)
        if self.window_style == "none":
            req(cfg, "attention.window", None)
        if self.window_style == "all" and cfg.attention.window is not None:
            req(cfg, "attention.layer_pattern", [None, "L"])

    def write_window(self, cfg: ModelConfig) -> dict:
        if self.window_style == "none":
            return {}
        local = [cfg.is_local(i) for i in range(cfg.n_layers)]
        if self.window_style == "all":
            return {"sliding_window": cfg.attention.window if all(local) else None}
        if self.window_style == "types":
            return {"sliding_window": cfg.attention.window, "layer_types": layer_types(cfg)}
        if not any(local):
            return {"use_sliding_window": False, "sliding_window": None,
                    "max_window_layers": cfg.n_layers}
        first = local.index(True)
        return {"use_sliding_window": True, "sliding_window": cfg.attention.window,
                "max_window_layers": first, "layer_types": layer_types(cfg)}

    def weight_table(self, cfg: ModelConfig) -> list[Rule]:
        return llama_table(self.norms)


@register_family
class LlamaFamily(LlamaLike):
    model_type = "llama"
    architecture = "LlamaForCausalLM"
    save_priority = 10


@register_family
class MistralFamily(LlamaLike):
    model_type = "mistral"
    architecture = "MistralForCausalLM"
    has_attention_bias_field = False
    window_style = "all"
    default_window = 4096             # MistralConfig's default (MixtralConfig's is None)
    save_priority = 20


@register_family
class MinistralFamily(LlamaLike):
    model_type = "ministral"
    architecture = "MinistralForCausalLM"
    has_attention_bias_field = False
    window_style = "types"
    default_window = 4096             # MinistralConfig's default
    save_priority = 25


@register_family
class Qwen2Family(LlamaLike):
    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    has_attention_bias_field = False
    qkv_bias = True
    window_style = "qwen"
    save_priority = 30


@register_family
class Qwen3Family(LlamaLike):
    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    qk_norm = "per_head"
    window_style = "qwen"
    save_priority = 30


@register_family
class MixtralFamily(LlamaLike):
    model_type = "mixtral"
    architecture = "MixtralForCausalLM"
    has_attention_bias_field = False
    window_style = "all"
    save_priority = 40
    routed_experts = True

    def read_moe(self, c: HFConfig) -> MoEConfig:
        c.unsupported("router_jitter_noise", why="multiplicative router noise in training")
        return MoEConfig(n_experts=c.require("num_local_experts"),
                         top_k=c.get("num_experts_per_tok", 2), normalize_top_k=True,
                         aux_loss_coef=c.get("router_aux_loss_coef", 0.001))

    def from_config(self, cfg: ModelConfig) -> dict:
        if cfg.mlp.moe is None:
            raise ConfigError("HF family 'mixtral' needs mlp.moe (a dense MLP is not a mixtral)")
        self.require(cfg, "mlp.moe.normalize_top_k", True)
        self.require(cfg, "mlp.moe.shared_expert_d_ff", None)
        hf = super().from_config(cfg)
        moe = cfg.mlp.moe
        hf.update(num_local_experts=moe.n_experts, num_experts_per_tok=moe.top_k,
                  router_aux_loss_coef=float(moe.aux_loss_coef), router_jitter_noise=0.0)
        return hf

    def to_config(self, hf: dict) -> ModelConfig:
        cfg = super().to_config(hf)
        if cfg.mlp.moe is None:  # pragma: no cover - read_moe always returns one
            raise ConfigError("mixtral config without experts")
        return cfg

    def weight_table(self, cfg: ModelConfig) -> list[Rule]:
        if cfg.mlp.moe is None:
            raise ConfigError("HF family 'mixtral' needs mlp.moe set")
        moe = {"gate": "router", "experts.{e}.w1": "experts.{e}.gate_proj", "experts.{e}.w2": "experts.{e}.down_proj",
               "experts.{e}.w3": "experts.{e}.up_proj"}
        return llama_table() + renames(layers(moe, "model.layers.{i}.block_sparse_moe.", "blocks.{i}.mlp."), "weight")


# the experts of the families with routed MLPs, HF (under model.layers.{i}.mlp.) -> ours (under blocks.{i}.mlp.)
ROUTED_EXPERTS = {"gate": "router", **{f"experts.{{e}}.{name}": f"experts.{{e}}.{name}"
                                       for name in ("gate_proj", "up_proj", "down_proj")}}


@register_family
class Qwen2MoeFamily(LlamaLike):
    model_type = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"
    has_attention_bias_field = False
    qkv_bias = True
    window_style = "qwen"
    routed_experts = True
    save_priority = 50

    def to_config(self, hf: dict) -> ModelConfig:
        c = HFConfig(hf, self.model_type)
        c.unsupported("qkv_bias", lambda v: v is False, "Qwen2-MoE without q/k/v biases")
        c.unsupported("decoder_sparse_step", lambda v: v != 1, "dense MLP layers between the sparse ones")
        c.unsupported("mlp_only_layers", bool, "dense MLP layers between the sparse ones")
        # every layer is sparse, so the experts' width is the MLP width (intermediate_size sizes dense layers only)
        return super().to_config({**hf, "intermediate_size": hf.get("moe_intermediate_size", 1408)})

    def read_moe(self, c: HFConfig) -> MoEConfig:
        return MoEConfig(n_experts=c.get("num_experts", 60), top_k=c.get("num_experts_per_tok", 4),
                         normalize_top_k=bool(c.get("norm_topk_prob", False)),
                         aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)),
                         shared_expert_d_ff=c.get("shared_expert_intermediate_size", 5632), shared_expert_gate=True)

    def from_config(self, cfg: ModelConfig) -> dict:
        moe = cfg.mlp.moe
        if moe is None or not moe.shared_expert_gate:
            raise ConfigError("HF family 'qwen2_moe' needs mlp.moe with a gated shared expert "
                              "(mlp.moe.shared_expert_gate)")
        hf = super().from_config(cfg)
        hf.update(num_experts=moe.n_experts, num_experts_per_tok=moe.top_k, norm_topk_prob=moe.normalize_top_k,
                  router_aux_loss_coef=float(moe.aux_loss_coef), moe_intermediate_size=cfg.d_ff,
                  shared_expert_intermediate_size=moe.shared_expert_d_ff, decoder_sparse_step=1, mlp_only_layers=[],
                  qkv_bias=True, output_router_logits=False)
        return hf

    def weight_table(self, cfg: ModelConfig) -> list[Rule]:
        shared = {f"shared_expert.{name}": f"shared_expert.{name}" for name in ("gate_proj", "up_proj", "down_proj")}
        return llama_table() + renames(layers({**ROUTED_EXPERTS, **shared, "shared_expert_gate": "shared_expert_gate"},
                                              "model.layers.{i}.mlp.", "blocks.{i}.mlp."), "weight")
