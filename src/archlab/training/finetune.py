"""Fine-tuning a trained model: `archlab finetune BASE --method sft|dpo --data FILE.jsonl --out DIR`. The method
(training/methods) prepares OUT/data and the trainer runs it; for sft (methods/staging.py, methods/sft.py), the
stages in order; every check passes before anything is written:

    1. the base (training.init_from): a run folder, an HF folder or an hf: id; its config, weights, tokenizer
    2. the tokenizer, staged with its chat template: the base's own, or a built-in one / a Jinja file
       (--chat-template); a built-in one's new special tokens grow the embedding and head by as many rows,
       each set to the mean embedding row
    3. the examples: decoders read archlab.data.chat (loss mask train.sft.loss_mask, truncation train.sft.truncation),
       encoder-decoders archlab.data.chat_seq2seq (source -> target); the validation split is a seeded hash of
       each line (train.seed, val_fraction) or a --val file
    4. OUT/data: an SFT folder (archlab.data.sft) or a pairs folder, with the staged tokenizer
    5. the trainer on OUT/data from the base's weights: full fine-tuning, or LoRA with train.lora; exact
       resume as any run. The run folder's tokenizer holds the template, so generate / serve / chat use it.

    result = finetune("runs/base", "sft.jsonl", "runs/sft", train_cfg=TrainConfig(lora=LoRAConfig(r=8), seq_len=256))
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from archlab.config import ConfigError
from archlab.errors import UserError
from archlab.runs.outputs import check_output
from archlab.training.config import TrainConfig
from archlab.training.methods.base import FinetuneRequest
from archlab.training.methods.staging import grow_vocab, stage_tokenizer

__all__ = ["finetune", "stage_tokenizer", "grow_vocab"]


def _checked_file(path: str | os.PathLike, flag: str, what: str, method: Any) -> Path:
    """`path` as a .jsonl file of a format `method` reads (data/formats.py), else a UserError saying what it is."""
    from archlab.data.formats import require

    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder: {what}")
    if not path.is_file():
        raise UserError(f"{flag} {path}: no such file ({what})")
    if path.suffix.lower() != ".jsonl":
        raise UserError(f"{flag} {path}: {what}")
    require(path, method.data_formats, who=f"--method {method.name}", flag=flag)
    return path


def _check_settings(cfg: TrainConfig, val_fraction: float) -> None:
    """The sft section's names (train.sft.loss_mask, truncation) and the held-out share, before anything is read."""
    from archlab.data.chat import LOSS_MASKS, TRUNCATIONS

    if cfg.sft.loss_mask not in LOSS_MASKS:
        raise ConfigError(f"train.sft.loss_mask={cfg.sft.loss_mask!r}: choose one of {', '.join(LOSS_MASKS)}")
    if cfg.sft.truncation not in TRUNCATIONS:
        raise ConfigError(f"train.sft.truncation={cfg.sft.truncation!r}: choose one of {', '.join(TRUNCATIONS)}")
    if not 0.0 <= val_fraction < 1.0 or not math.isfinite(val_fraction):
        raise UserError(f"--val-fraction {val_fraction} must be in [0, 1)")


def finetune(base: str | os.PathLike, data: str | os.PathLike, out: str | os.PathLike, *,
             train_cfg: TrainConfig, method: str = "sft", model_overrides: dict | None = None,
             val: str | os.PathLike | None = None, chat_template: str | None = None, val_fraction: float | None = None,
             resume: bool = False, progress: bool | str = True) -> Any:
    """Fine-tune `base` on the .jsonl `data` with `method` (training/methods: sft on chat lines, dpo on preference
    lines) into the run folder `out` (training.trainer.TrainResult). val_fraction: the share of lines held out
    (None: sft 0.05, dpo train.dpo.val_fraction). Bad input (a line, a setting, a LoRA target) is a UserError /
    ConfigError. The run folder's lock is taken before anything is written in it (a second fine-tune of the same
    --out is refused and touches nothing), and a refusal removes only what this call wrote: the folder if it made
    it, else the data folder it prepared.
    Example: finetune("runs/sft", "prefs.jsonl", "runs/dpo", method="dpo", train_cfg=TrainConfig(lr=5e-6))"""
    from archlab.data.chat import NoTemplateForMessages
    from archlab.runs.lock import LOCK_FILE, RunLock
    from archlab.training.config import refuse_other_methods_settings
    from archlab.training.methods import METHODS, finetune_methods
    from archlab.training.trainer import train

    if method not in finetune_methods():
        raise UserError(f"--method {method}: choose one of {', '.join(finetune_methods())}")
    chosen = METHODS.get(method)
    refuse_other_methods_settings(train_cfg, method)     # a setting no step of this method would read
    out = Path(out)
    main = int(os.environ.get("RANK", "0")) == 0       # torchrun: rank 0 writes and checks --out, as the trainer
    if main:                                           # (the other ranks would see its lock as a live writer's)
        check_output(out, inputs=[None if str(base).startswith("hf:") else base, data, val, chat_template],
                     in_place=True)             # never the base, the data or the template, nor a live writer's
        _refuse_not_empty(out, resume)
    if not str(base).startswith("hf:") and not Path(base).is_dir():    # else named as --init-from further on
        raise UserError(f"BASE {base}: no such folder (a run folder, an HF folder or an hf:ORG/NAME id)")
    if resume:
        _refuse_another_method(out, method)
    from archlab.runs.model_folder import refuse_quantized
    refuse_quantized(base, "finetune")           # int8 weights cannot train: before anything is written
    data_path = _checked_file(data, "--data", chosen.data_help, chosen)
    val_path = _checked_file(val, "--val", chosen.data_help, chosen) if val is not None else None
    if val_path is not None and val_path.resolve() == data_path.resolve():   # the held-out score would be training's
        warnings.warn(f"--val {val} is the same file as --data {data}: val_loss will measure training lines, not "
                      "held-out ones (pass another file, or leave --val out to hold out --val-fraction of --data)",
                      stacklevel=2)
    train_cfg, val_fraction = chosen.fit_settings(dataclasses.replace(train_cfg, method=method), val_path,
                                                  val_fraction)
    _check_settings(train_cfg, val_fraction)
    with RunLock(out) if main else contextlib.nullcontext() as lock:
        if main:
            _refuse_not_empty(out, resume, ignore=LOCK_FILE)    # a writer that finished while this one started
        had_data = (out / "data").exists()
        try:
            request = FinetuneRequest(base, data_path, val_path, out, train_cfg, model_overrides, chat_template,
                                      val_fraction, resume, progress)
            try:
                model_cfg, data_dir, source = chosen.prepare(request)
            except NoTemplateForMessages as exc:      # the data layer's advice names Python; this names the option
                raise UserError(f"{exc.where}: these lines are chat messages and {base} has no chat template to "
                                "render them: pass --chat-template chatml (or llama3, plain, a Jinja file), or "
                                "write them as plain text") from None
            return train(model_cfg, train_cfg, data_dir, out, resume=resume, progress=progress, init_from=source,
                         locked=main)
        except (UserError, ConfigError, FileExistsError):
            if main and not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists():
                if lock.created:                  # refused before training: leave nothing behind
                    shutil.rmtree(out, ignore_errors=True)
                elif not had_data:
                    shutil.rmtree(out / "data", ignore_errors=True)
            raise


def _refuse_another_method(out: Path, method: str) -> None:
    """--resume of a run another method trained: refused before its config.yaml is rewritten (the weights it holds,
    a value head or a score head, would not load into this method's model anyway)."""
    from archlab.runs.model_folder import CONFIG_FILE, read_run_config

    if not (out / CONFIG_FILE).is_file():
        return
    train = read_run_config(out).get("train")
    was = train.get("method") if isinstance(train, dict) else None
    if was is not None and was != method:
        raise UserError(f"--resume: {out} was trained with --method {was}, this command asks for --method {method}: "
                        f"resume with --method {was}, or fine-tune into a new --out")


def _refuse_not_empty(out: Path, resume: bool, ignore: str = "") -> None:
    if not resume and out.is_dir() and any(p.name != ignore for p in out.iterdir()):
        raise UserError(f"--out {out} exists and is not empty: choose a new folder (or --resume a fine-tune there)")
