"""A lean single-token decode step for the common pre-norm RoPE/NoPE dense models (LLaMA-style).

At batch 1 a decode step is dominated by per-op and per-call overhead, not arithmetic: the model's
own forward spends about 1 ms of a 2.8 ms step (the generate benchmark's model, one thread) in
Python (module calls, attribute lookups, view ops), so `FastDecoder.step` wires the same layers
without them: it computes what `TransformerLM.forward(tokens, positions, cache)` computes for one new
token per row, with the package's own pieces and no math of its own:
  - weights packed by `archlab.nn.fused.packed` (q/k/v and gate/up fused, stored (in, out), the faster
    gemv layout at one row), the same cache the modules decode through;
  - norms through `archlab.nn.fused.rms_norm` (RMSNorm) or the norm module itself;
  - q and k rotated in one pass by `archlab.nn.fused.rope_half`, tables built once per step;
  - the mask from the model's `MaskSpec` (no mask at all when the query may see every key), and the
    attention on the backend archlab.nn.attention_backends chooses.
It shares the model's StaticKVCache (the prompt is prefilled by the model itself) and is tested
equal to the model's forward (tests/test_generate_fast.py). Anything it does not cover falls back
to the model: `FastDecoder.supports(model, cache)` says why not, as a string, or None.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.nn.modules import module as _module

from archlab.nn import attention_backends as backends
from archlab.nn import fused
from archlab.nn.kv_cache import StaticKVCache
from archlab.nn.masks import MaskSpec
from archlab.nn.mlp import DenseMLP
from archlab.nn.norms import RMSNorm
from archlab.nn.position import NoPosition, RotaryEmbedding


def _has_hooks(model: torch.nn.Module) -> bool:
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def unsupported_reason(model, cache) -> str | None:
    """None if FastDecoder covers this model and cache, else what it does not cover."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "blocks"):
        return "not a TransformerLM"
    if not isinstance(cache, StaticKVCache):
        return "only StaticKVCache"
    if model.training:
        return "model in training mode (dropout)"
    if _has_hooks(model):
        return "forward hooks registered (they must see the model's own forward)"
    if model.abs_position.at_input or model.embed_norm is not None:
        return "absolute positions or an embedding norm"
    if cfg.logit_scale is not None or cfg.final_logit_softcap is not None:
        return "logit scale or final soft-cap"
    for block in model.blocks:
        att = block.attn
        if block.position != "pre" or block.parallel:
            return f"norm position {block.position!r} / parallel block"
        if not isinstance(block.mlp, DenseMLP):
            return "mixture-of-experts MLP"
        if att.qk_norm != "none" or att.clip_qkv is not None or att.softcap is not None \
                or att.sinks is not None or att.gate_proj is not None or att.record_probs:
            return "QK-norm, clip, soft-cap, sinks, gated or recorded attention"
        pos = att.position
        if type(pos) is RotaryEmbedding:
            if pos.interleaved or pos.rotary_dim != att.head_dim:
                return "interleaved or partial RoPE"
        elif not isinstance(pos, NoPosition):
            return f"position {type(pos).__name__} (relative biases)"
    return None


class _Layer:
    """One block's tensors for the decode step: weights packed (in, out) by archlab.nn.fused.packed."""

    def __init__(self, block):
        att, mlp = block.attn, block.mlp
        self.att = att
        self.h, self.k, self.e = att.n_heads, att.n_kv_heads, att.head_dim
        self.qkv = _pack((att.q_proj, att.k_proj, att.v_proj))                 # (d, (h + 2k) e)
        self.o = _pack((att.o_proj,))
        self.rope = type(att.position) is RotaryEmbedding
        self.gated, self.act = mlp.gated, mlp.act
        up = (mlp.gate_proj, mlp.up_proj) if mlp.gated else (mlp.up_proj,)
        self.up = _pack(up)                                                      # (d, 2f | f)
        self.down = _pack((mlp.down_proj,))
        self.attn_norm, self.mlp_norm = _Norm(block.attn_norm), _Norm(block.mlp_norm)


def _pack(linears) -> fused._Packed:
    """The modules' own packed weights (the cache their forward decodes through)."""
    pack = fused.packed_linears(linears)
    assert pack is not None, "q/k/v and gate/up share their bias setting (config.bias)"
    return pack


_linear = fused.packed_matmul                          # (b, in) -> (b, out)


class _Norm:
    """RMSNorm through archlab.nn.fused.rms_norm (the module's formula, its weight resolved once per
    generate call); any other norm runs as its module."""

    def __init__(self, norm: torch.nn.Module):
        self.module = norm
        self.rms = isinstance(norm, RMSNorm)
        if self.rms:
            self.eps = norm.eps
            self.weight = norm.weight + norm.weight_offset if norm.weight_offset else norm.weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps) if self.rms else self.module(x)


class _Prepared:
    """Everything FastDecoder derives from the weights, built once per model version."""

    def __init__(self, model):
        with torch.no_grad():
            self.layers = [_Layer(block) for block in model.blocks]
            self.final_norm = None if model.final_norm is None else _Norm(model.final_norm)
            owner = model if model.lm_head is None else model.lm_head
            bias = [] if model.head_bias is None else [model.head_bias]
            self.head = fused.packed(owner, "head", [model.head_weight], bias)            # (d, v)


_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> (signature, _Prepared)


def _signature(model) -> tuple | None:
    """Changes whenever a parameter is replaced or modified in place (None: cannot tell)."""
    try:
        return tuple((p.data_ptr(), p._version) for p in model.parameters())
    except RuntimeError:  # parameters created under inference_mode have no version counter
        return None


def prepare(model) -> _Prepared:
    """The model's prepared weights, reused while its parameters are unchanged (checked once per call
    of generate, not per step)."""
    sig = _signature(model)
    hit = _PREPARED.get(model)
    if sig is not None and hit is not None and hit[0] == sig:
        return hit[1]
    prepared = _Prepared(model)
    if sig is not None:
        _PREPARED[model] = (sig, prepared)
    return prepared


class FastDecoder:
    """`step(tokens (b,), positions (b, 1)) -> logits (b, v)` over `cache`, one token per row."""

    def __init__(self, model, cache: StaticKVCache):
        reason = unsupported_reason(model, cache)
        if reason is not None:
            raise ValueError(f"FastDecoder does not cover this model: {reason}")
        self.model, self.cache = model, cache
        self.prepared = prepare(model)
        self.scale_embeddings = model.config.scale_embeddings
        self.d_model = model.config.d_model

    supports = staticmethod(unsupported_reason)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        prep = self.prepared
        x = F.embedding(tokens, self.model.embed.weight)                      # (b, d)
        if self.scale_embeddings:
            x = x * torch.tensor(self.d_model ** 0.5, dtype=x.dtype)
        b, dtype = x.shape[0], x.dtype
        tables: dict = {}   # RoPE (cos, sin) per frequency set, masks per (window, keys)
        masks: dict = {}
        for lay in prep.layers:
            x = x + self._attention(lay, lay.attn_norm(x), positions, tables, masks, b, dtype)
            up = _linear(lay.mlp_norm(x), lay.up)                               # (b, 2f) or (b, f)
            if lay.gated:
                gate, up = up.chunk(2, dim=-1)
                up = lay.act(gate) * up
            else:
                up = lay.act(up)
            x = x + _linear(up, lay.down)
        if prep.final_norm is not None:
            x = prep.final_norm(x)
        return _linear(x, prep.head)                                           # (b, v)

    def _attention(self, lay: _Layer, x, positions, tables, masks, b, dtype) -> torch.Tensor:
        h, k, e = lay.h, lay.k, lay.e
        qkv = _linear(x, lay.qkv).view(b, h + 2 * k, 1, e)                     # (b, h+2k, 1, e)
        qk, v = qkv[:, :h + k], qkv[:, h + k:]
        if lay.rope:  # q and k rotated together by the model's formula
            rope = lay.att.position
            if rope.table_key not in tables:
                tables[rope.table_key] = rope.tables(positions, dtype)          # (b, 1, 1, e) each
            qk = fused.rope_half(qk, *tables[rope.table_key])
        q, k_new = qk.split((h, k), dim=1)                                     # (b, h|k, 1, e)
        keys, values, k_pos = self.cache.update(lay.att.layer, k_new, v, positions)
        mask_key = (lay.att.window, k_pos.shape[1])
        if mask_key not in masks:  # one query that may see every key needs no mask at all
            mask = MaskSpec().with_window(lay.att.window).allows(positions, k_pos)  # (b, 1, 1, s)
            masks[mask_key] = None if bool(mask.all()) else mask
        out, _ = backends.run(backends.AttnCall(q, keys, values, lay.att.scale, mask=masks[mask_key]))  # (b, h, 1, e)
        return _linear(out.view(b, h * e), lay.o)
