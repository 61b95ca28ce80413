"""Which floating-point type a device trains fastest in: bf16 autocast where the hardware has bf16
matrix units, float32 where it would only emulate them.

Why it matters: a CPU with AVX2 alone has no bf16 matmul kernel in oneDNN, so torch falls
back to a scalar one. Measured on a 2-core AVX2 EPYC (torch 2.13): bf16 matmul 1.3 GFLOP/s against
184 GFLOP/s in float32, and a training step of the 14M benchmark model 24x slower under bf16
autocast. On a Sapphire Rapids CPU (AMX) the same step runs ~2x faster in bf16. So `train.dtype`
takes "auto" (bf16 where native, else float32), and an explicit "bfloat16" on such a device is
honoured with a warning that names the cost.

    resolve_dtype("auto", torch.device("cpu"))   # "float32" on AVX2, "bfloat16" with AMX / on A100+
"""
from __future__ import annotations

import contextlib
import functools

import torch

__all__ = ["DTYPES", "has_native_bf16", "resolve_dtype", "bf16_warning", "autocast"]

DTYPES = ("float32", "bfloat16", "auto")


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
    """"auto" -> "bfloat16" where the device has native bf16 matmuls, else "float32"; an explicit
    "float32" / "bfloat16" is returned as given.
    Example: resolve_dtype("auto", "cuda")   # "bfloat16" on an A100 or H100, "float32" on a V100"""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    if dtype != "auto":
        return dtype
    return "bfloat16" if has_native_bf16(device) else "float32"


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
