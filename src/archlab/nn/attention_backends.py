"""Attention backends behind one seam: a layer computes q, k, v and what may attend to what, puts them in
an `AttnCall`, and `run(call)` hands it to the first backend in `ORDER` that can compute it and is the
faster choice here. Each backend declares

    supports(call) -> None | str    what it computes exactly (else the reason): a correctness contract
    prefers(call)  -> bool          whether it is worth choosing for this call on this machine: speed

"eager" supports every call and is the reference: every other backend is tested equal to it over
tests/variants.py, gradients included (tests/nn/test_attention_backends.py). A new kernel (sliding-window,
block-sparse, FlexAttention) is one more registered class here; layers never change.

    with forced("eager"): model(x)      # every layer on one backend (tests, diagnostics)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from archlab.nn import tiled_attention
from archlab.nn.fused import materialized
from archlab.nn.masks import AttnInputs, MaskSpec
from archlab.nn.registry import Registry

__all__ = ["AttnCall", "Backend", "BACKENDS", "ORDER", "register", "choose", "decode_attention", "dense_choice",
           "forced", "observe", "run", "softmax_attention"]


PositionBias = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]


@dataclass(eq=False)
class AttnCall:
    """One layer's attention, as data. Shapes: b batch, h query heads, k kv heads, t queries, s keys.

    What may attend to what comes in one of two forms: a layer gives its `spec` and the positions (kernels
    that need no dense mask read those; `dense()` builds the mask once per forward for those that do), a
    direct caller gives `mask` / `is_causal` as tensors. A position bias likewise: `position_bias` computed
    over whichever (query, key) pairs a backend visits, or a `bias` tensor."""

    q: torch.Tensor                        # (b, h, t, e)
    k: torch.Tensor                        # (b, k, s, e), h a multiple of k (GQA, MQA)
    v: torch.Tensor                        # (b, k, s, e)
    scale: float
    mask: torch.Tensor | None = None       # (b|1, 1, t, s) bool, True = may attend (direct callers)
    is_causal: bool = False                # no mask tensor: query i sees keys 0..i (t == s, no cache)
    bias: torch.Tensor | None = None       # (b|1, h, t, s) added to the scores (direct callers)
    softcap: float | None = None           # scores -> cap * tanh(scores / cap) (Gemma 2)
    sinks: torch.Tensor | None = None      # (h,) learned sink logits in the softmax denominator
    dropout: float = 0.0                   # on the probabilities (training only)
    keep_probs: bool = False               # return the probabilities too (diagnostics)
    spec: MaskSpec | None = None           # the layer's structure, its window applied (layers)
    q_pos: torch.Tensor | None = None      # (b|1, t) query positions, -1 = padding
    k_pos: torch.Tensor | None = None      # (b|1, s) key positions, -1 = an empty or padded slot
    inputs: AttnInputs | None = None       # the forward's shared dense masks
    position_bias: PositionBias | None = None   # (q_pos, k_pos) -> (b, h, t, s): ALiBi, T5
    aligned: bool = False                  # key j is query j's token: t == s, positions 0..t-1, no cache
    _dense: tuple[torch.Tensor | None, bool] | None = field(default=None, init=False, repr=False)

    def dense(self) -> tuple[torch.Tensor | None, bool]:
        """(mask (b|1, 1, t, s) or None, is_causal): the form SDPA and the eager reference take."""
        if self.spec is None:
            return self.mask, self.is_causal
        if self._dense is None:
            assert self.q_pos is not None and self.k_pos is not None, "a spec needs its positions"
            self._dense = (self.inputs.dense(self.spec, self.q_pos, self.k_pos) if self.inputs is not None
                           else self.spec.dense(self.q_pos, self.k_pos, plain=self.aligned))
        return self._dense

    def dense_bias(self) -> torch.Tensor | None:
        """The position bias over every (query, key) pair, (b|1, h, t, s), or None."""
        if self.position_bias is None or self.q_pos is None or self.k_pos is None:
            return self.bias
        return self.position_bias(self.q_pos, self.k_pos)

    def dense_mask(self) -> torch.Tensor | None:
        """The mask as a tensor, the causal one included (None: every query sees every key)."""
        mask, is_causal = self.dense()
        if mask is None and is_causal:
            t, s = self.q.shape[2], self.k.shape[2]
            return torch.ones(t, s, dtype=torch.bool, device=self.q.device).tril(s - t)[None, None]
        return mask


class Backend:
    name = "?"

    def supports(self, call: AttnCall) -> str | None:
        return None

    def prefers(self, call: AttnCall) -> bool:
        return True

    def __call__(self, call: AttnCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out (b, h, t, e), probabilities (b, h, t, s) when call.keep_probs, else None)."""
        raise NotImplementedError


BACKENDS: Registry[Backend] = Registry("attention backend")
_PRIORITY: dict[str, int] = {}
ORDER: tuple[str, ...] = ()           # backend names by descending priority: `choose` tries them in turn
_ORDERED: list[Backend] = []


def register(priority: int) -> Callable[[type[Backend]], type[Backend]]:
    """Class decorator: register one instance of the backend, tried before every backend of lower priority
    (the eager reference, which supports every call, is last at 0).
    Example: @register(priority=300) class BlockLocal(Backend): ..."""
    def add(cls: type[Backend]) -> type[Backend]:
        global ORDER, _ORDERED
        backend = cls()
        BACKENDS.register(backend.name)(backend)
        _PRIORITY[backend.name] = priority
        ORDER = tuple(sorted(_PRIORITY, key=lambda name: -_PRIORITY[name]))
        _ORDERED = [BACKENDS.get(name) for name in ORDER]
        return cls
    return add


def softmax_attention(call: AttnCall, *, with_lse: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The reference math: scores, soft-cap, bias, mask, sinks, softmax, dropout, in float32 (at least).
    (out (b, h, t, e), the probabilities when call.keep_probs, the rows' log-sum-exp (b, h, t) when
    with_lse: what lets a kernel merge the attention of disjoint key sets, as FlashAttention's tiles do)."""
    groups = call.q.shape[1] // call.k.shape[1]
    k, v = call.k.repeat_interleave(groups, dim=1), call.v.repeat_interleave(groups, dim=1)   # (b, h, s, e)
    # upcast to fp32 (at least) before softcap and softmax: bf16 logits lose the tail that matters
    acc = torch.promote_types(call.q.dtype, torch.float32)
    scores = (call.q @ k.transpose(-1, -2)).to(acc) * call.scale                       # (b, h, t, s)
    if call.softcap is not None:
        scores = call.softcap * torch.tanh(scores / call.softcap)
    bias = call.dense_bias()
    if bias is not None:
        scores = scores + bias
    mask = call.dense_mask()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if call.sinks is not None:   # a per-head logit in the denominator only: (b, h, t, s + 1), then dropped
        b, t = scores.shape[0], scores.shape[2]
        sink = call.sinks.to(acc)[None, :, None, None].expand(b, -1, t, 1)
        scores = torch.cat((scores, sink), dim=-1)
    lse = torch.logsumexp(scores, -1) if with_lse else None
    probs = scores.softmax(-1)
    if call.sinks is not None:
        probs = probs[..., :-1]
    kept = probs.detach() if call.keep_probs else None
    probs = F.dropout(probs, call.dropout, call.dropout > 0)
    return probs.to(v.dtype) @ v, kept, lse                                                 # (b, h, t, e)


@register(priority=0)
class Eager(Backend):
    """The readable reference (softmax_attention): every call, every switch."""

    name = "eager"

    def __call__(self, call: AttnCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, kept, _ = softmax_attention(call)
        return out, kept


@register(priority=100)
class SDPA(Backend):
    """torch's scaled_dot_product_attention (flash / memory-efficient / math kernels); a bias rides in
    its float mask."""

    name = "sdpa"

    def supports(self, call: AttnCall) -> str | None:
        if call.softcap is not None or call.sinks is not None or call.keep_probs:
            return "no soft-cap, sinks or kept probabilities"
        return None

    def __call__(self, call: AttnCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, (attn_mask, is_causal), bias = call.q, call.dense(), call.dense_bias()
        if bias is not None:                            # a bias needs the mask beside it, explicitly
            mask = call.dense_mask()
            bias = bias.to(q.dtype)
            attn_mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
            is_causal = False
        elif attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = _additive(call, attn_mask)
        b, h, t, e = q.shape
        groups = h // call.k.shape[1]
        if (t == 1 and groups > 1 and bias is None and not (is_causal and attn_mask is None)
                and (attn_mask is None or (attn_mask.dim() == 4 and attn_mask.shape[1] == 1))):
            # one query per head (a decode step): a kv head's `groups` query heads as the rows of one query matrix
            # (b, k, groups, e), the same keys for each (the mask (b|1, 1, 1, s) broadcasts over them); the CPU
            # kernel then reads each kv head's keys once per group, not once per query head
            out = F.scaled_dot_product_attention(q.reshape(b, h // groups, groups, e), call.k, call.v,
                                                 attn_mask=attn_mask, dropout_p=call.dropout, scale=call.scale)
            return out.reshape(b, h, 1, e), None                                               # (b, h, 1, e)
        out = F.scaled_dot_product_attention(q, call.k, call.v, attn_mask=attn_mask,
                                             is_causal=is_causal and attn_mask is None, dropout_p=call.dropout,
                                             scale=call.scale, enable_gqa=groups > 1)
        return out, None


@register(priority=150)
class Decode(Backend):
    """One query per row over a KV cache, in a compiled decode step (nn/compiled_step.py): `decode_attention`, which
    inductor fuses into one loop nest over the cache beside the cache writes, where SDPA is an extern call per layer
    that it cannot fuse. Eagerly SDPA is as fast (SmolLM2-135M's eager step: the same time within noise): not chosen
    there."""

    name = "decode"

    def supports(self, call: AttnCall) -> str | None:
        if call.q.shape[2] != 1 or call.q.shape[1] % call.k.shape[1]:
            return "one query per row (a decode step)"
        if call.softcap is not None or call.sinks is not None or call.keep_probs or call.dropout:
            return "no soft-cap, sinks, kept probabilities or dropout"
        if call.bias is not None or call.position_bias is not None:
            return "no position bias"
        if call.spec is None and (call.is_causal or (call.mask is not None and call.mask.shape[1] != 1)):
            return "a mask shared by the heads"
        return None

    def prefers(self, call: AttnCall) -> bool:
        # compiled, one row only: on benchmarks/generate.py's model (GQA 8/4, head dim 32) the compiled step's
        # batch-8 generate ran 0.75x the same step with SDPA in the graph (11 interleaved rounds, 0.68-0.85), batch 1
        # 0.95x (0.83-0.99); SmolLM2-135M's batch-1 step is what chose it
        return torch.compiler.is_compiling() and call.q.shape[0] == 1

    def __call__(self, call: AttnCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        mask = call.dense()[0]
        return decode_attention(call.q, call.k, call.v, call.scale, mask, traced=torch.compiler.is_compiling()), None


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None, *,
                     traced: bool) -> torch.Tensor:                         # (b, h, 1, e), (b, k, s, e) -> (b, h, 1, e)
    """Attention of one query per row: each kv head's query heads as the rows of one (groups, e) matrix against its
    keys (GQA folded: each kv head's keys read once), scores and softmax in float32 (at least), the values' weighted
    sum; mask (b|1, 1, 1, s) bool or None. traced=True writes the two contractions as broadcast products summed over
    a dimension (what inductor fuses into its loops), else as batched matmuls (what runs fast eagerly).
    Example: out = decode_attention(q, k, v, q.shape[-1] ** -0.5, None, traced=False)"""
    b, h, _, e = q.shape
    kv = k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    q = q.reshape(b, kv, h // kv, e)                                                       # (b, k, g, e)
    if traced:     # q computed once into a buffer, not again for every key inside the loop below
        scores = (materialized(q)[:, :, :, None].to(acc) * k[:, :, None].to(acc)).sum(-1)   # (b, k, g, s)
    else:
        scores = torch.matmul(q, k.transpose(-1, -2)).to(acc)                             # (b, k, g, s)
    scores = scores * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(-1)
    if traced:
        out = (probs[..., None] * v[:, :, None].to(acc)).sum(-2).to(v.dtype)             # (b, k, g, e)
    else:
        out = torch.matmul(probs.to(v.dtype), v)                                           # (b, k, g, e)
    return out.reshape(b, h, 1, e)


def _additive(call: AttnCall, mask: torch.Tensor) -> torch.Tensor:
    """The bool mask as the additive float mask SDPA turns it into on every call (0 where allowed, -inf
    elsewhere: the same numbers), turned once per forward for the layers sharing it (AttnInputs.shared), not
    once per layer: a prefill continuing a long cache has a (t, s) mask as large as its keys. Without gradients
    only; a mask not from the forward's shared ones is handed on as it is."""
    if call.inputs is None or torch.is_grad_enabled():
        return mask
    key = ("additive", id(mask), call.q.dtype)         # the shared bool mask lives as long as the forward
    hit = call.inputs.shared.get(key)
    if hit is None:
        hit = call.inputs.shared[key] = torch.zeros(mask.shape, dtype=call.q.dtype, device=mask.device
                                                    ).masked_fill_(~mask, float("-inf"))
    return hit


@register(priority=200)
class CPUCausal(Backend):
    """nn/tiled_attention.causal_attention: SDPA's CPU flash forward with the tiled backward, faster for bf16
    training on CPUs with bf16 matmul units."""

    name = "cpu_causal"

    def supports(self, call: AttnCall) -> str | None:
        mask, is_causal = call.dense()
        if not is_causal or mask is not None or call.bias is not None or call.position_bias is not None:
            return "plain causal attention only (no mask tensor, no bias)"
        if call.softcap is not None or call.sinks is not None or call.keep_probs or call.dropout:
            return "no soft-cap, sinks, kept probabilities or dropout"
        if call.q.device.type != "cpu" or call.q.shape[2] != call.k.shape[2]:
            return "CPU, queries = keys (no cache)"
        return None

    def prefers(self, call: AttnCall) -> bool:
        return tiled_attention.use_cpu_attention(call.q, call.dropout)    # bf16 training on bf16 units

    def __call__(self, call: AttnCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        return tiled_attention.causal_attention(call.q, call.k, call.v, call.scale), None


@register(priority=50)
class Tiled(Backend):
    """nn/tiled_attention: FlashAttention-2's online softmax tile by tile, over the key spans the layer's
    mask reaches; O(n) memory. Never chosen on its own (Python per tile): forced("tiled")."""

    name = "tiled"

    def supports(self, call: AttnCall) -> str | None:
        if call.softcap is not None or call.sinks is not None or call.keep_probs or call.dropout:
            return "no soft-cap, sinks, kept probabilities or dropout"
        if call.bias is not None or (call.spec is None and call.mask is not None):
            return "a layer's spec (or no mask), a position bias as a function"
        if call.spec is None and call.is_causal and call.q.shape[2] != call.k.shape[2]:
            return "causal without a spec: queries = keys"
        if call.position_bias is not None and call.q_pos is not None and call.k_pos is not None:
            sample = call.position_bias(call.q_pos[:, :1], call.k_pos[:, :1])
            if sample is not None and sample.requires_grad:
                return "a position bias without weights (a learned T5 table: eager)"
        return None

    def prefers(self, call: AttnCall) -> bool:
        return False

    def __call__(self, call: AttnCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        t, s = call.q.shape[2], call.k.shape[2]
        if call.spec is None:
            plan = (tiled_attention.TilePlan.causal(t) if call.is_causal else tiled_attention.TilePlan.from_spec(
                MaskSpec(causal=False), torch.arange(t)[None], torch.arange(s)[None]))
        else:
            assert call.q_pos is not None and call.k_pos is not None
            plan = tiled_attention.TilePlan.from_spec(call.spec, call.q_pos, call.k_pos, aligned=call.aligned,
                                                      position_bias=call.position_bias)
        return tiled_attention.tiled_attention(call.q, call.k, call.v, call.scale, plan), None


_FORCED: str | None = None   # a plain global, not a ContextVar: torch.compile traces through it (no graph break)


@contextlib.contextmanager
def forced(name: str | None, *, strict: bool = False) -> Iterator[None]:
    """Run every call on backend `name` where it supports the call (strict: raise where it does not);
    the usual choice elsewhere. For tests and diagnostics."""
    global _FORCED
    BACKENDS.get(name) if name is not None else None      # an unknown name fails here
    before, _FORCED = _FORCED, None if name is None else f"{'!' if strict else ''}{name}"
    try:
        yield
    finally:
        _FORCED = before


def choose(call: AttnCall) -> Backend:
    """The backend that runs `call`."""
    wanted = _FORCED
    if wanted is not None:
        strict = wanted.startswith("!")
        backend = BACKENDS.get(wanted.lstrip("!"))
        reason = backend.supports(call)
        if reason is None:
            return backend
        if strict:
            raise ValueError(f"attention backend {backend.name!r} cannot run this call: {reason}")
    return dense_choice(call)


def dense_choice(call: AttnCall) -> Backend:
    """The first backend by priority that supports `call` and prefers it here, whatever `forced` says (a
    kernel that turns its call into smaller dense calls hands them on through this)."""
    for backend in _ORDERED:
        if backend.supports(call) is None and backend.prefers(call):
            return backend
    raise AssertionError("the eager backend supports every call")


_OBSERVER: Callable[[AttnCall], None] | None = None   # a plain global: torch.compile traces the check


@contextlib.contextmanager
def observe(fn: Callable[[AttnCall], None]) -> Iterator[None]:
    """Call fn(call) with every call, in layer order, before it runs: diagnostics read the q and k the
    layers really computed (norms, clipping, rotation included) instead of recomputing them."""
    global _OBSERVER
    before, _OBSERVER = _OBSERVER, fn
    try:
        yield
    finally:
        _OBSERVER = before


def run(call: AttnCall) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out (b, h, t, e), probabilities or None) of `call` on the backend `choose` picks.
    Example: out, _ = run(AttnCall(q, k, v, q.shape[-1] ** -0.5, is_causal=True))"""
    if _OBSERVER is not None:
        _OBSERVER(call)
    return choose(call)(call)
