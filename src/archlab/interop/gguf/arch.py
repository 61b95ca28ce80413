"""GGUF architectures as data: how a file's `{arch}.*` metadata becomes the Hugging Face config.json whose
family (archlab.interop.families) then builds the ModelConfig and names the weights, and what llama.cpp's
converter did to the tensors on the way in (undone here, redone on export).

One `GGUFArch` per `general.architecture`; adding one is one entry in ARCHES:
  * `model_type`: the HF family whose config fields and weight table the file follows;
  * `fields`: `{arch}.<key>` -> config.json field, over COMMON_FIELDS;
  * `fixed`: config.json fields the architecture implies (llama.cpp hard-codes them);
  * `permute_qk`: llama.cpp's converter (convert_hf_to_gguf) reorders the rows of q and k of LLaMA-style models so that
    its RoPE rotates adjacent pairs (interleaved) instead of the two halves of each head (HF's rotate-half);
  * `norm_offset`: Gemma's RMSNorm multiplies by (1 + w); llama.cpp stores 1 + w, HF stores w;
  * `transposed`: GGUF tensor names stored (out, in) where HF stores (in, out) (GPT-2's Conv1D).
The tensor names come from gguf's own map (gguf.get_tensor_name_map), which knows llama.cpp's name for each
HF name of an architecture: no second name table.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from archlab.interop.gguf.reader import GGUFError, GGUFFile

# `{arch}.<key>` -> config.json field, for the LLaMA-like architectures
COMMON_FIELDS = {
    "context_length": "max_position_embeddings", "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers", "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta", "vocab_size": "vocab_size",
}


@dataclass(frozen=True)
class GGUFArch:
    """How one GGUF `general.architecture` maps onto an HF family (see the module docstring)."""

    name: str
    model_type: str
    fields: dict[str, str] = field(default_factory=lambda: dict(COMMON_FIELDS))
    fixed: dict[str, Any] = field(default_factory=dict)
    permute_qk: bool = False
    norm_offset: float = 0.0
    transposed: tuple[str, ...] = ()
    extra: Callable[[GGUFFile, dict], dict] | None = None     # more config.json fields from the file
    rotary: str = "full"          # "full": rope.dimension_count must equal head_dim; "partial": it may be less

    def hf_config(self, f: GGUFFile) -> dict:
        """The config.json dict this file describes."""
        hf: dict[str, Any] = {"model_type": self.model_type, **self.fixed}
        for key, hf_key in self.fields.items():
            value = f.metadata.get(f"{self.name}.{key}")
            if value is not None:
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise GGUFError(f"{f.path}: metadata {self.name}.{key}={value!r} is not a number")
                hf[hf_key] = value
        tokens = f.metadata.get("tokenizer.ggml.tokens")
        if "vocab_size" not in hf:
            if "token_embd.weight" not in f.tensors:
                raise GGUFError(f"{f.path}: no token_embd.weight tensor")
            hf["vocab_size"] = f.tensors["token_embd.weight"].shape[0]
        hf["tie_word_embeddings"] = "output.weight" not in f.tensors
        for role in ("bos", "eos", "pad"):
            key = f"tokenizer.ggml.{'padding' if role == 'pad' else role}_token_id"
            if isinstance(f.metadata.get(key), int) and tokens is not None and f.metadata[key] < len(tokens):
                hf[f"{role}_token_id"] = f.metadata[key]
        hf.update(_rope_scaling(f, self.name))
        n_heads = hf.get("num_attention_heads")
        if isinstance(n_heads, int) and n_heads > 0 and isinstance(hf.get("hidden_size"), int):
            head_dim = hf.get("head_dim", hf["hidden_size"] // n_heads)
            rot = f.metadata.get(f"{self.name}.rope.dimension_count")
            if isinstance(rot, int) and rot != head_dim:
                if self.rotary != "partial":
                    raise GGUFError(f"{f.path}: {self.name}.rope.dimension_count={rot} differs from the head size "
                                    f"{head_dim}; partial rotary is not supported for {self.name}")
                hf["partial_rotary_factor"] = rot / head_dim
        if self.extra is not None:
            hf.update(self.extra(f, hf))
        return hf

    def from_gguf(self, name: str, tensor: torch.Tensor, hf: dict) -> torch.Tensor:
        """A dequantized GGUF tensor as the HF checkpoint holds it."""
        if self.permute_qk and name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")):
            tensor = unpermute_rows(tensor, _heads(name, hf))
        if self.norm_offset and name.endswith("norm.weight"):
            tensor = tensor - self.norm_offset
        if tensor.ndim == 2 and any(name.endswith(t) for t in self.transposed):
            tensor = tensor.t().contiguous()
        return tensor

    def to_gguf(self, name: str, tensor: torch.Tensor, hf: dict) -> torch.Tensor:
        """An HF checkpoint tensor as llama.cpp stores it under GGUF name `name` (from_gguf's inverse)."""
        if tensor.ndim == 2 and any(name.endswith(t) for t in self.transposed):
            tensor = tensor.t().contiguous()
        if self.norm_offset and name.endswith("norm.weight"):
            tensor = tensor + self.norm_offset
        if self.permute_qk and name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")):
            tensor = permute_rows(tensor, _heads(name, hf))
        return tensor


def _heads(name: str, hf: dict) -> int:
    n = hf["num_attention_heads"]
    return n if ".attn_q." in name else hf.get("num_key_value_heads", n)


def permute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF's rotate-half row order -> llama.cpp's interleaved pairs, per head (convert_hf_to_gguf's permute):
    within each head, rows (0..e/2-1 | e/2..e-1) become (0, e/2, 1, e/2+1, ...)."""
    e = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, e // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)   # (h*e, ...) -> same


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """permute_rows' inverse: llama.cpp's interleaved pairs -> HF's rotate-half order."""
    e = w.shape[0] // n_heads
    return w.reshape(n_heads, e // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)   # (h*e, ...) -> same


def _rope_scaling(f: GGUFFile, arch: str) -> dict:
    """config.json's rope_scaling from `{arch}.rope.scaling.*` (none, linear, yarn)."""
    kind = f.metadata.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return {}
    factor = f.field(f"{arch}.rope.scaling.factor", float)
    if kind == "linear" and factor is not None:
        return {"rope_scaling": {"rope_type": "linear", "factor": factor}}
    if kind == "yarn" and factor is not None:
        original = f.field(f"{arch}.rope.scaling.original_context_length", int)
        return {"rope_scaling": {"rope_type": "yarn", "factor": factor,
                                 **({"original_max_position_embeddings": original} if original else {})}}
    raise GGUFError(f"{f.path}: {arch}.rope.scaling.type={kind!r} is not supported (supported: none, linear, yarn)")


def _gemma_scale(layers_27b: int) -> Callable[[GGUFFile, dict], dict]:
    """Gemma 2 and 3 scale queries by query_pre_attn_scalar**-0.5: llama.cpp hard-codes head_dim, except for the
    27B models (recognised by their layer count, as llama.cpp does), which use hidden_size / n_heads."""
    def extra(f: GGUFFile, hf: dict) -> dict:
        if hf.get("num_hidden_layers") == layers_27b:
            return {"query_pre_attn_scalar": hf["hidden_size"] // hf["num_attention_heads"]}
        return {"query_pre_attn_scalar": hf.get("head_dim", 256)}
    return extra


def _llama_biases(f: GGUFFile, hf: dict) -> dict:
    """LLaMA's attention_bias / mlp_bias: the file has no key for them, its tensors say."""
    return {"attention_bias": "blk.0.attn_q.bias" in f.tensors, "mlp_bias": "blk.0.ffn_up.bias" in f.tensors}


GEMMA_FIELDS = {**COMMON_FIELDS, "attention.sliding_window": "sliding_window",
                "attn_logit_softcapping": "attn_logit_softcapping",
                "final_logit_softcapping": "final_logit_softcapping"}

ARCHES: dict[str, GGUFArch] = {a.name: a for a in [
    GGUFArch("llama", "llama", fixed={"hidden_act": "silu"}, permute_qk=True, extra=_llama_biases),
    GGUFArch("qwen2", "qwen2", fixed={"hidden_act": "silu"}),
    GGUFArch("qwen3", "qwen3", fixed={"hidden_act": "silu"}),
    GGUFArch("phi3", "phi3", fields={**COMMON_FIELDS, "attention.sliding_window": "sliding_window"},
             fixed={"hidden_act": "silu"}, rotary="partial"),
    GGUFArch("gemma", "gemma", fixed={"hidden_act": "gelu_pytorch_tanh"}, norm_offset=1.0),
    GGUFArch("gemma2", "gemma2", fields=GEMMA_FIELDS, fixed={"hidden_activation": "gelu_pytorch_tanh"},
             norm_offset=1.0, extra=_gemma_scale(46)),
    GGUFArch("gemma3", "gemma3_text", fields=GEMMA_FIELDS, fixed={"hidden_activation": "gelu_pytorch_tanh"},
             norm_offset=1.0, extra=_gemma_scale(62)),
    GGUFArch("gpt2", "gpt2",
             fields={"context_length": "n_positions", "embedding_length": "n_embd", "block_count": "n_layer",
                     "feed_forward_length": "n_inner", "attention.head_count": "n_head",
                     "attention.layer_norm_epsilon": "layer_norm_epsilon", "vocab_size": "vocab_size"},
             fixed={"activation_function": "gelu_new"},
             transposed=("attn_qkv.weight", "attn_output.weight", "ffn_up.weight", "ffn_down.weight")),
]}


def arch_of(f: GGUFFile) -> GGUFArch:
    """The GGUFArch of the file's general.architecture; a GGUFError lists the supported ones."""
    name = f.field("general.architecture", str)
    if name is None:
        raise GGUFError(f"{f.path}: no general.architecture in the metadata")
    if name not in ARCHES:
        raise GGUFError(f"{f.path}: architecture {name!r} is not supported (supported: {', '.join(ARCHES)})")
    return ARCHES[name]

