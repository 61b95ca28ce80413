"""The stages every `archlab finetune` method shares, before anything is written: the base (training.init_from: a
run folder, an HF folder or an hf: id), its tokenizer staged with the chat template asked for (the base's own, a
built-in one whose new special tokens grow the embedding and head by as many rows, each the mean embedding row, or
a Jinja file), the model config checked against the base and the LoRA settings against the model; and the check
that a --resume finds the prepared folder made with this command's settings."""
from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from archlab.data.tokenizer_adapter import vocab_size_of
from archlab.data.tokens import META_FILE
from archlab.errors import UserError
from archlab.training import lora as lora_stage
from archlab.training.init_from import InitSource, read_init_source
from archlab.training.methods.base import FinetuneRequest

__all__ = ["TOKENIZER_FILES", "stage_tokenizer", "grow_vocab", "staged_base", "check_same_data", "prepare_line_folder"]

# files of an HF folder that belong to its tokenizer (a run folder's tokenizer/ is copied whole)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "additional_chat_templates")


def stage_tokenizer(source_dir: Path, staged: Path, chat_template: str | None) -> tuple[list[int], int]:
    """Copy the base's tokenizer into `staged` and install the chat template asked for: a built-in name
    (archlab.tokenizer.chat_builtin, its special tokens added) or a Jinja file. Returns (new token ids, the
    tokenizer's vocabulary size before them)."""
    from archlab.tokenizer.chat import TEMPLATE_FILE
    from archlab.tokenizer.chat_builtin import CHAT_FORMATS, install_chat_template
    from archlab.tokenizer.chat_render import ChatTemplateSyntaxError, check_template_syntax
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
    try:
        check_template_syntax(text)
    except ChatTemplateSyntaxError as exc:
        raise UserError(f"--chat-template {chat_template}: {exc}") from None
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


def check_same_data(folder: Path, settings: dict) -> None:
    """--resume: the prepared folder's meta.json must hold the settings this command gives (a UserError naming the
    first that differs)."""
    import json

    meta = json.loads((folder / META_FILE).read_text())
    for key, value in settings.items():
        if key not in ("corpus", "val_corpus") and meta.get(key) != value:
            raise UserError(f"--resume: {folder} was prepared with {key}={meta.get(key)!r}, this command gives "
                            f"{value!r}: resume with the run's data and settings, or fine-tune into a new --out")


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
    template = f" with --chat-template {req.chat_template}" if req.chat_template else ""
    lora_stage.check(model_cfg, req.train_cfg, staged,     # trainable token texts (`template`): in this tokenizer
                     shown_as=f"{source.tokenizer_dir}{template}")          # the user's path, not the staging one
    return source, model_cfg, staged


def prepare_line_folder(req: FinetuneRequest, kind: str, settings: dict, read: Any) -> tuple[Any, Path, InitSource]:
    """Stages 1-4 of a method whose data folder keeps its .jsonl lines as given (data/preference_folder.py: dpo and
    reward's preference pairs, ppo's prompts): the base staged (staged_base), every line checked by `read(staged
    tokenizer)` (-> data with vocab_size and eot_id), then OUT/data written (format `kind`) with `settings` and the
    file's sha256 in its meta.json; on --resume the folder's settings must be this command's. Returns (model config,
    OUT/data, the base reading its tokenizer there)."""
    import os
    import tempfile

    from archlab.data.preference import file_sha256
    from archlab.data.preference_folder import write_line_folder

    cfg, out = req.train_cfg, req.out
    if req.val is not None:
        held = getattr(getattr(cfg, cfg.method), "val_fraction", None)
        raise UserError(f"--val {req.val}: --method {cfg.method} " + (
            "takes no validation file" if held is None else
            f"holds out --val-fraction of --data's lines (train.{cfg.method}.val_fraction) instead"))
    data_dir = out / "data"
    with tempfile.TemporaryDirectory(prefix="archlab-finetune-") as tmp:
        source, model_cfg, staged = staged_base(req, Path(tmp))
        if model_cfg.arch != "decoder":
            raise UserError(f"--method {cfg.method} trains decoder models, not arch={model_cfg.arch}")
        settings = {"corpus": str(req.data), "sha256": file_sha256(req.data), "seq_len": cfg.seq_len, **settings,
                    "chat_template": req.chat_template}
        if req.resume and (data_dir / META_FILE).is_file():
            check_same_data(data_dir, settings)
        else:
            data = read(staged)
            if os.environ.get("RANK", "0") != "0":     # torchrun: rank 0 writes the folder, the others wait for it
                _wait_for(data_dir / META_FILE)
                check_same_data(data_dir, settings)
                return model_cfg, data_dir, dataclasses.replace(source, tokenizer_dir=data_dir / "tokenizer")
            out.mkdir(parents=True, exist_ok=True)
            building = data_dir.with_name(data_dir.name + ".tmp")
            if building.exists():
                shutil.rmtree(building)
            write_line_folder(building, req.data, staged, kind=kind, vocab_size=data.vocab_size, eot_id=data.eot_id,
                              **settings)
            os.replace(building, data_dir)
    return model_cfg, data_dir, dataclasses.replace(source, tokenizer_dir=data_dir / "tokenizer")


def _wait_for(path: Path, timeout_s: float = 1800.0) -> None:
    """Until `path` exists (rank 0 moves the finished folder in at once); a UserError after `timeout_s`."""
    import time

    start = time.monotonic()
    while not path.is_file():
        if time.monotonic() - start > timeout_s:
            raise UserError(f"{path} did not appear within {timeout_s:.0f} s: rank 0 did not prepare the data")
        time.sleep(0.1)
