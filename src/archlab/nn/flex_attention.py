"""FlexAttention (Dong et al. 2024, "Flex Attention: A Programming Model for Generating Optimized Attention
Kernels"): an attention variant as two small functions that torch.compile fuses into one kernel,

    mask_mod(b, h, q_idx, kv_idx) -> bool              may this query see this key
    score_mod(score, b, h, q_idx, kv_idx) -> score     soft-cap, position bias

and a BlockMask: mask_mod evaluated once per (128 × 128) tile of the score matrix, so the kernel skips the
tiles with no allowed pair and runs full ones without calling mask_mod; the cost follows the mask.

The mask_mod here is the layer's own predicate, MaskSpec.pairs (what MaskSpec.allows evaluates over a whole
grid), on one (query, key) pair: the call's positions and the spec's per-row facts (prefix length, key
padding, segment ids, global tokens) looked up by index. One BlockMask per spec and forward, shared by its
layers through call.inputs.shared as the dense masks are. The score_mod soft-caps, then adds the position
bias: ALiBi's and T5's depend on the distance q - k only, so a (h, distances) table from the layer's own
bias function is indexed per pair. Learned sinks, a logit in the denominator only, scale each row by
sigmoid(lse - sink) from the kernel's log-sum-exp. Direct callers' mask and bias tensors are indexed alike.

torch 2.13 runs FlexAttention's forward on CPU (the unfused reference) but no backward there: on CPU it
serves forced("flex") under torch.no_grad(); on CUDA the compiled kernel is chosen for masked calls.

The compiled kernel has limits of its own, found on an H200 (torch 2.11): a head dimension below 16 is refused
by its lowering (supports() says so), and some shapes find no kernel configuration at all (fp32, one key/value
head for four query heads, head dimension 16, with gradients: "NoValidChoicesError"). A call whose kernel
cannot be built runs on the eager reference with one warning, and its shape is refused from then on, so the
chooser takes the next backend instead of recompiling on every call.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._dynamo.exc import BackendCompilerFailed
from torch._inductor.exc import LoweringException
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

from archlab.nn.attention_backends import AttnCall, Backend, register, softmax_attention
from archlab.nn.masks import MaskSpec
from archlab.nn.position import ALiBi, T5Bias

__all__ = ["Flex", "spec_mask_mod"]

_COMPILED: Callable[..., Any] | None = None   # torch.compile(flex_attention), built on first CUDA use
_UNBUILDABLE: dict[tuple, str] = {}            # kernel_shape(call) -> why torch could not build its kernel
BUILD_ERRORS = (BackendCompilerFailed, LoweringException)   # InductorError is a BackendCompilerFailed


def kernel_shape(call: AttnCall) -> tuple:
    """What selects a compiled kernel's configuration: dtype, head dims, query / key-value heads, gradients."""
    return (call.q.device.type, call.q.dtype, call.q.shape[-1], call.v.shape[-1], call.q.shape[1], call.k.shape[1],
            _needs_grad(call))


def _kernel(device: torch.device) -> Callable[..., Any]:
    """The compiled FlexAttention kernel on CUDA; elsewhere the uncompiled one (materializes the scores)."""
    global _COMPILED
    if device.type != "cuda":
        return flex_attention
    if _COMPILED is None:
        _COMPILED = torch.compile(flex_attention)
    return _COMPILED


def spec_mask_mod(spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor) -> Callable[..., torch.Tensor]:
    """mask_mod of `spec` over (b, t) query and (b, s) key positions: MaskSpec.pairs on one pair."""
    b = q_pos.shape[0]
    prefix, padding, seg, key_seg = spec.prefix_lengths, spec.key_padding, spec.segment_ids, spec.keys_segments()
    prefix = None if prefix is None else prefix.expand(b)                       # (b,)
    padding = None if padding is None else padding.expand(b, -1)                # (b, s)
    seg = None if seg is None else seg.expand(b, -1)                            # (b, t) the queries' documents
    key_seg = None if key_seg is None else key_seg.expand(b, -1)                # (b, s) the keys' documents
    g = torch.tensor(spec.global_indices or (-2,), device=q_pos.device)        # -2: no position
    q_global, k_global = torch.isin(q_pos, g), torch.isin(k_pos, g)              # (b, t), (b, s)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return spec.pairs(q_pos[b, q], k_pos[b, kv],
                          global_pair=q_global[b, q] | k_global[b, kv] if spec.global_indices else None,
                          prefix=None if prefix is None else prefix[b],
                          key_real=None if padding is None else padding[b, kv],
                          same_segment=None if seg is None or key_seg is None else seg[b, q] == key_seg[b, kv])
    return mask_mod


def _block_mask(mask_mod: Callable[..., torch.Tensor], rows: int, t: int, s: int, device: torch.device) -> BlockMask:
    """The BlockMask (rows 1: one for every batch row); compiled on CUDA, where vmap would materialize (t, s)."""
    return create_block_mask(mask_mod, None if rows == 1 else rows, None, t, s, device=device,
                             _compile=device.type == "cuda")


@dataclass
class _Pairs:
    """What the layers of one spec share in a forward: positions expanded to the batch, and the BlockMask."""
    q_pos: torch.Tensor                     # (b, t)
    k_pos: torch.Tensor                     # (b, s)
    block_mask: BlockMask
    distances: tuple[int, int] | None = None   # (least q - k, how many): a position bias table's range

    def distance_range(self) -> tuple[int, int]:
        if self.distances is None:                         # a host sync, once per spec and forward
            low = int(self.q_pos.min() - self.k_pos.max())
            self.distances = (low, int(self.q_pos.max() - self.k_pos.min()) - low + 1)
        return self.distances


def _spec_pairs(call: AttnCall) -> _Pairs:
    """The call's _Pairs, built once per forward for every layer whose spec and shapes match."""
    spec, q_pos, k_pos = call.spec, call.q_pos, call.k_pos
    assert spec is not None and q_pos is not None and k_pos is not None
    key = ("flex", spec.key, tuple(q_pos.shape), tuple(k_pos.shape))
    shared = call.inputs.shared if call.inputs is not None else {}
    hit = shared.get(key)
    if hit is None:
        b, t, s = call.q.shape[0], call.q.shape[2], call.k.shape[2]
        per_row = [x for x in (q_pos, k_pos, spec.prefix_lengths, spec.key_padding, spec.segment_ids,
                               spec.key_segment_ids) if x is not None]
        rows = max(x.shape[0] for x in per_row)                                  # 1: shared by every row
        q_pos, k_pos = q_pos.expand(b, t), k_pos.expand(b, s)
        mask_mod = spec_mask_mod(spec, q_pos, k_pos)
        hit = shared[key] = _Pairs(q_pos, k_pos, _block_mask(mask_mod, rows, t, s, call.q.device))
    return hit


def _tensor_block_mask(call: AttnCall) -> BlockMask | None:
    """A direct caller's mask tensor or causal flag as a BlockMask (None: every query sees every key)."""
    b, t, s = call.q.shape[0], call.q.shape[2], call.k.shape[2]
    if call.mask is not None:
        mask = call.mask.expand(b, 1, t, s)

        def tensor_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return mask[b, 0, q, kv]
        return _block_mask(tensor_mod, call.mask.shape[0], t, s, call.q.device)
    if call.is_causal:
        def causal_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return kv <= q + (s - t)                                             # tril(s - t), as eager
        return _block_mask(causal_mod, 1, t, s, call.q.device)
    return None


def _relative(position_bias: Callable[..., Any]) -> bool:
    """A bias of the distance q - k only (ALiBi, T5): what a table indexed by distance reproduces."""
    return isinstance(getattr(position_bias, "__self__", None), (ALiBi, T5Bias))


def _score_mod(call: AttnCall, pairs: _Pairs | None) -> Callable[..., torch.Tensor] | None:
    """Soft-cap, then the position bias (a table by distance) or a direct caller's bias tensor."""
    cap, table, low = call.softcap, None, 0
    q_pos, k_pos = (pairs.q_pos, pairs.k_pos) if pairs is not None else (None, None)
    if call.position_bias is not None and pairs is not None:
        low, n = pairs.distance_range()
        distances = torch.arange(low, low + n, device=call.q.device)[None]      # (1, n)
        bias = call.position_bias(distances, torch.zeros_like(distances[:, :1]))  # (1, h, n, 1)
        table = None if bias is None else bias[0, :, :, 0]                       # (h, n)
    dense = call.bias
    if dense is not None:
        dense = dense.expand(call.q.shape[0], call.q.shape[1], call.q.shape[2], call.k.shape[2])   # (b, h, t, s)
    if cap is None and table is None and dense is None:
        return None

    def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
                  ) -> torch.Tensor:
        if cap is not None:
            score = cap * torch.tanh(score / cap)
        if table is not None and q_pos is not None and k_pos is not None:
            score = score + table[h, q_pos[b, q] - k_pos[b, kv] - low]
        if dense is not None:
            score = score + dense[b, h, q, kv]
        return score
    return score_mod


# before SDPA where CUDA is (it is preferred there); on a CPU-only machine it is never preferred, so it sits just
# above eager: the calls SDPA and the blocked kernels take never pay its checks (~1-2 us a call in a decode step)
@register(priority=400 if torch.cuda.is_available() else 1)
class Flex(Backend):
    """FlexAttention with the call's BlockMask: masks and position biases without a dense (t, s) mask."""

    name = "flex"

    def supports(self, call: AttnCall) -> str | None:
        cpu = call.q.is_cpu
        if not (cpu or call.q.is_cuda):
            return "CPU (forward only) or CUDA tensors"
        if call.keep_probs or call.dropout:
            return "no kept probabilities or dropout"
        if call.spec is not None and (call.q_pos is None or call.k_pos is None):
            return "a spec with its positions"
        if call.position_bias is not None and (call.spec is None or not _relative(call.position_bias)):
            return "a position bias of the distance q - k only (ALiBi, T5) over a spec's positions"
        if call.q.is_cuda and min(call.q.shape[-1], call.v.shape[-1]) < 16:
            return "a head dimension of at least 16 (the compiled CUDA kernel's minimum)"
        if (why := _UNBUILDABLE.get(kernel_shape(call))) is not None:
            return f"torch could not build the compiled kernel for this shape here ({why})"
        if cpu and _needs_grad(call):
            return "torch 2.13 has no CPU FlexAttention backward (forward under torch.no_grad() only)"
        return None

    def prefers(self, call: AttnCall) -> bool:
        """On CUDA, for more than one query where a dense mask or the eager path would be needed otherwise
        (a window, pattern, prefix or padding; soft-cap, a position bias, sinks). A plain causal call stays on
        SDPA's flash kernel, a decode step on SDPA (no BlockMask per step)."""
        if not call.q.is_cuda or call.q.shape[2] == 1:
            return False
        plain = call.spec is None or (call.aligned and call.spec.only_structure)
        extras = (call.softcap, call.sinks, call.position_bias, call.bias)
        return not plain or any(x is not None for x in extras)

    def __call__(self, call: AttnCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        try:
            return self._flex(call)
        except BUILD_ERRORS as e:
            why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            _UNBUILDABLE[kernel_shape(call)] = why
            warnings.warn(f"FlexAttention: torch could not build a kernel for {tuple(call.q.shape)} "
                          f"{call.q.dtype} queries and {call.k.shape[1]} key/value heads ({why}); this shape runs "
                          "on the other backends from now on", RuntimeWarning, stacklevel=2)
            out, _, _ = softmax_attention(call)
            return out, None

    def _flex(self, call: AttnCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        pairs = _spec_pairs(call) if call.spec is not None else None
        block_mask = pairs.block_mask if pairs is not None else _tensor_block_mask(call)
        q = call.q                                                                # (b, h, t, e)
        kw = {"score_mod": _score_mod(call, pairs), "block_mask": block_mask, "scale": call.scale,
              "enable_gqa": call.k.shape[1] != q.shape[1]}
        if call.sinks is None:
            return _kernel(q.device)(q, call.k, call.v, **kw), None
        # a sink takes its share of each row's denominator: out · sigmoid(lse - sink)
        out, aux = _kernel(q.device)(q, call.k, call.v, return_aux=AuxRequest(lse=True), **kw)
        keep = torch.sigmoid(aux.lse - call.sinks.to(aux.lse.dtype)[None, :, None])        # (b, h, t)
        return (out * keep[..., None]).to(q.dtype), None


def _needs_grad(call: AttnCall) -> bool:
    """Would autograd need FlexAttention's backward for this call?"""
    if not torch.is_grad_enabled():
        return False
    if any(x is not None and x.requires_grad for x in (call.q, call.k, call.v, call.bias, call.sinks)):
        return True
    if call.position_bias is not None and call.q_pos is not None and call.k_pos is not None:
        sample = call.position_bias(call.q_pos[:, :1], call.k_pos[:, :1])            # a learned T5 table
        return sample is not None and sample.requires_grad
    return False
