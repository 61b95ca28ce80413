"""HF RoPE settings both ways: legacy `rope_theta` / `rope_scaling` and transformers-5 `rope_parameters` ->
(theta, RopeScaling), one reader per rope type (`ROPE_READERS`), and back (`write_rope`); the partial-rotary
fraction likewise (`partial_rotary`, `write_partial_rope`)."""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from archlab.config import ConfigError, ModelConfig, RopeScaling
from archlab.interop.families.base import HFConfig
from archlab.nn.registry import Registry


def read_rope(c: HFConfig, default_theta: float = 10_000.0, params: dict | None = None,
              aliases: dict[str, str] | None = None,
              kinds: Sequence[str] | None = None) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from legacy `rope_theta` + `rope_scaling` or transformers-5 `rope_parameters`
    (pass `params` to read one entry of a per-layer-type `rope_parameters`). `aliases` renames
    rope types the way a family's HF config class does (Phi-3: su, yarn -> longrope); `kinds`
    limits the types the family's HF model accepts. Defaults follow transformers'
    modeling_rope_utils (a top-level `original_max_position_embeddings` wins over the one in
    the rope dict; yarn/longrope `factor` defaults to max_position_embeddings / original)."""
    nested = params is not None
    if params is None:
        params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    theta = float(params.get("rope_theta") or c.get("rope_theta", default_theta))
    kind = params.get("rope_type", params.get("type", "default"))
    kind = (aliases or {}).get(kind, kind)
    supported = list(kinds) if kinds is not None else ["default", *ROPE_READERS.names()]
    if kind not in supported:
        raise c.error(f"rope type {kind!r} (rope_scaling / rope_parameters) is not supported by "
                      f"archlab here (supported: {', '.join(map(repr, supported))})")
    if kind == "default":
        return theta, None
    top = None if nested else c.get("original_max_position_embeddings")
    original = top or params.get("original_max_position_embeddings")
    original = int(original or c.require("max_position_embeddings"))
    try:
        return theta, ROPE_READERS.get(kind)(params, original, c)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise c.error(f"rope type {kind!r}: missing or malformed field {exc}") from exc


# rope type -> reader(params, original_max_position_embeddings, config) -> RopeScaling
ROPE_READERS: Registry[Callable[[dict, int, HFConfig], RopeScaling]] = Registry("HF rope type")


def _implied_factor(params: dict, original: int, c: HFConfig) -> float:
    """transformers: a missing yarn/longrope factor is max_position_embeddings / original."""
    return float(params.get("factor") or c.require("max_position_embeddings") / original)


@ROPE_READERS.register("linear")
def _read_linear(params: dict, original: int, c: HFConfig) -> RopeScaling:
    return RopeScaling(kind="linear", factor=float(params["factor"]))


@ROPE_READERS.register("llama3")
def _read_llama3(params: dict, original: int, c: HFConfig) -> RopeScaling:
    return RopeScaling(kind="llama3", factor=float(params["factor"]),
                       low_freq_factor=float(params["low_freq_factor"]),
                       high_freq_factor=float(params["high_freq_factor"]),
                       original_max_seq_len=original)


@ROPE_READERS.register("yarn")
def _read_yarn(params: dict, original: int, c: HFConfig) -> RopeScaling:
    factor = _implied_factor(params, original, c)
    attention = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None and mscale and mscale_all_dim:  # DeepSeek: a ratio of two mscales
        def get_mscale(m: float) -> float:
            return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0
        attention = get_mscale(mscale) / get_mscale(mscale_all_dim)
    return RopeScaling(kind="yarn", factor=factor, original_max_seq_len=original,
                       beta_fast=float(params.get("beta_fast") or 32),   # `or`: as transformers
                       beta_slow=float(params.get("beta_slow") or 1),
                       truncate=bool(params.get("truncate", True)),
                       attention_factor=None if attention is None else float(attention))


@ROPE_READERS.register("longrope")
def _read_longrope(params: dict, original: int, c: HFConfig) -> RopeScaling:
    attention = params.get("attention_factor")
    return RopeScaling(kind="longrope", factor=_implied_factor(params, original, c),
                       original_max_seq_len=original,
                       short_factor=params["short_factor"], long_factor=params["long_factor"],
                       attention_factor=None if attention is None else float(attention))


@ROPE_READERS.register("dynamic")
def _read_dynamic(params: dict, original: int, c: HFConfig) -> RopeScaling:
    # transformers scales past max_position_embeddings (not original_max_position_embeddings)
    return RopeScaling(kind="dynamic", factor=float(params["factor"]),
                       original_max_seq_len=int(c.require("max_position_embeddings")))


def write_rope(theta: float, scaling: RopeScaling | None) -> dict:
    """HF rope fields: `rope_parameters` (transformers >= 5) plus legacy `rope_theta`/`rope_scaling`.
    Dynamic NTK scales past max_position_embeddings: `Family.to_hf` sets it."""
    theta = float(theta)
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        params.update(rope_type=scaling.kind, factor=float(scaling.factor))
        if scaling.kind == "llama3":
            params.update(low_freq_factor=float(scaling.low_freq_factor),
                          high_freq_factor=float(scaling.high_freq_factor))
        if scaling.kind in ("llama3", "yarn", "longrope"):
            params["original_max_position_embeddings"] = scaling.original_max_seq_len
        if scaling.kind == "yarn":
            params.update(beta_fast=float(scaling.beta_fast), beta_slow=float(scaling.beta_slow),
                          truncate=scaling.truncate)
        if scaling.kind == "longrope":
            params.update(short_factor=list(scaling.short_factor),
                          long_factor=list(scaling.long_factor))
        if scaling.attention_factor is not None:
            params["attention_factor"] = float(scaling.attention_factor)
    legacy = None
    if params["rope_type"] != "default":
        legacy = {k: v for k, v in params.items() if k != "rope_theta"}
        legacy["type"] = params["rope_type"]
    return {"rope_theta": theta, "rope_scaling": legacy, "rope_parameters": params}


def partial_rotary(c: HFConfig, legacy_key: str, default: float) -> float:
    """Fraction of each head's dims that RoPE rotates: transformers-5 `rope_parameters
    .partial_rotary_factor`, else the legacy top-level field."""
    params = c.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor") or c.get(legacy_key, default))


def write_partial_rope(cfg: ModelConfig) -> dict:
    """The inverse of `partial_rotary`: HF rope fields (`write_rope`) with the rotary fraction in
    `rope_parameters.partial_rotary_factor` (each family writes its own legacy top-level field)."""
    rope = write_rope(cfg.position.rope_theta, cfg.position.rope_scaling)
    rope["rope_parameters"]["partial_rotary_factor"] = cfg.position.rotary_fraction
    return rope
