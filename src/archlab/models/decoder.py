"""TransformerLM: embedder (embed_tokens) -> TransformerStack("decoder") (its final norm included) -> LM head
(nn/heads.LMHead), every choice from ModelConfig.

Read top to bottom: the variants live in archlab.nn (norms, mlp, position, attention, block);
this file only wires them. Parallelism, compilation and activation checkpointing are applied to a built
model from outside (training/distributed.py prepare_model, training/recompute.py), never here.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from archlab.config import ConfigError, ModelConfig
from archlab.nn.embedding import Embedder, init_weights
from archlab.nn.fused import DecodeSession, PlannedDecode, call
from archlab.nn.heads import LMHead, LossOutput
from archlab.nn.mlp import MoEMLP
from archlab.nn.stack import TransformerStack

__all__ = ["LossOutput", "TransformerLM", "moe_aux_loss", "moe_balance_step", "moe_load_fields", "next_token_loss"]


def moe_aux_loss(model: nn.Module, zero: torch.Tensor) -> torch.Tensor:
    """The MoE layers' weighted auxiliary losses of the last forward (zero without MoE)."""
    return sum((m.aux_loss for m in model.modules() if isinstance(m, MoEMLP)), zero)


def moe_load_fields(model: nn.Module) -> dict[str, float | list[list[float]]]:
    """The routed experts' load in the model's last forward, for a metrics line (real tokens only): the share of
    routed slots each expert took, per MoE layer (`moe/expert_fraction`, 4 decimals; 1 / n_experts each is perfect
    balance) and the busiest expert's share over all layers (`moe/max_expert_fraction`). {} without MoE.
    Example: moe_load_fields(model) -> {"moe/max_expert_fraction": 0.41, "moe/expert_fraction": [[0.41, ...]]}"""
    loads = [m.load for m in model.modules() if isinstance(m, MoEMLP)]
    if not loads:
        return {}
    table = torch.stack([load.float().cpu() for load in loads])        # (moe layers, n) one host sync
    return {"moe/max_expert_fraction": round(float(table.max()), 4),
            "moe/expert_fraction": [[round(f, 4) for f in row] for row in table.tolist()]}


def moe_balance_step(model: nn.Module, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     update: bool = True) -> None:
    """After an optimizer step: every MoE layer with balance=bias moves its expert bias by the routed slots its
    training forwards counted since the last call (DeepSeek-V3: over the whole step, every micro-batch), and the
    counts start again. `reduce` sums a (layers, n) count table over data-parallel ranks, so every rank moves its
    bias alike; update=False (a skipped, non-finite step) drops the counts. No-op without such layers.
    Example: loss.backward(); optimizer.step(); moe_balance_step(model)"""
    layers = [(m, m.expert_bias) for m in model.modules() if isinstance(m, MoEMLP) and m.expert_bias is not None]
    taken = [m.take_routed() for m, _ in layers]
    if not update or not layers:
        return
    table = torch.stack([torch.zeros_like(bias) if c is None else c.to(bias)                     # (layers, n)
                         for (_, bias), c in zip(layers, taken)])
    if reduce is not None:
        table = reduce(table)
    for (m, _), counts in zip(layers, table):
        m.update_bias(counts)


def next_token_loss(model: nn.Module, head: LMHead, hidden: torch.Tensor, targets: torch.Tensor,
                    ignore_index: int = -100) -> LossOutput:
    """The next-token loss of a model's final hidden states (b, t, d) against targets (b, t): the head's
    cross-entropy fused in row chunks, its z-loss, the model's MoE auxiliary losses."""
    total, ce, z_loss = head.fused_loss(hidden.flatten(0, 1), targets.flatten(), ignore_index)
    aux = moe_aux_loss(model, ce.new_zeros(()))
    return LossOutput(total=total + aux, ce=ce, z_loss=z_loss, aux_loss=aux)


class TransformerLM(Embedder, PlannedDecode, nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        cfg = self.config = config
        if cfg.arch != "decoder":
            other = {"encoder": "EncoderLM", "encoder_decoder": "EncoderDecoderLM"}[cfg.arch]
            raise ConfigError(f"arch={cfg.arch!r}: TransformerLM is the decoder-only LM (build archlab.{other})")
        self.build_embedder(cfg)
        self.blocks = TransformerStack(cfg, "decoder")   # its layers, T5 table and final norm
        self.lm_head = LMHead(cfg, self.embed)
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
        x = self.embed_tokens(input_ids, inputs.positions, session=session)        # (b, t, d)
        x = call(self.blocks, session)(x, inputs)     # (b, t, d), normed; decoding: the stack's forward (nn/fused)
        if return_hidden:
            return x
        if targets is not None:  # through forward, so DDP/FSDP/compile wrappers see the whole step
            return self.loss_from_hidden(x, targets)
        return call(self.lm_head, session)(x, session)                       # (b, t, v)

    # ---- loss ----------------------------------------------------------------------------
    def loss(self, input_ids: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
             **forward_kw) -> LossOutput:
        """Next-token cross-entropy (targets already shifted) + z-loss + MoE auxiliary losses."""
        hidden = self(input_ids, return_hidden=True, **forward_kw)          # (b, t, d)
        return self.loss_from_hidden(hidden, targets, ignore_index)

    def loss_from_hidden(self, hidden: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> LossOutput:
        return next_token_loss(self, self.lm_head, hidden, targets, ignore_index)

    def loss_from_logits(self, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> LossOutput:
        """The unfused reference of loss_from_hidden, from (b, t, v) logits."""
        ce, z_loss = self.lm_head.loss_from_logits(logits, targets, ignore_index)
        aux = moe_aux_loss(self, ce.new_zeros(()))
        return LossOutput(total=ce + z_loss + aux, ce=ce, z_loss=z_loss, aux_loss=aux)

    def num_params(self) -> int:
        """Unique parameters (tied embeddings count once)."""
        return sum(p.numel() for p in self.parameters())
