"""The optimizer and the learning-rate schedule.

- AdamW with decoupled weight decay (Loshchilov & Hutter 2019); norms, biases and embeddings are
  excluded from decay by default (`train.optimizer.no_decay`), as are other parameters with fewer than 2 dims.
- Linear warmup, then cosine to min_lr_ratio * lr (Loshchilov & Hutter 2017), warmup-stable-decay
  (WSD: constant, then a linear cooldown over the last `decay_fraction`; Hu et al. 2024, MiniCPM), or
  constant.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from archlab.training.config import NO_DECAY_CATEGORIES, OptimizerConfig, TrainConfig

__all__ = ["param_groups", "build_optimizer", "lr_multiplier", "schedule_progress", "warmup_shortfall"]


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
        no_decay = OptimizerConfig(no_decay=no_decay).no_decay_set
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


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device,
                    strategy: str) -> torch.optim.AdamW:
    """AdamW over `param_groups(model)`; build it after FSDP has sharded `model` (its DTensor params)."""
    groups = param_groups(model, cfg.optimizer.weight_decay, cfg.optimizer.no_decay_set)
    for g in groups:
        g.pop("names")
    # fused AdamW (one kernel over all parameters, CPU and CUDA): ~4x less optimizer time on CPU than
    # the per-parameter loop torch picks by default there; FSDP's DTensor parameters keep the default
    fused = device.type in ("cpu", "cuda") and strategy != "fsdp"
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.optimizer.betas, eps=cfg.optimizer.eps,
                                  **({"fused": True} if fused else {}))
    if fused:   # the fused kernel writes the parameters without bumping their version counters, which caches of
        # weights derived from them (the decode session's packed weights, nn/fused.py) read to see a change: without
        # this, generation in the training process (samples, RL rollouts) ran on the weights of the first generation
        params = [p for g in groups for p in g["params"]]
        optimizer.register_step_post_hook(lambda *_: torch.autograd.graph.increment_version(params))
    return optimizer


def lr_multiplier(cfg: TrainConfig, step: int, progress: float) -> float:
    """LR / cfg.lr for optimizer step `step` (0-based). `progress` in [0, 1] is how far the post-warmup
    phase has come (steps or elapsed time, see `schedule_progress`)."""
    if step < cfg.schedule.warmup_steps:
        return (step + 1) / cfg.schedule.warmup_steps
    p = min(max(progress, 0.0), 1.0)
    floor = cfg.schedule.min_lr_ratio
    if cfg.schedule.kind == "constant":
        return 1.0
    if cfg.schedule.kind == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p))
    # wsd: stable at 1, then linear cooldown to `floor` over the last decay_fraction
    start = 1.0 - cfg.schedule.decay_fraction
    if p <= start or cfg.schedule.decay_fraction == 0:
        return 1.0
    return 1.0 - (1.0 - floor) * (p - start) / cfg.schedule.decay_fraction


def warmup_shortfall(cfg: TrainConfig, steps: int | None) -> str | None:
    """One line naming the budget and the warmup when a run of `steps` optimizer steps ends inside its warmup (the LR
    never reaches train.lr), else None. A warning rather than a warmup scaled to the budget: an explicit
    warmup_steps keeps its meaning, and runs of different budgets (a lab sweep, a resume with a longer budget)
    keep one schedule.
    Example: warmup_shortfall(TrainConfig(budget=30, warmup_steps=100), 30)  # '... the LR peaks at 30% ...'"""
    if steps is None or steps >= cfg.schedule.warmup_steps:
        return None
    peak = lr_multiplier(cfg, max(steps - 1, 0), 0.0)
    if cfg.budget_unit == "minutes":
        budget = f"train.budget={cfg.budget:g} minutes ended at step {steps:,},"
    else:
        budget = f"train.budget={cfg.budget:g} {cfg.budget_unit}" + (
            f" ({steps:,} steps)" if cfg.budget_unit != "steps" else "") + " ends"
    verb = "peaked" if cfg.budget_unit == "minutes" else "peaks"
    return (f"{budget} inside train.schedule.warmup_steps={cfg.schedule.warmup_steps}: the LR {verb} at {peak:.0%} "
            f"of train.lr={cfg.lr:g} ({peak * cfg.lr:.2g}); lower train.schedule.warmup_steps or raise the budget")


def schedule_progress(cfg: TrainConfig, step: int, total_steps: int | None, elapsed_s: float) -> float:
    if total_steps is not None:
        span = max(1, total_steps - cfg.schedule.warmup_steps)
        return (step - cfg.schedule.warmup_steps) / span
    return elapsed_s / (cfg.budget * 60.0)
