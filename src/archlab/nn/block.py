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
from archlab.nn.masks import AttnInputs
from archlab.nn.mlp import build_mlp
from archlab.nn.norms import build_norm
from archlab.nn.position import T5RelativeBias, build_attention_position


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


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
        drop = self.drop if self.training else _identity    # no module call per sublayer when decoding
        attn = lambda h: drop(self.attn(h, inputs))  # noqa: E731
        mlp = lambda h: drop(self.mlp(h))  # noqa: E731
        if self.parallel:
            y = self.attn_norm(x)
            return x + attn(y) + mlp(self.mlp_norm(x) if self.mlp_norm is not None else y)
        mlp_norm = self.mlp_norm
        assert mlp_norm is not None          # a serial block always has its own MLP norm
        if self.position == "pre":
            x = x + attn(self.attn_norm(x))
            return x + mlp(mlp_norm(x))
        if self.position == "post":
            x = self.attn_norm(x + attn(x))
            return mlp_norm(x + mlp(x))
        if self.position == "sandwich":
            x = x + self.attn_post_norm(attn(self.attn_norm(x)))
            return x + self.mlp_post_norm(mlp(mlp_norm(x)))
        # post_sublayer
        x = x + self.attn_norm(attn(x))
        return x + mlp_norm(mlp(x))
