"""What MFU needs, and what the throughput benchmark reports: training FLOPs per token, the device's
achievable matmul FLOP/s, peak memory, and how much of the machine's CPU other processes took meanwhile (a busy
machine lowers both the tokens/s and the matmul peak MFU divides by, so MFU alone cannot show it)."""
from __future__ import annotations

import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from archlab.config import ModelConfig
from archlab.nn.heads import LMHead

__all__ = ["train_flops_per_token", "matmul_peak_flops", "matmul_weight_shapes", "matmul_ceiling", "peak_memory",
           "CpuShare", "BUSY_SHARE", "busy_note", "machine_cpu_seconds"]


def train_flops_per_token(model_cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token = 3 x forward (backward is ~2x forward), the forward counted exactly by
    archlab.accounting.flops_per_token (matmuls and attention; no 6N shortcut to hide a counting bug)."""
    from archlab.models.accounting import flops_per_token
    return 3.0 * float(flops_per_token(model_cfg, seq_len))


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
    torch_dtype = _torch_dtype(dtype)
    peak = 0.0
    for size in sizes:
        peak = max(peak, _timed_matmul(device, torch_dtype, size, seconds / len(sizes)))
        if 2.0 * (2 * size) ** 3 / peak > seconds:   # the next size's one matmul alone would overrun
            break                                     # (emulated bf16 on CPU: ~1 GFLOP/s)
    _PEAK_CACHE[key] = peak
    return peak


def _timed_matmul(device: torch.device, dtype: torch.dtype, size: int, seconds: float) -> float:
    gen = torch.Generator(device=device).manual_seed(0)  # private: the caller's RNG is untouched
    a = torch.randn(size, size, device=device, generator=gen).to(dtype)
    b = torch.randn(size, size, device=device, generator=gen).to(dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)   # reused: no allocation is timed
    _time_once(lambda: torch.mm(a, b, out=out), device)          # warm-up
    best, deadline = float("inf"), time.perf_counter() + seconds
    while True:
        best = min(best, _time_once(lambda: torch.mm(a, b, out=out), device))
        if time.perf_counter() > deadline:
            break
    return 2.0 * size**3 / best


def matmul_weight_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(out, in) of every weight a forward multiplies the tokens by: each nn.Linear, and each head's token
    projection (nn/heads.LMHead: its own matrix or the tied embedding). MoE experts see a share of the
    tokens each, so they are not listed: the ceiling is for dense models.
    Example: matmul_weight_shapes(TransformerLM(presets.tiny("llama2-7b")))  # [(64, 64), ...]"""
    shapes = [tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    shapes += [tuple(m.matrix.shape) for m in model.modules() if isinstance(m, LMHead)]
    return shapes


def matmul_ceiling(weight_shapes: list[tuple[int, int]], tokens: int, device: torch.device,
                   dtype: str = "float32", *, repeats: int = 5) -> tuple[float, float]:
    """(FLOPs, seconds) of a training step's weight matmuls run alone: per (out, in) weight the
    forward x W^T, the input gradient dy W and the weight gradient dy^T x, on `tokens` rows, each the
    best of `repeats`. FLOPs / seconds / matmul_peak_flops is the MFU this step could reach if
    everything else (attention, norms, activations, optimizer) were free: on CPU the model's own
    shapes (K = d_model = 320, say) run below the big square matmuls that set the peak.
    Example: flops, s = matmul_ceiling(matmul_weight_shapes(model), 2048, "cpu")
             ceiling = flops / s / matmul_peak_flops(torch.device("cpu"))"""
    device = torch.device(device)
    torch_dtype = _torch_dtype(dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    flops = seconds = 0.0
    for (n_out, n_in), count in Counter(weight_shapes).items():
        w = torch.randn(n_out, n_in, device=device, generator=gen).to(torch_dtype)
        x = torch.randn(tokens, n_in, device=device, generator=gen).to(torch_dtype)
        dy = torch.randn(tokens, n_out, device=device, generator=gen).to(torch_dtype)
        # (rows x inner x cols) of each product, with the layouts a Linear's forward and backward use
        for a, b in ((x, w.t()), (dy, w), (dy.t(), x)):
            out = torch.empty(a.shape[0], b.shape[1], device=device, dtype=torch_dtype)
            best = min(_time_once(lambda a=a, b=b, out=out: torch.mm(a, b, out=out), device)
                       for _ in range(repeats + 1))
            flops += count * 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
            seconds += count * best
    return flops, seconds


def _torch_dtype(dtype: str) -> torch.dtype:
    return torch.bfloat16 if dtype == "bfloat16" else torch.float32


def _time_once(fn, device: torch.device) -> float:
    """Seconds of one call of `fn`, the GPU's queue drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)
    except Exception:
        return 0


# Other processes taking more than this share of the machine's CPU time make a CPU run's speed (and a minutes
# budget's step count) visibly lower than the same machine idle: say so.
BUSY_SHARE = 0.25


def machine_cpu_seconds() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot, summed over its CPUs (/proc/stat; None
    elsewhere). Busy is every state but idle and iowait."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]           # user nice system idle iowait irq softirq steal
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = sum(ticks)
    return (total - ticks[3] - ticks[4]) / hz, total / hz


@dataclass
class CpuShare:
    """The share of the machine's CPU capacity that processes other than this one used since `start()` (or since
    it was made): (machine busy - this process's CPU time) / machine capacity. None where /proc/stat is missing or
    too little time has passed to tell.
    Example: meter = CpuShare(); ...; meter.others()  # 0.48: other processes kept half the machine busy"""
    since: tuple[float, float, float] | None = field(default=None)
    read = staticmethod(machine_cpu_seconds)      # the machine's (busy, total) CPU seconds; tests replace it
    own = staticmethod(time.process_time)         # this process's CPU seconds; tests replace it too

    def __post_init__(self) -> None:
        self.start()

    def start(self) -> None:
        machine = self.read()
        self.since = None if machine is None else (*machine, self.own())

    def others(self) -> float | None:
        machine = self.read()
        if machine is None or self.since is None:
            return None
        busy, total, own = machine[0] - self.since[0], machine[1] - self.since[1], self.own() - self.since[2]
        if total < 0.05:      # /proc/stat counts in 10 ms ticks: too short a span says nothing
            return None
        return min(1.0, max(0.0, (busy - own) / total))


def busy_note(share: float | None, what: str) -> str | None:
    """One line when other processes took more than BUSY_SHARE of the machine's CPU while `what` ran, else None."""
    if share is None or share <= BUSY_SHARE:
        return None
    return (f"other processes used {share:.0%} of this machine's CPU time while {what}: tokens/s is below what "
            "this machine does idle, a minutes budget buys fewer steps, and MFU (whose matmul peak was measured "
            "on the same busy CPU) does not show it")
