"""Position encodings.

At the input (added to token embeddings):
  sinusoidal  Vaswani et al. 2017: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(...)
              (layout "interleaved"); "split": all sines, then all cosines (Marian / fairseq), optionally
              held as a frozen parameter table (Marian: transformers counts it)
  learned     GPT/GPT-2/OPT: a table of max_seq_len vectors (OPT stores rows shifted by 2)
Inside attention (one object per layer, so layers can differ: Command A, Gemma 3):
  rope        Su et al. 2021 (RoFormer): rotate pairs of q/k dims by p * theta^(-2i/r). Layouts:
              "half" pairs dim i with i + r/2 (HF LLaMA, GPT-NeoX); "interleaved" pairs 2i with
              2i+1 (GPT-J, Cohere, Meta's original). Partial rotary rotates the first r dims.
              Context extension (ROPE_SCALINGS): linear (Chen et al. 2023, position
              interpolation), Llama 3's, YaRN (Peng et al. 2023), LongRoPE (Ding et al. 2024;
              Phi-3) and dynamic NTK; the last two pick frequencies by each call's length.
  alibi       Press et al. 2021: logits - slope_h * (p_q - p_k)
  t5          Raffel et al. 2020: a learned scalar per (log-bucketed distance, head), shared
              across layers
  none        NoPE (Kazemnejad et al. 2023): causal masking alone carries order
Positions are (b, t) integer tensors; -1 marks a padding slot (masked out by attention).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from archlab.config import ABSOLUTE_POSITIONS, LayerSpec, ModelConfig, RopeScaling
from archlab.nn.fused import rope_half
from archlab.nn.registry import Registry

ATTENTION_POSITIONS: Registry[type[AttentionPosition]] = Registry("position kind")


class AttentionPosition(nn.Module):
    """Base: does nothing. Subclasses rotate q/k or return an additive logit bias."""

    has_bias = False     # set for every class that overrides `bias`: attention skips the call otherwise

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.has_bias = cls.bias is not AttentionPosition.bias

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, tables=None) -> torch.Tensor:
        return x  # x: (b, h, t, e), positions: (b, t); tables: precomputed by RoPE's `tables`

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        return None  # -> (b, h, tq, tk) or None

    def tables(self, positions: torch.Tensor, dtype: torch.dtype):
        return None  # RoPE: (cos, sin) built once per forward and shared by layers with equal frequencies


@ATTENTION_POSITIONS.register("none")
class NoPosition(AttentionPosition):
    """NoPE: no explicit position signal."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, t5_table: T5RelativeBias | None = None):
        super().__init__()


@ATTENTION_POSITIONS.register("sinusoidal")
@ATTENTION_POSITIONS.register("learned")
class InputPosition(NoPosition):
    """Absolute encodings act at the input (see AbsolutePosition); nothing in attention."""


# ---- RoPE context extension ----------------------------------------------------------------------
# kind -> fn(exponents, theta, scaling, seq_len) -> (inv_freq, attention_factor). `exponents` are
# 2i/r for i < r/2 (unscaled frequencies theta^-exponents); `seq_len` is None when the module is
# built and, for CALL_LENGTH_KINDS, the 0-d tensor max(position) + 1 of each call. The attention
# factor multiplies cos and sin (so q.k logits by its square), as transformers does.
ROPE_SCALINGS: Registry[Callable[..., tuple[torch.Tensor, float]]] = Registry("rope scaling kind")
# frequencies follow the length of each call, as transformers' `dynamic_rope_update` does
CALL_LENGTH_KINDS = ("longrope", "dynamic")


@ROPE_SCALINGS.register("linear")
def _linear_scaling(exponents, theta, s: RopeScaling, seq_len=None):
    """Position interpolation (Chen et al. 2023): every frequency divided by `factor`."""
    return 1.0 / theta ** exponents / s.factor, 1.0


@ROPE_SCALINGS.register("llama3")
def _llama3_scaling(exponents, theta, s: RopeScaling, seq_len=None):
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    inv_freq = 1.0 / theta ** exponents
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = s.original_max_seq_len / s.low_freq_factor
    high_wavelen = s.original_max_seq_len / s.high_freq_factor
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    ramp = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(medium, ramp, scaled), 1.0


@ROPE_SCALINGS.register("yarn")
def _yarn_scaling(exponents, theta, s: RopeScaling, seq_len=None):
    """YaRN (Peng et al. 2023, arXiv 2309.00071), "NTK-by-parts": dims that turn more than
    beta_fast times within the original context keep their frequency, dims turning fewer than
    beta_slow times are interpolated by `factor`, a linear ramp between; cos/sin scaled by
    0.1 ln(factor) + 1 (the paper's sqrt(1/t)) unless attention_factor is given."""
    r = 2 * exponents.shape[0]
    inv_freq = 1.0 / theta ** exponents

    def dim_turning(turns: float) -> float:  # the dim whose wavelength fits `turns` times
        return r * math.log(s.original_max_seq_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(s.beta_fast), dim_turning(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, r - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    steps = torch.arange(r // 2, dtype=exponents.dtype, device=exponents.device)
    interpolate = ((steps - low) / (high - low)).clamp(0, 1)          # 0: keep, 1: divide by factor
    scaled = inv_freq / s.factor * interpolate + inv_freq * (1 - interpolate)
    if s.attention_factor is not None:
        return scaled, s.attention_factor
    return scaled, 0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0


@ROPE_SCALINGS.register("longrope")
def _longrope_scaling(exponents, theta, s: RopeScaling, seq_len=None):
    """LongRoPE (Ding et al. 2024, arXiv 2402.13753; Phi-3 "su"): a searched divisor per
    frequency, `short_factor` while the call's max position + 1 <= original_max_seq_len and
    `long_factor` past it (transformers' rule: one choice per forward call, by its positions);
    cos/sin scaled by sqrt(1 + ln(factor) / ln(original_max_seq_len)) unless attention_factor."""
    inv_freq = 1.0 / theta ** exponents
    short = inv_freq / inv_freq.new_tensor(s.short_factor)
    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.factor <= 1:
        attention = 1.0
    else:
        attention = math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_seq_len))
    if seq_len is None:
        return short, attention
    long = inv_freq / inv_freq.new_tensor(s.long_factor)
    return torch.where(seq_len > s.original_max_seq_len, long, short), attention


@ROPE_SCALINGS.register("dynamic")
def _dynamic_scaling(exponents, theta, s: RopeScaling, seq_len=None):
    """Dynamic NTK scaling (bloc97/emozilla 2023, as in transformers): for a call of length
    L > original_max_seq_len the base grows to theta (factor L / original - factor + 1)^(r/(r-2));
    shorter calls are unscaled. Stateless: transformers caches the longest call's frequencies
    until a call shorter than the original context, so a shorter-but-long call after a longer
    one differs there (fresh models, growing decodes and short calls agree)."""
    if seq_len is None:
        return 1.0 / theta ** exponents, 1.0
    r = 2 * exponents.shape[0]
    length = seq_len.to(exponents.dtype).clamp(min=s.original_max_seq_len)
    base = theta * (s.factor * length / s.original_max_seq_len - (s.factor - 1)) ** (r / (r - 2))
    return 1.0 / base ** exponents, 1.0


def rope_exponents(rotary_dim: int) -> torch.Tensor:
    """2i/r for i < r/2, float64: frequencies are theta^-exponents."""
    # tables are built on the CPU explicitly, so a model built on the meta device (fast loading of
    # checkpoints, see interop.load_hf) still gets real buffers
    return torch.arange(0, rotary_dim, 2, dtype=torch.float64, device="cpu") / rotary_dim


def rope_frequencies(rotary_dim: int, theta: float,
                     scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (r/2,) float32, attention factor) at build time (calls up to
    original_max_seq_len for the CALL_LENGTH_KINDS)."""
    exponents = rope_exponents(rotary_dim)
    if scaling is None:
        return (1.0 / theta ** exponents).float(), 1.0
    inv_freq, attention = ROPE_SCALINGS.get(scaling.kind)(exponents, theta, scaling)
    return inv_freq.float(), float(attention)


def rope_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Frequencies theta^(-2i/r), i < r/2, after optional context-extension scaling."""
    return rope_frequencies(rotary_dim, theta, scaling)[0]


@ATTENTION_POSITIONS.register("rope")
class RotaryEmbedding(AttentionPosition):
    inv_freq: torch.Tensor       # registered buffers, typed for the checker
    half_freq: torch.Tensor
    half_sign: torch.Tensor
    """RoPE; q.k then depends only on the offset p_q - p_k."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, t5_table: T5RelativeBias | None = None):
        super().__init__()
        pos = cfg.position
        theta, scaling = spec.rope_theta, spec.rope_scaling
        assert theta is not None, "RoPE needs position.rope_theta"
        self.rotary_dim = cfg.rotary_dim
        self.interleaved = pos.rope_layout == "interleaved"
        inv_freq, self.attention_factor = rope_frequencies(self.rotary_dim, theta, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # the "half" layout's tables straight from its frequencies twice over and the signs of [-sin, sin]
        half = torch.ones_like(inv_freq)
        self.register_buffer("half_freq", torch.cat((inv_freq, inv_freq)), persistent=False)   # (r,)
        self.register_buffer("half_sign", torch.cat((-half, half)), persistent=False)          # (r,)
        self.dynamic = scaling is not None and scaling.kind in CALL_LENGTH_KINDS
        self.theta, self.scaling = theta, scaling
        # layers with equal keys have equal tables: a decode step builds them once (AttnInputs.shared)
        self.table_key = ("rope", theta, scaling, self.rotary_dim, self.interleaved)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for `positions` (b, t), each (b, 1, t, r/2); "half" layout: ([cos, cos], [-sin, sin]),
        each (b, 1, t, r), so `rotate` needs two multiplies and one add."""
        inv_freq = self.inv_freq if self.interleaved else self.half_freq
        if self.dynamic and self.scaling is not None:
            # longrope, dynamic: frequencies from this call's max position, as tensor ops (no
            # host sync, traceable); q and k of a call share them through AttnInputs.shared
            r, seq_len = self.rotary_dim, positions.max() + 1
            exponents = torch.arange(0, r, 2, dtype=torch.float32, device=positions.device) / r
            inv_freq, _ = ROPE_SCALINGS.get(self.scaling.kind)(exponents, self.theta, self.scaling,
                                                               seq_len)
            inv_freq = inv_freq if self.interleaved else torch.cat((inv_freq, inv_freq))
        # positions (b, t), or (1, t) shared by all rows on the plain causal path: tables built once
        angles = positions.clamp(min=0)[:, None, :, None].float() * inv_freq  # (b|1, 1, t, r/2 | r)
        cos, sin = angles.cos(), angles.sin()
        if not self.interleaved:                       # ([cos, cos], [-sin, sin])
            sin = sin.mul_(self.half_sign)
        if self.attention_factor != 1.0:  # YaRN, LongRoPE: q.k logits times attention_factor^2
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return (cos, sin) if cos.dtype == dtype else (cos.to(dtype), sin.to(dtype))

    def rotate(self, x: torch.Tensor, positions: torch.Tensor,
               tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        r = self.rotary_dim
        cos, sin = self.tables(positions, x.dtype) if tables is None else tables
        if r == x.shape[-1] and not self.interleaved:      # the whole head rotates (LLaMA): no slices
            return rope_half(x, cos, sin)
        x_rot, x_pass = x[..., :r], x[..., r:]
        if self.interleaved:
            x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            # (x1 cos - x2 sin, x2 cos + x1 sin) written as x [cos, cos] + [x2, x1] [-sin, sin]:
            # one multiply and one multiply-add, with a hand-written backward (nn/fused.py)
            rotated = rope_half(x_rot, cos, sin)
        return torch.cat((rotated, x_pass), dim=-1) if x_pass.shape[-1] else rotated


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Geometric slopes 2^(-8i/n); for non-powers of two, interleave the next power's slopes."""
    def power_of_two(n):
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_two(closest)
    if closest < n_heads:
        slopes += power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, device="cpu")


@ATTENTION_POSITIONS.register("alibi")
class ALiBi(AttentionPosition):
    """Press et al. 2022: a per-head linear penalty on distance, -m |i - j|. Symmetric, as MosaicBERT uses
    it for bidirectional attention; under a causal mask it equals the original -m (i - j)."""
    slopes: torch.Tensor

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, t5_table: T5RelativeBias | None = None):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(cfg.attention.n_heads), persistent=False)

    def bias(self, q_pos, k_pos):
        distance = (q_pos[:, None, :, None] - k_pos[:, None, None, :]).float().abs()  # (b, 1, tq, tk)
        return -self.slopes[:, None, None] * distance


class T5RelativeBias(nn.Module):
    """The learned bias table itself (one per stack, built by TransformerLM). A causal stack (T5's decoder)
    buckets how far back a key is; a bidirectional one (T5's encoder) gives keys before and after the query
    half of the buckets each, as HF's `_relative_position_bucket(bidirectional=True)`."""

    def __init__(self, cfg: ModelConfig, bidirectional: bool = False):
        super().__init__()
        self.num_buckets = cfg.position.t5_num_buckets
        self.max_distance = cfg.position.t5_max_distance
        self.bidirectional = bidirectional
        self.embedding = nn.Embedding(self.num_buckets, cfg.attention.n_heads)

    def bucket(self, distance: torch.Tensor) -> torch.Tensor:
        """Bucket of `distance` = query position - key position: exact for small distances, log-spaced up
        to max_distance; bidirectional: keys after the query in the upper half of the buckets."""
        buckets, offset = self.num_buckets, torch.zeros((), dtype=torch.long, device=distance.device)
        if self.bidirectional:
            buckets //= 2
            offset = (distance < 0).long() * buckets
            n = distance.abs()
        else:
            n = distance.clamp(min=0)
        exact = buckets // 2
        large = exact + (
            torch.log(n.float().clamp(min=1) / exact) / math.log(self.max_distance / exact) * (buckets - exact)
        ).long()
        large = large.clamp(max=buckets - 1)
        return offset + torch.where(n < exact, n, large)

    def forward(self, q_pos, k_pos):
        buckets = self.bucket(q_pos[:, :, None] - k_pos[:, None, :])   # (b, tq, tk)
        return self.embedding(buckets).permute(0, 3, 1, 2).float()      # (b, h, tq, tk)


@ATTENTION_POSITIONS.register("t5")
class T5Bias(AttentionPosition):
    """Looks up its stack's one T5RelativeBias, given explicitly (held outside the module tree: the
    stack owns its weights, once)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, t5_table: T5RelativeBias | None = None):
        super().__init__()
        if t5_table is None:
            raise ValueError("a T5 position layer needs its stack's T5RelativeBias (t5_table)")
        self._table = (t5_table,)

    def bias(self, q_pos, k_pos):
        return self._table[0](q_pos, k_pos)


def build_attention_position(cfg: ModelConfig, spec: LayerSpec,
                             t5_table: T5RelativeBias | None = None) -> AttentionPosition:
    return ATTENTION_POSITIONS.get(spec.position_kind)(cfg, spec, t5_table)


def sinusoid_table(n_positions: int, d: int, layout: str = "interleaved") -> torch.Tensor:
    """(n, d) float32 sinusoids, angles p / 10000^(2i/d) computed in float64 (as transformers' Marian table):
    interleaved sin, cos pairs, or split (sines in the first ceil(d/2) dims, cosines after)."""
    angles = (torch.arange(n_positions, dtype=torch.float64, device="cpu")[:, None]
              / 10_000 ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d))   # (n, ceil(d/2))
    if layout == "split":
        return torch.cat((angles.sin(), angles.cos()[:, : d // 2]), dim=-1).float()
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)[:, :d].float()


class AbsolutePosition(nn.Module):
    inv_freq: torch.Tensor
    """Sinusoidal or learned vectors added to the token embeddings; nothing for other kinds."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.position.kind
        self.d_model = cfg.d_model
        self.offset = cfg.position.learned_offset
        self.layout = cfg.position.sinusoid_layout
        self.at_input = self.kind in ABSOLUTE_POSITIONS    # else forward returns None
        self.table: nn.Parameter | None = None
        if self.kind == "learned":
            self.embedding = nn.Embedding(cfg.max_seq_len + self.offset, cfg.d_model)
        elif self.kind == "sinusoidal" and cfg.position.sinusoid_table:   # Marian: frozen, counted
            self.table = nn.Parameter(sinusoid_table(cfg.max_seq_len, cfg.d_model, self.layout), requires_grad=False)
        elif self.kind == "sinusoidal":
            steps = torch.arange(0, cfg.d_model, 2, device="cpu").float()
            inv = 1.0 / 10_000 ** (steps / cfg.d_model)
            self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor | None:  # (b, t) -> (b, t, d)
        positions = positions.clamp(min=0)
        if self.kind == "learned":
            return self.embedding(positions + self.offset)
        if self.table is not None:
            return self.table[positions]
        if self.kind == "sinusoidal":
            angles = positions[..., None].float() * self.inv_freq
            if self.layout == "split":
                return torch.cat((angles.sin(), angles.cos()[..., : self.d_model // 2]), dim=-1)
            pe = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)
            return pe[..., : self.d_model]
        return None
