"""Position encodings.

At the input (added to token embeddings):
  sinusoidal  Vaswani et al. 2017: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(...)
  learned     GPT/GPT-2/OPT: a table of max_seq_len vectors (OPT stores rows shifted by 2)
Inside attention (one object per layer, so layers can differ: Command A, Gemma 3):
  rope        Su et al. 2021 (RoFormer): rotate pairs of q/k dims by p * theta^(-2i/r). Layouts:
              "half" pairs dim i with i + r/2 (HF LLaMA, GPT-NeoX); "interleaved" pairs 2i with
              2i+1 (GPT-J, Cohere, Meta's original). Partial rotary rotates the first r dims.
              Scaling: linear (Chen et al. 2023, position interpolation) and Llama 3's.
  alibi       Press et al. 2021: logits - slope_h * (p_q - p_k)
  t5          Raffel et al. 2020: a learned scalar per (log-bucketed distance, head), shared
              across layers
  none        NoPE (Kazemnejad et al. 2023): causal masking alone carries order
Positions are (b, t) integer tensors; -1 marks a padding slot (masked out by attention).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from archlab.config import ModelConfig, RopeScaling
from archlab.nn.fused import rope_half
from archlab.nn.registry import Registry

ATTENTION_POSITIONS: Registry[type[nn.Module]] = Registry("position kind")


class AttentionPosition(nn.Module):
    """Base: does nothing. Subclasses rotate q/k or return an additive logit bias."""

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, tables=None) -> torch.Tensor:
        return x  # x: (b, h, t, e), positions: (b, t); tables: precomputed by RoPE's `tables`

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        return None  # -> (b, h, tq, tk) or None


@ATTENTION_POSITIONS.register("none")
class NoPosition(AttentionPosition):
    """NoPE: no explicit position signal."""

    def __init__(self, cfg: ModelConfig, layer: int, shared: dict):
        super().__init__()


@ATTENTION_POSITIONS.register("sinusoidal")
@ATTENTION_POSITIONS.register("learned")
class InputPosition(NoPosition):
    """Absolute encodings act at the input (see AbsolutePosition); nothing in attention."""


def rope_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Frequencies theta^(-2i/r), i < r/2, after optional context-extension scaling."""
    # tables are built on the CPU explicitly, so a model built on the meta device (fast loading of
    # checkpoints, see interop.load_hf) still gets real buffers
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device="cpu")
    inv_freq = 1.0 / theta ** (steps / rotary_dim)
    if scaling is None:
        return inv_freq.float()
    if scaling.kind == "linear":
        return (inv_freq / scaling.factor).float()
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    ramp = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(medium, ramp, scaled).float()


@ATTENTION_POSITIONS.register("rope")
class RotaryEmbedding(AttentionPosition):
    """RoPE; q.k then depends only on the offset p_q - p_k."""

    def __init__(self, cfg: ModelConfig, layer: int, shared: dict):
        super().__init__()
        pos = cfg.position
        local = cfg.is_local(layer) and pos.local_rope_theta is not None
        theta = pos.local_rope_theta if local else pos.rope_theta
        scaling = None if local else pos.rope_scaling  # Gemma 3: local layers are unscaled
        self.rotary_dim = cfg.rotary_dim
        self.interleaved = pos.rope_layout == "interleaved"
        self.register_buffer("inv_freq", rope_inv_freq(self.rotary_dim, theta, scaling),
                             persistent=False)
        # layers with equal keys have equal tables: a decode step builds them once (Attention memo)
        self.table_key = ("rope", theta, scaling, self.rotary_dim, self.interleaved)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for `positions` (b, t), each (b, 1, t, r/2); "half" layout: ([cos, cos], [-sin, sin])
        over r dims, so `rotate` needs two multiplies and one add."""
        # positions (b, t), or (1, t) shared by all rows on the plain causal path: tables built once
        angles = positions.clamp(min=0)[:, None, :, None].float() * self.inv_freq  # (b|1, 1, t, r/2)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        if self.interleaved:
            return cos, sin
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor,
               tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        r = self.rotary_dim
        cos, sin = self.tables(positions, x.dtype) if tables is None else tables
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
    def __init__(self, cfg: ModelConfig, layer: int, shared: dict):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(cfg.attention.n_heads), persistent=False)

    def bias(self, q_pos, k_pos):
        distance = (q_pos[:, None, :, None] - k_pos[:, None, None, :]).float()  # (b, 1, tq, tk)
        return -self.slopes[:, None, None] * distance


class T5RelativeBias(nn.Module):
    """The learned bias table itself (one per model, built by TransformerLM)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_buckets = cfg.position.t5_num_buckets
        self.max_distance = cfg.position.t5_max_distance
        self.embedding = nn.Embedding(self.num_buckets, cfg.attention.n_heads)

    def bucket(self, distance: torch.Tensor) -> torch.Tensor:
        """Causal buckets: exact for small distances, log-spaced up to max_distance."""
        n = distance.clamp(min=0)
        exact = self.num_buckets // 2
        large = exact + (
            torch.log(n.float().clamp(min=1) / exact) / math.log(self.max_distance / exact)
            * (self.num_buckets - exact)
        ).long()
        large = large.clamp(max=self.num_buckets - 1)
        return torch.where(n < exact, n, large)

    def forward(self, q_pos, k_pos):
        buckets = self.bucket(q_pos[:, :, None] - k_pos[:, None, :])   # (b, tq, tk)
        return self.embedding(buckets).permute(0, 3, 1, 2).float()      # (b, h, tq, tk)


@ATTENTION_POSITIONS.register("t5")
class T5Bias(AttentionPosition):
    """Looks up the model's shared T5RelativeBias (held outside the module tree: no duplicates)."""

    def __init__(self, cfg: ModelConfig, layer: int, shared: dict):
        super().__init__()
        self._table = (shared["t5"],)

    def bias(self, q_pos, k_pos):
        return self._table[0](q_pos, k_pos)


def build_attention_position(cfg: ModelConfig, layer: int, shared: dict) -> AttentionPosition:
    return ATTENTION_POSITIONS.get(cfg.position_kind(layer))(cfg, layer, shared)


class AbsolutePosition(nn.Module):
    """Sinusoidal or learned vectors added to the token embeddings; nothing for other kinds."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.position.kind
        self.d_model = cfg.d_model
        self.offset = cfg.position.learned_offset
        if self.kind == "learned":
            self.embedding = nn.Embedding(cfg.max_seq_len + self.offset, cfg.d_model)
        elif self.kind == "sinusoidal":
            steps = torch.arange(0, cfg.d_model, 2, device="cpu").float()
            inv = 1.0 / 10_000 ** (steps / cfg.d_model)
            self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor | None:  # (b, t) -> (b, t, d)
        positions = positions.clamp(min=0)
        if self.kind == "learned":
            return self.embedding(positions + self.offset)
        if self.kind == "sinusoidal":
            angles = positions[..., None].float() * self.inv_freq
            pe = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)
            return pe[..., : self.d_model]
        return None
