"""What every kind of LM shares at its two ends: the embedder (token ids -> vectors), the weight init, and
the masked-LM head an encoder puts on top.

The embedder is a mixin, not a child module, so that every model keeps its parameters at the top level
(`embed.weight`, `abs_position.embedding.weight`, `embed_norm.weight`, `token_types.weight`): checkpoints,
HF weight rules and optimizer states name them the same in decoders and encoders.

    x = E[ids] (* sqrt(d), Gemma) (+ T[token types], BERT) (+ P[positions], GPT-2 / BERT / sinusoids)
      -> embedding norm (BLOOM, BERT) -> dropout
"""
from __future__ import annotations

import math

import torch
from torch import nn

from archlab.config import GATED_ACTIVATIONS, ModelConfig
from archlab.nn.fused import head_linear
from archlab.nn.mlp import ACTIVATIONS
from archlab.nn.norms import build_norm
from archlab.nn.position import AbsolutePosition

__all__ = ["Embedder", "MLMHead", "init_weights"]


class Embedder:
    """Mixin for an nn.Module LM: `build_embedder(cfg)` in __init__, `embed_tokens(...)` in forward."""

    config: ModelConfig
    embed: nn.Embedding
    token_types: nn.Embedding | None
    abs_position: AbsolutePosition
    embed_norm: nn.Module | None
    embed_drop: nn.Dropout
    training: bool

    def build_embedder(self, cfg: ModelConfig) -> None:
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.abs_position = AbsolutePosition(cfg)
        # registered only where the config has them, so decoder checkpoints keep exactly their old keys
        self.token_types = nn.Embedding(cfg.type_vocab_size, cfg.d_model) if cfg.type_vocab_size else None
        self.embed_norm = (build_norm(cfg.norm.kind, cfg.d_model, cfg.norm.eps, cfg.bias.norm)
                           if cfg.norm.embedding_norm else None)
        self.embed_drop = nn.Dropout(cfg.embedding_dropout)

    def embed_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     token_type_ids: torch.Tensor | None = None, *,
                     stack_parts: tuple[AbsolutePosition, nn.Module | None] | None = None) -> torch.Tensor:
        """Token vectors (scaled as Gemma), token types (BERT's segments; 0 where not given), absolute
        positions where the config adds them at the input, the embedding norm and dropout. (b, t) -> (b, t, d).
        stack_parts: (position, embedding norm) of a stack of its own (BART's and Marian's decoder:
        position.per_stack) in place of the model's `abs_position` and `embed_norm`."""
        abs_position, embed_norm = stack_parts or (self.abs_position, self.embed_norm)
        x = self.embed(input_ids)                                           # (b, t, d)
        if self.config.scale_embeddings:  # Gemma: sqrt(d) rounded to the activation dtype
            x = x * torch.tensor(self.config.d_model ** 0.5, dtype=x.dtype)
        if self.token_types is not None:
            types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            x = x + self.token_types(types)
        elif token_type_ids is not None:
            raise ValueError("token_type_ids given but the config has no token types (type_vocab_size=0)")
        if abs_position.at_input:
            x = x + abs_position(positions).to(x.dtype)
        if embed_norm is not None:
            x = embed_norm(x)
        if self.training:
            x = self.embed_drop(x)
        return x


class MLMHead(nn.Module):
    """BERT's masked-LM head (Devlin et al. 2019): transform (dense + activation + norm), then the decoder,
    tied to the token embedding in BERT and RoBERTa, with its own vocabulary bias (the model's head_bias).
    The activation is the MLP's (BERT's `hidden_act`; GELU for a gated MLP)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        act = cfg.mlp.activation
        self.act = ACTIVATIONS["gelu" if act in GATED_ACTIVATIONS else act]
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)
        self.norm = build_norm(cfg.norm.kind, cfg.d_model, cfg.norm.eps, cfg.bias.norm)

    def transform(self, x: torch.Tensor) -> torch.Tensor:           # (b, t, d) -> (b, t, d)
        return self.norm(self.act(self.dense(x)))

    def forward(self, x: torch.Tensor, owner: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None
                ) -> torch.Tensor:                                   # (b, t, d) -> (b, t, v)
        return head_linear(self.transform(x), owner, weight, bias)


def _t5_std(name: str, module: nn.Module, cfg: ModelConfig) -> float | None:
    """T5's init (Mesh TensorFlow, as transformers' T5PreTrainedModel._init_weights with factor 1): queries
    (d e)^-0.5, keys, values, MLP inputs and relative-bias tables d^-0.5, attention outputs (h e)^-0.5, MLP outputs
    d_ff^-0.5, token embedding and untied head 1. The queries' scale stands in for the 1/sqrt(e) that T5's
    attention leaves out. None: a matrix T5 does not have (init.std)."""
    d, e, h, f = cfg.d_model, cfg.head_dim, cfg.attention.n_heads, cfg.d_ff
    leaf = name.rsplit(".", 1)[-1]
    if isinstance(module, nn.Embedding):
        return {"embed": 1.0, "embedding": d ** -0.5}.get(leaf)     # the token table; T5's bias tables
    return {"q_proj": (d * e) ** -0.5, "k_proj": d ** -0.5, "v_proj": d ** -0.5, "o_proj": (h * e) ** -0.5,
            "gate_proj": d ** -0.5, "up_proj": d ** -0.5, "down_proj": f ** -0.5, "lm_head": 1.0}.get(leaf)


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig) -> None:
    """One init for every kind of LM: Normal(0, std) for matrices and embeddings, zero biases (and zero
    parameters named *bias, e.g. a head's vocabulary bias); residual outputs scaled by 1/sqrt(2 n_layers)
    when init.scaled_residual (GPT-2); with init.kind="t5", T5's per-matrix scales (_t5_std). Seeded by
    cfg.seed alone; nothing to do on the meta device.
    Example: init_weights(model, model.config)   # at the end of a model's __init__"""
    if any(p.is_meta for p in model.parameters()):   # weights come from a checkpoint
        return
    init = cfg.init
    gen = torch.Generator().manual_seed(cfg.seed)
    residual_std = init.std / math.sqrt(2 * cfg.n_layers)

    def fill(weight: torch.Tensor, std: float) -> None:
        if init.truncated:
            nn.init.trunc_normal_(weight, 0.0, std, -3 * std, 3 * std, generator=gen)
        else:
            nn.init.normal_(weight, 0.0, std, generator=gen)

    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        std = _t5_std(name, module, cfg) if init.kind == "t5" else None
        if std is None:
            scaled = init.scaled_residual and getattr(module, "is_residual_out", False)
            std = residual_std if scaled else init.std
        fill(module.weight, std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.zero_()
    for name, param in model.named_parameters(recurse=False):
        if name.endswith("bias"):
            param.zero_()
