"""`dpo`: preference tuning (DPO, IPO, SimPO; training/dpo.py holds the losses) as a method: the preference pairs
and their batches, the loss against the reference log-probs scored once before the first step (`start`), TRL's
log fields and the held-out pairs' figures."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from archlab.training import dpo
from archlab.training.methods.base import METHODS, Method

__all__ = ["DPORun", "open_dpo"]


class DPORun:
    """DPOBatches as the trainer drives a method."""

    def __init__(self, batches: dpo.DPOBatches, tokenizer_dir: Path | None):
        self.batches = batches
        self.train_data, self.val_data = batches.data, batches.data.without_pairs()
        self.tokenizer_dir = tokenizer_dir

    def loss(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> Any:
        return self.batches.loss(model, inputs, labels)

    def log_fields(self) -> dict[str, float]:
        return self.batches.metrics()             # rewards/..., logps/... (this rank's, since the last line)

    def evaluate(self, model: Any, *, device: torch.device, dtype: str, info: Any) -> dict[str, float]:
        return self.batches.evaluate(model, device=device, dtype=dtype)   # the held-out pairs (train.dpo_val_fraction)

    def start(self, model: torch.nn.Module, run_dir: Path, *, device: torch.device, dtype: str, info: Any,
              resuming: bool, progress: bool) -> None:
        """The reference log-probs: scored now from the starting weights, or read back on a resume."""
        dpo.prepare_reference(self.batches, model, run_dir, device=device, dtype=dtype, info=info, resuming=resuming,
                              progress=progress)


def open_dpo(model_cfg: Any, cfg: Any, data_dir: Path, init_from: Any, info: Any, *, progress: bool = True) -> DPORun:
    batches = dpo.open_preference_data(model_cfg, cfg, data_dir, init_from, info, progress=progress)
    tokenizer = Path(init_from.tokenizer_dir) if init_from is not None and init_from.tokenizer_dir else None
    return DPORun(batches, tokenizer)


METHODS.register("dpo")(Method("dpo", "direct preference optimization (DPO, IPO, SimPO) against the starting model",
                               open_dpo))
