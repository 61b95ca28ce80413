"""Tiled attention (FlashAttention-2, Dao 2023, Alg. 1 and 2): the one readable implementation of attention
that never holds a (t, s) matrix, for full, windowed and block-sparse masks.

Queries split into tiles of TILE rows; a `TilePlan` says which key spans each tile visits (compiled from the
layer's MaskSpec predicate: spans without an allowed pair are skipped, and a span every pair of which is
allowed needs no mask). The forward keeps, per query row, a running max m, a denominator l and an output
accumulator: the online softmax

    s  = scale q k^T (+ bias), masked          one key span at a time, float32
    m' = max(m, rowmax s);  p = exp(s - m')
    l  = l exp(m - m') + rowsum p;   acc = acc exp(m - m') + p v;   m = m'
    out = acc / l;   lse = m + log l           lse saved for the backward

and the backward recomputes p from the saved lse, span by span:

    P  = exp(s - lse)                          (P and dS rounded to the input dtype for the matmuls, as
    dV += P^T dO                                FlashAttention-2 does: bf16 inputs reach bf16 matmul units)
    dS = P * (dO V^T - rowsum(dO * O))
    dQ = scale dS K,   dK += scale dS^T Q

Memory: q, k, v, out, lse and one tile's scores: O(n) (measured in benchmarks/attention_cost.py --kernels).
It runs tile by tile in Python, so it is the reference for memory, not for speed: two backends use it.
  "tiled"       any call a plan expresses (no soft-cap, sinks or dropout; a position bias without weights);
                never chosen on its own (forced("tiled")), the small-memory path for long sequences
  "cpu_causal"  bf16 training on CPUs with bf16 matmul units: SDPA's flash forward (which returns the same
                lse) and this backward, one span per tile (torch's CPU flash backward runs bf16 slower than
                float32 there; measured 6-9% of a bf16 training step)
tests/nn/test_tiled_attention.py checks both against a float64 reference and the eager backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from archlab.training.precision import has_native_bf16

__all__ = ["TILE", "MAX_LEN", "Span", "TilePlan", "tiled_attention", "causal_attention", "use_cpu_attention"]

TILE = 128             # query rows per tile (64-256 measured; 128 best at 512-1,024 tokens, causal backward)
MAX_LEN = 1024         # cpu_causal: longer sequences keep SDPA's own backward (as fast there)
SLICE_BYTES = 16 << 20  # float32 scores per tile and span: (batch x head) rows are sliced to stay under it


@dataclass
class Span:
    """A run of keys a query tile visits, and what within it is allowed."""
    keys: slice
    mask: torch.Tensor | None = None      # (b|1, 1, rows, keys) bool; None: every pair allowed
    bias: torch.Tensor | None = None      # (b|1, h, rows, keys) added to the scores (no gradient)


@dataclass
class TilePlan:
    """For each query tile (a slice of rows), the key spans it visits, in order."""
    tiles: list[tuple[slice, list[Span]]]

    @classmethod
    def causal(cls, t: int, tile: int | None = None) -> TilePlan:
        """Plain causal attention, t queries over the same t keys: a tile sees keys 0..its last row."""
        tile, tiles = tile or TILE, []
        for r0 in range(0, t, tile):
            r1 = min(r0 + tile, t)
            mask = torch.ones(r1 - r0, r1, dtype=torch.bool).tril(r0)[None, None]
            tiles.append((slice(r0, r1), [Span(slice(0, r1), mask)]))
        return cls(tiles)

    @classmethod
    def from_spec(cls, spec, q_pos: torch.Tensor, k_pos: torch.Tensor, *, position_bias=None,
                  aligned: bool = False, tile: int | None = None) -> TilePlan:
        """The plan of MaskSpec `spec` over (b|1, t) query and (b|1, s) key positions: per query tile, the runs
        of key tiles holding an allowed pair (a window's reach bounds the candidates when queries and keys are
        aligned), with the predicate's mask where a run is not all allowed."""
        t, s, tile = q_pos.shape[-1], k_pos.shape[-1], tile or TILE
        before, after = spec.reach()
        bounded = aligned and before is not None and after is not None and not spec.global_indices
        tiles = []
        for r0 in range(0, t, tile):
            r1 = min(r0 + tile, t)
            lo, hi = (max(0, r0 - before), min(s, r1 + after)) if bounded else (0, s)
            tile_spec = spec.sliced(slice(r0, r1), slice(lo, hi))               # its documents and padding
            allowed = tile_spec.allows(q_pos[:, r0:r1], k_pos[:, lo:hi])        # (b|1, 1, rows, hi - lo)
            hit = allowed.flatten(0, 2).any(0)                                  # (hi - lo,) keys some row sees
            spans = []
            for k0, k1 in _runs(hit, tile):
                mask = allowed[..., k0:k1]
                keys = slice(lo + k0, lo + k1)
                bias = None if position_bias is None else position_bias(q_pos[:, r0:r1], k_pos[:, keys])
                spans.append(Span(keys, None if bool(mask.all()) else mask, bias))
            tiles.append((slice(r0, r1), spans))
        return cls(tiles)


def _runs(hit: torch.Tensor, tile: int) -> list[tuple[int, int]]:
    """Consecutive key tiles with an allowed pair, merged into (start, end) runs."""
    n = hit.shape[0]
    keep = [bool(hit[k0:k0 + tile].any()) for k0 in range(0, n, tile)]
    runs: list[tuple[int, int]] = []
    for i, kept in enumerate(keep):
        if not kept:
            continue
        k0, k1 = i * tile, min((i + 1) * tile, n)
        if runs and runs[-1][1] == k0:
            runs[-1] = (runs[-1][0], k1)
        else:
            runs.append((k0, k1))
    return runs


def _per_row(x: torch.Tensor, b: int, h: int, heads: slice) -> torch.Tensor:
    """A span's (b|1, 1|h, rows, keys) mask or bias for a slice of the flattened (b·h) rows."""
    if x.shape[0] == 1 and x.shape[1] == 1:
        return x[0]                                                        # (1, rows, keys): broadcasts
    return x.expand(b, h, *x.shape[2:]).reshape(b * h, *x.shape[2:])[heads]


def _probs_unnormalized(q, k, scale, span: Span, b: int, h: int, heads: slice, acc) -> torch.Tensor:
    """scale q k^T (+ bias) as float32 products of the inputs (as the flash kernels compute them), with
    masked pairs at -inf: (rows of b·h, tile rows, span keys)."""
    s = torch.bmm(q.to(acc) * scale, k.to(acc).transpose(1, 2))
    if span.bias is not None:
        s += _per_row(span.bias, b, h, heads)
    if span.mask is not None:
        s.masked_fill_(~_per_row(span.mask, b, h, heads), float("-inf"))
    return s


def _flat(q, k, v, *rest):
    """(b, h, t, e) and (b, k, s, e) -> (b·h, t|s, e), GQA's kv heads repeated for every query head."""
    b, h, _, e = q.shape
    groups = h // k.shape[1]                         # GQA/MQA: every query head gets its key/value head
    if groups > 1:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return tuple(z.reshape(b * h, -1, z.shape[-1]) for z in (q, k, v, *rest))


def _slice_rows(plan: TilePlan) -> int:
    """(b·h) rows per slice, so that one span's float32 scores stay under SLICE_BYTES (they stay in cache)."""
    widest = max(((sp.keys.stop - sp.keys.start) * (rows.stop - rows.start) for rows, spans in plan.tiles
                  for sp in spans), default=1)
    return max(1, SLICE_BYTES // (4 * widest))


def _forward(q, k, v, scale, plan: TilePlan):
    """The online softmax: (out (b, h, t, e), lse (b, h, t) float32)."""
    b, h, t, e = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf = _flat(q, k, v)
    out = torch.empty_like(qf)
    lse = torch.empty(b * h, t, 1, dtype=acc, device=q.device)
    step = _slice_rows(plan)
    for i in range(0, b * h, step):
        heads = slice(i, i + step)
        for rows, spans in plan.tiles:
            qs = (heads, rows)
            m = torch.full((*qf[qs].shape[:2], 1), float("-inf"), dtype=acc, device=q.device)
            denom = torch.zeros_like(m)
            o = torch.zeros(*qf[qs].shape[:2], e, dtype=acc, device=q.device)
            for span in spans:
                s = _probs_unnormalized(qf[qs], kf[heads, span.keys], scale, span, b, h, heads, acc)
                m_new = torch.maximum(m, s.amax(-1, keepdim=True))
                safe = m_new.masked_fill(m_new == float("-inf"), 0.0)          # a row with no key yet: p = 0
                p = s.sub_(safe).exp_()
                correction = (m - safe).exp_()
                denom = denom.mul_(correction).add_(p.sum(-1, keepdim=True))
                o = o.mul_(correction).add_(torch.bmm(p.to(q.dtype), vf[heads, span.keys]))
                m = m_new
            out[qs] = (o / denom).to(q.dtype)
            lse[qs] = m + denom.log()
    return out.view(b, h, t, e), lse.view(b, h, t)


def _backward(q, k, v, out, lse, grad_out, scale, plan: TilePlan):
    """dq, dk, dv from the saved lse, span by span (k, v: the unexpanded kv heads)."""
    b, h, t, e = q.shape
    kv_heads = k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf, of, gf = _flat(q, k, v, out, grad_out)
    lse = lse.reshape(b * h, t, 1)
    dq = torch.zeros(b * h, t, e, dtype=acc, device=q.device)
    dk, dv = (torch.zeros_like(kf, dtype=acc) for _ in range(2))
    step = _slice_rows(plan)
    for i in range(0, b * h, step):
        heads = slice(i, i + step)
        for rows, spans in plan.tiles:
            qs = (heads, rows)
            go = gf[qs].to(acc)
            row_dot = (go * of[qs].to(acc)).sum(-1, keepdim=True)                # (r, c, 1)
            for span in spans:
                ks = (heads, span.keys)
                p = _probs_unnormalized(qf[qs], kf[ks], scale, span, b, h, heads, acc).sub_(lse[qs]).exp_()
                grad_s = torch.bmm(go, vf[ks].to(acc).transpose(1, 2)).sub_(row_dot).mul_(p).to(q.dtype)
                dv[ks] += torch.bmm(p.to(q.dtype).transpose(1, 2), gf[qs])       # (r, keys, e)
                dq[qs] += torch.bmm(grad_s, kf[ks]).mul_(scale)
                dk[ks] += torch.bmm(grad_s.transpose(1, 2), qf[qs]).mul_(scale)
    groups = h // kv_heads
    dk, dv = (z.view(b, kv_heads, groups, -1, e).sum(2) for z in (dk, dv))         # (b, k, s, e)
    return dq.view(b, h, t, e).to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale: float, plan: TilePlan):    # q (b, h, t, e); k, v (b, k, s, e)
        out, lse = _forward(q, k, v, scale, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.plan = scale, plan
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        return (*_backward(q, k, v, out, lse, grad_out, ctx.scale, ctx.plan), None, None)


class _CausalAttention(torch.autograd.Function):
    """SDPA's CPU flash forward (it returns the lse the tiled backward needs), the tiled backward."""

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
        plan = TilePlan.causal(q.shape[2])
        return (*_backward(q, k, v, out, lse, grad_out, ctx.scale, plan), None)


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, plan: TilePlan) -> torch.Tensor:
    """softmax(scale q k^T + bias, masked as `plan` says) v for (b, h, t, e) queries and (b, k, s, e) keys and
    values (h a multiple of k), tile by tile. Example: out = tiled_attention(q, k, v, 0.125, TilePlan.causal(t))"""
    return _Tiled.apply(q, k, v, scale, plan)


def use_cpu_attention(q: torch.Tensor, dropout: float) -> bool:
    """Whether causal_attention should replace SDPA: bf16 on a CPU with bf16 matmul units, eager, up
    to MAX_LEN queries, with a backward to run. (Where bf16 is emulated, AVX2 alone, SDPA's backward
    is the faster one: 150 vs 195 ms for 8 x 5 heads of 64 at 1,024 tokens.)"""
    return (not torch.compiler.is_compiling()       # first: the CPU feature probe below breaks graphs
            and q.device.type == "cpu" and q.dtype == torch.bfloat16 and dropout == 0.0
            and q.shape[-2] <= MAX_LEN and torch.is_grad_enabled() and q.requires_grad
            and has_native_bf16(q.device))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale q k^T, causal) v for (b, h, t, e) queries and (b, k, t, e) keys/values (h a
    multiple of k); the same forward as SDPA's CPU flash kernel, the tiled backward.
    Example: out = causal_attention(q, k, v, q.shape[-1] ** -0.5)"""
    return _CausalAttention.apply(q, k, v, scale)
