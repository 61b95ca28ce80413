"""The Sparse Transformer's strided pattern (Child et al. 2019) at the cost of the pairs it attends to.

A strided query i sees the l keys before it, |i - j| < l, and every l-th key beyond, (i - j) % l == 0. No
block of queries shares its keys (each residue mod l reaches a different column set), so the pattern
splits into two disjoint key sets, each of which has a fast layout:

    local    |i - j| < l                a sliding window: nn/local_attention's blocks, O(n·(B + l))
    strided  (i - j) % l == 0, |i-j|>=l  one residue class mod l: a full attention over n / l positions,
                                        the classes as batch rows, O(n² / l)

Each part is a softmax over its own keys; the two merge exactly through their log-sum-exp, as
FlashAttention merges key tiles: out = Σ_p exp(lse_p - lse) out_p with lse = log Σ_p exp(lse_p). Both parts
run the reference math (attention_backends.softmax_attention), so autograd gives the backward. A masked key
adds -1e30 rather than -inf, so a row with no key in one part (a query whose strided keys are all in the
future) weighs that part exp(-1e30 - lse) = 0 instead of turning into NaN.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from archlab.nn.attention_backends import AttnCall, Backend, register, softmax_attention
from archlab.nn.local_attention import BlockLocal, dilate, unblock, undilate

__all__ = ["Strided"]

MASKED = -1e30   # a finite "minus infinity": exp underflows to 0, and nothing becomes NaN


def _finite(call: AttnCall) -> AttnCall:
    """`call` with its boolean mask folded into the bias as MASKED (a dense call: mask and bias tensors)."""
    mask, bias = call.dense_mask(), call.dense_bias()
    if mask is None:
        return call
    penalty = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, MASKED)
    return replace(call, mask=None, is_causal=False, bias=penalty if bias is None else bias + penalty)


def _lse_out(call: AttnCall) -> tuple[torch.Tensor, torch.Tensor]:
    out, _, lse = softmax_attention(_finite(call), with_lse=True)
    assert lse is not None
    return out, lse


@register(priority=310)
class Strided(Backend):
    """A strided Sparse Transformer layer as a local window plus one full attention per residue class."""

    name = "strided"
    local = BlockLocal()

    def supports(self, call: AttnCall) -> str | None:
        spec = call.spec
        if spec is None or spec.pattern != "strided" or not call.aligned or call.q_pos is None:
            return "a strided pattern's spec over aligned queries and keys (no cache, or a fresh cache's prefill)"
        if spec.prefix_lengths is not None or spec.global_indices or spec.key_segment_ids is not None:
            return "no prefix, global tokens or keys' own segment ids (their pairs fall outside both parts)"
        if call.keep_probs or call.bias is not None:
            return "no kept probabilities or bias tensor"
        return None

    def prefers(self, call: AttnCall) -> bool:
        """Where the full call visits more pairs than the two parts: t/2 (causal) against B + l + t/l."""
        assert call.spec is not None and call.spec.block_size is not None
        t, stride = call.q.shape[2], call.spec.block_size
        full = t / 2 if call.spec.causal else t
        return full >= self.local.block + 2 * stride + t / stride

    def __call__(self, call: AttnCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        spec = call.spec
        assert spec is not None and spec.block_size is not None and call.q_pos is not None
        stride, (b, _, t, _) = spec.block_size, call.q.shape
        window = replace(spec, pattern=None, block_size=None,
                         window=(stride - 1, 0 if spec.causal else stride - 1))            # |i - j| < l
        # the local part: sliding-window blocks, sinks counted here (once)
        local = self.local.blocked(replace(call, spec=window))
        out_local, lse_local = _lse_out(local)                                            # (b·nb, h, B, [e])
        out_local = unblock(out_local, b, t)
        lse_local = unblock(lse_local[..., None], b, t)[..., 0]                          # (b, h, t)
        # the strided part: residue classes mod l as batch rows, every same-class pair beyond the window
        padding, seg, q_pos = spec.key_padding, spec.segment_ids, call.q_pos
        rows = max(x.shape[0] for x in (q_pos, padding, seg) if x is not None)
        q_pos = dilate(q_pos.expand(rows, t), stride, -1)                                 # (r·l, t/l)
        padding = None if padding is None else dilate(padding.expand(rows, t), stride, False)
        seg = None if seg is None else dilate(seg.expand(rows, t), stride, -1)
        classes = replace(spec, key_padding=padding, segment_ids=seg)
        # beyond the window: the pattern's pairs (documents included) less the window's, whatever their documents
        near = replace(window, key_padding=padding, segment_ids=None)
        mask = classes.allows(q_pos, q_pos) & ~near.allows(q_pos, q_pos)
        bias = None if call.position_bias is None else call.position_bias(q_pos, q_pos)   # (r·l, h, t/l, t/l)
        far = AttnCall(dilate(call.q, stride), dilate(call.k, stride), dilate(call.v, stride), call.scale,
                       mask=_rows(mask, b * stride), softcap=call.softcap, dropout=call.dropout,
                       bias=None if bias is None else _rows(bias, b * stride))
        out_far, lse_far = _lse_out(far)                                                  # (b·l, h, t/l, [e])
        out_far = undilate(out_far, stride, t)
        lse_far = undilate(lse_far[..., None], stride, t)[..., 0]
        lse = torch.logaddexp(lse_local, lse_far)                                         # (b, h, t)
        weights = [torch.exp(part - lse)[..., None].to(out_local.dtype) for part in (lse_local, lse_far)]
        return weights[0] * out_local + weights[1] * out_far, None


def _rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """A mask or bias over (r·l) residue rows, repeated to the call's (b·l) rows when positions are shared."""
    return x if x.shape[0] == rows else x.repeat(rows // x.shape[0], 1, 1, 1)

