"""Eager-mode savings: hand-written backward passes for two elementwise layers, and one matmul for
several projections of the same input under autocast.

Eager PyTorch runs every op of a composite layer as its own pass over memory. For RMSNorm that is
~3 passes forward and ~9 backward, and autograd keeps x, x^2's mean and the normalized x; here the
forward keeps only the normalized x and 1/rms, and the backward is 5 passes (forward + backward measured
1.6x faster on CPU, about 5% of a LLaMA-style training step). RoPE's backward is the transposed
rotation, one multiply and one multiply-add (1.6x faster in isolation; within the noise of a step).
tests/test_fused.py checks values and gradients against the composite formulas.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["rms_norm", "rope_half", "project"]


def project(x: torch.Tensor, linears: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, ...]:
    """(l(x) for l in linears); under autocast as one matmul over the concatenated weights.

    Autocast casts a float32 input once per matmul, and backward casts each projection's dL/dx back
    and sums them: for q/k/v that is three casts and two adds each way, for gate/up two and one. One
    matmul over the concatenated weights casts once and needs no sum (bf16 steps measured 1-9%
    faster over three runs). Without autocast the concatenation and the split's backward cost what
    they save, so the projections run one by one; likewise for a few tokens (decoding), where
    copying the weights would dominate. The parameters stay separate Linears, as checkpoints and the lecture name them.
    Example: q, k, v = project(x, (attn.q_proj, attn.k_proj, attn.v_proj))
    """
    biases: list[torch.Tensor | None] = [linear.bias for linear in linears]
    fuse = (torch.is_autocast_enabled(x.device.type) and x.shape[:-1].numel() >= x.shape[-1]
            and len({bias is None for bias in biases}) == 1)
    if not fuse:
        return tuple(linear(x) for linear in linears)
    weights: list[torch.Tensor] = [linear.weight for linear in linears]
    weight = torch.cat(weights, dim=0)                                   # (sum of outs, d)
    bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])
    out = F.linear(x, weight, bias)                                      # (..., sum of outs)
    return out.split([linear.out_features for linear in linears], dim=-1)


class _RMSNorm(torch.autograd.Function):
    """y = x / rms(x) * w, computed in float32 (Zhang & Sennrich 2019)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):          # x (..., d), weight (d,)
        xf = x.to(torch.promote_types(x.dtype, torch.float32))   # float32, or float64 for gradcheck
        ms = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().div_(xf.shape[-1])
        rstd = ms.add_(eps).rsqrt_()                  # (..., 1)
        xhat = xf * rstd                              # (..., d) float32
        ctx.save_for_backward(xhat, rstd, weight)     # xhat, not x: backward needs no recompute
        ctx.in_dtype = x.dtype
        return (xhat * weight.to(xf.dtype)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        xhat, rstd, weight = ctx.saved_tensors
        g, w = grad.to(xhat.dtype), weight.to(xhat.dtype)
        g_xhat = g * xhat                                               # (..., d)
        dw = g_xhat.flatten(0, -2).sum(0) if ctx.needs_input_grad[1] else None
        # dx = rstd * (g w - xhat * mean(g w xhat)); mean(g w xhat) = (g xhat) @ w / d, one gemv
        mean = (g_xhat @ w).unsqueeze(-1).div_(xhat.shape[-1])         # (..., 1)
        dx = torch.addcmul(g * w, xhat, mean, value=-1).mul_(rstd)
        return dx.to(ctx.in_dtype), None if dw is None else dw.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # (..., d) -> same
    """x / rms(x) * weight in float32, returned in x's dtype. Example: y = rms_norm(x, norm.weight, 1e-5)"""
    return _RMSNorm.apply(x, weight, eps)


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [x2, x1] over the last dim: a permutation that is its own inverse (and adjoint)."""
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


class _RopeHalf(torch.autograd.Function):
    """y = x * [cos, cos] + swap(x) * [-sin, sin]: RoPE in the "half" layout. Linear in x, so the
    backward is the transposed rotation, dx = g * [cos, cos] + swap(g * [-sin, sin]); nothing of x
    is kept."""

    @staticmethod
    def forward(ctx, x, cos, sin):                    # x (b, h, t, e); cos, sin broadcast to it
        ctx.save_for_backward(cos, sin)
        return torch.addcmul(x * cos, _swap_halves(x), sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return torch.addcmul(_swap_halves(grad * sin), grad, cos), None, None


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate all of x's last dim; cos = [cos, cos] and sin = [-sin, sin] (RotaryEmbedding.tables).
    Example: cos, sin = rope.tables(positions, q.dtype); q = rope_half(q, cos, sin)"""
    return _RopeHalf.apply(x, cos, sin)
