"""Ways to train on one loop (base.py): `pretrain` (tokens.py), `sft` (sft.py), `dpo` (dpo.py), `reward`
(reward.py), `grpo` (grpo.py, its rollouts in rollout.py and rewards in rewards.py), `ppo` (ppo.py); the
stages every `archlab finetune` method shares (staging.py). The trainer asks `select` which method a run uses
and drives the MethodRun that method opens; it names none of them.

    from archlab.training.methods import METHODS, select
    select(TrainConfig(method="dpo"), Path("prefs.jsonl"))      # -> "dpo" (a UserError for chat lines)
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from archlab.training.methods import dpo as _dpo  # noqa: F401  (registers "dpo")
from archlab.training.methods import grpo as _grpo  # noqa: F401  (registers "grpo")
from archlab.training.methods import ppo as _ppo  # noqa: F401  (registers "ppo")
from archlab.training.methods import reward as _reward  # noqa: F401  (registers "reward")
from archlab.training.methods import sft as _sft  # noqa: F401  (registers "sft")
from archlab.training.methods import tokens as _tokens  # noqa: F401  (registers "pretrain")
from archlab.training.methods.base import METHODS, Batches, FinetuneRequest, Method, MethodRun

__all__ = ["METHODS", "Method", "MethodRun", "Batches", "FinetuneRequest", "select", "open_run", "finetune_methods"]


def finetune_methods() -> list[str]:
    """The methods `archlab finetune --method` runs (those with a `prepare`), the default (sft) first."""
    return sorted((name for name in METHODS.names() if METHODS.get(name).prepare is not None),
                  key=lambda name: name != "sft")


def select(cfg: Any, data_dir: Path) -> str:
    """The method a run trains with: train.method, once its data is one of the formats it reads (data/formats.py;
    a UserError naming the format found and those the method reads otherwise)."""
    from archlab.data.formats import require

    require(data_dir, METHODS.get(cfg.method).data_formats, who=f"train.method={cfg.method}")
    return cfg.method


def open_run(model_cfg: Any, cfg: Any, data_dir: Path, init_from: Any, info: Any, *, progress: bool = True
             ) -> MethodRun:
    """The MethodRun of the method `select` picks, checked against the settings before anything is written.
    Example: session = open_run(model_cfg, cfg, Path("data/tiny"), None, info)"""
    return METHODS.get(select(cfg, data_dir)).open(model_cfg, cfg, data_dir, init_from, info, progress=progress)
