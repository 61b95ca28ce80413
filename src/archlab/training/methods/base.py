"""The seam between the training loop and the ways to train: a Method (registered by name) opens a MethodRun for
one run, and the trainer drives that and names no method.

    method = METHODS.get("dpo")
    session = method.open(model_cfg, train_cfg, data_dir, init_from, info, progress=True)
    inputs, labels = session.batches.next(step, micro)        # a pure function of (seed, step, micro, rank)
    out = session.loss(model, inputs, labels)                 # LossOutput: what backward() takes
    record.update(session.log_fields())                       # logged under TRL's names
    scores = session.evaluate(model, device=..., dtype=..., info=...)   # {"val_loss": ..., ...} or {}

Anchors: TRL (one trainer and config per method over one loop), torchtune (a recipe from loss modules),
OLMo-core (a TrainModule the Trainer drives).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from archlab.nn.registry import Registry

__all__ = ["Batches", "MethodRun", "Method", "METHODS", "FinetuneRequest"]


class Batches(Protocol):
    """What one step consumes: `next(step, micro)` -> (inputs, labels); the state a checkpoint keeps of it."""

    def next(self, step: int, micro: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class MethodRun(Protocol):
    """One run of a method on its data, opened (and checked) before the run folder is written.

    train_data / val_data: what the run folder records of the data (meta, vocab_size, n_tokens, bytes_per_token,
    eot_id); tokenizer_dir: the folder the token ids come from (None: none)."""

    train_data: Any
    val_data: Any
    batches: Batches
    tokenizer_dir: Path | None

    def loss(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> Any:
        """The LossOutput of one micro-batch under `model` (the step's, possibly wrapped, module)."""
        ...

    def log_fields(self) -> dict[str, float]:
        """The method's own figures since the last call, added to the training log line."""
        ...

    def evaluate(self, model: Any, *, device: torch.device, dtype: str, info: Any) -> dict[str, float]:
        """Held-out figures, `val_loss` first; {} when there is nothing to evaluate. Collective under DDP/FSDP."""
        ...

    def extend(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Modules the method adds to the built model before the optimizer is made (a reward model's score head),
        after LoRA's adapters (so they train); returns their fresh state, which starting weights do not hold."""
        ...

    def start(self, model: torch.nn.Module, run_dir: Path, *, device: torch.device, dtype: str, info: Any,
              resuming: bool, progress: bool) -> None:
        """Once, after the weights are in place and before the first step (DPO scores its reference here)."""
        ...

    def check_resume(self, run_dir: Path) -> None:
        """On a resume, before anything in the run folder is written: a UserError unless the method's own files
        there are this run's (DPO: the reference log-probs scored by --init-from's weights on this data)."""
        ...


@dataclass(frozen=True)
class FinetuneRequest:
    """What `archlab finetune` asks of a method's `prepare`: the base (run folder, HF folder or hf: id), the data
    and validation files (checked to exist), the run folder, the settings."""

    base: Any
    data: Path
    val: Path | None
    out: Path
    train_cfg: Any
    model_overrides: dict | None
    chat_template: str | None
    val_fraction: float
    resume: bool
    progress: bool | str


def _sft_settings(train_cfg: Any, val: Path | None, val_fraction: float | None) -> tuple[Any, float]:
    return train_cfg, 0.05 if val_fraction is None else val_fraction


@dataclass(frozen=True)
class Method:
    """A way to train: its name, a one-line summary (`archlab finetune --help`), and `open`, which builds the run's
    MethodRun from (model_cfg, train_cfg, data_dir, init_from, info, progress=...) or raises UserError /
    ConfigError before anything is written. Methods `archlab finetune` runs have `prepare` (FinetuneRequest ->
    (model config, the prepared data folder OUT/data, the base as an InitSource), every check before a write),
    `data_help` (what their --data lines hold), `data_formats` (the data/formats.py formats the method reads, a
    .jsonl file or a prepared folder; every other is refused naming both) and `fit_settings` ((train_cfg, --val,
    --val-fraction) -> (train_cfg, the held-out share): where the method keeps its held-out share)."""

    name: str
    summary: str
    open: Any
    prepare: Any = None
    data_help: str = ""
    data_formats: tuple[str, ...] = ("token_stream",)
    fit_settings: Any = _sft_settings


METHODS: Registry[Method] = Registry("method")
