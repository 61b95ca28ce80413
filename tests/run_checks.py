"""Checks that several training tests share."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from archlab.runs.checkpoint import latest_checkpoint, load_checkpoint
from archlab.training.trainer import read_metrics, train


def assert_resume_is_exact(model_cfg, train_cfg, data_dir: Path, root: Path) -> None:
    """Train to the end, then resume a copy from its second-to-last checkpoint (the last one removed): the data
    order, the objective's draws and the weights continue exactly, and the logged losses agree."""
    train(model_cfg, train_cfg, data_dir, root / "full", progress=False)
    shutil.copytree(root / "full", root / "part")
    shutil.rmtree(latest_checkpoint(root / "part"))
    train(model_cfg, train_cfg, data_dir, root / "part", resume=True, progress=False)
    a, _ = load_checkpoint(latest_checkpoint(root / "full"))
    b, _ = load_checkpoint(latest_checkpoint(root / "part"))
    for name in a:
        assert torch.equal(a[name], b[name]), name
    full = [r["loss"] for r in read_metrics(root / "full" / "metrics.jsonl") if "loss" in r]
    part = [r["loss"] for r in read_metrics(root / "part" / "metrics.jsonl") if "loss" in r]
    assert full == part and len(full) == int(train_cfg.budget)
