"""Ways to train on one loop (base.py): `pretrain` and `sft` (tokens.py), `dpo` (dpo.py). The trainer asks `select`
which method a run uses and drives the MethodRun that method opens; it names none of them.

    from archlab.training.methods import METHODS, select
    select(TrainConfig(method="dpo"), Path("prefs.jsonl"))      # -> "dpo"
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from archlab.training.methods import dpo as _dpo  # noqa: F401  (registers "dpo")
from archlab.training.methods import tokens as _tokens  # noqa: F401  (registers "pretrain")
from archlab.training.methods.base import METHODS, Batches, FinetuneRequest, Method, MethodRun

__all__ = ["METHODS", "Method", "MethodRun", "Batches", "FinetuneRequest", "select", "open_run", "finetune_methods"]


def finetune_methods() -> list[str]:
    """The methods `archlab finetune --method` runs (those with a `prepare`), the default (sft) first."""
    return sorted((name for name in METHODS.names() if METHODS.get(name).prepare is not None),
                  key=lambda name: name != "sft")


def select(cfg: Any, data_dir: Path) -> str:
    """The method a run trains with: train.method, or DPO for a data file (a preference .jsonl: DPO refuses it
    unless train.method=dpo, saying so)."""
    return "dpo" if data_dir.is_file() else cfg.method


def open_run(model_cfg: Any, cfg: Any, data_dir: Path, init_from: Any, info: Any, *, progress: bool = True
             ) -> MethodRun:
    """The MethodRun of the method `select` picks, checked against the settings before anything is written.
    Example: session = open_run(model_cfg, cfg, Path("data/tiny"), None, info)"""
    return METHODS.get(select(cfg, data_dir)).open(model_cfg, cfg, data_dir, init_from, info, progress=progress)
