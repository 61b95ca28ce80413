"""Normalization layers.

LayerNorm (Ba et al. 2016), RMSNorm (Zhang & Sennrich 2019, arXiv 1910.07467), RMSNorm with
(1 + w) weights (Gemma), LayerNorm1p (Nemotron: weight stored as w - 1), non-parametric LayerNorm
(OLMo 1: no weight, no bias), and BatchNorm (Ioffe & Szegedy 2015) for comparison. All compute in float32
and cast back: bf16 variance underflows.

BatchNorm normalizes each channel by statistics over every (row, position) of the batch while training, so
what one token's output is depends on the other tokens in the batch: on later tokens (a causal LM's training
forward sees the future through the mean), and on padding: padded slots enter the statistics (Shen et al.
2020, "PowerNorm", arXiv 2003.07845, on why Transformers use LayerNorm). At evaluation it uses running
averages and acts on each token alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from archlab.nn.fused import rms_norm
from archlab.nn.registry import Registry

NORMS: Registry[type[nn.Module]] = Registry("norm kind")


@NORMS.register("layernorm")
class LayerNorm(nn.Module):
    """y = (x - mean) / std * w + b."""

    weight_offset = 0.0

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - self.weight_offset))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() + self.weight_offset
        bias = None if self.bias is None else self.bias.float()
        y = F.layer_norm(x.float(), (x.shape[-1],), weight, bias, self.eps)
        return y.to(x.dtype)


@NORMS.register("layernorm_1p")
class LayerNorm1p(LayerNorm):
    """Nemotron: the stored weight is w - 1 (zero-initialised), applied as (1 + w)."""

    weight_offset = 1.0


@NORMS.register("nonparametric")
class NonParametricLayerNorm(nn.Module):
    """OLMo 1: LayerNorm without any learnable weight or bias."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = False):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), None, None, self.eps).to(x.dtype)


@NORMS.register("rmsnorm")
class RMSNorm(nn.Module):
    """y = x / rms(x) * w. No mean subtraction, no bias (Zhang & Sennrich 2019)."""

    weight_offset = 0.0

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - self.weight_offset))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Gemma multiplies by (1 + w) in float32 before casting; LLaMA casts first then scales.
        # The difference is below bf16 resolution, so one float32 path serves both.
        weight = self.weight + self.weight_offset if self.weight_offset else self.weight
        return rms_norm(x, weight, self.eps)      # nn/fused.py: the same math, fewer passes


@NORMS.register("rmsnorm_1p")
class RMSNorm1p(RMSNorm):
    """Gemma: weights stored zero-initialised and applied as (1 + w)."""

    weight_offset = 1.0


@NORMS.register("batchnorm")
class BatchNorm(nn.Module):
    """y = (x - mean_batch) / std_batch * w + b per channel (Ioffe & Szegedy 2015), the statistics over all
    leading dims (b, t, ...) in training, running averages (momentum 0.1, as torch) in evaluation."""

    running_mean: torch.Tensor
    running_var: torch.Tensor

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = False, momentum: float = 0.1):
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:           # (..., d) -> same
        flat = x.float().reshape(-1, x.shape[-1])                   # (b t, d): every position is a sample
        bias = None if self.bias is None else self.bias.float()
        mean, var = self.running_mean.float(), self.running_var.float()   # the buffers themselves when float32
        y = F.batch_norm(flat, mean, var, self.weight.float(), bias, self.training, self.momentum, self.eps)
        if self.training and mean is not self.running_mean:                # a bf16 model: write the update back
            with torch.no_grad():
                self.running_mean.copy_(mean)
                self.running_var.copy_(var)
        return y.reshape(x.shape).to(x.dtype)


def build_norm(kind: str, dim: int, eps: float, bias: bool) -> nn.Module:
    return NORMS.get(kind)(dim, eps=eps, bias=bias)


class HeadwiseNorm(nn.Module):
    """QK-norm over each head's dims with a separate weight per head, weight (h, e): Cohere
    Command R+ (`per_head_untied`); the plain `per_head` QK-norm shares one (e,) weight."""

    def __init__(self, kind: str, n_heads: int, head_dim: int, eps: float):
        super().__init__()
        base = NORMS.get(kind)
        if not issubclass(base, (LayerNorm, RMSNorm)):
            from archlab.config import ConfigError

            raise ConfigError(f"attention.qk_norm='per_head_untied' needs a norm with a weight; "
                              f"norm.kind={kind!r} has none")
        self.eps, self.center = eps, issubclass(base, LayerNorm)
        self.weight_offset = base.weight_offset
        self.weight = nn.Parameter(torch.full((n_heads, head_dim), 1.0 - self.weight_offset))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, h, t, e) -> (b, h, t, e)
        weight = self.weight[:, None, :]                                 # (h, 1, e): one per head
        if self.weight_offset:
            weight = weight + self.weight_offset
        if self.center:   # the package's LayerNorm and RMSNorm formulas, with a weight per head
            y = F.layer_norm(x.float(), (x.shape[-1],), None, None, self.eps) * weight.float()
            return y.to(x.dtype)
        return rms_norm(x, weight, self.eps)
