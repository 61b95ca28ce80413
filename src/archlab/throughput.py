"""What MFU needs, and what the throughput benchmark reports: training FLOPs per token, the device's
achievable matmul FLOP/s, and peak memory."""
from __future__ import annotations

import sys
import time

import torch

from archlab.config import ModelConfig

__all__ = ["train_flops_per_token", "matmul_peak_flops", "peak_memory"]


def train_flops_per_token(model_cfg: ModelConfig, seq_len: int, n_params: int) -> float:
    """Training FLOPs per token = 3 x forward (backward is ~2x forward). Forward FLOPs from
    archlab.accounting.flops_per_token when available, else 2 * params (Kaplan et al. 2020: 6N)."""
    try:
        from archlab.accounting import flops_per_token
        return 3.0 * float(flops_per_token(model_cfg, seq_len))
    except Exception:  # accounting not written yet, or does not know this config
        return 6.0 * n_params


_PEAK_CACHE: dict[tuple, float] = {}
_KNOWN_PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}


def matmul_peak_flops(device: torch.device, dtype: str = "float32", *, seconds: float = 0.3,
                      n: int | None = None) -> float:
    """Achievable matmul FLOP/s on this device and dtype, measured (square matmuls, best of several
    timings); on known GPUs in bf16 the datasheet dense peak. Cached per process."""
    device = torch.device(device)
    key = (device.type, dtype, n)
    if key in _PEAK_CACHE:
        return _PEAK_CACHE[key]
    if device.type == "cuda" and dtype == "bfloat16":
        name = torch.cuda.get_device_name(device)
        for tag, peak in _KNOWN_PEAKS.items():
            if tag in name:
                _PEAK_CACHE[key] = peak
                return peak
    size = n or (512 if device.type == "cpu" else 4096)
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)  # private: the caller's RNG is untouched
    a = torch.randn(size, size, device=device, generator=gen).to(torch_dtype)
    b = torch.randn(size, size, device=device, generator=gen).to(torch_dtype)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    a @ b
    sync()
    best, deadline = float("inf"), time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            break
    peak = 2.0 * size**3 / best
    _PEAK_CACHE[key] = peak
    return peak


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)
    except Exception:
        return 0
