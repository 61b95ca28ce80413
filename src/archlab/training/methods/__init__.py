"""Ways to train on one loop (base.py): `pretrain` (tokens.py), `sft`, `dpo` (dpo.py). The trainer asks `select`
which method a run uses and drives the MethodRun that method opens; it names none of them.

    from archlab.training.methods import METHODS, select
    select(TrainConfig(objective="dpo"), Path("prefs.jsonl"))      # -> "dpo"
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from archlab.training.methods import dpo as _dpo  # noqa: F401  (registers "dpo")
from archlab.training.methods import tokens as _tokens  # noqa: F401  (registers "pretrain")
from archlab.training.methods.base import METHODS, Batches, Method, MethodRun

__all__ = ["METHODS", "Method", "MethodRun", "Batches", "select", "open_run"]


def select(cfg: Any, data_dir: Path) -> str:
    """The method a run trains with: DPO for train.objective=dpo or a data file (preference .jsonl; it refuses
    other settings with a message saying which), else the prepared folder's own (pretrain)."""
    if cfg.objective == "dpo" or data_dir.is_file():
        return "dpo"
    return "pretrain"


def open_run(model_cfg: Any, cfg: Any, data_dir: Path, init_from: Any, info: Any, *, progress: bool = True
             ) -> MethodRun:
    """The MethodRun of the method `select` picks, checked against the settings before anything is written.
    Example: session = open_run(model_cfg, cfg, Path("data/tiny"), None, info)"""
    return METHODS.get(select(cfg, data_dir)).open(model_cfg, cfg, data_dir, init_from, info, progress=progress)
