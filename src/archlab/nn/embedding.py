"""What every kind of LM shares at its input: the embedder (token ids -> vectors), and the weight init of the
whole model (the heads' included, nn/heads.py).

The embedder is a mixin, not a child module, so that every model keeps its parameters at the top level
(`embed.weight`, `abs_position.embedding.weight`, `embed_norm.weight`, `token_types.weight`): checkpoints,
HF weight rules and optimizer states name them the same in decoders and encoders.

    x = E[ids] (* sqrt(d), Gemma) (+ T[token types], BERT) (+ P[positions], GPT-2 / BERT / sinusoids)
      -> embedding norm (BLOOM, BERT) -> dropout
"""
from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn

from archlab.config import ModelConfig
from archlab.nn.fused import DecodeSession, direct
from archlab.nn.heads import LMHead
from archlab.nn.norms import build_norm
from archlab.nn.position import AbsolutePosition

__all__ = ["Embedder", "init_weights"]


class Embedder:
    """Mixin for an nn.Module LM: `build_embedder(cfg)` in __init__, `embed_tokens(...)` in forward."""

    config: ModelConfig
    embed: nn.Embedding
    token_types: nn.Embedding | None
    abs_position: AbsolutePosition
    embed_norm: nn.Module | None
    embed_drop: nn.Dropout
    decoder_abs_position: AbsolutePosition | None
    decoder_embed_norm: nn.Module | None
    training: bool

    def build_embedder(self, cfg: ModelConfig, two_stacks: bool = False) -> None:
        """two_stacks: an encoder-decoder's, whose decoder has its own absolute positions and embedding norm
        with position.per_stack (BART, Marian: `decoder_abs_position`, `decoder_embed_norm`)."""
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.abs_position = AbsolutePosition(cfg)
        # registered only where the config has them, so decoder checkpoints keep exactly their old keys
        self.token_types = nn.Embedding(cfg.type_vocab_size, cfg.d_model) if cfg.type_vocab_size else None
        self.embed_norm = (build_norm(cfg.norm.kind, cfg.d_model, cfg.norm.eps, cfg.bias.norm)
                           if cfg.norm.embedding_norm else None)
        self.embed_drop = nn.Dropout(cfg.embedding_dropout)
        own = two_stacks and cfg.position.per_stack
        self.decoder_abs_position = AbsolutePosition(cfg) if own else None
        self.decoder_embed_norm = (build_norm(cfg.norm.kind, cfg.d_model, cfg.norm.eps, cfg.bias.norm)
                                   if own and cfg.norm.embedding_norm else None)

    def embed_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     token_type_ids: torch.Tensor | None = None, *, decoder: bool = False,
                     session: DecodeSession | None = None) -> torch.Tensor:
        """Token vectors (scaled as Gemma), token types (BERT's segments; 0 where not given), absolute
        positions where the config adds them at the input, the embedding norm and dropout. (b, t) -> (b, t, d).
        decoder: an encoder-decoder's decoder side, which reads its own position and embedding norm where it
        has them (position.per_stack) in place of the model's `abs_position` and `embed_norm`; session: a decode
        loop's (its direct calls, nn/fused.direct)."""
        m = direct(cast(nn.Module, self), session)   # the embeddings, or in a decode session their forwards
        position = self.decoder_abs_position if decoder and self.decoder_abs_position is not None else None
        own = position is not None
        at_input = (self.abs_position if position is None else position).at_input
        abs_position, embed_norm = ((m.decoder_abs_position, m.decoder_embed_norm) if own
                                    else (m.abs_position, m.embed_norm))
        x = m.embed(input_ids)                                              # (b, t, d)
        if self.config.scale_embeddings:  # Gemma: sqrt(d) rounded to the activation dtype
            x = x * torch.tensor(self.config.d_model ** 0.5, dtype=x.dtype)
        if self.token_types is not None:
            types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            x = x + m.token_types(types)
        elif token_type_ids is not None:
            raise ValueError("token_type_ids given but the config has no token types (type_vocab_size=0)")
        if at_input:
            x = x + abs_position(positions).to(x.dtype)
        if embed_norm is not None:
            x = embed_norm(x)
        if self.training:
            x = self.embed_drop(x)
        return x


def _t5_std(name: str, module: nn.Module, cfg: ModelConfig) -> float | None:
    """T5's init (Mesh TensorFlow, as transformers' T5PreTrainedModel._init_weights with factor 1): queries
    (d e)^-0.5, keys, values, MLP inputs and relative-bias tables d^-0.5, attention outputs (h e)^-0.5, MLP outputs
    d_ff^-0.5, token embedding and untied head 1. The queries' scale stands in for the 1/sqrt(e) that T5's
    attention leaves out. None: a matrix T5 does not have (init.std)."""
    d, e, h, f = cfg.d_model, cfg.head_dim, cfg.attention.n_heads, cfg.d_ff
    leaf = name.rsplit(".", 1)[-1]
    if isinstance(module, LMHead):
        return 1.0
    if isinstance(module, nn.Embedding):
        return {"embed": 1.0, "embedding": d ** -0.5}.get(leaf)     # the token table; T5's bias tables
    return {"q_proj": (d * e) ** -0.5, "k_proj": d ** -0.5, "v_proj": d ** -0.5, "o_proj": (h * e) ** -0.5,
            "gate_proj": d ** -0.5, "up_proj": d ** -0.5, "down_proj": f ** -0.5}.get(leaf)


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig) -> None:
    """One init for every kind of LM: Normal(0, std) for matrices and embeddings, zero biases (a head's
    vocabulary bias too); residual outputs scaled by 1/sqrt(2 n_layers)
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
        if not isinstance(module, (nn.Linear, nn.Embedding, LMHead)) or module.weight is None:   # a tied head: none
            continue
        std = _t5_std(name, module, cfg) if init.kind == "t5" else None
        if std is None:
            scaled = init.scaled_residual and getattr(module, "is_residual_out", False)
            std = residual_std if scaled else init.std
        fill(module.weight, std)
        if isinstance(module, (nn.Linear, LMHead)) and module.bias is not None:
            module.bias.zero_()
