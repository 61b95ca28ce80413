"""Causal attention for bf16 training on CPU: SDPA's flash forward, a backward made of batched matmuls.

On CPU, torch's flash-attention backward runs bf16 slower than float32 (it converts tiles and
does not reach the AMX / AVX512-BF16 matmul units), so the attention of a bf16 training step cost
more than the fp32 one. This backward is FlashAttention-2's (Dao 2023, Alg. 2) done one
slice of (batch x head) rows at a time with torch's batched matmuls:

    P  = exp(s q k^T - lse)               float32, lse saved by the forward; causal: lower triangle
    dV = P^T dO                           P rounded to bf16 for the matmul, as FlashAttention-2 does
    dS = P * (dO V^T - rowsum(dO * O))    float32
    dQ = s dS K,  dK = s dS^T Q           dS rounded to bf16 for the matmuls

Scores are float32 products of the bf16 inputs, as in the flash kernels, so P matches the forward's
softmax. The slices hold at most SLICE_BYTES of float32 scores, so memory stays bounded at any
length. tests/test_cpu_attention.py checks outputs and gradients against SDPA and a float64
reference; benchmarks/train_throughput.py measures the step.
"""
from __future__ import annotations

import torch

__all__ = ["causal_attention", "use_cpu_attention"]

SLICE_BYTES = 16 << 20   # float32 (rows, t, s) scores per slice of the backward


def use_cpu_attention(q: torch.Tensor, dropout: float) -> bool:
    """Whether causal_attention should replace SDPA: bf16 on CPU, eager, with a backward to run."""
    return (q.device.type == "cpu" and q.dtype == torch.bfloat16 and dropout == 0.0
            and torch.is_grad_enabled() and q.requires_grad and not torch.compiler.is_compiling())


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale: float):          # q (b, h, t, e); k, v (b, k, t, e)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, True, scale=scale)           # out (b, h, t, e), lse (b, h, t) float32
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):                      # (b, h, t, e)
        q, k, v, out, lse = ctx.saved_tensors
        b, h, t, e = q.shape
        kv_heads, groups = k.shape[1], h // k.shape[1]
        if groups > 1:                                # GQA: every query head gets its key/value head
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        q, k, v, out, grad_out = (z.reshape(b * h, t, e) for z in (q, k, v, out, grad_out))
        lse = lse.reshape(b * h, t, 1)
        rows = max(1, SLICE_BYTES // (4 * t * t))
        parts = [_backward_slice(q[i:i + rows], k[i:i + rows], v[i:i + rows], out[i:i + rows],
                                 lse[i:i + rows], grad_out[i:i + rows], ctx.scale)
                 for i in range(0, b * h, rows)]
        dq, dk, dv = (torch.cat(z) if len(parts) > 1 else z[0] for z in zip(*parts))   # (b*h, t, e)
        dq, dk, dv = (z.view(b, h, t, e) for z in (dq, dk, dv))
        if groups > 1:
            dk, dv = (z.view(b, kv_heads, groups, t, e).sum(2) for z in (dk, dv))   # (b, k, t, e)
        return dq, dk, dv, None


def _backward_slice(q, k, v, out, lse, grad_out, scale):   # (r, t, e) each; lse (r, t, 1)
    f32 = torch.promote_types(q.dtype, torch.float32)                       # float64 in the tests
    go = grad_out.to(f32)
    probs = torch.bmm(q.to(f32) * scale, k.to(f32).transpose(1, 2))           # (r, t, t) scores
    probs = probs.sub_(lse).exp_().tril_()                                   # softmax rows, causal
    row_dot = (go * out).sum(-1, keepdim=True)                               # (r, t, 1)
    grad_s = torch.bmm(go, v.to(f32).transpose(1, 2)).sub_(row_dot).mul_(probs).to(q.dtype)
    dv = torch.bmm(probs.to(q.dtype).transpose(1, 2), grad_out)              # (r, t, e)
    dq = torch.bmm(grad_s, k).mul_(scale)
    dk = torch.bmm(grad_s.transpose(1, 2), q).mul_(scale)
    return dq, dk, dv


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale q k^T, causal) v for (b, h, t, e) queries and (b, k, t, e) keys/values (h a
    multiple of k); the same forward as SDPA's CPU flash kernel, a matmul backward.
    Example: out = causal_attention(q, k, v, q.shape[-1] ** -0.5)"""
    return _CausalAttention.apply(q, k, v, scale)
