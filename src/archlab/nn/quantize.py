"""The one place where int8 quantization math lives: symmetric absmax quantization of weights per output row
and of activations per token or per tensor, their round trips ("fake quantization"), and LLM.int8's outlier split.
The int8 run (nn/int8.py: QuantizedLinear, whose dequantize-matmul reference is `dequantize_rows`) and the lab's
quantization suite (lab/real_model.py) both call these functions, so a suite measures the scheme the run uses.

    quantize_rows(w)         w (o, i) -> q int8 (o, i), s (o,)       w ~ q * s[:, None], s = max|w_row| / 127
    fake_quant_per_token(x)  x (..., i) -> x rounded on a 255-level grid per row (per token)
    fake_quant_per_tensor(x) the same grid for the whole tensor (one scale: Dettmers et al. 2022's failure case)
    outlier_split_linear     LLM.int8() (Dettmers et al. 2022, arXiv 2208.07339): the input columns holding a
                             value >= threshold stay in float, the rest run as int8 x int8 (per token x per row)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["QMAX", "quantize_rows", "dequantize_rows", "fake_quant_rows", "fake_quant_per_token",
           "fake_quant_per_tensor", "w8a8_linear", "outlier_split_linear"]

QMAX = 127   # symmetric int8: [-127, 127], so that -q is representable for every q


def _scale(absmax: torch.Tensor) -> torch.Tensor:
    """absmax / 127, with all-zero rows given scale 1 (q = 0 there, and no division by zero)."""
    return torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:   # (o, i) -> (o, i) int8, (o,) float32
    """Symmetric int8 with one scale per output row: q = round(w / s), s = max|w_row| / 127.
    Example: q, s = quantize_rows(linear.weight); w_hat = dequantize_rows(q, s)"""
    w = w.detach().float()
    scale = _scale(w.abs().amax(dim=1))                                  # (o,)
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale[:, None] in `dtype`: the matrix an int8 layer multiplies by (its reference path).
    Example: w_hat = dequantize_rows(*quantize_rows(w))"""
    return (q.to(torch.float32) * scale[:, None]).to(dtype)             # (o, i)


def fake_quant_rows(w: torch.Tensor) -> torch.Tensor:
    """w after an int8 round trip per output row (int8 weight-only quantization), in w's dtype."""
    return dequantize_rows(*quantize_rows(w), dtype=w.dtype)


def fake_quant_per_token(x: torch.Tensor) -> torch.Tensor:               # (..., i) -> same
    """x after a symmetric int8 round trip with one scale per row of its last dimension (per token)."""
    scale = _scale(x.detach().abs().amax(dim=-1, keepdim=True).float())  # (..., 1)
    return (torch.round(x.float() / scale).clamp_(-QMAX, QMAX) * scale).to(x.dtype)


def fake_quant_per_tensor(x: torch.Tensor) -> torch.Tensor:
    """x after a symmetric int8 round trip with one scale for the whole tensor: an outlier anywhere coarsens the
    grid of every other value (what per-tensor W8A8 does to a model with massive activations)."""
    scale = _scale(x.detach().abs().amax().float())
    return (torch.round(x.float() / scale).clamp_(-QMAX, QMAX) * scale).to(x.dtype)


_ACTIVATIONS = {"token": fake_quant_per_token, "tensor": fake_quant_per_tensor}


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                activations: str = "token") -> torch.Tensor:             # (..., i) -> (..., o)
    """F.linear with int8 weights per row and int8 activations per token ("token") or per tensor ("tensor"),
    simulated in float (the products of two int8 grids are exact in float32 up to accumulation order)."""
    return F.linear(_ACTIVATIONS[activations](x), fake_quant_rows(weight), bias)


def outlier_split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         threshold: float = 6.0) -> torch.Tensor:        # (..., i) -> (..., o)
    """LLM.int8()'s mixed-precision decomposition: the input features where some |x| >= threshold (the outlier
    dimensions) multiply the float weight columns; all others run as W8A8 (weights per row, activations per token).
    Example: y = outlier_split_linear(x, linear.weight, linear.bias, threshold=6.0)"""
    outliers = (x.detach().abs() >= threshold).flatten(0, -2).any(dim=0)  # (i,) bool
    regular = ~outliers
    y = F.linear(fake_quant_per_token(x * regular), fake_quant_rows(weight * regular), bias)
    if bool(outliers.any()):
        y = y + F.linear(x[..., outliers], weight[:, outliers])
    return y
