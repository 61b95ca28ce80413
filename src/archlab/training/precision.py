"""Which floating-point type a device trains fastest in: bf16 autocast where the hardware has bf16
matrix units, float32 where it would only emulate them.

Why it matters: a CPU with AVX2 alone has no bf16 matmul kernel in oneDNN, so torch falls
back to a scalar one. Measured on a 2-core AVX2 EPYC (torch 2.13): bf16 matmul 1.3 GFLOP/s against
184 GFLOP/s in float32, and a training step of the 14M benchmark model 24x slower under bf16
autocast. On a Sapphire Rapids CPU (AMX) the same step runs ~2x faster in bf16. So `train.dtype`
takes "auto" (bf16 where native, else float32), and an explicit "bfloat16" on such a device is
honoured with a warning that names the cost.

    resolve_dtype("auto", torch.device("cpu"))   # "float32" on AVX2, "bfloat16" with AMX / on A100+

CPU flags alone mislead: a 2-core Xeon with AVX512-BF16 and no AMX ran bf16 matmuls at 170 GFLOP/s
against 326 in float32 (its training step 0.69x of float32 under autocast), where an EPYC with the same
flag ran 2.4x faster. So on a CPU with bf16 instructions "auto" times a short bf16 and float32 matmul
(~0.2 s, cached per CPU model, thread count and torch version in ~/.cache/archlab/precision.json) and
picks bf16 only where it is at least BF16_MIN_SPEEDUP faster. The trainer records the choice in the run
folder, so a resume or a lab rerun keeps it.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from pathlib import Path

import torch

from archlab.paths import cache_dir

__all__ = ["DTYPES", "has_native_bf16", "resolve_dtype", "auto_dtype", "bf16_warning", "autocast",
           "measured_bf16_speedup", "read_record"]

DTYPES = ("float32", "bfloat16", "auto")
BF16_MIN_SPEEDUP = 1.25   # matmul speed-up below which a step gains nothing (elementwise work stays put)


def has_native_bf16(device: torch.device | str) -> bool:
    """Whether bf16 matmuls on `device` run on hardware built for them (not emulated).
    CUDA: compute capability 8.0+ (Ampere), as torch reports. CPU: AVX512-BF16 or AMX instructions
    (plain AVX512 converts bf16 in registers: no faster than float32, so not counted).
    Example: has_native_bf16("cpu")   # False on an AVX2-only EPYC, True on Sapphire Rapids"""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False
        try:
            return torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:                              # torch < 2.4: no emulation flag
            return torch.cuda.get_device_capability(device)[0] >= 8
    if device.type == "cpu":
        return _cpu_has_native_bf16()
    return False


@functools.cache
def _cpu_has_native_bf16() -> bool:       # cached: attention asks on every call
    cpu = torch.cpu
    if hasattr(cpu, "_is_avx512_bf16_supported") and hasattr(cpu, "_is_amx_tile_supported"):
        return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())
    try:                                    # older torch: oneDNN's check (also true on plain AVX512)
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(dtype: str, device: torch.device | str) -> str:
    """"auto" -> what `auto_dtype` chooses for the device; an explicit "float32" / "bfloat16" is returned
    as given.
    Example: resolve_dtype("auto", "cuda")   # "bfloat16" on an A100 or H100, "float32" on a V100"""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    if dtype != "auto":
        return dtype
    return auto_dtype(device)[0]


def auto_dtype(device: torch.device | str) -> tuple[str, str]:
    """(dtype, why) for "auto": GPUs by bf16 tensor cores; CPUs by a measured matmul where they have bf16
    instructions at all.
    Example: auto_dtype("cpu")   # ("float32", "no bf16 matrix units (AVX2): bf16 would be emulated")"""
    device = torch.device(device)
    if not has_native_bf16(device):
        what = "compute capability < 8.0" if device.type == "cuda" else torch.backends.cpu.get_cpu_capability()
        return "float32", f"no bf16 matrix units ({what}): bf16 would be emulated"
    if device.type != "cpu":
        return "bfloat16", "bf16 tensor cores"
    speedup = measured_bf16_speedup()
    verdict = "bfloat16" if speedup >= BF16_MIN_SPEEDUP else "float32"
    return verdict, (f"bf16 matmul measured {speedup:.2f}x float32 on this CPU "
                     f"({'>=' if verdict == 'bfloat16' else '<'} {BF16_MIN_SPEEDUP}x)")


def measured_bf16_speedup(size: int = 512, seconds: float = 0.1) -> float:
    """float32 time / bf16 time of a size x size matmul on this CPU (cached on disk per CPU model, thread
    count and torch version: the answer does not change between runs, and a lab sweep asks often)."""
    key = f"{cpu_model()}|threads={torch.get_num_threads()}|torch={torch.__version__}|size={size}"
    path = _cache_file()
    cache = read_record(path)
    if key not in cache:
        times = {dt: _matmul_seconds(dt, size, seconds) for dt in (torch.float32, torch.bfloat16)}
        cache[key] = times[torch.float32] / times[torch.bfloat16]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            os.replace(tmp, path)
        except OSError:        # a read-only home: measure again next time
            pass
    return float(cache[key])


def _matmul_seconds(dtype: torch.dtype, size: int, seconds: float) -> float:
    """Best time of one matmul, repeated for about `seconds` after a warm-up."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return best


def _cache_file() -> Path:
    return cache_dir() / "precision.json"


def read_record(path: Path) -> dict:
    """A precision JSON file (the measured-speedup cache, a run folder's precision.json) as a dict; {}
    when it is missing, unreadable or not an object: the caller then measures or decides afresh."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform
        return platform.processor() or "CPU"


def bf16_warning(dtype: str, device: torch.device | str) -> str | None:
    """The warning for training in bf16 on a device that emulates it, or None.
    Example: if (msg := bf16_warning(cfg.dtype, device)): warnings.warn(msg)"""
    device = torch.device(device)
    if dtype != "bfloat16" or has_native_bf16(device):
        return None
    if device.type == "cuda":
        return ("train.dtype=bfloat16, but this GPU has no bf16 tensor cores (compute capability < 8.0): "
                "autocast falls back to float32")
    capability = torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else device.type
    return (f"train.dtype=bfloat16 on a CPU without bf16 matrix units ({capability}; no AVX512-BF16 or "
            f"AMX): bf16 matmuls are emulated, measured ~100x slower than float32 matmuls and a training "
            f"step ~20x slower. Use train.dtype=auto or float32 unless bf16 numerics are the point.")


def autocast(device: torch.device | str, dtype: str):
    """The context a training or eval step runs under: bf16 autocast for "bfloat16" (and for "auto"
    where native), else a no-op (float32). A GPU without bf16 tensor cores stays float32.
    Example: with autocast(device, "auto"): loss = model(x, targets=y).total"""
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    if dtype != "bfloat16" or (device.type == "cuda" and not has_native_bf16(device)):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
