"""Attention backends behind one seam: a layer computes q, k, v and what may attend to what, puts them in
an `AttnCall`, and `run(call)` hands it to the first backend in `ORDER` that can compute it and is the
faster choice here. Each backend declares

    supports(call) -> None | str    what it computes exactly (else the reason): a correctness contract
    prefers(call)  -> bool          whether it is worth choosing for this call on this machine: speed

"eager" supports every call and is the reference: every other backend is tested equal to it over
tests/variants.py, gradients included (tests/test_attention_backends.py). A new kernel (sliding-window,
block-sparse, FlexAttention) is one more registered class here; layers never change.

    with forced("eager"): model(x)      # every layer on one backend (tests, diagnostics)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from archlab.nn import cpu_attention
from archlab.nn.registry import Registry

__all__ = ["AttnCall", "BACKENDS", "ORDER", "choose", "forced", "observe", "run"]


@dataclass
class AttnCall:
    """One layer's attention, as data. Shapes: b batch, h query heads, k kv heads, t queries, s keys."""

    q: torch.Tensor                        # (b, h, t, e)
    k: torch.Tensor                        # (b, k, s, e), h a multiple of k (GQA, MQA)
    v: torch.Tensor                        # (b, k, s, e)
    scale: float
    mask: torch.Tensor | None = None       # (b|1, 1, t, s) bool, True = may attend
    is_causal: bool = False                # no mask tensor: query i sees keys 0..i (t == s, no cache)
    bias: torch.Tensor | None = None       # (b|1, h, t, s) added to the scores (ALiBi, T5)
    softcap: float | None = None           # scores -> cap * tanh(scores / cap) (Gemma 2)
    sinks: torch.Tensor | None = None      # (h,) learned sink logits in the softmax denominator
    dropout: float = 0.0                   # on the probabilities (training only)
    keep_probs: bool = False               # return the probabilities too (diagnostics)

    def dense_mask(self) -> torch.Tensor | None:
        """The mask as a tensor, the causal one included (None: every query sees every key)."""
        if self.mask is None and self.is_causal:
            t, s = self.q.shape[2], self.k.shape[2]
            return torch.ones(t, s, dtype=torch.bool, device=self.q.device).tril(s - t)[None, None]
        return self.mask


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


class Eager(Backend):
    """The readable reference: scores, soft-cap, bias, mask, sinks, softmax, dropout, in float32."""

    name = "eager"

    def __call__(self, call: AttnCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        groups = call.q.shape[1] // call.k.shape[1]
        k, v = call.k.repeat_interleave(groups, dim=1), call.v.repeat_interleave(groups, dim=1)  # (b, h, s, e)
        # upcast to fp32 before softcap and softmax: bf16 logits lose the tail that matters
        scores = (call.q @ k.transpose(-1, -2)).float() * call.scale                   # (b, h, t, s)
        if call.softcap is not None:
            scores = call.softcap * torch.tanh(scores / call.softcap)
        if call.bias is not None:
            scores = scores + call.bias
        mask = call.dense_mask()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        if call.sinks is not None:
            b, t = scores.shape[0], scores.shape[2]
            sink = call.sinks.float()[None, :, None, None].expand(b, -1, t, 1)
            probs = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        kept = probs.detach() if call.keep_probs else None
        probs = F.dropout(probs, call.dropout, call.dropout > 0)
        return probs.to(v.dtype) @ v, kept                                                 # (b, h, t, e)


class SDPA(Backend):
    """torch's scaled_dot_product_attention (flash / memory-efficient / math kernels); a bias rides in
    its float mask."""

    name = "sdpa"

    def supports(self, call: AttnCall) -> str | None:
        if call.softcap is not None or call.sinks is not None or call.keep_probs:
            return "no soft-cap, sinks or kept probabilities"
        return None

    def __call__(self, call: AttnCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, is_causal, attn_mask = call.q, call.is_causal, call.mask
        if call.bias is not None:                       # a bias needs the mask beside it, explicitly
            mask = call.dense_mask()
            bias = call.bias.to(q.dtype)
            attn_mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
            is_causal = False
        out = F.scaled_dot_product_attention(q, call.k, call.v, attn_mask=attn_mask,
                                             is_causal=is_causal and attn_mask is None, dropout_p=call.dropout,
                                             scale=call.scale, enable_gqa=call.k.shape[1] != q.shape[1])
        return out, None


class CPUCausal(Backend):
    """nn/cpu_attention.causal_attention: SDPA's CPU flash forward with a matmul backward, faster for bf16
    training on CPUs with bf16 matmul units."""

    name = "cpu_causal"

    def supports(self, call: AttnCall) -> str | None:
        if not call.is_causal or call.mask is not None or call.bias is not None:
            return "plain causal attention only (no mask tensor, no bias)"
        if call.softcap is not None or call.sinks is not None or call.keep_probs or call.dropout:
            return "no soft-cap, sinks, kept probabilities or dropout"
        if call.q.device.type != "cpu" or call.q.shape[2] != call.k.shape[2]:
            return "CPU, queries = keys (no cache)"
        return None

    def prefers(self, call: AttnCall) -> bool:
        return cpu_attention.use_cpu_attention(call.q, call.dropout)    # bf16 training on bf16 units

    def __call__(self, call: AttnCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        return cpu_attention.causal_attention(call.q, call.k, call.v, call.scale), None


for _backend in (Eager(), SDPA(), CPUCausal()):
    BACKENDS.register(_backend.name)(_backend)
ORDER = ("cpu_causal", "sdpa", "eager")        # the first that supports and prefers a call runs it
_ORDERED = [BACKENDS.get(name) for name in ORDER]
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
