"""One stack of Transformer layers whose role is configuration, as HF's one `T5Stack` serves both sides:

    decoder         causal self-attention (GPT, LLaMA; T5's and BART's decoders without their context)
    encoder         bidirectional self-attention (BERT; T5's and BART's encoders)
    cross_decoder   causal self-attention, then cross-attention to an encoder's output (T5's, BART's decoders)

The stack owns what a stack is: its Blocks (indexed as a list: `model.blocks[i]`, keys `blocks.{i}.`), each
layer's decisions resolved once (ModelConfig.layer_spec), its T5 relative-bias table, its final norm, and the
per-forward attention inputs (`inputs`: positions from the attention mask, the KV cache or packed documents, what
attends to what, the bounds of a position table). The decoder-only LM is embedding -> TransformerStack("decoder")
-> head; an encoder-decoder runs a TransformerStack("encoder") and hands its output, as a nn/masks.Context, to a
TransformerStack("cross_decoder") (ModelConfig.stack_depth: the decoder may be deeper or shallower).
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from archlab.config import STACK_ROLES, ConfigError, ModelConfig, StackRole
from archlab.nn.block import Block
from archlab.nn.fused import direct
from archlab.nn.masks import AttnInputs, Context, MaskSpec, document_positions
from archlab.nn.norms import build_norm
from archlab.nn.position import T5RelativeBias

__all__ = ["TransformerStack", "padded_positions", "stack_t5_table"]


def padded_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """(b, t) 0/1 mask -> (b, t) positions: each row's real tokens numbered 0, 1, ... in order, padding -1, so
    left- and right-padded rows embed alike (RoBERTa's convention).
    Example: padded_positions(torch.tensor([[0, 1, 1]])) -> tensor([[-1, 0, 1]])"""
    real = attention_mask.bool()
    return torch.where(real, real.long().cumsum(-1) - 1, -1)


def stack_t5_table(cfg: ModelConfig, role: StackRole) -> T5RelativeBias | None:
    """The one T5 relative-bias table a stack of this role shares across its layers (None where no layer
    uses T5 positions): a causal stack buckets how far back a key is, an encoder's buckets are bidirectional
    (Raffel et al. 2020)."""
    if not any(cfg.position_kind(i) == "t5" for i in range(cfg.stack_depth(role))):
        return None
    return T5RelativeBias(cfg, bidirectional=role == "encoder")


class TransformerStack(nn.Module):
    """The layers (children 0..n-1, so `model.blocks[i]` and the keys `blocks.{i}.` read as a ModuleList's), the
    stack's T5 relative-bias table (`t5_bias`, None without T5 positions; registered before the layers, so the
    parameters keep their order) and its final norm (`final_norm`, None where the config has none). What the
    layers read each forward comes from `inputs`; `forward` returns the normed hidden states."""

    def __init__(self, cfg: ModelConfig, role: StackRole = "decoder"):
        """Example: enc = TransformerStack(cfg, "encoder"); y = enc(x, enc.inputs(ids, attention_mask=mask))"""
        if role not in STACK_ROLES:
            raise ConfigError(f"unknown stack role {role!r}: one of {', '.join(STACK_ROLES)}")
        super().__init__()
        self.t5_bias = stack_t5_table(cfg, role)                 # one table for all layers (T5), or None
        specs = [cfg.layer_spec(i, role) for i in range(cfg.stack_depth(role))]   # every per-layer decision, once
        self.layers = tuple(Block(cfg, spec, self.t5_bias) for spec in specs)
        for i, block in enumerate(self.layers):
            self.add_module(str(i), block)
        self.final_norm = (build_norm(cfg.norm.kind, cfg.d_model, cfg.norm.eps, cfg.bias.norm)
                           if cfg.norm.final_norm else None)
        self.role = role
        self.causal = role != "encoder"
        self._structure_only = MaskSpec(causal=self.causal)   # built once: a decode step counts every call
        self.prefix_lm = cfg.attention.prefix_lm
        self.max_seq_len = cfg.max_seq_len
        # a learned table, or Marian's stored sinusoids, has max_seq_len rows: a position past them has no vector
        self.bounded = cfg.position.kind == "learned" or (cfg.position.kind == "sinusoidal"
                                                          and cfg.position.sinusoid_table)

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[Block]:
        return iter(self.layers)

    def __getitem__(self, index: int) -> Block:
        return self.layers[index]

    def inputs(self, ids: torch.Tensor, *, positions: torch.Tensor | None = None,
               attention_mask: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
               cache=None, prefix_lengths: torch.Tensor | None = None, session=None) -> AttnInputs:
        """The one AttnInputs of a forward over (b, t) `ids`, every block reads it. Positions, unless given: from
        0 in each packed document (`document_ids`, -1 padding), each row's real tokens counted from 0
        (`attention_mask`, 1 = real; its zeros become key padding), or 0..t-1 continuing the `cache` (rows
        unpadded, of one length). Without any of them the forward is plain: one (1, t) row that RoPE tables,
        biases and masks broadcast over the batch (b x less table work); the KV cache keeps positions per row.
        Example: x = stack(x, stack.inputs(ids, attention_mask=mask))"""
        (b, t), implied = ids.shape, positions is None and attention_mask is None and document_ids is None
        if document_ids is not None and (cache is not None or session is not None):
            raise ValueError("document_ids pack whole documents into a forward: not with a KV cache")
        if attention_mask is not None and cache is not None:
            raise ValueError("cached decoding takes unpadded rows (no attention mask)")
        if prefix_lengths is not None and not self.prefix_lm:
            raise ValueError("prefix_lengths given but config.attention.prefix_lm is False")
        if positions is None:
            if document_ids is not None:
                positions = document_positions(document_ids, attention_mask)
            elif attention_mask is not None:
                positions = padded_positions(attention_mask)
            else:
                start = len(cache) if cache is not None else 0
                positions = torch.arange(start, start + t, device=ids.device)[None]         # (1, t)
                if cache is not None:
                    positions = positions.expand(b, t)                                     # (b, t)
        # (a compiled decode step skips this host sync: generation checked the context before its first step)
        if self.bounded and not torch.compiler.is_compiling() and int(positions.max()) >= self.max_seq_len:
            raise ValueError(f"position {int(positions.max())} is past max_seq_len={self.max_seq_len}: "
                             "the position table has no row for it")
        padding = None if attention_mask is None else attention_mask.bool()
        spec = self.mask_spec(prefix_lengths, padding, document_ids)
        return AttnInputs(positions, spec, cache=cache, plain=implied and cache is None,
                          continued=implied and cache is not None, fresh=cache is not None and len(cache) == 0,
                          session=session)

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
        """context: what a cross_decoder's layers attend to (the encoder's output), None for the other roles.
        Returns the final norm's output (the hidden states unchanged where the config has no final norm)."""
        if (context is not None) != (self.role == "cross_decoder"):
            raise ValueError(f"a {self.role} stack " + ("needs the encoder's output (a Context)"
                                                      if context is None else "takes no context"))
        m = direct(self, inputs.session)   # the blocks, or in a decode session their forwards (nn/fused.direct)
        if context is None:
            for block in m.layers:
                x = block(x, inputs)
        else:
            for block in m.layers:
                x = block(x, inputs, context)
        return x if m.final_norm is None else m.final_norm(x)
