"""OLMo (Groeneveld et al. 2024), OLMo 2 (OLMo et al. 2024) and OLMoE (Muennighoff et al. 2024): LLaMA-like
layouts with different norms (and OLMoE's experts).

  olmo   non-parametric LayerNorm (no weight, no bias, eps 1e-5: there are no norm tensors at
         all), optional clip_qkv clamping q, k, v to [-c, c], attention_bias on q, k, v and o
  olmo2  RMSNorm AFTER each sublayer, inside the residual branch ("post_sublayer":
         x + N(attn(x)), HF's `post_attention_layernorm` / `post_feedforward_layernorm`), and
         QK-norm over the full projection width (`q_norm` over h*e, `k_norm` over k*e)
  olmoe  pre-norm RMSNorm, olmo2's full-width QK-norm and a top-k mixture of experts (`mlp.gate`,
         `mlp.experts.E.{gate,up,down}_proj`): softmax over all experts, top-k, the k weights renormalized
         only with norm_topk_prob (OLMoE-1B-7B: not). A clip_qkv is refused: transformers clamps q and k
         after their norm, archlab's attention before it (OLMoE-1B-7B has none)
"""
from __future__ import annotations

from archlab.config import ConfigError, ModelConfig, MoEConfig
from archlab.interop.families.base import HFConfig, register_family
from archlab.interop.families.llama import ROUTED_EXPERTS, LlamaLike, llama_table
from archlab.interop.families.tables import Rule, layers, renames

POST_SUBLAYER_NORMS = {"post_attention_layernorm": "attn_norm", "post_feedforward_layernorm": "mlp_norm"}


@register_family
class OlmoFamily(LlamaLike):
    model_type = "olmo"
    architecture = "OlmoForCausalLM"
    norm_kind = "nonparametric"
    clip_qkv = True

    def read_eps(self, c: HFConfig) -> float:
        return 1e-5  # OlmoLayerNorm hard-codes it


@register_family
class Olmo2Family(LlamaLike):
    model_type = "olmo2"
    architecture = "Olmo2ForCausalLM"
    norm_position = "post_sublayer"
    norms = POST_SUBLAYER_NORMS
    qk_norm = "full"

    def read_eps(self, c: HFConfig) -> float:
        return float(c.get("rms_norm_eps", 1e-5))


@register_family
class OlmoeFamily(LlamaLike):
    model_type = "olmoe"
    architecture = "OlmoeForCausalLM"
    qk_norm = "full"
    routed_experts = True
    save_priority = 45

    def read_eps(self, c: HFConfig) -> float:
        return float(c.get("rms_norm_eps", 1e-5))

    def read_moe(self, c: HFConfig) -> MoEConfig:
        c.unsupported("clip_qkv", lambda v: True, "transformers' OLMoE clamps q and k after the QK-norm, archlab "
                                                  "before it")
        return MoEConfig(n_experts=c.get("num_experts", 64), top_k=c.get("num_experts_per_tok", 8),
                         normalize_top_k=bool(c.get("norm_topk_prob", False)),
                         aux_loss_coef=float(c.get("router_aux_loss_coef", 0.01)))

    def from_config(self, cfg: ModelConfig) -> dict:
        moe = cfg.mlp.moe
        if moe is None:
            raise ConfigError("HF family 'olmoe' needs mlp.moe (a dense MLP is not an olmoe)")
        self.require(cfg, "mlp.moe.shared_expert_d_ff", None)
        hf = super().from_config(cfg)
        hf.update(num_experts=moe.n_experts, num_experts_per_tok=moe.top_k, norm_topk_prob=moe.normalize_top_k,
                  router_aux_loss_coef=float(moe.aux_loss_coef), output_router_logits=False)
        return hf

    def weight_table(self, cfg: ModelConfig) -> list[Rule]:
        return llama_table() + renames(layers(ROUTED_EXPERTS, "model.layers.{i}.mlp.", "blocks.{i}.mlp."), "weight")
