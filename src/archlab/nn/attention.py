"""Causal self-attention and its variants.

Dimension legend used in shape comments across archlab:
  b batch, t time (queries), s time (keys, cache included), d model, h heads, k kv-heads,
  e head dim, f ffn width, v vocab.

Variants (each a field of AttentionConfig):
  MHA / GQA / MQA        Ainslie et al. 2023 (arXiv 2305.13245); Shazeer 2019
  sliding window          Beltagy et al. 2020 (Longformer); Mistral; per-layer local/global pattern
  dilated window, global tokens   Longformer; strided / fixed sparse patterns   Child et al. 2019
  prefix-LM mask          Raffel et al. 2020 (bidirectional over a prefix)
  QK-norm                 Dehghani et al. 2023; per head (Qwen3, Gemma 3) or full width (OLMo 2)
  logit soft-cap          Gemma 2: s -> cap * tanh(s / cap)
  gated attention         Qiu et al. 2025 (arXiv 2505.06708): sigmoid(x W_g) * attn, before W_o
  learned sinks           a per-head logit in the softmax denominator (Xiao et al. 2023; gpt-oss)
The layer computes q, k, v, the positions' bias and the mask; the attention itself runs on the backend
nn/attention_backends.py chooses (SDPA where the math allows, the eager reference for soft-cap, sinks
or recorded probabilities, the CPU bf16 kernel where it is faster), each tested equal to the eager one.
"""
from __future__ import annotations

import torch
from torch import nn

from archlab.config import AttentionConfig, BiasConfig, LayerSpec, NormConfig
from archlab.nn import attention_backends as backends
from archlab.nn import flex_attention, local_attention, strided_attention  # noqa: F401  (register their backends)
from archlab.nn.fused import DecodePlan, DecodeSession, decode_weights, linear, packed_groups, packed_matmul, project
from archlab.nn.masks import AttnInputs, Context, LocalPattern, MaskSpec
from archlab.nn.mlp import mark_residual_out
from archlab.nn.norms import HeadwiseNorm, build_norm
from archlab.nn.position import AttentionPosition


def _split_heads(z: torch.Tensor, b: int, t: int, n: int, e: int) -> torch.Tensor:   # (b, t, n*e) -> (b, n, t, e)
    return z.view(b, n, 1, e) if t == 1 else z.view(b, t, n, e).transpose(1, 2)   # one query: a view suffices


class Attention(nn.Module):
    def __init__(self, d: int, att: AttentionConfig, spec: LayerSpec, position: AttentionPosition, *,
                 bias: BiasConfig, norm: NormConfig):
        """Its own slice of the config, as DenseMLP: the attention axis, this layer's spec, the position
        module built for it (Block: build_attention_position), and the bias and norm choices it reads."""
        super().__init__()
        self.layer = spec.index
        self.n_heads, self.n_kv_heads = att.n_heads, att.kv_heads
        self.head_dim = att.head_dim or d // att.n_heads
        h_e, k_e = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(d, h_e, bias=bias.qkv)
        self.k_proj = nn.Linear(d, k_e, bias=bias.qkv)
        self.v_proj = nn.Linear(d, k_e, bias=bias.qkv)
        self.o_proj = mark_residual_out(nn.Linear(h_e, d, bias=bias.attn_out))
        self.gate_proj = nn.Linear(d, h_e, bias=False) if att.gated else None
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if att.learned_sinks else None

        self.qk_norm = att.qk_norm
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if att.qk_norm == "per_head_untied":
            self.q_norm = HeadwiseNorm(norm.kind, self.n_heads, self.head_dim, norm.eps)
            self.k_norm = HeadwiseNorm(norm.kind, self.n_kv_heads, self.head_dim, norm.eps)
        elif att.qk_norm != "none":
            per_head, qk_bias = att.qk_norm == "per_head", bias.qk_norm
            self.q_norm = build_norm(norm.kind, self.head_dim if per_head else h_e, norm.eps, qk_bias)
            self.k_norm = build_norm(norm.kind, self.head_dim if per_head else k_e, norm.eps, qk_bias)

        self.local = LocalPattern.of(att) if spec.local else None   # window / dilation / globals / sparse
        self.position = position
        self.scale = spec.attn_scale
        self.softcap = att.logit_softcap
        self.clip_qkv = att.clip_qkv
        self.dropout = att.dropout
        self.record_probs = False      # diagnostics switch this on to keep `last_probs`
        self.last_probs: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, inputs: AttnInputs, context: Context | None = None) -> torch.Tensor:
        """(b, t, d) -> (b, t, d). Self-attention over x; with a `context`, cross-attention: queries from x,
        keys and values from the context (an encoder's output, projected once per context)."""
        b, t, _ = x.shape
        positions, cache, session = inputs.positions, inputs.cache, inputs.session
        position = self.position
        packs = decode_weights(session, x, self, self._decode_weights)   # decoding: (q/k/v, o) packed, one lookup
        if context is not None:
            return self._finish(x, self._cross_call(x, inputs, context), packs, session)
        spec = inputs.layer_spec(self.local)
        if cache is not None and getattr(cache, "rotates_keys", False):
            # StreamingLLM cache (kv_cache.SinkKVCache): it keeps un-rotated keys and rotates q and k with
            # in-cache positions (a stretch longer than it holds: as decoding it token by token would)
            q, k, v = self._heads(x, b, t, session=session)                   # (b, h|k, t, e)
            q, k, v, positions, k_pos, spec = cache.attend(self.layer, q, k, v, positions, position, spec)
        else:
            if packs is not None and t == 1:  # one query: q, k, v heads as one view, q and k rotated in one pass
                h, k_heads = self.n_heads, self.n_kv_heads
                qkv = packed_matmul(x, packs[0]).view(b, h + 2 * k_heads, 1, self.head_dim)   # (b, h+2k, 1, e)
                if self.clip_qkv is not None:
                    qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
                rope = _shared_tables(position, positions, qkv.dtype, inputs.shared)   # RoPE cos/sin | None
                q, k = position.rotate(qkv[:, :h + k_heads], positions, rope).split_with_sizes((h, k_heads), dim=1)
                v = qkv[:, h + k_heads:]
            else:
                q, k, v = self._heads(x, b, t, session=session)               # (b, h|k, t, e)
                rope = _shared_tables(position, positions, q.dtype, inputs.shared)
                q, k = position.rotate(q, positions, rope), position.rotate(k, positions, rope)
            k_pos = positions
            if cache is not None:
                k, v, k_pos = cache.update(self.layer, k, v, positions)     # (b, k, s, e), (b, s)

        # what attends to what, as the layer's spec and positions: a backend builds the dense mask (once per
        # forward, through `inputs`) or the position bias (over the pairs it visits) only if it needs them
        # aligned (key j is query j's token): no cache on the plain path, or packed documents with their own
        # positions, or a prefill whose cache hands back exactly this forward's keys over contiguous positions;
        # blocked kernels need it
        aligned = (cache is None and (inputs.plain or (inputs.spec.segment_ids is not None and inputs.contiguous()))
                   ) or (inputs.fresh and k.shape[2] == t and t > 1 and not getattr(cache, "rotates_keys", False)
                         and inputs.contiguous())
        call = self._call(q, k, v, spec, positions, k_pos, inputs, aligned=aligned)
        return self._finish(x, call, packs, session)

    def _finish(self, x: torch.Tensor, call: backends.AttnCall, packs, session) -> torch.Tensor:
        """Run the call on its backend; heads merged, gated, projected out: (b, t, d)."""
        b, t, _ = x.shape
        out, probs = backends.run(call)                                     # (b, h, t, e)
        if self.record_probs:
            self.last_probs = probs
        out = (out.view(b, t, -1) if t == 1 else out.transpose(1, 2).reshape(b, t, -1))  # (b, t, h*e)
        if self.gate_proj is not None:
            out = out * torch.sigmoid(linear(x, self.gate_proj, session))
        return linear(out, self.o_proj, session) if packs is None else packed_matmul(out, packs[1])

    def _decode_weights(self, x: torch.Tensor, plan: DecodePlan):
        """(q/k/v packed, o packed) for decoding (nn/fused.py), or None: QK-norm between the projection and
        the heads (those layers decode Linear by Linear), or hooks or autocast to honour."""
        if self.qk_norm != "none":
            return None
        return packed_groups(plan, x, (self.q_proj, self.k_proj, self.v_proj), (self.o_proj,))

    def _cross_call(self, x: torch.Tensor, inputs: AttnInputs, context: Context) -> backends.AttnCall:
        """Cross-attention's call: q from x; k, v from the context's hidden states, once per context and layer
        (a generation's decode steps reuse them); what may be attended is the context's spec (its padding).
        No rotation and no position bias: T5's, BART's and the 2017 Transformer's cross-attention have none."""
        b, t, _ = x.shape
        kv = context.kv.get(self)
        if kv is None:
            _, k, v = self._heads(context.hidden, b, context.hidden.shape[1], heads="kv",
                                  session=inputs.session)                  # (b, k, s, e)
            kv = context.kv[self] = (k, v)
        q = self._heads(x, b, t, heads="q", session=inputs.session)[0]     # (b, h, t, e)
        k, v = kv
        return backends.AttnCall(q, k, v, self.scale, keep_probs=self.record_probs, spec=context.spec,
                                 dropout=self.dropout if self.training else 0.0, q_pos=inputs.positions,
                                 k_pos=context.positions, inputs=inputs)

    def _heads(self, x: torch.Tensor, b: int, t: int, heads: str = "qkv", session: DecodeSession | None = None
               ) -> list:
        """q, k, v heads (b, h|k, t, e), clipped and QK-normed as configured, not yet rotated; `heads`: which
        of them to project from x (cross-attention: "q" from the decoder, "kv" from the context), the others
        None; `session`: a decode session's packed weights."""
        linears = {"q": self.q_proj, "k": self.k_proj, "v": self.v_proj}
        z = dict(zip(heads, project(x, tuple(linears[name] for name in heads), session)))   # (b, t, h*e | k*e)
        if self.clip_qkv is not None:  # OLMo (Groeneveld et al. 2024): tames loss spikes
            z = {name: y.clamp(-self.clip_qkv, self.clip_qkv) for name, y in z.items()}
        norms = {name: norm for name, norm in (("q", self.q_norm), ("k", self.k_norm)) if norm is not None}
        if self.qk_norm == "full":
            z.update({name: norm(z[name]) for name, norm in norms.items() if name in z})
        counts = {"q": self.n_heads, "k": self.n_kv_heads, "v": self.n_kv_heads}
        z = {name: _split_heads(y, b, t, counts[name], self.head_dim) for name, y in z.items()}
        if self.qk_norm in ("per_head", "per_head_untied"):
            z.update({name: norm(z[name]) for name, norm in norms.items() if name in z})
        return [z.get(name) for name in "qkv"]

    def _call(self, q, k, v, spec: MaskSpec, q_pos, k_pos, inputs: AttnInputs | None, *, aligned: bool
              ) -> backends.AttnCall:
        position = self.position
        return backends.AttnCall(q, k, v, self.scale, softcap=self.softcap, sinks=self.sinks,
                                 keep_probs=self.record_probs, dropout=self.dropout if self.training else 0.0,
                                 spec=spec, q_pos=q_pos, k_pos=k_pos, inputs=inputs, aligned=aligned,
                                 position_bias=position.bias if position.has_bias else None)

    def attention_backend(self, seq_len: int = 2, spec: MaskSpec | None = None) -> str:
        """The backend this layer's full-sequence forward of `seq_len` tokens runs (recorded in provenance.json;
        `spec`: the stack's, before this layer's local pattern)."""
        h, k, e = self.n_heads, self.n_kv_heads, self.head_dim
        q, kv = torch.empty(1, h, seq_len, e, device="meta"), torch.empty(1, k, seq_len, e, device="meta")
        pos = torch.arange(seq_len, device="meta")[None]
        spec = (spec or MaskSpec(causal=True)).restricted(self.local)
        return backends.choose(self._call(q, kv, kv, spec, pos, pos, None, aligned=True)).name


def _shared_tables(position: AttentionPosition, positions: torch.Tensor, dtype: torch.dtype, shared: dict | None):
    """RoPE tables once per forward for layers with equal frequencies (None: rotate builds them)."""
    key = getattr(position, "table_key", None)
    if shared is None or key is None:
        return None
    tables = shared.get((key, dtype))
    if tables is None:
        tables = shared[key, dtype] = position.tables(positions, dtype)
    return tables
