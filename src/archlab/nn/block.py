"""Residual wiring of one Transformer layer.

    post (2017, BERT, OPT-350m)      pre (GPT-2, LLaMA)             sandwich (Gemma 2/3)
    x = N(x + Attn(x))               x = x + Attn(N(x))             x = x + N'(Attn(N(x)))
    x = N(x + MLP(x))                x = x + MLP(N(x))              x = x + N'(MLP(N(x)))

    post_sublayer (OLMo 2)           parallel, one norm              parallel, two norms
    x = x + N(Attn(x))               (GPT-J, PaLM, Falcon, Cohere)   (GPT-NeoX)
    x = x + N(MLP(x))                y = N(x)                        x = x + Attn(N1(x))
                                     x = x + Attn(y) + MLP(y)              + MLP(N2(x))

N is the configured norm; every N/N' above is its own module with its own weights.
Pre-norm keeps an identity path from input to output, which is why it trains without warmup
(Xiong et al. 2020, arXiv 2002.04745); post-norm normalizes the residual stream itself.
"""
from __future__ import annotations

import torch
from torch import nn

from archlab.config import LayerSpec, ModelConfig
from archlab.nn.attention import Attention
from archlab.nn.calls import call
from archlab.nn.masks import AttnInputs
from archlab.nn.mlp import build_mlp
from archlab.nn.norms import build_norm
from archlab.nn.position import T5RelativeBias, build_attention_position


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
        if self.position == "sandwich":
            self.attn_post_norm, self.mlp_post_norm = norm(), norm()
        self.drop = nn.Dropout(cfg.block.residual_dropout)

    def forward(self, x: torch.Tensor, inputs: AttnInputs) -> torch.Tensor:    # (b, t, d) -> (b, t, d)
        # children run through nn.calls.call (hooks honoured, minus __call__'s cost: a decode step pays it ~30x)
        attn_norm, mlp_norm = self.attn_norm, self.mlp_norm
        if self.parallel:
            y = call(attn_norm, x)
            return x + self._attn(y, inputs) + self._mlp(call(mlp_norm, x) if mlp_norm is not None else y)
        assert mlp_norm is not None          # a serial block always has its own MLP norm
        if self.position == "pre":
            x = x + self._attn(call(attn_norm, x), inputs)
            return x + self._mlp(call(mlp_norm, x))
        if self.position == "post":
            x = call(attn_norm, x + self._attn(x, inputs))
            return call(mlp_norm, x + self._mlp(x))
        if self.position == "sandwich":
            x = x + call(self.attn_post_norm, self._attn(call(attn_norm, x), inputs))
            return x + call(self.mlp_post_norm, self._mlp(call(mlp_norm, x)))
        # post_sublayer
        x = x + call(attn_norm, self._attn(x, inputs))
        return x + call(mlp_norm, self._mlp(x))

    def _attn(self, h: torch.Tensor, inputs: AttnInputs) -> torch.Tensor:    # the sublayer + residual dropout
        out = call(self.attn, h, inputs)
        return self.drop(out) if self.training else out

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        out = call(self.mlp, h)
        return self.drop(out) if self.training else out
