"""Causal attention for bf16 training on CPU: SDPA's flash forward, a backward made of batched matmuls.

On CPU, torch's flash-attention backward runs bf16 slower than float32 (it does not reach the
AMX / AVX512-BF16 matmul units), so a bf16 training step spent more on attention than an fp32 one.
This backward is FlashAttention-2's (Dao 2023, Alg. 2) with torch's batched matmuls, one block of
QUERY_BLOCK query rows at a time (a block needs only the keys up to its last query: the causal
upper triangle is skipped, and a block's scores stay in cache):

    P  = exp(s q k^T - lse)               float32, lse saved by the forward; causal: lower triangle
    dV = P^T dO                           P rounded to bf16 for the matmul, as FlashAttention-2 does
    dS = P * (dO V^T - rowsum(dO * O))    float32
    dQ = s dS K,  dK = s dS^T Q           dS rounded to bf16 for the matmuls; dK, dV summed in float32

Scores are float32 products of the bf16 inputs, as in the flash kernels, so P matches the forward's
softmax. Measured forward + backward, 8 x 5 heads of 64, 2 cores, against SDPA: 2x as fast at 128
tokens, 1.15-1.25x at 256-512, even at 1,024; so longer sequences keep SDPA (MAX_LEN), as do float32
(SDPA's backward is as fast there), GPUs, dropout and torch.compile. Whole bf16 training step of the
14M benchmark model: 6-9% faster. tests/test_cpu_attention.py checks outputs and gradients against
SDPA and a float64 reference.
"""
from __future__ import annotations

import torch

from archlab.precision import has_native_bf16

__all__ = ["causal_attention", "use_cpu_attention"]

QUERY_BLOCK = 128        # query rows per block (64-256 measured; 128 best at 512-1,024 tokens)
MAX_LEN = 1024           # longer sequences: SDPA's own backward
SLICE_BYTES = 16 << 20   # float32 scores per block: (batch x head) rows are sliced to stay under it


def use_cpu_attention(q: torch.Tensor, dropout: float) -> bool:
    """Whether causal_attention should replace SDPA: bf16 on a CPU with bf16 matmul units, eager, up
    to MAX_LEN queries, with a backward to run. (Where bf16 is emulated, AVX2 alone, SDPA's backward
    is the faster one: 150 vs 195 ms for the shapes above.)"""
    return (not torch.compiler.is_compiling()       # first: the CPU feature probe below breaks graphs
            and q.device.type == "cpu" and q.dtype == torch.bfloat16 and dropout == 0.0
            and q.shape[-2] <= MAX_LEN and torch.is_grad_enabled() and q.requires_grad
            and has_native_bf16(q.device))


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
        acc = torch.promote_types(q.dtype, torch.float32)
        dq = torch.empty_like(q)
        dk, dv = (torch.zeros(b * h, t, e, dtype=acc, device=q.device) for _ in range(2))
        rows = max(1, SLICE_BYTES // (4 * QUERY_BLOCK * t))                # (b*h) rows per slice
        for i in range(0, b * h, rows):
            for r0 in range(0, t, QUERY_BLOCK):       # queries r0..r1-1 see keys 0..r1-1 at most
                heads, r1 = slice(i, i + rows), min(r0 + QUERY_BLOCK, t)
                qs, ks = (heads, slice(r0, r1)), (heads, slice(0, r1))
                dq[qs], dk_part, dv_part = _backward_block(q[qs], k[ks], v[ks], out[qs], lse[qs],
                                                           grad_out[qs], ctx.scale, r0)
                dk[ks] += dk_part
                dv[ks] += dv_part
        dq = dq.view(b, h, t, e)
        dk, dv = (z.view(b, kv_heads, groups, t, e).sum(2).to(q.dtype) for z in (dk, dv))  # (b, k, t, e)
        return dq, dk, dv, None


def _backward_block(q, k, v, out, lse, grad_out, scale, first: int):
    """One block of query rows: q, out, grad_out (r, c, e) and lse (r, c, 1) for queries
    first..first+c-1; k, v (r, s, e) for the keys they may see, 0..first+c-1."""
    f32 = torch.promote_types(q.dtype, torch.float32)                       # float64 in the tests
    go = grad_out.to(f32)
    probs = torch.bmm(q.to(f32) * scale, k.to(f32).transpose(1, 2))           # (r, c, s) scores
    probs = probs.sub_(lse).exp_().tril_(first)                              # softmax rows, causal
    row_dot = (go * out).sum(-1, keepdim=True)                               # (r, c, 1)
    grad_s = torch.bmm(go, v.to(f32).transpose(1, 2)).sub_(row_dot).mul_(probs).to(q.dtype)
    dv = torch.bmm(probs.to(q.dtype).transpose(1, 2), grad_out)              # (r, s, e)
    dq = torch.bmm(grad_s, k).mul_(scale)                                    # (r, c, e)
    dk = torch.bmm(grad_s.transpose(1, 2), q).mul_(scale)                    # (r, s, e)
    return dq, dk, dv


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale q k^T, causal) v for (b, h, t, e) queries and (b, k, t, e) keys/values (h a
    multiple of k); the same forward as SDPA's CPU flash kernel, a matmul backward.
    Example: out = causal_attention(q, k, v, q.shape[-1] ** -0.5)"""
    return _CausalAttention.apply(q, k, v, scale)
