"""OLMo (Groeneveld et al. 2024) and OLMo 2 (OLMo et al. 2024): LLaMA-like layouts with
different norms.

  olmo   non-parametric LayerNorm (no weight, no bias, eps 1e-5: there are no norm tensors at
         all), optional clip_qkv clamping q, k, v to [-c, c], attention_bias on q, k, v and o
  olmo2  RMSNorm AFTER each sublayer, inside the residual branch ("post_sublayer":
         x + N(attn(x)), HF's `post_attention_layernorm` / `post_feedforward_layernorm`), and
         QK-norm over the full projection width (`q_norm` over h*e, `k_norm` over k*e)
"""
from __future__ import annotations

from archlab.interop.families.base import HFConfig, register_family
from archlab.interop.families.llama import LlamaLike

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
