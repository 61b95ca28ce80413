"""Analytic accounting from a ModelConfig alone (no model built): parameters, FLOPs, memory.

    param_count(cfg)                     unique parameters, == build_model(cfg).num_params()
    param_breakdown(cfg)                 the same, split into embeddings/position/attention/mlp/norms/head
    non_embedding_param_count(cfg)       attention + mlp + norms (Kaplan et al. 2020's N)
    flops_per_token(cfg, seq_len)        forward FLOPs per token (Kaplan et al. 2020 convention, below)
    keys_per_query(cfg, layer, seq_len)  attended pairs per query: windows, dilation, global tokens, sparse patterns
    packed_keys_per_query(cfg, layer, lengths)   the same over a row of packed documents (document masks)
    training_flops_per_token(cfg, T)     3x forward (backward costs twice the forward)
    kv_cache_bytes(cfg, seq_len, ...)    K and V cache honouring GQA/MQA and sliding windows
    training_memory_bytes(cfg, ...)      weights + grads + optimizer state + activations (estimate)
    available_memory(device)             bytes free on a device, what those estimates are checked against
    check_weights_fit(cfg, device)       refuse to build a model whose weights alone exceed that

An encoder-decoder (arch="encoder_decoder") has n_layers encoder layers and stack_depth("cross_decoder")
decoder layers, each decoder layer with a cross-attention sublayer (its own q/k/v/o and norm); one shared
embedding, one T5 table per stack. Its FLOPs per token are per token processed, a source and a target of
seq_len tokens each (`encoder_decoder_flops` splits them); its KV cache holds the decoder's self-attention
keys and values plus the cross-attention's, projected once from the source.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from archlab.config import ConfigError, ModelConfig, StackRole
from archlab.errors import UserError

DTYPE_BYTES = {
    "float64": 8, "fp64": 8, "float32": 4, "fp32": 4, "tf32": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float8": 1, "fp8": 1, "int8": 1, "int4": 0.5,
}


def trains_in(dtype: Any) -> bool:
    """Whether gradients and activations can be kept in `dtype`: the float formats of 2 bytes or more. int8,
    int4 and fp8 are formats weights and caches are stored in; training computes in a wider float."""
    return dtype_bytes(dtype) >= 2


def dtype_bytes(dtype: Any) -> float:
    """Bytes per element for a dtype name ("bfloat16", "fp32", ...) or a torch.dtype."""
    itemsize = getattr(dtype, "itemsize", None)
    if itemsize is not None and not isinstance(dtype, str):
        return itemsize
    key = str(dtype).removeprefix("torch.").lower()
    if key not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


# ---- parameters ----------------------------------------------------------------------------------
def _norm_params(cfg: ModelConfig, dim: int, bias: bool) -> int:
    kind = cfg.norm.kind
    if kind == "nonparametric":
        return 0
    if kind in ("layernorm", "layernorm_1p", "batchnorm"):
        return dim * (2 if bias else 1)
    return dim  # rmsnorm kinds have no bias


def _linear(d_in: int, d_out: int, bias: bool) -> int:
    return d_in * d_out + (d_out if bias else 0)


def _dense_mlp_params(d: int, f: int, gated: bool, bias: bool) -> int:
    return _linear(d, f, bias) * (2 if gated else 1) + _linear(f, d, bias)


def _attention_params(cfg: ModelConfig) -> int:
    """One layer's attention: q, k, v, o (+ gate, sinks, QK-norm weights)."""
    att, d, e = cfg.attention, cfg.d_model, cfg.head_dim
    he, ke = att.n_heads * e, cfg.n_kv_heads * e
    n = _linear(d, he, cfg.bias.qkv) + 2 * _linear(d, ke, cfg.bias.qkv) + _linear(he, d, cfg.bias.attn_out)
    if att.gated:
        n += d * he
    if att.learned_sinks:
        n += att.n_heads
    if att.qk_norm == "per_head":
        n += 2 * _norm_params(cfg, e, cfg.bias.qk_norm)
    elif att.qk_norm in ("full", "per_head_untied"):  # untied: one weight per head (Cohere)
        n += _norm_params(cfg, he, cfg.bias.qk_norm) + _norm_params(cfg, ke, cfg.bias.qk_norm)
    return n


def _mlp_params(cfg: ModelConfig) -> int:
    mlp, d, bias = cfg.mlp, cfg.d_model, cfg.bias.mlp
    dense = _dense_mlp_params(d, cfg.d_ff, mlp.gated, bias)
    if mlp.moe is None:
        return dense
    moe = mlp.moe
    n = moe.n_experts * dense + d * moe.n_experts  # experts + router (no bias)
    if moe.shared_expert_d_ff:
        n += _dense_mlp_params(d, moe.shared_expert_d_ff, mlp.gated, bias)
    return n + (d if moe.shared_expert_gate else 0)


def _block_norms(cfg: ModelConfig) -> int:
    count = 2
    if cfg.block.parallel and cfg.block.parallel_norms == 1:
        count = 1
    if cfg.norm.position == "sandwich":
        count += 2
    return count


def _stacks(cfg: ModelConfig) -> list[StackRole]:
    """The stack roles a config's model has: one, or an encoder and a cross-attending decoder."""
    if cfg.arch == "encoder_decoder":
        return ["encoder", "cross_decoder"]
    return ["encoder" if cfg.arch == "encoder" else "decoder"]


def _uses_t5(cfg: ModelConfig, stack: StackRole = "decoder") -> bool:
    return any(cfg.position_kind(i) == "t5" for i in range(cfg.stack_depth(stack)))


def param_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """Unique parameters by part. QK-norm weights count under attention; tied head counts 0. An encoder-decoder's
    cross-attention counts under attention, its norms under norms."""
    d, v = cfg.d_model, cfg.vocab_size
    norm_one = _norm_params(cfg, d, cfg.bias.norm)
    position = 0
    position_stacks = 2 if cfg.position.per_stack else 1   # BART, Marian: the decoder's own table and norm
    if cfg.position.kind == "learned":
        position += position_stacks * (cfg.max_seq_len + cfg.position.learned_offset) * d
    elif cfg.position.kind == "sinusoidal" and cfg.position.sinusoid_table:   # Marian's frozen table counts
        position += position_stacks * cfg.max_seq_len * d
    attention = mlp = norms = 0
    for stack in _stacks(cfg):
        depth, cross = cfg.stack_depth(stack), int(stack == "cross_decoder")
        if _uses_t5(cfg, stack):
            position += cfg.position.t5_num_buckets * cfg.attention.n_heads  # one table per stack, all its layers
        attention += depth * (1 + cross) * _attention_params(cfg)
        mlp += depth * _mlp_params(cfg)
        cross_norms = cross * (2 if cfg.norm.position == "sandwich" else 1)
        norms += depth * (_block_norms(cfg) + cross_norms) * norm_one + int(cfg.norm.final_norm) * norm_one
    norms += position_stacks * norm_one * int(cfg.norm.embedding_norm)
    # a head bias held as a buffer (BART's / Marian's final_logits_bias) counts as transformers counts it: not
    head = (0 if cfg.tie_embeddings else v * d) + (v if cfg.bias.head and not cfg.bias.head_buffer else 0)
    if cfg.arch == "encoder":   # the MLM head's transform: dense (with bias) + norm (BERT)
        head += d * d + d + norm_one
    if cfg.nsp_head:            # BERT's pooler (dense d -> d) and next-sentence classifier (d -> 2), with biases
        head += d * d + d + 2 * d + 2
    return {
        "embeddings": (v + cfg.type_vocab_size) * d,
        "position": position,
        "attention": attention,
        "mlp": mlp,
        "norms": norms,
        "head": head,
    }


def param_count(cfg: ModelConfig) -> int:
    """Unique parameters; equals build_model(cfg).num_params() (TransformerLM, EncoderLM or EncoderDecoderLM;
    tied embeddings count once)."""
    return sum(param_breakdown(cfg).values())


def non_embedding_param_count(cfg: ModelConfig) -> int:
    """Parameters outside the vocabulary and position matrices (token/type embeddings, learned or T5
    position tables, an untied head): Kaplan et al. 2020's N, the blocks' weights and the norms."""
    parts = param_breakdown(cfg)
    return parts["attention"] + parts["mlp"] + parts["norms"]


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters a token passes through: MoE counts only top_k experts (+ shared, router)."""
    total = param_count(cfg)
    moe = cfg.mlp.moe
    if moe is None:
        return total
    dense = _dense_mlp_params(cfg.d_model, cfg.d_ff, cfg.mlp.gated, cfg.bias.mlp)
    layers = sum(cfg.stack_depth(stack) for stack in _stacks(cfg))
    return total - layers * (moe.n_experts - moe.top_k) * dense


# ---- FLOPs ---------------------------------------------------------------------------------------
def average_context(seq_len: int, window: int | None = None) -> float:
    """Mean number of keys a causal query sees over positions 0..T-1: (T+1)/2, or with a window w
    the mean of min(i+1, w)."""
    if seq_len < 1:
        raise ConfigError(f"seq_len={seq_len} must be >= 1")
    if window is None or window >= seq_len:
        return (seq_len + 1) / 2
    # positions 0..w-1 see 1..w keys, the remaining T-w positions see w each
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def keys_per_query(cfg: ModelConfig, layer: int, seq_len: int, prefix_len: int = 0,
                   stack: str | None = None) -> float:
    """Mean number of keys a query of `layer` of a `stack` (None: the encoder of an encoder-only config, else a
    causal decoder) attends to over positions 0..T-1 (self-attention), for every pattern
    the layer can have: a window (dilated: min(w, i // d + 1)), Sparse Transformer strided (min(l, i+1) +
    i // l) and fixed ((i mod l) + 1 + (i // l) c), Longformer's global tokens (their rows see i + 1 keys,
    every other row also sees the global keys outside its own pattern), and a prefix-LM prefix of
    `prefix_len` tokens (its queries see the whole prefix). Per-query counts in O(T) (O(T·G) for G global
    tokens), tested equal to counting MaskSpec.allows' pairs."""
    import torch

    if seq_len < 1 or not 0 <= prefix_len <= seq_len:
        raise ConfigError(f"seq_len={seq_len} must be >= 1 and prefix_len={prefix_len} in 0..seq_len")
    if stack == "encoder" or (stack is None and cfg.arch == "encoder"):
        return _bidirectional_keys_per_query(cfg, layer, seq_len)
    i = torch.arange(seq_len, dtype=torch.float64)
    counts = _pattern_counts(cfg, layer, i)
    att = cfg.attention
    if cfg.is_local(layer) and att.global_tokens:
        from archlab.nn.masks import LocalPattern, MaskSpec

        g = min(att.global_tokens, seq_len)
        plain = MaskSpec().restricted(dataclasses.replace(LocalPattern.of(att), global_tokens=0))
        held = plain.allows(i.long()[None], torch.arange(g)[None])[0, 0]          # (T, G): already seen
        seen = (torch.arange(g)[None, :] <= i[:, None])                          # causal
        counts = counts + (seen & ~held).sum(-1)
        counts[:g] = i[:g] + 1                                                   # global rows: everything before
    if prefix_len:
        counts[:prefix_len] = prefix_len
    return float(counts.mean())


def packed_keys_per_query(cfg: ModelConfig, layer: int, document_lengths: Sequence[int],
                          stack: str | None = None) -> float:
    """Mean keys per query over a row packed with documents of these lengths under document masks (each query
    sees only its own document, positions restart at each): every document's `keys_per_query`, weighted by its
    length. Tested equal to counting MaskSpec.allows' pairs with segment ids.
    Example: packed_keys_per_query(cfg, 0, [100, 28]) < keys_per_query(cfg, 0, 128)"""
    lengths = [int(n) for n in document_lengths]
    if not lengths or min(lengths) < 1:
        raise ConfigError(f"document_lengths={lengths} must be one or more lengths >= 1")
    return sum(n * keys_per_query(cfg, layer, n, stack=stack) for n in lengths) / sum(lengths)


def _bidirectional_keys_per_query(cfg: ModelConfig, layer: int, seq_len: int, rows: int = 1024) -> float:
    """An encoder layer: every key (T) on a global layer; a local layer's pairs counted from MaskSpec.allows,
    the one predicate, `rows` queries at a time."""
    import torch

    from archlab.nn.masks import LocalPattern, MaskSpec

    if not cfg.is_local(layer):
        return float(seq_len)
    spec = MaskSpec(causal=False).restricted(LocalPattern.of(cfg.attention))
    keys = torch.arange(seq_len)[None]
    pairs = sum(int(spec.allows(torch.arange(lo, min(lo + rows, seq_len))[None], keys).sum())
                for lo in range(0, seq_len, rows))
    return pairs / seq_len


def _pattern_counts(cfg: ModelConfig, layer: int, i):
    """Keys each causal query position i sees through the layer's own pattern (global tokens aside)."""
    att = cfg.attention
    if not cfg.is_local(layer):
        return i + 1
    if att.sparse == "strided":
        stride = att.sparse_stride
        return (i + 1).clamp(max=stride) + (i // stride).floor()
    if att.sparse == "fixed":
        stride = att.sparse_stride
        return i % stride + 1 + (i // stride).floor() * att.sparse_summary
    return ((i // att.dilation).floor() + 1).clamp(max=att.window)


def _layer_matmuls(cfg: ModelConfig) -> tuple[int, int]:
    """(attention, MLP) weights one layer multiplies a token by: q/k/v/o (+ gate); the top_k experts (+ shared,
    router)."""
    att, d, e = cfg.attention, cfg.d_model, cfg.head_dim
    he, ke = att.n_heads * e, cfg.n_kv_heads * e
    attn = d * he * 2 + 2 * d * ke + (d * he if att.gated else 0)
    f_mats = 3 if cfg.mlp.gated else 2
    moe = cfg.mlp.moe
    if moe is None:
        mlp = f_mats * d * cfg.d_ff
    else:
        mlp = moe.top_k * f_mats * d * cfg.d_ff + d * moe.n_experts
        if moe.shared_expert_d_ff:
            mlp += f_mats * d * moe.shared_expert_d_ff + (d if moe.shared_expert_gate else 0)
    return attn, mlp


def _matmul_params_per_token(cfg: ModelConfig) -> int:
    """Weights multiplied per token of a one-stack model: its layers' projections and experts, the LM head."""
    attn, mlp = _layer_matmuls(cfg)
    d = cfg.d_model
    mlm_transform = d * d if cfg.arch == "encoder" else 0
    return cfg.n_layers * (attn + mlp) + d * cfg.vocab_size + mlm_transform


def flops_per_token(cfg: ModelConfig, seq_len: int, prefix_len: int = 0,
                    document_lengths: Sequence[int] | None = None) -> float:
    """Forward FLOPs per token for a sequence of `seq_len` tokens (Kaplan et al. 2020, Table 1).

    Convention: 2 FLOPs per multiply-add. Counted: 2 x every weight matrix a token is multiplied by
    (q/k/v/o and gate projections, the top_k routed experts + shared expert + router for MoE, the
    LM head, tied or not) plus, per layer, 2 x 2 x ctx x n_heads x head_dim for QK^T and PV, where ctx
    is the mean number of keys a query attends to (`keys_per_query`: windows, dilation, global tokens,
    sparse patterns, a prefix-LM prefix of `prefix_len` tokens; with `document_lengths`, a row of packed
    documents under document masks: `packed_keys_per_query`). Not counted: embedding
    lookups, norms, biases, softmax, activations, position encodings (all O(d) per token).
    """
    att = cfg.attention
    if cfg.arch == "encoder_decoder":
        if prefix_len:
            raise ConfigError(f"prefix_len={prefix_len}: an encoder-decoder has no prefix "
                              "(its encoder reads the source)")
        if document_lengths is not None:
            raise ConfigError("document_lengths: an encoder-decoder's FLOPs are per source and target "
                              "(encoder_decoder_flops)")
        return sum(encoder_decoder_flops(cfg, seq_len, seq_len).values()) / (2 * seq_len)
    if document_lengths is not None and (prefix_len or sum(document_lengths) != seq_len):
        raise ConfigError(f"document_lengths sum to {sum(document_lengths)}, not seq_len={seq_len} "
                          f"(and take no prefix_len)")
    flops = 2.0 * _matmul_params_per_token(cfg)
    for layer in range(cfg.n_layers):
        keys = (keys_per_query(cfg, layer, seq_len, prefix_len) if document_lengths is None
                else packed_keys_per_query(cfg, layer, document_lengths))
        flops += 4.0 * keys * att.n_heads * cfg.head_dim
    return flops


def encoder_decoder_flops(cfg: ModelConfig, source_len: int, target_len: int) -> dict[str, float]:
    """Forward FLOPs of one encoder-decoder pass, by stack: the encoder over `source_len` tokens (bidirectional
    attention), the decoder over `target_len` tokens (causal self-attention, cross-attention to every source
    token, the LM head) including its cross-attention keys and values, projected once per source token and
    layer. Same convention as `flops_per_token`. Example: encoder_decoder_flops(presets.get("t5-11b"), 512, 114)"""
    if cfg.arch != "encoder_decoder":
        raise ConfigError(f"arch={cfg.arch!r}: encoder_decoder_flops needs arch='encoder_decoder'")
    if source_len < 1 or target_len < 1:
        raise ConfigError(f"source_len={source_len} and target_len={target_len} must be >= 1")
    att, d, e = cfg.attention, cfg.d_model, cfg.head_dim
    he, ke = att.n_heads * e, cfg.n_kv_heads * e
    attn, mlp = _layer_matmuls(cfg)
    pair = 4.0 * att.n_heads * e                           # QK^T and PV per attended (query, key) pair
    encoder = source_len * 2.0 * cfg.n_layers * (attn + mlp)
    encoder += source_len * sum(pair * keys_per_query(cfg, i, source_len, stack="encoder")
                                for i in range(cfg.n_layers))
    depth = cfg.stack_depth("cross_decoder")
    cross_q_o = 2 * d * he + (d * he if att.gated else 0)   # per target token; k/v per source token
    decoder = target_len * 2.0 * (depth * (attn + cross_q_o + mlp) + d * cfg.vocab_size)
    decoder += source_len * 2.0 * depth * 2 * d * ke
    decoder += target_len * sum(pair * (keys_per_query(cfg, i, target_len, stack="cross_decoder") + source_len)
                                for i in range(depth))
    return {"encoder": encoder, "decoder": decoder}


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward: 3x forward (the backward pass computes grads for inputs and weights)."""
    return 3.0 * flops_per_token(cfg, seq_len)


# ---- KV cache ------------------------------------------------------------------------------------
def cached_tokens(cfg: ModelConfig, layer: int, seq_len: int) -> int:
    """Tokens layer `layer` must keep: the last (w-1)·d + 1 on a windowed layer (AttentionConfig.kv_span),
    else all of them (global layers, global tokens, sparse patterns, whose keys reach back to the start)."""
    span = cfg.attention.kv_span(layer)
    return seq_len if span is None else min(span, seq_len)


def kv_cache_bytes(cfg: ModelConfig, seq_len: int, batch: int = 1, dtype: Any = "bfloat16",
                   source_len: int | None = None) -> int:
    """Bytes of K and V after `seq_len` tokens: sum over layers of 2 x k x e x tokens kept x bytes.

    GQA/MQA shrink k (n_kv_heads); local layers keep only their window (a rolling buffer). An encoder-decoder
    decoding `seq_len` target tokens also keeps each decoder layer's cross-attention K and V of the source,
    `source_len` tokens (None: seq_len).
    """
    if seq_len < 0 or batch < 1 or (source_len is not None and source_len < 0):
        raise ConfigError(f"seq_len={seq_len} and source_len={source_len} must be >= 0 and batch={batch} >= 1")
    if cfg.arch == "encoder":   # an encoder reads its whole input at once: nothing is cached
        return 0
    per_token_layer = 2 * cfg.n_kv_heads * cfg.head_dim * dtype_bytes(dtype)
    cross = cfg.arch == "encoder_decoder"
    depth = cfg.stack_depth("cross_decoder" if cross else "decoder")
    tokens = sum(cached_tokens(cfg, i, seq_len) for i in range(depth))
    if cross:
        tokens += depth * (seq_len if source_len is None else source_len)
    return int(batch * tokens * per_token_layer)


def kv_bytes_per_token(cfg: ModelConfig, dtype: Any = "bfloat16") -> int:
    """Cache growth per token while no window is full: 2 x n_layers x k x e x bytes (0 for an encoder; an
    encoder-decoder's decoder layers per target token, and as much again per source token, once)."""
    if cfg.arch == "encoder":
        return 0
    depth = cfg.stack_depth("cross_decoder" if cfg.arch == "encoder_decoder" else "decoder")
    return int(2 * depth * cfg.n_kv_heads * cfg.head_dim * dtype_bytes(dtype))


# ---- training memory -----------------------------------------------------------------------------
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "lion": 1, "sgd_momentum": 1, "sgd": 0}


def activation_elements_per_token(cfg: ModelConfig) -> int:
    """Activations saved for backward per token, all layers (no recomputation, flash attention:
    no t x t probabilities stored). Per layer: the inputs of both norms and of the projections they
    feed (4d, sandwich +2d), q/k/v ((h + 2k) e), the attention output (h e), and in the MLP the
    pre-activations and the down-projection input ((2 or 3) f, times top_k for MoE). Plus the final
    norm's input and the dL/dh the chunked loss keeps (2d): no logits are kept (model.loss_from_hidden,
    see `training_memory` for its workspace). A simplification of Korthikanti et al. 2022
    (arXiv 2205.05198) without dropout masks. An encoder-decoder: one source and one target token, the
    encoder's layers and final norm plus the decoder's, each decoder layer also its cross-attention's norm input
    and query projection input (2d), query and output (2 h e) and the source's keys and values (2 k e)."""
    att, d, e, f = cfg.attention, cfg.d_model, cfg.head_dim, cfg.d_ff
    per_layer = 4 * d + (2 * d if cfg.norm.position == "sandwich" else 0)
    per_layer += (att.n_heads + 2 * cfg.n_kv_heads) * e + att.n_heads * e
    mlp = (3 if cfg.mlp.gated else 2) * f
    if cfg.mlp.moe is not None:
        mlp = mlp * cfg.mlp.moe.top_k + (
            (3 if cfg.mlp.gated else 2) * cfg.mlp.moe.shared_expert_d_ff
            if cfg.mlp.moe.shared_expert_d_ff else 0)
    per_layer += mlp
    if cfg.arch == "encoder_decoder":
        cross = 2 * d + 2 * att.n_heads * e + 2 * cfg.n_kv_heads * e
        return cfg.n_layers * per_layer + d + cfg.stack_depth("cross_decoder") * (per_layer + cross) + 2 * d
    return cfg.n_layers * per_layer + 2 * d


def training_memory(cfg: ModelConfig, batch: int, seq_len: int, dtype: Any = "bfloat16",
                    optimizer: str = "adamw") -> dict[str, int]:
    """Estimated bytes by part for one training step on one device (no sharding).

    weights: P x bytes(dtype); grads: P x bytes(dtype); optimizer: P x 4 x n_states (fp32 moments,
    AdamW 2) plus an fp32 master copy P x 4 when dtype is narrower than fp32 (mixed precision);
    activations: batch x seq_len x activation_elements_per_token x bytes(dtype); loss: the chunked
    head + cross-entropy's workspace, two float32 chunks of logits (on GPU up to 256 MB each) and the
    float32 dL/dW of the head, v x d x 4. Ignores allocator fragmentation, temporary buffers and the
    CUDA context.
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ConfigError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZER_STATES)}")
    if batch < 1 or seq_len < 1:
        raise ConfigError(f"batch={batch} and seq_len={seq_len} must be >= 1")
    if not trains_in(dtype):
        raise ConfigError(f"training memory in {dtype}: gradients and activations are not kept in {dtype} "
                          "(a storage format for weights and caches); give the float dtype training computes in")
    p, nbytes = param_count(cfg), dtype_bytes(dtype)
    optimizer_bytes = p * 4 * OPTIMIZER_STATES[optimizer] + (p * 4 if nbytes < 4 else 0)
    tokens = batch * seq_len
    activations = tokens * activation_elements_per_token(cfg) * nbytes
    from archlab.nn.fused_loss import chunk_rows  # imports torch: only when asked for memory
    rows = min(tokens, chunk_rows("cuda", cfg.vocab_size))       # the larger (GPU) chunks
    loss = 2 * rows * cfg.vocab_size * 4 + cfg.vocab_size * cfg.d_model * 4
    return {
        "weights": int(p * nbytes),
        "grads": int(p * nbytes),
        "optimizer": int(optimizer_bytes),
        "activations": int(activations),
        "loss": int(loss),
    }


def training_memory_bytes(cfg: ModelConfig, batch: int, seq_len: int, dtype: Any = "bfloat16",
                          optimizer: str = "adamw") -> int:
    """Total of `training_memory` (see there for the formula)."""
    return sum(training_memory(cfg, batch, seq_len, dtype, optimizer).values())


# ---- what the device has -------------------------------------------------------------------------------
class MemoryCheckError(UserError):
    """An estimate of the memory a model needs exceeds the memory the device has free."""


def available_memory(device: Any) -> int | None:
    """Bytes free for a new model: CUDA's free memory, or the kernel's MemAvailable (None where unknown)."""
    if getattr(device, "type", str(device).split(":")[0]) == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_weights_fit(cfg: ModelConfig, device: Any = "cpu", *, dtype: Any = "float32", what: str = "the model"
                      ) -> None:
    """Refuse, before a byte is allocated, to build a model whose weights alone exceed the memory free on
    `device` (a config that asks for 10^11-wide layers would otherwise reach the allocator)."""
    from archlab.units import human_bytes, human_count

    n = param_count(cfg)
    need, free = int(n * dtype_bytes(dtype)), available_memory(device)
    if free is not None and need > free:
        raise MemoryCheckError(f"{what} has {human_count(n)} parameters, {human_bytes(need)} of {dtype} weights, "
                               f"and {getattr(device, 'type', device)} has {human_bytes(free)} free")
