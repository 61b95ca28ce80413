"""Fine-tuning a trained model on chat data: `archlab finetune BASE --data FILE.jsonl --out DIR`.

The stages, in order; every check passes before anything is written:

    1. the base (training.init_from): a run folder, an HF folder or an hf: id; its config, weights, tokenizer
    2. the tokenizer, staged with its chat template: the base's own, or a built-in one / a Jinja file
       (--chat-template); a built-in one's new special tokens grow the embedding and head by as many rows,
       each set to the mean embedding row
    3. the examples: decoders read archlab.data.chat (loss mask train.sft.loss_mask, truncation train.sft.truncation),
       encoder-decoders archlab.data.chat_pairs (source -> target); the validation split is a seeded hash of
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
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from archlab.config import ConfigError
from archlab.data.preference import file_sha256
from archlab.data.prepare import split_by_line
from archlab.data.tokenizer_adapter import vocab_size_of
from archlab.data.tokens import META_FILE
from archlab.errors import UserError
from archlab.runs.outputs import check_output
from archlab.training import lora as lora_stage
from archlab.training.config import TrainConfig
from archlab.training.init_from import InitSource, read_init_source
from archlab.training.methods.base import FinetuneRequest

__all__ = ["finetune", "stage_tokenizer", "grow_vocab", "staged_base", "prepare_sft", "check_same_data"]

# files of an HF folder that belong to its tokenizer (a run folder's tokenizer/ is copied whole)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "additional_chat_templates")


def stage_tokenizer(source_dir: Path, staged: Path, chat_template: str | None) -> tuple[list[int], int]:
    """Copy the base's tokenizer into `staged` and install the chat template asked for: a built-in name
    (archlab.tokenizer.chat_builtin, its special tokens added) or a Jinja file. Returns (new token ids, the
    tokenizer's vocabulary size before them)."""
    from archlab.tokenizer.chat import TEMPLATE_FILE
    from archlab.tokenizer.chat_builtin import CHAT_FORMATS, install_chat_template
    from archlab.tokenizer.loading import load

    if source_dir.name == "tokenizer" or not (source_dir / "config.json").is_file():
        shutil.copytree(source_dir, staged)
    else:
        staged.mkdir()
        for name in TOKENIZER_FILES:
            if (source_dir / name).is_dir():
                shutil.copytree(source_dir / name, staged / name)
            elif (source_dir / name).is_file():
                shutil.copy2(source_dir / name, staged / name)
    if not (staged / "tokenizer.json").is_file():
        raise UserError(f"{source_dir} has no tokenizer.json: chat fine-tuning needs a tokenizer with a chat template")
    before = vocab_size_of(load(staged))
    if chat_template is None:
        return [], before
    if chat_template in CHAT_FORMATS:
        return install_chat_template(staged, chat_template, overwrite=True), before
    file = Path(chat_template)
    if not file.is_file():
        raise UserError(f"--chat-template {chat_template}: neither a built-in template "
                        f"({', '.join(CHAT_FORMATS)}) nor a file")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--chat-template {chat_template}: cannot read it as UTF-8 text ({exc})") from None
    (staged / TEMPLATE_FILE).write_text(text, encoding="utf-8")
    return [], before


def grow_vocab(source: InitSource, new_ids: list[int], old_rows: int) -> tuple[InitSource, str]:
    """The base with embedding / head rows for `new_ids` (grown when they lie past its vocabulary), each set to
    the mean of the first `old_rows` rows (the tokens it was trained on); and a line saying so."""
    vocab = source.model_config.vocab_size
    size = max(vocab, max(new_ids) + 1)
    state = dict(source.state)
    for name, weight in source.state.items():
        if name.split(".")[0] in ("embed", "lm_head") and weight.shape[0] == vocab:
            grown = torch.cat([weight, weight.new_zeros((size - vocab, *weight.shape[1:]))])   # (size, ...)
            grown[new_ids] = weight[:old_rows].mean(dim=0)
            state[name] = grown
    cfg = source.model_config.with_overrides({"vocab_size": size}) if size != vocab else source.model_config
    line = (f"added {len(new_ids)} special tokens to the tokenizer: embedding and head rows {vocab} -> {size}, "
            f"the new rows {new_ids[0]}..{new_ids[-1]} set to the mean embedding")
    return dataclasses.replace(source, model_config=cfg, state=state), line


def _checked_file(path: str | os.PathLike, flag: str, what: str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{flag} {path}: no such file")
    if path.suffix.lower() != ".jsonl":
        raise UserError(f"{flag} {path}: {what}")
    return path


def _read_examples(arch: str, path: Path, tokenizer_dir: Path, cfg: TrainConfig, progress: bool) -> list:
    if arch == "encoder_decoder":
        from archlab.data.chat_pairs import read_chat_pairs
        return list(read_chat_pairs(path, tokenizer_dir, max_len=cfg.seq_len, truncation=cfg.sft.truncation,
                                    setting="train.sft.truncation"))
    if arch != "decoder":
        raise UserError(f"archlab finetune trains decoders and encoder-decoders, not arch={arch}")
    from archlab.data.chat import load_chat_data
    data = load_chat_data(path, tokenizer_dir, mask=cfg.sft.loss_mask, max_tokens=cfg.seq_len,
                          truncation=cfg.sft.truncation, progress=progress, setting="train.sft.truncation")
    if data.truncated or data.skipped:
        print(f"{path}: {data.truncated} examples truncated, {data.skipped} skipped (train.sft.truncation="
              f"{cfg.sft.truncation})", file=sys.stderr)
    return data.examples


def _write_data(folder: Path, arch: str, splits: dict, tokenizer_dir: Path, described: dict) -> None:
    """The data folder, built under a temporary name beside `folder` and renamed into place."""
    from archlab.tokenizer.loading import load

    tokenizer = load(tokenizer_dir)
    eot_id = getattr(tokenizer, "eot_id", None)
    if eot_id is None:
        raise UserError(f"the tokenizer of {tokenizer_dir} has no end-of-text token to pad and end examples with")
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    if arch == "encoder_decoder":
        from archlab.data.chat_pairs import write_pairs_folder as write
    else:
        from archlab.data.sft import write_sft_folder as write
    write(tmp, splits, tokenizer_dir, vocab_size_of(tokenizer), eot_id, **described)
    os.replace(tmp, folder)


def _data_settings(data: Path, val: Path | None, cfg: TrainConfig, chat_template: str | None,
                   val_fraction: float) -> dict:
    """What the examples depend on, kept in the data folder's meta.json (a resume must find the same)."""
    return {"corpus": str(data), "sha256": file_sha256(data), "val_corpus": str(val) if val else None,
            "val_sha256": file_sha256(val) if val else None, "loss_mask": cfg.sft.loss_mask,
            "truncation": cfg.sft.truncation,
            "seq_len": cfg.seq_len, "seed": cfg.seed, "val_fraction": None if val else val_fraction,
            "chat_template": chat_template}


def check_same_data(folder: Path, settings: dict) -> None:
    """--resume: the prepared folder's meta.json must hold the settings this command gives (a UserError naming the
    first that differs)."""
    import json

    meta = json.loads((folder / META_FILE).read_text())
    for key, value in settings.items():
        if key not in ("corpus", "val_corpus") and meta.get(key) != value:
            raise UserError(f"--resume: {folder} was prepared with {key}={meta.get(key)!r}, this command gives "
                            f"{value!r}: resume with the run's data and settings, or fine-tune into a new --out")


def _check_settings(cfg: TrainConfig, val_fraction: float) -> None:
    """The sft section's names (train.sft.loss_mask, truncation) and the held-out share, before anything is read."""
    from archlab.data.chat import LOSS_MASKS, TRUNCATIONS

    if cfg.sft.loss_mask not in LOSS_MASKS:
        raise ConfigError(f"train.sft.loss_mask={cfg.sft.loss_mask!r}: choose one of {', '.join(LOSS_MASKS)}")
    if cfg.sft.truncation not in TRUNCATIONS:
        raise ConfigError(f"train.sft.truncation={cfg.sft.truncation!r}: choose one of {', '.join(TRUNCATIONS)}")
    if not 0.0 <= val_fraction < 1.0 or not math.isfinite(val_fraction):
        raise UserError(f"--val-fraction {val_fraction} must be in [0, 1)")


def staged_base(req: FinetuneRequest, tmp: Path) -> tuple[InitSource, Any, Path]:
    """Stages 1-2, shared by every method: (the base, grown where a built-in template adds tokens; the model config
    with the overrides, checked against the base; the staged tokenizer folder under `tmp`). LoRA settings are
    checked here too, before anything is written."""
    source = read_init_source(req.base)
    if source.tokenizer_dir is None:
        raise UserError(f"{req.base} holds no tokenizer: fine-tuning needs one")
    staged = tmp / "tokenizer"
    new_ids, old_rows = stage_tokenizer(Path(source.tokenizer_dir), staged, req.chat_template)
    if new_ids:
        source, line = grow_vocab(source, new_ids, old_rows)
        if req.progress:
            print(line, file=sys.stderr)
    overrides = req.model_overrides
    model_cfg = source.model_config.with_overrides(overrides) if overrides else source.model_config
    source.check_model(model_cfg)
    lora_stage.check(model_cfg, req.train_cfg, staged)     # trainable token texts (`template`): in this tokenizer
    return source, model_cfg, staged


def prepare_sft(req: FinetuneRequest) -> tuple[Any, Path, InitSource]:
    """`--method sft`, stages 1-4: (model config, the data folder OUT/data, the base to start from)."""
    train_cfg, data_path, val_path, out = req.train_cfg, req.data, req.val, req.out
    data_dir = out / "data"
    with tempfile.TemporaryDirectory(prefix="archlab-finetune-") as tmp:
        source, model_cfg, staged = staged_base(req, Path(tmp))
        settings = _data_settings(data_path, val_path, train_cfg, req.chat_template, req.val_fraction)
        if req.resume and (data_dir / META_FILE).is_file():
            check_same_data(data_dir, settings)
        else:
            examples = _read_examples(model_cfg.arch, data_path, staged, train_cfg, req.progress is True)
            if val_path is not None:
                splits = {"train": examples,
                          "val": _read_examples(model_cfg.arch, val_path, staged, train_cfg, req.progress is True)}
            else:
                train_part, val_part = split_by_line(data_path, examples, train_cfg.seed, req.val_fraction)
                splits = {"train": train_part, "val": val_part}
            if not splits["train"]:
                raise UserError(f"--data {data_path}: no examples to train on")
            out.mkdir(parents=True, exist_ok=True)
            _write_data(data_dir, model_cfg.arch, splits, staged, settings)
    return model_cfg, data_dir, dataclasses.replace(source, tokenizer_dir=data_dir / "tokenizer")


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
    from archlab.runs.lock import LOCK_FILE, RunLock
    from archlab.training.methods import METHODS, finetune_methods
    from archlab.training.trainer import train

    if method not in finetune_methods():
        raise UserError(f"--method {method}: choose one of {', '.join(finetune_methods())}")
    chosen = METHODS.get(method)
    out = Path(out)
    check_output(out, inputs=[None if str(base).startswith("hf:") else base, data, val, chat_template],
                 in_place=True)                 # never the base, the data or the template, nor a live writer's
    _refuse_not_empty(out, resume)
    data_path = _checked_file(data, "--data", chosen.data_help)
    val_path = _checked_file(val, "--val", chosen.data_help) if val is not None else None
    train_cfg, val_fraction = chosen.fit_settings(dataclasses.replace(train_cfg, method=method), val_path,
                                                  val_fraction)
    _check_settings(train_cfg, val_fraction)
    main = int(os.environ.get("RANK", "0")) == 0       # torchrun: rank 0 writes, as in the trainer
    with RunLock(out) if main else contextlib.nullcontext() as lock:
        _refuse_not_empty(out, resume, ignore=LOCK_FILE)    # a writer that finished while this one started
        had_data = (out / "data").exists()
        try:
            request = FinetuneRequest(base, data_path, val_path, out, train_cfg, model_overrides, chat_template,
                                      val_fraction, resume, progress)
            model_cfg, data_dir, source = chosen.prepare(request)
            return train(model_cfg, train_cfg, data_dir, out, resume=resume, progress=progress, init_from=source,
                         locked=main)
        except (UserError, ConfigError, FileExistsError):
            if main and not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists():
                if lock.created:                  # refused before training: leave nothing behind
                    shutil.rmtree(out, ignore_errors=True)
                elif not had_data:
                    shutil.rmtree(out / "data", ignore_errors=True)
            raise


def _refuse_not_empty(out: Path, resume: bool, ignore: str = "") -> None:
    if not resume and out.is_dir() and any(p.name != ignore for p in out.iterdir()):
        raise UserError(f"--out {out} exists and is not empty: choose a new folder (or --resume a fine-tune there)")
