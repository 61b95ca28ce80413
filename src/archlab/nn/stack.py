"""One stack of Transformer layers whose role is configuration, as HF's one `T5Stack` serves both sides:

    decoder         causal self-attention (GPT, LLaMA; T5's and BART's decoders without their context)
    encoder         bidirectional self-attention (BERT; T5's and BART's encoders)
    cross_decoder   causal self-attention, then cross-attention to an encoder's output (T5's, BART's decoders)

The stack is a ModuleList of Blocks (so `model.blocks[i]` and the checkpoint keys `blocks.{i}.` stay as
they were) with a forward: it resolves each layer's decisions once (ModelConfig.layer_spec) and says what
attends to what (`mask_spec`). The decoder-only LM is embedding -> TransformerStack("decoder") -> head; an
encoder-decoder runs a TransformerStack("encoder") and hands its output, as a nn/masks.Context, to a
TransformerStack("cross_decoder") (ModelConfig.stack_depth: the decoder may be deeper or shallower).
"""
from __future__ import annotations

import torch
from torch import nn

from archlab.config import STACK_ROLES, ConfigError, ModelConfig, StackRole
from archlab.nn.block import Block
from archlab.nn.masks import AttnInputs, Context, MaskSpec
from archlab.nn.position import T5RelativeBias

__all__ = ["TransformerStack", "stack_t5_table"]


def stack_t5_table(cfg: ModelConfig, role: StackRole) -> T5RelativeBias | None:
    """The one T5 relative-bias table a stack of this role shares across its layers (None where no layer
    uses T5 positions), owned by the model (its key stays `t5_bias.`): a causal stack buckets how far back
    a key is, an encoder's buckets are bidirectional (Raffel et al. 2020).
    Example: self.t5_bias = stack_t5_table(cfg, "encoder")   # then TransformerStack(cfg, "encoder", self.t5_bias)"""
    if not any(cfg.position_kind(i) == "t5" for i in range(cfg.stack_depth(role))):
        return None
    return T5RelativeBias(cfg, bidirectional=role == "encoder")


class TransformerStack(nn.ModuleList):
    def __init__(self, cfg: ModelConfig, role: StackRole = "decoder", t5_table: T5RelativeBias | None = None):
        """t5_table: the stack's one T5 bias table (built by the model that owns its weights), if any.
        Example: enc = TransformerStack(cfg, "encoder"); y = enc(x, AttnInputs(pos, enc.mask_spec(), plain=True))"""
        if role not in STACK_ROLES:
            raise ConfigError(f"unknown stack role {role!r}: one of {', '.join(STACK_ROLES)}")
        specs = [cfg.layer_spec(i, role) for i in range(cfg.stack_depth(role))]   # every per-layer decision, once
        super().__init__(Block(cfg, spec, t5_table) for spec in specs)
        self.role = role
        self.causal = role != "encoder"
        self._structure_only = MaskSpec(causal=self.causal)   # built once: a decode step counts every call

    def mask_spec(self, prefix_lengths: torch.Tensor | None = None, key_padding: torch.Tensor | None = None,
                  document_ids: torch.Tensor | None = None) -> MaskSpec:
        """What attends to what in this stack: causal or not by role, plus a prefix-LM prefix, padding, or packed
        documents ((b, t) ids: a query sees only its own document's keys)."""
        if prefix_lengths is None and key_padding is None and document_ids is None:
            return self._structure_only
        return MaskSpec(causal=self.causal, prefix_lengths=prefix_lengths, key_padding=key_padding,
                        segment_ids=document_ids)

    def forward(self, x: torch.Tensor, inputs: AttnInputs, context: Context | None = None
                ) -> torch.Tensor:                                       # (b, t, d) -> (b, t, d)
        """context: what a cross_decoder's layers attend to (the encoder's output), None for the other roles."""
        if (context is not None) != (self.role == "cross_decoder"):
            raise ValueError(f"a {self.role} stack " + ("needs the encoder's output (a Context)"
                                                      if context is None else "takes no context"))
        if context is None:
            for block in self:
                x = block(x, inputs)
        else:
            for block in self:
                x = block(x, inputs, context)
        return x
