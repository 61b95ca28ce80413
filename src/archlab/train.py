"""Training: TrainConfig, AdamW parameter groups, LR schedules, and the training loop `train()`.

    result = train(model_cfg, train_cfg, data_dir, out_dir, resume=False)

- AdamW with decoupled weight decay (Loshchilov & Hutter 2019); norms, biases and embeddings are
  excluded from decay by default (`no_decay`), as are other parameters with fewer than 2 dims.
- Linear warmup, then cosine to min_lr_ratio * lr (Loshchilov & Hutter 2017), warmup-stable-decay
  (WSD: constant, then a linear cooldown over the last `decay_fraction`; Hu et al. 2024, MiniCPM), or
  constant.
- Gradient clipping by global norm, gradient accumulation, bf16 autocast, torch.compile opt-in.
- Loss = LossOutput.total of the model (cross-entropy + z-loss + MoE auxiliary losses).
- Budget in optimizer steps, tokens or minutes of wall time. With a minutes budget the schedule
  follows elapsed time (so LR, and hence losses, are not bit-reproducible across runs).
- `batch_size` is GLOBAL (sequences per micro-step summed over data-parallel ranks): the same config
  trains the same model on 1 or N processes; tokens per optimizer step = batch_size*grad_accum*seq_len.
- Checkpoints (archlab.checkpoint) hold weights, optimizer, counters, RNG states and the sampler
  position: `resume=True` continues step for step as if never interrupted (tested on CPU with kill -9).
- A NaN/Inf loss or gradient norm raises `Diverged` (nan_policy="stop") naming the step and the last
  good checkpoint, or skips that step's update (nan_policy="skip"; 10 in a row still raise).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_type_hints

import numpy as np
import torch
import yaml
from torch import nn

from archlab import checkpoint as ckpt_io
from archlab import distributed as dist_util
from archlab.config import ConfigError, ModelConfig, _check_literals, _parse_value
from archlab.evaluate import autocast, evaluate, sample_ids

__all__ = ["TrainConfig", "TrainResult", "Diverged", "train", "param_groups", "lr_multiplier",
           "matmul_peak_flops", "train_flops_per_token", "plot_loss_curve", "fit_vocab"]

NO_DECAY_CATEGORIES = ("norms", "biases", "embeddings")
MAX_CONSECUTIVE_SKIPS = 10


class Diverged(RuntimeError):
    """The loss (or gradient norm) became NaN/Inf. `.step` and `.checkpoint` (Path or None) say where;
    `.result` holds the TrainResult up to that point (diverged=True)."""

    def __init__(self, message: str, step: int, checkpoint: Path | None, result: "TrainResult | None" = None):
        super().__init__(message)
        self.step, self.checkpoint, self.result = step, checkpoint, result


# --------------------------------------------------------------------------- config
@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Every knob of a training run; dotted overrides and YAML as ModelConfig (no nesting here)."""

    lr: float = 3e-4
    min_lr_ratio: float = 0.1              # final LR = lr * min_lr_ratio (cosine, wsd)
    warmup_steps: int = 100
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_fraction: float = 0.2            # wsd: the cooldown's share of the budget
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float | None = 1.0          # None / 0: no clipping
    batch_size: int = 32                   # global sequences per micro-step (all ranks together)
    seq_len: int = 256
    grad_accum: int = 1
    budget: float = 1000.0
    budget_unit: Literal["steps", "tokens", "minutes"] = "steps"
    eval_every: int = 200                  # optimizer steps; 0: only at the end
    eval_batches: int = 20
    sample_every: int = 0                  # 0: only at the end; -1: never
    sample_tokens: int = 64
    sample_prompt: str = ""                # "" : start from the end-of-text token
    sample_temperature: float = 0.8
    log_every: int = 10
    dtype: Literal["float32", "bfloat16"] = "float32"
    compile: bool = False
    seed: int = 0                          # data order and dropout (init: ModelConfig.seed)
    checkpoint_every: int = 500            # 0: only at the end
    keep_last: int = 3
    nan_policy: Literal["stop", "skip"] = "stop"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    no_decay: str = "norms,biases,embeddings"   # comma list of norms, biases, embeddings; or "none"
    dist_strategy: Literal["ddp", "fsdp"] = "ddp"

    def __post_init__(self):
        if isinstance(self.betas, list):
            object.__setattr__(self, "betas", tuple(self.betas))
        _check_literals(self, "train")
        for name in ("lr", "eps", "batch_size", "seq_len", "grad_accum", "budget", "eval_batches",
                     "log_every"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"train.{name}={getattr(self, name)!r} must be positive")
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "sample_tokens", "weight_decay"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name}={getattr(self, name)!r} must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ConfigError(f"train.decay_fraction={self.decay_fraction} must be in [0, 1]")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"train.betas={self.betas!r} must be two numbers in [0, 1)")
        if self.grad_clip is not None and self.grad_clip < 0:
            raise ConfigError(f"train.grad_clip={self.grad_clip} must be >= 0 (or None)")
        parts = self.no_decay_set  # validates
        del parts

    @property
    def no_decay_set(self) -> frozenset[str]:
        text = self.no_decay.strip().lower()
        if text in ("", "none"):
            return frozenset()
        parts = frozenset(p.strip() for p in text.split(",") if p.strip())
        unknown = parts - set(NO_DECAY_CATEGORIES)
        if unknown:
            raise ConfigError(f"train.no_decay has unknown categories {sorted(unknown)}; "
                              f"use a comma list of {', '.join(NO_DECAY_CATEGORIES)} or 'none'")
        return parts

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.seq_len

    def total_steps(self) -> int | None:
        """Optimizer steps in the budget (None for a minutes budget)."""
        if self.budget_unit == "steps":
            return max(1, int(round(self.budget)))
        if self.budget_unit == "tokens":
            return max(1, math.ceil(self.budget / self.tokens_per_step))
        return None

    # serialization, as ModelConfig
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"train config must be a mapping, got {type(data).__name__}")
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown field(s) in train: {', '.join(sorted(unknown))}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"train: {exc}") from exc

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> "TrainConfig":
        data = yaml.safe_load(text)
        if not isinstance(data, dict):
            raise ConfigError("a train config YAML must be a mapping")
        return cls.from_dict(data.get("train", data))

    def with_overrides(self, overrides: dict[str, Any]) -> "TrainConfig":
        """New config from {"lr": "1e-3", "betas": "0.9,0.99"}; a leading "train." is accepted."""
        data = self.to_dict()
        hints = get_type_hints(TrainConfig)
        for key, value in overrides.items():
            name = key[len("train."):] if key.startswith("train.") else key
            if name not in hints:
                raise ConfigError(f"unknown train config key {key!r}")
            if name == "betas" and isinstance(value, str):
                text = value.strip().strip("[]()")
                try:
                    value = [float(v) for v in text.split(",")]
                except ValueError as exc:
                    raise ConfigError(f"{key}={value!r} must be two comma-separated numbers") from exc
            elif name == "grad_clip" and isinstance(value, str) and value.strip().lower() in ("none", "off", "0"):
                value = None
            else:
                value = _parse_value(hints[name], value, key)
            data[name] = value
        return TrainConfig.from_dict(data)


@dataclass
class TrainResult:
    steps: int
    tokens_seen: int
    final_val_loss: float | None
    best_val_loss: float | None
    final_train_loss: float | None
    tokens_per_s: float
    peak_memory_bytes: int          # CUDA: max allocated; CPU: the process's peak RSS
    diverged: bool
    run_dir: Path
    metrics_path: Path

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["run_dir"], d["metrics_path"] = str(self.run_dir), str(self.metrics_path)
        return d


# --------------------------------------------------------------------------- optimizer + schedule
def _param_category(module: nn.Module, name: str, param: nn.Parameter) -> str:
    if isinstance(module, nn.Embedding):
        return "embeddings"
    if name == "bias" or name.endswith("_bias"):
        return "biases"
    cls = type(module)
    if cls.__module__ == "archlab.nn.norms" or "norm" in cls.__name__.lower():
        return "norms"
    return "weights" if param.ndim >= 2 else "vectors"


def param_groups(model: nn.Module, weight_decay: float, no_decay: frozenset[str] | str
                 = frozenset(NO_DECAY_CATEGORIES)) -> list[dict]:
    """Two AdamW groups: decayed (matrices) and not decayed (the `no_decay` categories and every other
    parameter with fewer than 2 dims). A tied LM head is the embedding: it follows "embeddings"."""
    if isinstance(no_decay, str):
        no_decay = TrainConfig(no_decay=no_decay).no_decay_set
    decay, keep, seen = [], [], set()
    names_decay, names_keep = [], []
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            category = _param_category(module, name, param)
            full = f"{module_name}.{name}" if module_name else name
            if category in no_decay or category == "vectors":
                keep.append(param)
                names_keep.append(full)
            else:
                decay.append(param)
                names_decay.append(full)
    groups = [{"params": decay, "weight_decay": weight_decay, "names": names_decay},
              {"params": keep, "weight_decay": 0.0, "names": names_keep}]
    return [g for g in groups if g["params"]]


def lr_multiplier(cfg: TrainConfig, step: int, progress: float) -> float:
    """LR / cfg.lr for optimizer step `step` (0-based). `progress` in [0, 1] is how far the post-warmup
    phase has come (steps or elapsed time, see `_progress`)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    p = min(max(progress, 0.0), 1.0)
    floor = cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p))
    # wsd: stable at 1, then linear cooldown to `floor` over the last decay_fraction
    start = 1.0 - cfg.decay_fraction
    if p <= start or cfg.decay_fraction == 0:
        return 1.0
    return 1.0 - (1.0 - floor) * (p - start) / cfg.decay_fraction


def _progress(cfg: TrainConfig, step: int, total_steps: int | None, elapsed_s: float) -> float:
    if total_steps is not None:
        span = max(1, total_steps - cfg.warmup_steps)
        return (step - cfg.warmup_steps) / span
    return elapsed_s / (cfg.budget * 60.0)


# --------------------------------------------------------------------------- FLOPs / MFU
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


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)
    except Exception:
        return 0


# --------------------------------------------------------------------------- helpers
def _resolve_device(cfg: TrainConfig, info: dist_util.DistInfo) -> torch.device:
    kind = cfg.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("train.device='cuda' but CUDA is not available")
        return torch.device("cuda", info.local_rank if info.enabled else torch.cuda.current_device())
    return torch.device("cpu")


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def fit_vocab(model_cfg: ModelConfig, data_dir: str | os.PathLike) -> ModelConfig:
    """The model config with vocab_size set to the data folder's (presets carry their own vocab)."""
    from archlab.data import load_meta

    vocab = int(load_meta(data_dir)["vocab_size"])
    return model_cfg if model_cfg.vocab_size == vocab else model_cfg.with_overrides({"vocab_size": vocab})


def _append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep only lines up to `step`: a killed run may have logged past its last checkpoint."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except ValueError:  # a line cut short by the kill
            continue
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out


def plot_loss_curve(run_dir: str | os.PathLike) -> Path | None:
    """loss_curve.png: train loss (and validation loss) against tokens seen (matplotlib, Agg)."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    rows = read_metrics(metrics)
    train_rows = [r for r in rows if "loss" in r]
    val_rows = [r for r in rows if "val_loss" in r]
    if not train_rows and not val_rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train_rows:
        ax.plot([r["tokens"] for r in train_rows], [r["loss"] for r in train_rows], lw=1, label="train")
    if val_rows:
        ax.plot([r["tokens"] for r in val_rows], [r["val_loss"] for r in val_rows], "o-", ms=3, label="val")
    ax.set_xlabel("tokens")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = run_dir / "loss_curve.png"
    fig.savefig(out)
    plt.close(fig)
    return out


class _TensorBoard:
    """Scalars to RUN_DIR/tb when tensorboard is installed; silently nothing otherwise."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.writer = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.writer = SummaryWriter(str(run_dir / "tb"))
            except Exception:
                self.writer = None

    def log(self, record: dict) -> None:
        if self.writer is None:
            return
        for key, value in record.items():
            if key not in ("step", "tokens") and isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# --------------------------------------------------------------------------- the loop
def train(model_cfg: ModelConfig, train_cfg: TrainConfig, data_dir: str | os.PathLike,
          out_dir: str | os.PathLike, *, resume: bool = False, progress: bool = True) -> TrainResult:
    """Train `model_cfg` on the prepared data in `data_dir`; write the run folder `out_dir`.

    resume=True continues from the latest checkpoint in out_dir (a fresh start if there is none).
    Raises Diverged on a NaN/Inf loss with nan_policy="stop"; ConfigError for impossible settings;
    FileExistsError when out_dir already holds a run and resume is False.
    Under torchrun (WORLD_SIZE > 1) it runs data-parallel (train_cfg.dist_strategy); rank 0 writes.
    """
    from archlab.data import BatchSampler, TokenDataset

    cfg = train_cfg
    data_dir, run_dir = Path(data_dir), Path(out_dir)
    info = dist_util.setup("cuda" if (cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()))
                           else "cpu", cfg.dist_strategy)
    try:
        return _train(model_cfg, cfg, data_dir, run_dir, resume, progress, info, BatchSampler, TokenDataset)
    finally:
        dist_util.teardown(info)


def _train(model_cfg, cfg, data_dir, run_dir, resume, progress, info, BatchSampler, TokenDataset):
    from archlab.model import TransformerLM

    device = _resolve_device(cfg, info)
    train_data = TokenDataset(data_dir, "train")
    val_data = TokenDataset(data_dir, "val")
    if model_cfg.vocab_size < train_data.vocab_size:
        raise ConfigError(f"model vocab_size={model_cfg.vocab_size} is smaller than the data's "
                          f"vocab_size={train_data.vocab_size} ({data_dir}); set vocab_size "
                          f"(archlab.train.fit_vocab does it)")
    if model_cfg.position.kind == "learned" and cfg.seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"train.seq_len={cfg.seq_len} exceeds max_seq_len={model_cfg.max_seq_len}")
    if cfg.batch_size % info.world_size:
        raise ConfigError(f"train.batch_size={cfg.batch_size} (global) must be divisible by the "
                          f"world size {info.world_size}")
    local_batch = cfg.batch_size // info.world_size
    can_eval = val_data.n_tokens >= cfg.seq_len + 1
    if not can_eval and info.is_main:
        warnings.warn(f"validation split has {val_data.n_tokens} tokens < seq_len + 1: no evaluation")

    # ---- run folder -------------------------------------------------------------------------
    ckpt_root = run_dir / ckpt_io.CHECKPOINT_DIR
    metrics_path = run_dir / "metrics.jsonl"
    latest = ckpt_io.latest_checkpoint(run_dir) if resume else None
    if info.is_main:
        if not resume and (metrics_path.exists() or ckpt_io.list_checkpoints(run_dir)):
            raise FileExistsError(f"{run_dir} already holds a run; pass resume=True (--resume) to "
                                  "continue it or choose another --out")
        if latest is not None:
            saved = ckpt_io.read_run_config(run_dir)
            if saved["model"] != model_cfg.to_dict():
                raise ConfigError(f"cannot resume {run_dir}: its config.yaml has a different model config")
        run_dir.mkdir(parents=True, exist_ok=True)
        data_info = {"dir": str(data_dir.resolve()), "corpus": train_data.meta.get("corpus"),
                     "vocab_size": train_data.vocab_size, "train_tokens": train_data.n_tokens,
                     "val_tokens": val_data.n_tokens, "bytes_per_token": train_data.bytes_per_token}
        ckpt_io.write_run_config(run_dir, model_cfg.to_dict(), cfg.to_dict(), data_info)
        tok_src = data_dir / train_data.meta.get("tokenizer", "tokenizer")
        if tok_src.is_dir() and not (run_dir / "tokenizer").exists():
            shutil.copytree(tok_src, run_dir / "tokenizer")
        if latest is None and metrics_path.exists():
            metrics_path.unlink()
    if info.enabled:
        torch.distributed.barrier()

    # ---- model, optimizer, data -----------------------------------------------------------------
    _seed_everything(cfg.seed + info.rank)
    model = TransformerLM(model_cfg).to(device)
    raw = model
    n_params = raw.num_params()
    model = dist_util.wrap(model, info, device)           # FSDP shards in place; DDP wraps
    groups = param_groups(raw, cfg.weight_decay, cfg.no_decay_set)  # after FSDP: its DTensor params
    for g in groups:
        g.pop("names")
    # fused AdamW (one kernel over all parameters, CPU and CUDA): ~4x less optimizer time on CPU than
    # the per-parameter loop torch picks by default there; FSDP's DTensor parameters keep the default
    fused = device.type in ("cpu", "cuda") and info.strategy != "fsdp"
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                  **({"fused": True} if fused else {}))
    step_model = torch.compile(model) if cfg.compile else model
    sampler = BatchSampler(train_data, local_batch, cfg.seq_len, seed=cfg.seed, rank=info.rank,
                           world_size=info.world_size)
    total_steps = cfg.total_steps()
    step, tokens, elapsed, best_val, last_val, skipped = 0, 0, 0.0, None, None, 0

    if latest is not None:
        model_state, state = ckpt_io.load_checkpoint(latest)        # on CPU first
        dist_util.load_full_model_state(model, model_state, info)
        dist_util.load_full_optimizer_state(model, optimizer, state["optimizer"], info)
        sampler.load_state_dict(state["sampler"])
        step, tokens, elapsed = state["step"], state["tokens"], state["elapsed_s"]
        best_val, last_val, skipped = state.get("best_val"), state.get("last_val"), state.get("skipped", 0)
        rngs = state["rng"]
        _set_rng_state(rngs[info.rank] if len(rngs) == info.world_size else rngs[0])
        if info.is_main:
            _truncate_metrics(metrics_path, step)
        del model_state, state
    last_good = latest

    tokenizer = None
    if info.is_main or info.strategy == "fsdp":
        tokenizer = ckpt_io.load_run_tokenizer(data_dir) if (data_dir / "tokenizer").is_dir() else None
    flops_token = train_flops_per_token(model_cfg, cfg.seq_len, n_params)
    peak = matmul_peak_flops(device, cfg.dtype) if info.is_main else 0.0
    tb = _TensorBoard(run_dir, info.is_main)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    bar = None
    if progress and info.is_main:
        from tqdm.auto import tqdm
        bar = tqdm(total=total_steps, initial=step, desc="train", unit="step", dynamic_ncols=True,
                   file=sys.stderr)

    def log(record: dict) -> None:
        if info.is_main:
            _append_jsonl(metrics_path, record)
            tb.log(record)

    def run_eval() -> float | None:
        if not can_eval:
            return None
        result = evaluate(model, val_data, batch_size=cfg.batch_size,   # whole batches split over ranks
                          seq_len=cfg.seq_len, max_batches=cfg.eval_batches, device=device,
                          dtype=cfg.dtype, dist_info=info)
        log({"step": step, "tokens": tokens, "val_loss": result.loss, "val_ppl": result.ppl,
             "val_bpb": result.bpb})
        return result.loss

    def run_sample() -> None:
        if cfg.sample_every < 0 or tokenizer is None:
            return
        if info.strategy == "ddp" and not info.is_main:
            return
        prompt = tokenizer.encode(cfg.sample_prompt) if cfg.sample_prompt else [train_data.eot_id]
        module = raw if info.strategy != "fsdp" else model
        ids = sample_ids(module, prompt, cfg.sample_tokens, temperature=cfg.sample_temperature,
                         seed=cfg.seed + step, device=device, use_generate=info.strategy != "fsdp")
        if info.is_main:
            text = tokenizer.decode(ids)
            with open(run_dir / "samples.txt", "a") as f:
                f.write(f"=== step {step} (tokens {tokens}) ===\n{cfg.sample_prompt}{text}\n\n")

    def save() -> Path | None:
        model_state = dist_util.full_model_state(model, info)
        optim_state = dist_util.full_optimizer_state(model, optimizer, info)
        rngs = dist_util.gather_objects(_rng_state(), info)
        path = None
        if info.is_main:
            state = {"step": step, "tokens": tokens, "elapsed_s": elapsed, "best_val": best_val,
                     "last_val": last_val, "skipped": skipped, "optimizer": optim_state,
                     "sampler": sampler.state_dict(), "rng": rngs, "world_size": info.world_size,
                     "train_config": cfg.to_dict()}
            path = ckpt_io.save_checkpoint(ckpt_root, step, model_state, state, keep_last=cfg.keep_last,
                                           extra_meta={"tokens": tokens})
        if info.enabled:
            torch.distributed.barrier()
        return path if info.is_main else ckpt_io.latest_checkpoint(run_dir)

    def budget_spent() -> bool:
        if total_steps is not None:
            return step >= total_steps
        return dist_util.broadcast_flag(elapsed >= cfg.budget * 60.0, info)

    model.train()
    window_tokens, window_s = 0, 0.0      # throughput counts training steps only, not eval/saves
    run_tokens, run_s = 0, 0.0
    last_train_loss = None
    diverged = False
    t_prev = time.perf_counter()
    try:
        while not budget_spent():
            mult = lr_multiplier(cfg, step, _progress(cfg, step, total_steps, elapsed))
            for g in optimizer.param_groups:
                g["lr"] = cfg.lr * mult
            sums = torch.zeros(2, dtype=torch.float64, device=device)  # ce, total: summed on device
            for micro in range(cfg.grad_accum):
                x, y = next(sampler)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with dist_util.no_grad_sync(model, info, sync=micro == cfg.grad_accum - 1):
                    with autocast(device, cfg.dtype):
                        logits = step_model(x)                                   # (b, t, v)
                    out = raw.loss_from_logits(logits, y)
                    (out.total / cfg.grad_accum).backward()
                sums += torch.stack((out.ce.detach(), out.total.detach()))
            ce, total_loss = (sums / cfg.grad_accum).tolist()   # one host sync per optimizer step
            ce, total_loss = dist_util.all_reduce_mean([ce, total_loss], info)
            if cfg.grad_clip:
                grad_norm = torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.grad_clip)
            else:
                grad_norm = torch.nn.utils.get_total_norm([p.grad for p in raw.parameters() if p.grad is not None])
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            grad_norm = float(grad_norm)
            finite = math.isfinite(total_loss) and math.isfinite(grad_norm)
            if finite:
                optimizer.step()
                skipped = 0
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens += cfg.tokens_per_step
            now = time.perf_counter()
            elapsed += now - t_prev
            window_s += now - t_prev
            run_s += now - t_prev
            t_prev = now
            window_tokens += cfg.tokens_per_step
            run_tokens += cfg.tokens_per_step
            if not finite:
                where = f"last good checkpoint: {last_good}" if last_good else "no checkpoint saved yet"
                msg = f"loss {total_loss} / grad norm {grad_norm} at step {step}; {where}"
                log({"step": step, "tokens": tokens, "loss": ce, "nonfinite": True})
                skipped += 1
                if cfg.nan_policy == "stop" or skipped >= MAX_CONSECUTIVE_SKIPS:
                    diverged = True
                    if cfg.nan_policy == "skip":
                        msg += f" ({skipped} non-finite steps in a row)"
                    raise Diverged("training diverged: " + msg, step, last_good)
                warnings.warn("skipping the update: " + msg)
                continue
            last_train_loss = ce
            if step % cfg.log_every == 0 or step == total_steps:
                tps = window_tokens / window_s if window_s > 0 else 0.0
                mfu = flops_token * tps / peak if peak else 0.0
                record = {"step": step, "tokens": tokens, "loss": ce, "lr": cfg.lr * mult,
                          "grad_norm": grad_norm, "tokens_per_s": tps, "mfu": mfu}
                if total_loss != ce:
                    record["loss_total"] = total_loss
                log(record)
                if bar is not None:
                    bar.set_postfix(loss=f"{ce:.3f}", tok_s=f"{tps:,.0f}", mfu=f"{mfu:.1%}", refresh=False)
                window_tokens, window_s = 0, 0.0
            if bar is not None:
                bar.update(1)
            end = budget_spent()
            if (cfg.eval_every and step % cfg.eval_every == 0) or end:
                last_val = run_eval()
                if last_val is not None and (best_val is None or last_val < best_val):
                    best_val = last_val
            if (cfg.sample_every > 0 and step % cfg.sample_every == 0) or (end and cfg.sample_every >= 0):
                run_sample()
            if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or end:
                last_good = save() or last_good
            t_prev = time.perf_counter()   # eval / sample / checkpoint time is not training time...
            if total_steps is None:        # ...except for a minutes budget, which is wall time
                elapsed += t_prev - now
    except Diverged as exc:
        exc.result = _result(step, tokens, last_val, best_val, last_train_loss, run_tokens, run_s,
                             device, True, run_dir, metrics_path)
        raise
    finally:
        if bar is not None:
            bar.close()
        tb.close()
        if info.is_main:
            try:
                plot_loss_curve(run_dir)
            except Exception as exc:  # a plot must never lose a finished run
                warnings.warn(f"could not draw loss_curve.png: {exc}")
    return _result(step, tokens, last_val, best_val, last_train_loss, run_tokens, run_s, device, diverged,
                   run_dir, metrics_path)


def _result(step, tokens, last_val, best_val, last_train, run_tokens, dt, device, diverged, run_dir,
            metrics_path) -> TrainResult:
    return TrainResult(steps=step, tokens_seen=tokens, final_val_loss=last_val, best_val_loss=best_val,
                       final_train_loss=last_train, tokens_per_s=run_tokens / dt if dt > 0 else 0.0,
                       peak_memory_bytes=_peak_memory(device), diverged=diverged, run_dir=run_dir,
                       metrics_path=metrics_path)
