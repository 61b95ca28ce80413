"""Human-readable counts, FLOPs and bytes, shared by the CLI and the trainer's messages; bits per byte, the unit
every evaluation reports."""
from __future__ import annotations

import math

__all__ = ["bits_per_byte", "human_count", "human_flops", "human_bytes"]


def bits_per_byte(loss_nats: float, tokens: int, n_bytes: float) -> float:
    """Mean nats per token over `tokens` tokens -> bits per UTF-8 byte of their `n_bytes` bytes (nan without bytes).
    Example: bits_per_byte(math.log(2), 4, 4) -> 1.0"""
    return loss_nats * tokens / (n_bytes * math.log(2)) if n_bytes else float("nan")


def human_count(n: float, units=(("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3))) -> str:
    """6738415616 -> '6.74B', 68976648192 -> '69.0B', 540e9 -> '540.0B'."""
    for unit, scale in units:
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.2f}{unit}" if abs(v) < 10 else f"{v:.1f}{unit}"
    return f"{n:g}"


def human_flops(n: float) -> str:
    """2.5e12 -> '2.50TFLOP'."""
    return human_count(n, (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3))) + "FLOP"


def human_bytes(n: float) -> str:
    """Binary units: 8.5 * 2**20 -> '8.5 MiB', 512 -> '512 B'."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
