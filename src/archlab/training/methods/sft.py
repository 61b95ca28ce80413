"""`sft`: supervised fine-tuning on chat examples, the default method of `archlab finetune`. Its `prepare`:

    3. the examples: decoders read archlab.data.chat (loss mask train.sft.loss_mask, truncation train.sft.truncation),
       encoder-decoders archlab.data.chat_seq2seq (source -> target); the validation split is a seeded hash of
       each line (train.seed, --val-fraction) or a --val file
    4. OUT/data: an SFT folder (archlab.data.sft) or a pairs folder, with the staged tokenizer (methods/staging.py)

The run trains on OUT/data with the model's own loss on the scored tokens (methods/tokens.py)."""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from archlab.data.preference import file_sha256
from archlab.data.prepare import split_by_line
from archlab.data.tokenizer_adapter import vocab_size_of
from archlab.data.tokens import META_FILE
from archlab.errors import UserError
from archlab.training.config import TrainConfig
from archlab.training.init_from import InitSource
from archlab.training.methods.base import METHODS, FinetuneRequest, Method
from archlab.training.methods.staging import check_same_data, staged_base
from archlab.training.methods.tokens import open_tokens

__all__ = ["prepare_sft"]

def _read_examples(arch: str, path: Path, tokenizer_dir: Path, cfg: TrainConfig, progress: bool) -> list:
    if arch == "encoder_decoder":
        from archlab.data.chat_seq2seq import read_chat_seq2seq
        return list(read_chat_seq2seq(path, tokenizer_dir, max_len=cfg.seq_len, truncation=cfg.sft.truncation,
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


def _write_data(folder: Path, arch: str, splits: dict, tokenizer_dir: Path, described: dict,
                shown_as: str | os.PathLike) -> None:
    """The data folder, built under a temporary name beside `folder` and renamed into place. `shown_as`: the
    tokenizer as the user named it (the base's), not the staging copy `tokenizer_dir` that errors would show."""
    from archlab.tokenizer.loading import load

    tokenizer = load(tokenizer_dir)
    eot_id = getattr(tokenizer, "eot_id", None)
    if eot_id is None:
        raise UserError(f"the tokenizer of {shown_as} has no end-of-text token to pad and end examples with")
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    if arch == "encoder_decoder":
        from archlab.data.chat_seq2seq import write_seq2seq_folder as write
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
            _write_data(data_dir, model_cfg.arch, splits, staged, settings, shown_as=source.tokenizer_dir)
    return model_cfg, data_dir, dataclasses.replace(source, tokenizer_dir=data_dir / "tokenizer")


METHODS.register("sft")(Method("sft", "supervised fine-tuning on chat examples: the loss on the assistant's tokens",
                               open_tokens, prepare=prepare_sft,
                               data_help="chat data is a .jsonl file of messages or prompt/completion lines",
                               data_formats=("chat_examples", "seq2seq_pairs")))
