"""Matching variants to a base at equal parameters or equal FLOPs per token.

A gated MLP has three matrices where a plain one has two, so "SwiGLU beats ReLU" only means something
at equal size (Shazeer 2020 sets d_ff to 2/3 of the plain width). `match` solves one integer knob of a
variant (by default `mlp.d_ff`; `d_model` for aspect-ratio sweeps) so that the variant's parameter
count (its active parameters, for a mixture of experts against a dense model, or its forward FLOPs per token)
lands within a relative tolerance of the base's.

Counts come from `archlab.models.accounting` (analytic, from the config alone); when that module is absent
the parameter count falls back to building the model on the meta device, which allocates nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from archlab.config import ConfigError, ModelConfig
from archlab.models import accounting


class MatchError(ConfigError):
    """No value of the knob brings the variant within tolerance of the target."""


def param_count(cfg: ModelConfig) -> int:
    """Unique parameters, from the config alone (archlab.models.accounting; equal to the built model's)."""
    return int(accounting.param_count(cfg))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token (archlab.models.accounting: matmuls and attention)."""
    return float(accounting.flops_per_token(cfg, seq_len))


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters one token passes through: a mixture of experts counts its top_k experts (and router, shared
    expert), a dense model all (archlab.models.accounting)."""
    return int(accounting.active_param_count(cfg))


# what `match.by` may hold -> the measure of a config (seq_len: the FLOPs' context length)
MATCH_BY: dict[str, Callable[[ModelConfig, int], float]] = {
    "params": lambda cfg, seq_len: param_count(cfg),
    "active": lambda cfg, seq_len: active_param_count(cfg),
    "flops": flops_per_token,
}


@dataclass(frozen=True)
class MatchResult:
    config: ModelConfig
    knob: str
    value: int
    measure: float      # the variant's params (or FLOPs/token) after matching
    target: float       # the base's
    rel_error: float    # (measure - target) / target


def _knob_value(cfg: ModelConfig, knob: str) -> int:
    if knob == "mlp.d_ff":
        return cfg.d_ff
    node = cfg
    for part in knob.split("."):
        node = getattr(node, part)
    return int(node)


def match(
    cfg: ModelConfig,
    target: float,
    *,
    by: str = "params",
    knob: str = "mlp.d_ff",
    multiple: int = 1,
    tolerance: float = 0.02,
    seq_len: int = 128,
    extra_overrides: dict | None = None,
) -> MatchResult:
    """Smallest-error integer `knob` (a multiple of `multiple`) so that the measure hits `target`.

    by: one of MATCH_BY ("params", "active": a mixture of experts' active parameters, "flops"). The measure
    grows monotonically with d_ff and with d_model, so a doubling search for an upper bound and a bisection
    find the crossing; the closer of the two neighbours wins. Raises MatchError when even that one misses by
    more than `tolerance`.
    """
    if by not in MATCH_BY:
        raise ConfigError(f"match by={by!r} must be one of {', '.join(MATCH_BY)}")
    if target <= 0:
        raise ConfigError(f"match target={target} must be positive")
    measure: Callable[[ModelConfig], float] = lambda c: MATCH_BY[by](c, seq_len)  # noqa: E731
    extra = dict(extra_overrides or {})

    def build(units: int) -> ModelConfig:
        return cfg.with_overrides({knob: units * multiple, **extra})

    def value(units: int) -> float:
        try:
            return measure(build(units))
        except ConfigError:
            return float("nan")

    lo, hi = 1, max(1, _knob_value(cfg, knob) // multiple)
    while not value(hi) >= target:
        if hi > 1 << 24:
            raise MatchError(f"{knob} cannot reach {by}={target:.4g}")
        lo, hi = hi, hi * 2
    if value(lo) >= target:  # the knob's current value overshoots: search down from 1
        lo = 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if value(mid) >= target:
            hi = mid
        else:
            lo = mid
    best = min((lo, hi), key=lambda u: abs(value(u) - target) if value(u) == value(u) else float("inf"))
    got = value(best)
    rel = (got - target) / target
    if not abs(rel) <= tolerance:
        raise MatchError(
            f"matching {knob} by {by}: best {knob}={best * multiple} gives {got:.6g}, "
            f"{rel:+.2%} from the target {target:.6g} (tolerance {tolerance:.1%})"
        )
    return MatchResult(build(best), knob, best * multiple, got, float(target), rel)
