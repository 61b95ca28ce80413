"""`dpo`: preference tuning (DPO, IPO, SimPO, ORPO: training/dpo.py holds the losses; KTO: training/kto.py) as a
method: the preference pairs (or KTO's labelled completions) and their batches, the loss against the reference
log-probs scored once before the first step (`start`), TRL's log fields and the held-out lines' figures."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from archlab.training import dpo, kto
from archlab.training.methods.base import METHODS, FinetuneRequest, Method
from archlab.training.methods.staging import prepare_line_folder

__all__ = ["DPORun", "open_dpo"]


class DPORun:
    """DPOBatches (or KTOBatches) as the trainer drives a method; `family`: the module holding the batches' reference
    log-probs (dpo or kto: prepare_reference, read_reference)."""

    def __init__(self, batches: Any, tokenizer_dir: Path | None, family: Any = dpo):
        self.batches, self.family = batches, family
        self.train_data, self.val_data = batches.data, batches.data.without_pairs()
        self.tokenizer_dir = tokenizer_dir

    def loss(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> Any:
        return self.batches.loss(model, inputs, labels)

    def log_fields(self) -> dict[str, float]:
        return self.batches.metrics()             # rewards/..., logps/... (this rank's, since the last line)

    def evaluate(self, model: Any, *, device: torch.device, dtype: str, info: Any) -> dict[str, float]:
        return self.batches.evaluate(model, device=device, dtype=dtype)   # the held-out pairs (train.dpo.val_fraction)

    def extend(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {}

    def start(self, model: torch.nn.Module, run_dir: Path, *, device: torch.device, dtype: str, info: Any,
              resuming: bool, progress: bool) -> None:
        """The reference log-probs: scored now from the starting weights, or read back on a resume."""
        self.family.prepare_reference(self.batches, model, run_dir, device=device, dtype=dtype, info=info,
                                      resuming=resuming, progress=progress)

    def check_resume(self, run_dir: Path) -> None:
        """The stored reference log-probs are this run's (dpo.read_reference refuses them otherwise)."""
        self.family.read_reference(run_dir, self.batches)


def open_dpo(model_cfg: Any, cfg: Any, data_dir: Path, init_from: Any, info: Any, *, progress: bool = True) -> DPORun:
    if cfg.dpo.loss == "kto":
        batches: Any = kto.open_kto_data(model_cfg, cfg, data_dir, init_from, info, progress=progress)
        return DPORun(batches, Path(batches.data.tokenizer_dir), kto)
    batches = dpo.open_preference_data(model_cfg, cfg, data_dir, init_from, info, progress=progress)
    return DPORun(batches, Path(batches.data.tokenizer_dir))      # the tokenizer the pairs were encoded with


def prepare_preferences(req: FinetuneRequest) -> tuple[Any, Path, Any]:
    """archlab finetune --method dpo|reward: every line of the preference .jsonl checked with the staged tokenizer (its
    chat template), then OUT/data written as a preference folder (data/preference_folder.py) holding the lines and
    that tokenizer; (model config, OUT/data, the base). On --resume the folder's settings must be this command's.
    The method's config section (train.dpo, train.reward) gives the truncation policy."""
    from archlab.data.preference import load_preference_data
    from archlab.data.preference_folder import PREFERENCE_FORMAT

    cfg = req.train_cfg
    truncation, setting = getattr(cfg, cfg.method).truncation, f"train.{cfg.method}.truncation"
    def read(staged: Path) -> Any:
        data = load_preference_data(req.data, staged, max_tokens=cfg.seq_len, truncation=truncation,
                                    progress=req.progress is True, setting=setting)
        dpo.check_form(data, cfg)       # unpaired lines only for KTO, and KTO with both kinds of completion
        return data

    return prepare_line_folder(req, PREFERENCE_FORMAT, {"truncation": truncation}, read)


def preference_settings(train_cfg: Any, val: Path | None, val_fraction: float | None) -> tuple[Any, float]:
    """--val-fraction is the method's section's val_fraction (train.dpo.val_fraction: the held-out pairs), when
    given."""
    section = getattr(train_cfg, train_cfg.method)
    if val_fraction is None:
        return train_cfg, section.val_fraction
    changed = dataclasses.replace(section, val_fraction=val_fraction)
    return dataclasses.replace(train_cfg, **{train_cfg.method: changed}), val_fraction


METHODS.register("dpo")(Method("dpo", "direct preference optimization (DPO, IPO, SimPO, ORPO, KTO: train.dpo.loss) "
                               "against the starting model", open_dpo, prepare=prepare_preferences,
                               fit_settings=preference_settings,
                               data_help="preference data is a .jsonl file of prompt / chosen / rejected lines (KTO: "
                                         "also prompt / completion / label lines)",
                               data_formats=("preference_pairs", "unpaired_preferences")))
