"""ModelConfig: one typed slot per design axis of the architecture lecture's table.

Each sub-config holds one axis (norms, block wiring, attention, MLP, positions, biases,
embeddings/head, init). "Off" is `None`. Cross-field rules live in `__post_init__` and raise
`ConfigError` naming the field and the value. Configs are frozen; derive variants with
`cfg.with_overrides({"attention.n_kv_heads": 1})` using the same dotted keys as the CLI.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from archlab.errors import UserError


class ConfigError(UserError, ValueError):
    """An impossible or unknown configuration; the message names the field and the value."""


NormKind = Literal["layernorm", "rmsnorm", "rmsnorm_1p", "layernorm_1p", "nonparametric", "batchnorm"]
NormPosition = Literal["post", "pre", "sandwich", "post_sublayer"]
Activation = Literal[
    "relu", "gelu", "gelu_tanh", "relu2", "silu", "elu", "selu",
    "reglu", "geglu", "geglu_tanh", "swiglu", "glu", "bilinear",
]
GATED_ACTIVATIONS = ("reglu", "geglu", "geglu_tanh", "swiglu", "glu", "bilinear")
PositionKind = Literal["none", "sinusoidal", "learned", "rope", "alibi", "t5"]
ABSOLUTE_POSITIONS = ("sinusoidal", "learned")
RopeLayout = Literal["half", "interleaved"]
SinusoidLayout = Literal["interleaved", "split"]
QKNorm = Literal["none", "per_head", "per_head_untied", "full"]
SparsePattern = Literal["none", "strided", "fixed"]


def did_you_mean(name: str, known, before: str = " (", after: str = ")") -> str:
    """` (did you mean 'x'?)` for the closest of `known` to a misspelt `name`, else ''."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"{before}did you mean {close[0]!r}?{after}" if close else ""


SEED_LIMIT = 2**63   # torch.manual_seed takes up to 2**64 - 1; below 2**63 leaves room for per-rank offsets


def check_seed(name: str, seed: int) -> None:
    """A seed every generator takes (torch, numpy, random): a whole number in [0, 2**63)."""
    if not 0 <= seed < SEED_LIMIT:
        raise ConfigError(f"{name}={seed:.4g} must be in [0, 2**63)" if abs(seed) >= 1e6 else
                          f"{name}={seed} must be in [0, 2**63)")


def _positive(owner: str, **values: float | int | None) -> None:
    for name, value in values.items():
        if value is not None and not value > 0:
            raise ConfigError(f"{owner}.{name}={value!r} must be positive")


def _check_literals(obj: Any, owner: str) -> None:
    """Reject unknown kind names: every Literal-typed field must hold one of its values."""
    hints = get_type_hints(type(obj))
    for f in fields(obj):
        allowed = _literal_values(hints[f.name])
        value = getattr(obj, f.name)
        if allowed and value not in allowed:
            raise ConfigError(
                f"{owner}.{f.name}={value!r} is not one of {', '.join(map(repr, allowed))}"
            )


def _literal_values(tp: Any) -> tuple:
    if get_origin(tp) is Literal:
        return get_args(tp)
    if get_origin(tp) in (typing.Union, types.UnionType):
        values = tuple(v for arg in get_args(tp) for v in _literal_values(arg))
        return values + ((None,) if type(None) in get_args(tp) and values else ())
    return ()


@dataclass(frozen=True, kw_only=True)
class NormConfig:
    """Which normalization, and where it sits (see nn/block.py for the wirings)."""

    kind: NormKind = "rmsnorm"
    eps: float = 1e-5
    position: NormPosition = "pre"
    final_norm: bool = True          # norm before the LM head
    embedding_norm: bool = False     # BLOOM: LayerNorm right after the token embedding

    def __post_init__(self):
        _check_literals(self, "norm")
        _positive("norm", eps=self.eps)


@dataclass(frozen=True, kw_only=True)
class BlockConfig:
    """Serial (x + attn, then + mlp) or parallel (x + attn(n(x)) + mlp(n(x))) residual wiring."""

    parallel: bool = False
    parallel_norms: Literal[1, 2] = 1   # 1: one shared norm (GPT-J, PaLM, Cohere); 2: GPT-NeoX
    residual_dropout: float = 0.0

    def __post_init__(self):
        _check_literals(self, "block")
        if not 0.0 <= self.residual_dropout < 1.0:
            raise ConfigError(f"block.residual_dropout={self.residual_dropout} must be in [0, 1)")


@dataclass(frozen=True, kw_only=True)
class BiasConfig:
    """Biases, separately per place (Qwen2: q/k/v only; GPT-2: everywhere; LLaMA: none)."""

    qkv: bool = False
    attn_out: bool = False
    mlp: bool = False
    norm: bool = False   # LayerNorm's additive beta (ignored by RMSNorm kinds)
    head: bool = False   # LM-head bias (Phi-1/2)
    head_buffer: bool = False  # the head bias a fixed buffer, not a parameter (transformers' final_logits_bias in
                               # BART / Marian: loaded and saved, not trained, not counted); encoder_decoder only
    qk_norm: bool = False  # a beta on the QK-norm too (Phi-1/2 `qk_layernorm`; LayerNorm kinds)


RopeScalingKind = Literal["linear", "llama3", "yarn", "longrope", "dynamic"]
# the fields each kind reads (the others keep their defaults; nn/position.py holds the math)
ROPE_SCALING_FIELDS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len"),
    "yarn": ("factor", "original_max_seq_len", "beta_fast", "beta_slow", "truncate",
             "attention_factor"),
    "longrope": ("factor", "original_max_seq_len", "attention_factor", "short_factor",
                 "long_factor"),
    "dynamic": ("factor", "original_max_seq_len"),
}


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Context extension of RoPE frequencies: 'linear' (position interpolation), 'llama3',
    'yarn', 'longrope' (Phi-3) or 'dynamic' (NTK by call length). Math in nn/position.py;
    ROPE_SCALING_FIELDS lists the fields each kind reads."""

    kind: RopeScalingKind = "linear"
    factor: float = 1.0                # context multiple (longrope: sets only the attention factor)
    low_freq_factor: float = 1.0       # llama3 only
    high_freq_factor: float = 4.0      # llama3 only
    original_max_seq_len: int = 8192   # pretraining context (all kinds but linear)
    beta_fast: float = 32.0            # yarn: dims turning more often than this are kept
    beta_slow: float = 1.0             # yarn: dims turning less often are divided by factor
    truncate: bool = True              # yarn: round the ramp's ends to whole dims (gpt-oss: False)
    attention_factor: float | None = None  # yarn, longrope: cos/sin multiplier; None: the default
    short_factor: tuple[float, ...] | None = None  # longrope: per-frequency divisors, short calls
    long_factor: tuple[float, ...] | None = None   # longrope: the same past original_max_seq_len

    def __post_init__(self):
        _check_literals(self, "position.rope_scaling")
        owner = "position.rope_scaling"
        _positive(owner, factor=self.factor, original_max_seq_len=self.original_max_seq_len,
                  beta_fast=self.beta_fast, beta_slow=self.beta_slow,
                  attention_factor=self.attention_factor)
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError("position.rope_scaling.high_freq_factor must exceed low_freq_factor")
        if self.kind == "yarn" and self.beta_fast <= self.beta_slow:
            raise ConfigError(f"{owner}.beta_fast={self.beta_fast} must exceed "
                              f"beta_slow={self.beta_slow}")
        for name in ("attention_factor", "short_factor", "long_factor"):
            if getattr(self, name) is not None and name not in ROPE_SCALING_FIELDS[self.kind]:
                raise ConfigError(f"{owner}.{name} is not read by kind {self.kind!r} "
                                  f"(it reads {', '.join(ROPE_SCALING_FIELDS[self.kind])})")
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is None:
                if self.kind == "longrope":
                    raise ConfigError(f"{owner}.{name} is required by kind 'longrope' "
                                      "(one divisor per rotary frequency)")
                continue
            if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
                raise ConfigError(f"{owner}.{name}={value!r} must be a list of numbers")
            try:
                value = tuple(float(v) for v in value)  # a tuple: configs stay hashable
            except (TypeError, ValueError):
                raise ConfigError(f"{owner}.{name}={list(value)!r} must be a list of numbers") from None
            if not value or not all(v > 0 for v in value):
                raise ConfigError(f"{owner}.{name} must be a non-empty list of positive numbers")
            object.__setattr__(self, name, value)
        if (self.kind == "longrope" and self.short_factor is not None and self.long_factor is not None
                and len(self.short_factor) != len(self.long_factor)):
            raise ConfigError(f"{owner}.short_factor has {len(self.short_factor)} entries and "
                              f"long_factor {len(self.long_factor)}: both need one per frequency")


@dataclass(frozen=True, kw_only=True)
class PositionConfig:
    """Position information: added at the embedding (sinusoidal, learned), rotated into q/k
    (rope), or added to the attention logits (alibi, t5). Per-layer hybrids via the
    attention layer pattern: `global_kind` on global layers (Command A: rope local, none global),
    `local_rope_theta` on local layers (Gemma 3)."""

    kind: PositionKind = "rope"
    rope_theta: float = 10_000.0
    rope_layout: RopeLayout = "half"         # half: HF LLaMA/NeoX; interleaved: GPT-J/Cohere/Meta
    rotary_fraction: float = 1.0             # partial rotary (GPT-NeoX 0.25, Phi 0.4)
    rope_scaling: RopeScaling | None = None
    learned_offset: int = 0                  # OPT stores positions shifted by 2
    sinusoid_layout: SinusoidLayout = "interleaved"  # sin/cos pairs (2017, tensor2tensor's reference is split);
                                             # split: all sines, then all cosines (Marian / fairseq)
    sinusoid_table: bool = False             # sinusoids held as a frozen (max_seq_len, d) parameter (Marian's
                                             # MarianSinusoidalPositionalEmbedding: transformers counts it)
    per_stack: bool = False                  # encoder_decoder: each stack its own absolute position table and
                                             # embedding norm (BART, Marian); False: the encoder's serve both
    t5_num_buckets: int = 32
    t5_max_distance: int = 128
    global_kind: PositionKind | None = None  # None: same as `kind` on global layers
    local_rope_theta: float | None = None    # None: rope_theta on local layers too

    def __post_init__(self):
        _check_literals(self, "position")
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        _positive("position", rope_theta=self.rope_theta, t5_num_buckets=self.t5_num_buckets,
                  t5_max_distance=self.t5_max_distance, local_rope_theta=self.local_rope_theta)
        if not 0.0 < self.rotary_fraction <= 1.0:
            raise ConfigError(f"position.rotary_fraction={self.rotary_fraction} must be in (0, 1]")
        if self.learned_offset < 0:
            raise ConfigError(f"position.learned_offset={self.learned_offset} must be >= 0")
        if self.sinusoid_table and self.kind != "sinusoidal":
            raise ConfigError(f"position.sinusoid_table=True needs position.kind='sinusoidal', got {self.kind!r}")
        if self.global_kind in ABSOLUTE_POSITIONS:
            raise ConfigError(
                f"position.global_kind={self.global_kind!r}: absolute positions are added at the "
                "embedding, so they cannot differ per layer"
            )


@dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """Multi-head attention and its variants. Shapes: h heads, k kv-heads, e head_dim."""

    n_heads: int = 8
    n_kv_heads: int | None = None          # None -> MHA, 1 -> MQA, else GQA
    head_dim: int | None = None            # None -> d_model // n_heads (Gemma sets it explicitly)
    window: int | None = None              # sliding window (tokens a query sees, itself included)
    layer_pattern: str | None = None       # "LG" repeated over depth; None: all L if window else G
    prefix_lm: bool = False                # bidirectional attention inside a prefix (forward arg)
    qk_norm: QKNorm = "none"               # per_head: Qwen3/Gemma 3; full: OLMo 2
                                           # per_head_untied: own weight per head (Command R+)
    logit_softcap: float | None = None     # Gemma 2: 50.0  (cap * tanh(s / cap))
    query_pre_attn_scalar: float | None = None  # scale = scalar**-0.5 (Gemma 2); None: head_dim
    scale_by_inverse_layer: bool = False   # scale also / (layer + 1): GPT-2's fp16-stability
                                           # `scale_attn_by_inverse_layer_idx` (Stanford CRFM)
    clip_qkv: float | None = None          # OLMo: clamp q, k, v projections to [-c, c]
    gated: bool = False                    # sigmoid(x W_g) * attn_out, before o_proj (Qiu et al. 2025)
    learned_sinks: bool = False            # per-head logit in the softmax denominator
    dropout: float = 0.0
    # what a local ("L") layer attends to beyond a plain window
    dilation: int = 1                      # Longformer: the window's keys d positions apart (w keys reach (w-1)d+1)
    global_tokens: int = 0                 # Longformer: the first N positions see all (causally) and all see them
    sparse: SparsePattern = "none"         # Sparse Transformer (Child et al. 2019), instead of a window:
                                           # strided: |i-j| < l or (i-j) % l == 0; fixed: same l-block or a
                                           # summary key (j % l >= l - c), both merged in one head
    sparse_stride: int | None = None       # l, the stride / block of a sparse pattern
    sparse_summary: int = 1                # c, summary keys per block (fixed)

    def __post_init__(self):
        _check_literals(self, "attention")
        self._check_local_patterns()
        _positive("attention", n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                  head_dim=self.head_dim, logit_softcap=self.logit_softcap, clip_qkv=self.clip_qkv,
                  query_pre_attn_scalar=self.query_pre_attn_scalar)
        if self.window is not None and self.window < 1:
            raise ConfigError(f"attention.window={self.window} must be >= 1 (or None for global)")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"attention.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}"
            )
        if self.layer_pattern is not None:
            if not self.layer_pattern or set(self.layer_pattern) - {"L", "G"}:
                raise ConfigError(
                    f"attention.layer_pattern={self.layer_pattern!r} must be a non-empty string of "
                    "'L' (local) and 'G' (global)"
                )
            if "L" in self.layer_pattern and self.window is None and self.sparse == "none":
                raise ConfigError(
                    f"attention.layer_pattern={self.layer_pattern!r} has local layers but "
                    "attention.window is None (and attention.sparse is none)"
                )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"attention.dropout={self.dropout} must be in [0, 1)")

    def _check_local_patterns(self) -> None:
        if self.dilation < 1 or self.global_tokens < 0:
            raise ConfigError(f"attention.dilation={self.dilation} must be >= 1 and "
                              f"attention.global_tokens={self.global_tokens} >= 0")
        if self.dilation > 1 and self.window is None:
            raise ConfigError(f"attention.dilation={self.dilation} dilates a window, but attention.window is None")
        if self.global_tokens and self.window is None and self.sparse == "none":
            raise ConfigError(f"attention.global_tokens={self.global_tokens} needs local layers: "
                              "set attention.window or attention.sparse")
        if self.sparse == "none":
            return
        if self.window is not None:
            raise ConfigError(f"attention.sparse={self.sparse!r} replaces the window: attention.window must be None")
        if self.sparse_stride is None or self.sparse_stride < 1:
            raise ConfigError(f"attention.sparse={self.sparse!r} needs attention.sparse_stride >= 1")
        if not 1 <= self.sparse_summary <= self.sparse_stride:
            raise ConfigError(f"attention.sparse_summary={self.sparse_summary} must be in "
                              f"1..sparse_stride={self.sparse_stride}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def is_local(self, layer: int) -> bool:
        """A restricted layer: a window (maybe dilated, with global tokens) or a sparse pattern."""
        if self.layer_pattern is None:
            return self.window is not None or self.sparse != "none"
        return self.layer_pattern[layer % len(self.layer_pattern)] == "L"

    def kv_span(self, layer: int) -> int | None:
        """The most recent positions a layer's queries can reach (its KV cache may roll over that many
        slots), or None: all of them (a global layer, global tokens, a sparse pattern's strided keys)."""
        if not self.is_local(layer) or self.window is None or self.global_tokens:
            return None
        return (self.window - 1) * self.dilation + 1


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Mixture of experts replacing the dense MLP: top-k routing (Switch/Mixtral)."""

    n_experts: int = 8
    top_k: int = 2
    normalize_top_k: bool = True        # renormalize the k routing weights (Mixtral)
    aux_loss_coef: float = 0.01         # Switch load-balancing loss per layer, at transformers Mixtral scale
    router_z_loss_coef: float = 0.0     # ST-MoE router z-loss
    shared_expert_d_ff: int | None = None  # an always-on dense expert (DeepSeek/Qwen-MoE style)
    shared_expert_gate: bool = False       # Qwen2-MoE: the shared expert's output times sigmoid(w . x), per token
    capacity_factor: float | None = None   # None: no limit; else each expert takes at most
                                           # ceil(real tokens x top_k / n_experts x capacity_factor) per batch
                                           # (Switch, Fedus 2021); the overflow gets no expert output
    balance: Literal["loss", "bias"] = "loss"   # loss: Switch's balance loss at aux_loss_coef; bias: DeepSeek-V3's
                                           # auxiliary-loss-free balancing (Wang et al. 2024, arXiv 2408.15664): a
                                           # per-expert bias on the routing scores for top-k selection only, moved by
                                           # +-bias_update_rate after each optimizer step; no balance loss then
    bias_update_rate: float = 0.001        # balance=bias: gamma, the bias step per optimizer step (DeepSeek-V3's)

    def __post_init__(self):
        _check_literals(self, "mlp.moe")
        _positive("mlp.moe", n_experts=self.n_experts, top_k=self.top_k,
                  shared_expert_d_ff=self.shared_expert_d_ff, capacity_factor=self.capacity_factor,
                  bias_update_rate=self.bias_update_rate)
        if self.top_k > self.n_experts:
            raise ConfigError(
                f"mlp.moe.top_k={self.top_k} must be <= mlp.moe.n_experts={self.n_experts}"
            )
        if self.shared_expert_gate and not self.shared_expert_d_ff:
            raise ConfigError("mlp.moe.shared_expert_gate needs a shared expert (mlp.moe.shared_expert_d_ff)")
        if self.aux_loss_coef < 0 or self.router_z_loss_coef < 0:
            raise ConfigError("mlp.moe loss coefficients must be >= 0")


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """Feed-forward: activation, width and optional MoE.

    Width: `d_ff` if given, else `d_ff_ratio * d_model` rounded up to `multiple_of` (LLaMA uses
    ratio 8/3 with multiple_of 256 to keep gated MLPs at the parameter count of a 4x plain MLP).
    """

    activation: Activation = "swiglu"
    d_ff: int | None = None
    d_ff_ratio: float = 4.0
    multiple_of: int = 1
    moe: MoEConfig | None = None

    def __post_init__(self):
        _check_literals(self, "mlp")
        if isinstance(self.moe, dict):
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        _positive("mlp", d_ff=self.d_ff, d_ff_ratio=self.d_ff_ratio, multiple_of=self.multiple_of)

    @property
    def gated(self) -> bool:
        return self.activation in GATED_ACTIVATIONS

    def width(self, d_model: int) -> int:
        if self.d_ff is not None:
            return self.d_ff
        raw = int(self.d_ff_ratio * d_model)
        return self.multiple_of * math.ceil(raw / self.multiple_of)


@dataclass(frozen=True, kw_only=True)
class InitConfig:
    kind: Literal["normal", "t5"] = "normal"   # t5: Mesh TensorFlow's per-matrix scales (nn/embedding.py)
    std: float = 0.02               # normal: every matrix and embedding; t5: the matrices T5 has no rule for
    scaled_residual: bool = False   # GPT-2: output projections get std / sqrt(2 * n_layers)
    truncated: bool = False         # truncated normal at +-3 std (OLMo)

    def __post_init__(self):
        _check_literals(self, "init")
        _positive("init", std=self.std)
        if self.kind == "t5" and self.scaled_residual:
            raise ConfigError("init.scaled_residual is GPT-2's rule; init.kind=t5 sets every scale itself")


StackRole = Literal["decoder", "encoder", "cross_decoder"]
STACK_ROLES: tuple[str, ...] = get_args(StackRole)
Arch = Literal["decoder", "encoder", "encoder_decoder"]
ARCHS: tuple[str, ...] = get_args(Arch)


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """One layer's resolved decisions (ModelConfig.layer_spec): what the lecture's table says for it."""

    index: int
    stack: str = "decoder"                 # decoder (causal), encoder (bidirectional), cross_decoder
    causal: bool = True
    local: bool = False                    # a sliding-window layer of the local/global pattern
    window: int | None = None              # tokens a query sees (itself included), None: all
    position_kind: str = "rope"            # the position encoding inside attention at this layer
    rope_theta: float | None = 10_000.0
    rope_scaling: RopeScaling | None = None
    attn_scale: float = 1.0                # the softmax temperature: query_pre_attn_scalar**-0.5 ...
    cross_attention: bool = False          # a decoder layer that also attends to an encoder (cross_decoder)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A Transformer LM: every row of the lecture's table is one of these. `arch` says which stacks it has
    (decoder-only, encoder-only, both); every other switch is shared by its stacks (but the decoder's depth)."""

    name: str = "custom"
    arch: Arch = "decoder"                  # decoder-only LM (GPT); encoder with an MLM head (BERT, RoBERTa);
                                            # encoder_decoder (T5): encoder + decoder with cross-attention
    vocab_size: int = 32_000
    d_model: int = 512
    n_layers: int = 8
    max_seq_len: int = 2048
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    mlp: MLPConfig = field(default_factory=MLPConfig)
    norm: NormConfig = field(default_factory=NormConfig)
    block: BlockConfig = field(default_factory=BlockConfig)
    position: PositionConfig = field(default_factory=PositionConfig)
    bias: BiasConfig = field(default_factory=BiasConfig)
    init: InitConfig = field(default_factory=InitConfig)
    type_vocab_size: int = 0                # token-type (segment) embeddings: BERT 2, RoBERTa 1, 0 none
    nsp_head: bool = False                  # encoder: BERT's pooler (dense + tanh on [CLS]) and 2-way next-sentence
                                            # classifier beside the MLM head (BertForPreTraining)
    tie_embeddings: bool = False
    scale_embeddings: bool = False          # Gemma: token embeddings * sqrt(d_model)
    embedding_dropout: float = 0.0
    logit_scale: float | None = None        # Cohere: logits * 0.0625
    final_logit_softcap: float | None = None  # Gemma 2: 30.0
    z_loss: float = 0.0                     # PaLM: 1e-4 * log(Z)^2
    decoder_layers: int | None = None       # encoder_decoder: the decoder's depth (None: n_layers, the encoder's)
    decoder_start_token_id: int = 0         # encoder_decoder: the decoder's first input (T5: its pad id, 0)
    seed: int = 0

    def __post_init__(self):
        for f in fields(self):  # accept plain dicts for the sub-configs (from YAML / from_dict)
            value = getattr(self, f.name)
            sub = _SUBCONFIGS.get(f.name)
            if sub is not None and isinstance(value, dict):
                object.__setattr__(self, f.name, _build(sub, value, f.name))
        _positive("model", vocab_size=self.vocab_size, d_model=self.d_model,
                  n_layers=self.n_layers, max_seq_len=self.max_seq_len,
                  logit_scale=self.logit_scale, final_logit_softcap=self.final_logit_softcap)
        if self.z_loss < 0:
            raise ConfigError(f"z_loss={self.z_loss} must be >= 0")
        check_seed("seed", self.seed)
        if self.type_vocab_size < 0:
            raise ConfigError(f"type_vocab_size={self.type_vocab_size} must be >= 0")
        if self.nsp_head and (self.arch != "encoder" or self.type_vocab_size < 2):
            raise ConfigError(f"nsp_head=True needs arch='encoder' and type_vocab_size >= 2 (segments A and B), "
                              f"got arch={self.arch!r}, type_vocab_size={self.type_vocab_size}")
        if self.arch == "encoder" and self.attention.prefix_lm:
            raise ConfigError("attention.prefix_lm=True needs arch='decoder': an encoder is bidirectional already")
        self._check_encoder_decoder()
        if not 0.0 <= self.embedding_dropout < 1.0:
            raise ConfigError(f"embedding_dropout={self.embedding_dropout} must be in [0, 1)")
        att, pos = self.attention, self.position
        if att.head_dim is None and self.d_model % att.n_heads:
            raise ConfigError(
                f"attention.n_heads={att.n_heads} must divide d_model={self.d_model} "
                "(or set attention.head_dim)"
            )
        kinds = {pos.kind} | ({pos.global_kind} if pos.global_kind else set())
        if "rope" in kinds:
            rot = self.rotary_dim
            if rot < 2 or rot % 2:
                raise ConfigError(
                    f"rotary dim {rot} (head_dim={self.head_dim} x position.rotary_fraction="
                    f"{pos.rotary_fraction}) must be even and >= 2"
                )
            scaling = pos.rope_scaling
            for name in ("short_factor", "long_factor"):
                value = getattr(scaling, name, None)
                if value is not None and len(value) != rot // 2:
                    raise ConfigError(
                        f"position.rope_scaling.{name} has {len(value)} entries; rotary dim {rot} "
                        f"(head_dim={self.head_dim} x position.rotary_fraction="
                        f"{pos.rotary_fraction}) needs {rot // 2}, one per frequency"
                    )
            if scaling is not None and scaling.kind == "dynamic" and rot < 4:
                raise ConfigError(f"position.rope_scaling.kind='dynamic' needs a rotary dim >= 4 "
                                  f"(its base exponent is r/(r-2)), got {rot}")
        if self.block.parallel and self.norm.position != "pre":
            raise ConfigError(
                f"block.parallel=True needs norm.position='pre', got {self.norm.position!r}"
            )
        if att.qk_norm == "per_head_untied" and self.norm.kind == "nonparametric":
            raise ConfigError("attention.qk_norm='per_head_untied' needs a norm with a weight; "
                              "norm.kind='nonparametric' has none")
        if self.bias.qk_norm and (att.qk_norm not in ("per_head", "full")
                                  or self.norm.kind not in ("layernorm", "layernorm_1p")):
            raise ConfigError(
                f"bias.qk_norm=True needs attention.qk_norm 'per_head' or 'full' with a LayerNorm "
                f"norm.kind, got qk_norm={att.qk_norm!r}, norm.kind={self.norm.kind!r}")
        if self.mlp.width(self.d_model) < 1:
            raise ConfigError("mlp width must be >= 1")

    def _check_encoder_decoder(self) -> None:
        _positive("model", decoder_layers=self.decoder_layers)
        if not 0 <= self.decoder_start_token_id < self.vocab_size:
            raise ConfigError(f"decoder_start_token_id={self.decoder_start_token_id} must be in "
                              f"0..vocab_size-1={self.vocab_size - 1}")
        if self.bias.head_buffer and not self.bias.head:
            raise ConfigError("bias.head_buffer=True needs bias.head=True (it says how the head bias is held)")
        if self.arch != "encoder_decoder":
            for key, flag in (("bias.head_buffer", self.bias.head_buffer),
                              ("position.per_stack", self.position.per_stack)):
                if flag:
                    raise ConfigError(f"{key}=True is available with arch='encoder_decoder' only")
            if self.decoder_layers is not None:
                raise ConfigError(f"decoder_layers={self.decoder_layers} sets an encoder-decoder's decoder depth; "
                                  f"arch={self.arch!r} has n_layers only")
            return
        for switch, on in (("attention.prefix_lm", self.attention.prefix_lm), ("block.parallel", self.block.parallel),
                           ("type_vocab_size", self.type_vocab_size)):
            if on:   # a prefix is what the encoder is; parallel blocks have no place for the cross-attention
                raise ConfigError(f"{switch}={on!r} is not available with arch='encoder_decoder'")

    # ---- derived sizes -------------------------------------------------------------------
    def stack_depth(self, stack: StackRole = "decoder") -> int:
        """Layers in a stack of this role: `decoder_layers` (or n_layers) for an encoder-decoder's decoder
        (cross_decoder), n_layers otherwise. Example: ModelConfig(arch="encoder_decoder", decoder_layers=2)
        .stack_depth("cross_decoder") -> 2"""
        return (self.decoder_layers or self.n_layers) if stack == "cross_decoder" else self.n_layers

    @property
    def head_dim(self) -> int:
        return self.attention.head_dim or self.d_model // self.attention.n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.attention.kv_heads

    @property
    def d_ff(self) -> int:
        return self.mlp.width(self.d_model)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.position.rotary_fraction)

    def is_local(self, layer: int) -> bool:
        return self.attention.is_local(layer)

    def position_kind(self, layer: int) -> str:
        """Position encoding used inside attention at `layer` (absolute kinds act at the input)."""
        pos = self.position
        if not self.is_local(layer) and pos.global_kind is not None:
            return pos.global_kind
        return pos.kind

    def layer_spec(self, layer: int, stack: StackRole = "decoder") -> LayerSpec:
        """Every per-layer decision, resolved once: the slice of this config that layer `layer` of a
        `stack` reads (Attention, its position module and Block take it instead of the whole config and
        an index). Example: ModelConfig().layer_spec(0, "encoder").causal -> False"""
        if stack not in STACK_ROLES:
            raise ConfigError(f"unknown stack role {stack!r}: one of {', '.join(STACK_ROLES)}")
        depth = self.stack_depth(stack)
        if not 0 <= layer < depth:
            raise ConfigError(f"layer {layer} is outside 0..{depth - 1}")
        att, pos = self.attention, self.position
        local = self.is_local(layer)
        rope_local = local and pos.local_rope_theta is not None
        scale = (att.query_pre_attn_scalar or self.head_dim) ** -0.5
        if att.scale_by_inverse_layer:
            scale /= layer + 1
        return LayerSpec(index=layer, stack=stack, causal=stack != "encoder", local=local,
                         window=att.window if local else None, position_kind=self.position_kind(layer),
                         rope_theta=pos.local_rope_theta if rope_local else pos.rope_theta,
                         rope_scaling=None if rope_local else pos.rope_scaling,   # Gemma 3: local layers unscaled
                         attn_scale=scale, cross_attention=stack == "cross_decoder")

    # ---- serialization ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        return _build(cls, data, "model")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> "ModelConfig":
        data = yaml.safe_load(text)
        if not isinstance(data, dict):
            raise ConfigError("a model config YAML must be a mapping")
        return cls.from_dict(data.get("model", data))

    def with_overrides(self, overrides: dict[str, Any]) -> "ModelConfig":
        """New config with dotted-key overrides, e.g. {"norm.kind": "layernorm"}.

        Values may be strings as typed on a command line ("1e-4", "none", "true"); they are
        parsed by the field's type. Unknown keys raise ConfigError naming the key.
        """
        data = self.to_dict()
        for key, value in overrides.items():
            parts = key.split(".")
            node: dict = data
            cls: type = ModelConfig
            for i, part in enumerate(parts):
                hints = get_type_hints(cls)
                if part not in hints:
                    hint = did_you_mean(part, hints, "; ", "")
                    raise ConfigError(f"unknown config key {key!r} (no field {part!r}{hint})")
                if i == len(parts) - 1:
                    node[part] = _parse_value(hints[part], value, key)
                    break
                sub = _dataclass_in(hints[part])
                if sub is None:
                    raise ConfigError(f"config key {key!r}: {'.'.join(parts[:i + 1])} is not a group")
                if node.get(part) is None:
                    node[part] = dataclasses.asdict(sub())
                node, cls = node[part], sub
        return ModelConfig.from_dict(data)


_SUBCONFIGS = {
    "attention": AttentionConfig, "mlp": MLPConfig, "norm": NormConfig, "block": BlockConfig,
    "position": PositionConfig, "bias": BiasConfig, "init": InitConfig,
}


def _dataclass_in(tp: Any) -> type | None:
    for candidate in (tp, *get_args(tp)):
        if isinstance(candidate, type) and is_dataclass(candidate):
            return candidate
    return None


def _build(cls: type, data: dict[str, Any], owner: str):
    """Dataclass from a dict, recursing into sub-configs; unknown keys are an error."""
    if not isinstance(data, dict):
        raise ConfigError(f"{owner} must be a mapping, got {type(data).__name__}")
    hints = get_type_hints(cls)
    unknown = set(data) - set(hints)
    if unknown:
        raise ConfigError(f"unknown field(s) in {owner}: {', '.join(sorted(unknown))}")
    kwargs = {}
    for key, value in data.items():
        sub = _dataclass_in(hints[key])
        where = f"{owner}.{key}" if owner != "model" else key
        if sub is not None and isinstance(value, dict):
            value = _build(sub, value, where)
        else:
            _check_scalar(hints[key], value, where)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:  # wrong argument types surface as ConfigError too
        raise ConfigError(f"{owner}: {exc}") from exc


_SCALARS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _check_scalar(tp: Any, value: Any, key: str) -> None:
    """ConfigError naming the field when a YAML value has the wrong scalar type (e.g. d_model: wide)."""
    options = [a for a in (get_args(tp) or (tp,)) if a is not type(None)]
    if value is None or len(options) != 1 or options[0] not in _SCALARS:
        return
    kind = options[0]
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        raise ConfigError(f"{key}={value!r} must be {_SCALARS[kind]}")


def _parse_value(tp: Any, value: Any, key: str) -> Any:
    """Parse a command-line string into the field's type; non-strings pass through."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    args = get_args(tp)
    optional = type(None) in args
    if optional and text.lower() in ("none", "null", "off"):
        return None
    literal = _literal_values(tp)
    if literal:
        for option in literal:
            if str(option) == text:
                return option
        raise ConfigError(f"{key}={text!r} is not one of {', '.join(map(repr, literal))}")
    base = [a for a in args if a is not type(None)] or [tp]
    target = base[0]
    try:
        if target is bool:
            if text.lower() in ("true", "1", "yes", "on"):
                return True
            if text.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError(text)
        if target is int:
            return int(float(text)) if "e" in text.lower() else int(text)
        if target is float:
            return float(text)
        if target is str:
            return text
        if is_dataclass(target):
            parsed = yaml.safe_load(text)
            return parsed
    except ValueError as exc:
        raise ConfigError(f"{key}={text!r} is not a valid {getattr(target, '__name__', target)}") from exc
    return yaml.safe_load(text)
