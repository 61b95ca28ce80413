"""Where a run's model lives, in what precision, and whether it fits: the trainer's placement policy.

    device_kind(cfg.device)                      "cuda" or "cpu" ("auto": CUDA where it is available)
    resolve_device(cfg, info)                    the torch.device of this rank
    resolve_precision(cfg, device, info, ...)    dtype "auto" resolved and recorded in RUN/precision.json
    memory_per_device(model_cfg, cfg, info)      accounting.training_memory for one device's share
    check_memory_fits(model_cfg, cfg, device, info)   refuse a run that cannot fit, before a byte is allocated
    warn_past_context(model_cfg, cfg)            train.seq_len past max_seq_len: said once

Each is settled once, before the model is built, and none needs the loop that trains it (trainer.py): a
separate question from the training step, which the lab's runner and timing ask too (device_kind).
"""
from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import torch

from archlab.config import ConfigError, ModelConfig
from archlab.models.accounting import MemoryCheckError, available_memory
from archlab.training import lora as lora_stage
from archlab.training.config import TrainConfig
from archlab.training.distributed import DistInfo
from archlab.training.precision import auto_dtype, bf16_warning, read_record

__all__ = ["PRECISION_FILE", "device_kind", "resolve_device", "resolve_precision", "memory_per_device",
           "check_memory_fits", "warn_past_context"]

PRECISION_FILE = "precision.json"


def device_kind(device: str) -> str:
    """"cuda" or "cpu" for a TrainConfig.device ("auto": CUDA where it is available)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_device(cfg: TrainConfig, info: DistInfo) -> torch.device:
    kind = device_kind(cfg.device)
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("train.device='cuda' but CUDA is not available")
        return torch.device("cuda", info.local_rank if info.enabled else torch.cuda.current_device())
    return torch.device("cpu")


def resolve_precision(cfg: TrainConfig, device: torch.device, info: DistInfo, run_dir: Path, resuming: bool
                      ) -> TrainConfig:
    """cfg with dtype "auto" resolved: on a resume, to what the run recorded in precision.json (so a resumed
    run or a lab rerun trains as it began); else measured for `device` (precision.auto_dtype). A warning
    for bf16 on hardware that emulates it."""
    recorded = read_record(run_dir / PRECISION_FILE) if resuming else {}
    if cfg.dtype == "auto" and recorded.get("requested") == "auto" and recorded.get("dtype") in ("float32", "bfloat16"):
        dtype, reason = recorded["dtype"], recorded.get("reason", "")
    elif cfg.dtype == "auto":
        dtype, reason = auto_dtype(device)
    else:
        dtype, reason = cfg.dtype, "train.dtype"
    message = bf16_warning(dtype, device)
    if message and info.is_main:
        warnings.warn(message, stacklevel=3)
    if info.is_main:
        (run_dir / PRECISION_FILE).write_text(json.dumps({"requested": cfg.dtype, "dtype": dtype,
                                                          "reason": reason}, indent=2) + "\n")
    return dataclasses.replace(cfg, dtype=dtype)


def memory_per_device(model_cfg: ModelConfig, cfg: TrainConfig, info: DistInfo) -> dict[str, int]:
    """accounting.training_memory for one device's share: its slice of the global batch and, under FSDP,
    1/world of the weights, grads and optimizer state (sharded). dtype "auto" not yet resolved counts
    as float32 (the larger)."""
    from archlab.models.accounting import training_memory

    local_batch = max(1, cfg.batch_size // info.world_size)
    parts = training_memory(model_cfg, local_batch, cfg.seq_len, "bfloat16" if cfg.dtype == "bfloat16" else "float32")
    parts = lora_stage.scale_memory(parts, model_cfg, cfg)          # LoRA: grads and optimizer for adapters only
    if info.strategy == "fsdp":
        parts = {k: v // info.world_size if k in ("weights", "grads", "optimizer") else v for k, v in parts.items()}
    return parts


def check_memory_fits(model_cfg: ModelConfig, cfg: TrainConfig, device: torch.device, info: DistInfo) -> None:
    """Refuse, before a byte is allocated, a run whose estimated memory per device (memory_per_device,
    as `archlab inspect` prints it) exceeds what the device has free. `train.memory_check=false` skips it."""
    from archlab.units import human_bytes

    parts = memory_per_device(model_cfg, cfg, info)
    need, free = sum(parts.values()), available_memory(device)
    if free is not None and need > free:
        raise MemoryCheckError(
            f"this run needs about {human_bytes(need)} per device (weights {human_bytes(parts['weights'])}, "
            f"optimizer {human_bytes(parts['optimizer'])}, activations {human_bytes(parts['activations'])}) and "
            f"{device.type} has {human_bytes(free)} free: use a smaller model, train.batch_size or train.seq_len, "
            "or --set train.memory_check=false to try anyway")


def warn_past_context(model_cfg: ModelConfig, cfg: TrainConfig) -> None:
    """Computed positions (RoPE, ALiBi, T5, ...) train past max_seq_len; the model's context stays there."""
    if cfg.seq_len > model_cfg.max_seq_len:
        warnings.warn(f"train.seq_len={cfg.seq_len} is past max_seq_len={model_cfg.max_seq_len}: position.kind="
                      f"{model_cfg.position.kind} trains on it, but generate, eval and export keep "
                      f"{model_cfg.max_seq_len} as the model's context (set max_seq_len={cfg.seq_len} to match)",
                      stacklevel=4)
