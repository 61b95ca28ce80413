"""Residual wiring of one Transformer layer.

    post (2017, BERT, OPT-350m)      pre (GPT-2, LLaMA)             sandwich (Gemma 2/3)
    x = N(x + Attn(x))               x = x + Attn(N(x))             x = x + N'(Attn(N(x)))
    x = N(x + MLP(x))                x = x + MLP(N(x))              x = x + N'(MLP(N(x)))

    post_sublayer (OLMo 2)           parallel, one norm              parallel, two norms
    x = x + N(Attn(x))               (GPT-J, PaLM, Falcon, Cohere)   (GPT-NeoX)
    x = x + N(MLP(x))                y = N(x)                        x = x + Attn(N1(x))
                                     x = x + Attn(y) + MLP(y)              + MLP(N2(x))

N is the configured norm; every N/N' above is its own module with its own weights. A decoder layer of an
encoder-decoder (LayerSpec.cross_attention: T5, BART, the 2017 Transformer) has a third sublayer between the
two, cross-attention to the encoder's output, wired as the other two with its own norm(s) (`_wire`):
pre-norm x = x + Cross(N(x), enc), post-norm x = N(x + Cross(x, enc)), ...
Pre-norm keeps an identity path from input to output, which is why it trains without warmup
(Xiong et al. 2020, arXiv 2002.04745); post-norm normalizes the residual stream itself.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from archlab.config import LayerSpec, ModelConfig
from archlab.nn.attention import Attention
from archlab.nn.fused import direct
from archlab.nn.masks import AttnInputs, Context
from archlab.nn.mlp import MoEMLP, build_mlp
from archlab.nn.norms import build_norm
from archlab.nn.position import NoPosition, T5RelativeBias, build_attention_position


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, t5_table: T5RelativeBias | None = None):
        """spec: this layer's decisions (ModelConfig.layer_spec); t5_table: the stack's T5 bias, if any."""
        super().__init__()
        norm = lambda: build_norm(cfg.norm.kind, cfg.d_model, cfg.norm.eps, cfg.bias.norm)  # noqa: E731
        self.position = cfg.norm.position
        self.parallel = cfg.block.parallel
        position = build_attention_position(cfg, spec, t5_table)
        self.attn = Attention(cfg.d_model, cfg.attention, spec, position, bias=cfg.bias, norm=cfg.norm)
        self.mlp = build_mlp(cfg.d_model, cfg.mlp, cfg.bias.mlp)
        self.attn_norm = norm()
        two_norms = not self.parallel or cfg.block.parallel_norms == 2
        self.mlp_norm = norm() if two_norms else None
        sandwich = self.position == "sandwich"
        self.attn_post_norm = norm() if sandwich else None
        self.mlp_post_norm = norm() if sandwich else None
        # cross-attention (a cross_decoder's layers): the same Attention, keys and values from the encoder's
        # output, no position signal of its own (T5's, BART's and the 2017 Transformer's have none)
        self.cross_attn: Attention | None = None
        if spec.cross_attention:
            cross = dataclasses.replace(spec, local=False, window=None, position_kind="none")
            self.cross_attn = Attention(cfg.d_model, cfg.attention, cross, NoPosition(cfg, cross),
                                        bias=cfg.bias, norm=cfg.norm)
            self.cross_norm = norm()
            self.cross_post_norm = norm() if sandwich else None
        self.drop = nn.Dropout(cfg.block.residual_dropout)

    def forward(self, x: torch.Tensor, inputs: AttnInputs, context: Context | None = None
                ) -> torch.Tensor:                                               # (b, t, d) -> (b, t, d)
        m = direct(self, inputs.session)   # the sublayers, or in a decode session their forwards (nn/fused.direct)
        attn_norm, mlp_norm = m.attn_norm, m.mlp_norm
        if self.parallel:
            y = attn_norm(x)
            return x + self._attn(m, y, inputs) + self._mlp(m, mlp_norm(x) if mlp_norm is not None else y, inputs)
        assert mlp_norm is not None          # a serial block always has its own MLP norm
        x = self._wire(x, attn_norm, m.attn_post_norm, self._attn, m, inputs)
        if self.cross_attn is not None:
            if context is None:
                raise ValueError("a cross-attention layer needs the encoder's output (a Context)")
            x = self._wire(x, m.cross_norm, m.cross_post_norm, self._cross, m, inputs, context)
        return self._wire(x, mlp_norm, m.mlp_post_norm, self._mlp, m, inputs)

    def _wire(self, x: torch.Tensor, norm: Callable[..., torch.Tensor], post_norm: Callable[..., torch.Tensor] | None,
              sublayer: Callable[..., torch.Tensor], m: Any, inputs: AttnInputs, *args: Any) -> torch.Tensor:
        """One residual sublayer in the configured serial wiring (the diagram above): sublayer(m, h, inputs, *args);
        m: this block or its direct view."""
        position = self.position
        if position == "pre":
            return x + sublayer(m, norm(x), inputs, *args)
        if position == "post":
            return norm(x + sublayer(m, x, inputs, *args))
        if position == "sandwich":
            assert post_norm is not None
            return x + post_norm(sublayer(m, norm(x), inputs, *args))
        return x + norm(sublayer(m, x, inputs, *args))                     # post_sublayer

    def _attn(self, m: Any, h: torch.Tensor, inputs: AttnInputs) -> torch.Tensor:  # the sublayer + residual dropout
        out = m.attn(h, inputs)
        return self.drop(out) if self.training else out

    def _cross(self, m: Any, h: torch.Tensor, inputs: AttnInputs, context: Context) -> torch.Tensor:
        assert self.cross_attn is not None   # forward calls it only for a layer that has one
        out = m.cross_attn(h, inputs, context)
        return self.drop(out) if self.training else out

    def _mlp(self, m: Any, h: torch.Tensor, inputs: AttnInputs) -> torch.Tensor:  # decodes in the forward's session
        out = (m.mlp(h, inputs.session, real=inputs.real_tokens()) if isinstance(self.mlp, MoEMLP)
               else m.mlp(h, inputs.session))                 # routed: statistics over real tokens only
        return self.drop(out) if self.training else out
