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
    """Achievable matmul FLOP/s on this device and dtype: the best of timed square matmuls (sizes 512,
    1,024 and 2,048 on CPU, 4,096 on GPU, or `n`), a peak being a maximum; on known GPUs in bf16 the
    datasheet dense peak. Cached per process. On CPU the bf16 (AMX) figure varies run to run by up to
    2x at a single size, which is why several sizes are timed."""
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
    sizes = [n] if n else ([512, 1024, 2048] if device.type == "cpu" else [4096])
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    peak = max(_timed_matmul(device, torch_dtype, size, seconds / len(sizes)) for size in sizes)
    _PEAK_CACHE[key] = peak
    return peak


def _timed_matmul(device: torch.device, dtype: torch.dtype, size: int, seconds: float) -> float:
    gen = torch.Generator(device=device).manual_seed(0)  # private: the caller's RNG is untouched
    a = torch.randn(size, size, device=device, generator=gen).to(dtype)
    b = torch.randn(size, size, device=device, generator=gen).to(dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)   # reused: no allocation is timed

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.mm(a, b, out=out)
    sync()
    best, deadline = float("inf"), time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        sync()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            break
    return 2.0 * size**3 / best


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)
    except Exception:
        return 0
