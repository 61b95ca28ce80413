"""TransformerLM: embedder (embed_tokens) -> TransformerStack("decoder") -> final norm -> LM head, every
choice from ModelConfig.

Read top to bottom: the variants live in archlab.nn (norms, mlp, position, attention, block);
this file only wires them. Parallelism, compilation and checkpointing are applied to a built
model from outside (train.py), never here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from archlab.config import ConfigError, ModelConfig
from archlab.nn.embedding import Embedder, init_weights
from archlab.nn.fused import DecodeSession, head_linear
from archlab.nn.fused_loss import linear_cross_entropy
from archlab.nn.mlp import MoEMLP
from archlab.nn.norms import build_norm
from archlab.nn.stack import TransformerStack, stack_t5_table


@dataclass
class LossOutput:
    total: torch.Tensor     # what to backpropagate
    ce: torch.Tensor        # mean next-token cross-entropy (nats); no gradient on the fused path
    z_loss: torch.Tensor    # z_loss * mean(log Z)^2 (PaLM), already weighted
    aux_loss: torch.Tensor  # MoE load-balancing + router z-loss, already weighted
    accuracy: torch.Tensor | None = None   # share of scored slots whose argmax is the target (MLM evaluation)
    nsp_loss: torch.Tensor | None = None   # next-sentence cross-entropy (BERT pretraining), already in total
    nsp_accuracy: torch.Tensor | None = None   # share of rows whose next-sentence label is predicted (evaluation)


class NextTokenHead:
    """Mixin for an nn.Module LM whose top is a next-token head (the decoder-only LM, the encoder-decoder): the
    head (tied or not, bias, Cohere's logit scale, Gemma 2's soft-cap, T5's d**-0.5 rescale as a logit scale)
    and its losses. Its parameters stay the model's own (`lm_head.weight`, `head_bias`)."""

    config: ModelConfig
    embed: nn.Embedding
    lm_head: nn.Linear | None
    head_bias: nn.Parameter | None

    @property
    def head_weight(self) -> torch.Tensor:  # (v, d): the LM head, or the embedding when tied
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def head(self, x: torch.Tensor, session: DecodeSession | None = None) -> torch.Tensor:  # (b, t, d) -> (b, t, v)
        owner = cast(nn.Module, self) if self.lm_head is None else self.lm_head     # hooks on lm_head are honoured
        logits = head_linear(x, owner, self.head_weight, self.head_bias, session)   # packed in a decode session
        if self.config.logit_scale is not None:       # Cohere
            logits = logits * self.config.logit_scale
        cap = self.config.final_logit_softcap         # Gemma 2: cap * tanh(logits / cap)
        if cap is not None:
            logits = (cap * torch.tanh(logits.float() / cap)).to(logits.dtype)
        return logits

    def loss_from_hidden(self, hidden: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100) -> LossOutput:
        """The loss from the final hidden states: the head (bias, logit scale, soft-cap as in `head`)
        and the cross-entropy fused in row chunks (nn/fused_loss.py: no (b, t, v) logits in memory)."""
        weight: torch.Tensor = self.head_weight
        bias: torch.Tensor | None = self.head_bias
        if self.config.logit_scale is not None:       # Cohere: scaling the logits = scaling W (and b)
            weight = weight * self.config.logit_scale
            bias = None if bias is None else bias * self.config.logit_scale
        total, ce, z_loss = linear_cross_entropy(hidden.flatten(0, 1), weight, targets.flatten(),
                                                 ignore_index, self.config.z_loss or 0.0, bias=bias,
                                                 softcap=self.config.final_logit_softcap)
        aux = self._aux_loss(ce.new_zeros(()))
        return LossOutput(total=total + aux, ce=ce, z_loss=z_loss, aux_loss=aux)

    def loss_from_logits(self, logits: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100) -> LossOutput:
        logits = logits.float()
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index)
        zero = logits.new_zeros(())
        z_loss = zero
        if self.config.z_loss:
            valid = targets != ignore_index
            log_z = torch.logsumexp(logits, dim=-1)[valid]
            z_loss = self.config.z_loss * log_z.square().mean()
        aux = self._aux_loss(zero)
        return LossOutput(total=ce + z_loss + aux, ce=ce, z_loss=z_loss, aux_loss=aux)

    def _aux_loss(self, zero: torch.Tensor) -> torch.Tensor:
        """The MoE layers' weighted auxiliary losses of the last forward (zero without MoE)."""
        return sum((m.aux_loss for m in cast(nn.Module, self).modules() if isinstance(m, MoEMLP)), zero)


class TransformerLM(Embedder, NextTokenHead, nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        cfg = self.config = config
        if cfg.arch != "decoder":
            other = {"encoder": "EncoderLM", "encoder_decoder": "EncoderDecoderLM"}[cfg.arch]
            raise ConfigError(f"arch={cfg.arch!r}: TransformerLM is the decoder-only LM (build archlab.{other})")
        self.build_embedder(cfg)
        self.t5_bias = stack_t5_table(cfg, "decoder")   # one table for all layers (T5), or None
        self.blocks = TransformerStack(cfg, "decoder", self.t5_bias)   # a ModuleList: keys stay blocks.{i}.
        self.final_norm = (build_norm(cfg.norm.kind, cfg.d_model, cfg.norm.eps, cfg.bias.norm)
                           if cfg.norm.final_norm else None)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head_bias = nn.Parameter(torch.zeros(cfg.vocab_size)) if cfg.bias.head else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn/embedding.init_weights: the one init every kind of LM shares."""
        init_weights(self, self.config)

    # ---- forward -----------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,                      # (b, t) int
        positions: torch.Tensor | None = None,        # (b, t) int; -1 marks padding. None: 0..t-1, or
                                                      # continuing the cache (rows unpadded, one length)
        cache=None,                                   # see archlab.nn.kv_cache for the protocol
        prefix_lengths: torch.Tensor | None = None,   # (b,) for attention.prefix_lm
        return_hidden: bool = False,
        targets: torch.Tensor | None = None,          # (b, t) int: return the LossOutput instead
        session: DecodeSession | None = None,         # a decode loop's packed weights (nn/fused)
        document_ids: torch.Tensor | None = None,     # (b, t) int: packed documents (-1 padding); positions
                                                      # restart at each, no query sees another document
    ) -> torch.Tensor | LossOutput:                   # (b, t, v) logits, or (b, t, d) hidden
        inputs = self.blocks.inputs(input_ids, positions=positions, document_ids=document_ids, cache=cache,
                                    prefix_lengths=prefix_lengths, session=session)
        x = self.embed_tokens(input_ids, inputs.positions)                          # (b, t, d)
        x = self.blocks(x, inputs)                                           # (b, t, d)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if return_hidden:
            return x
        if targets is not None:  # through forward, so DDP/FSDP/compile wrappers see the whole step
            return self.loss_from_hidden(x, targets)
        return self.head(x, session)

    # ---- loss ----------------------------------------------------------------------------
    def loss(self, input_ids: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
             **forward_kw) -> LossOutput:
        """Next-token cross-entropy (targets already shifted) + z-loss + MoE auxiliary losses."""
        hidden = self(input_ids, return_hidden=True, **forward_kw)          # (b, t, d)
        return self.loss_from_hidden(hidden, targets, ignore_index)

    def num_params(self) -> int:
        """Unique parameters (tied embeddings count once)."""
        return sum(p.numel() for p in self.parameters())
