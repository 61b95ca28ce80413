"""A prepared preference folder (what `archlab finetune --method dpo|reward` writes to OUT/data): the preference
.jsonl as given (PREFERENCE_FILE), the tokenizer its lines encode with (tokenizer/, the chat template inside), and
meta.json (format "preference", the settings the pairs depend on, written last: its presence marks a complete
folder). The lines are encoded when a run opens the folder (data/preference.load_preference_data), so the folder is
the data and its tokenizer together, as an SFT folder is. A prompts folder (--method ppo) is the same shape:
write_line_folder(..., kind="prompts").

    write_preference_folder(out / "data", "prefs.jsonl", staged_tokenizer, vocab_size=302, eot_id=0, seq_len=256)
    data = open_preference_folder(out / "data", max_tokens=256, truncation="refuse")
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from archlab.data.prepare import write_json
from archlab.data.tokens import META_FILE

__all__ = ["PREFERENCE_FORMAT", "PREFERENCE_FILE", "write_line_folder", "write_preference_folder",
           "open_preference_folder"]

PREFERENCE_FORMAT = "preference"
PREFERENCE_FILE = "preference.jsonl"


def write_line_folder(folder: str | os.PathLike, data: str | os.PathLike, tokenizer_dir: str | os.PathLike, *,
                      kind: str, vocab_size: int, eot_id: int | None, **described: Any) -> dict:
    """Copy the .jsonl `data` (as `<kind>.jsonl`) and the tokenizer folder into `folder` (created) and write meta.json
    last, format `kind` ("preference", "prompts"); `described` (corpus, sha256, seq_len, ...) goes into meta.json as it
    is. Example: write_line_folder(out / "data", "prompts.jsonl", staged, kind="prompts", vocab_size=302, eot_id=0)"""
    folder = Path(folder)
    folder.mkdir(parents=True)
    shutil.copy2(data, folder / f"{kind}.jsonl")
    shutil.copytree(tokenizer_dir, folder / "tokenizer")
    meta = {"format": kind, "version": 1, **described, "vocab_size": int(vocab_size),
            "eot_id": eot_id, "splits": {"train": {"file": f"{kind}.jsonl"}}, "tokenizer": "tokenizer"}
    write_json(folder / META_FILE, meta)
    return meta


def write_preference_folder(folder: str | os.PathLike, data: str | os.PathLike, tokenizer_dir: str | os.PathLike, *,
                            vocab_size: int, eot_id: int | None, **described: Any) -> dict:
    """A preference folder (write_line_folder of kind "preference")."""
    return write_line_folder(folder, data, tokenizer_dir, kind=PREFERENCE_FORMAT, vocab_size=vocab_size,
                             eot_id=eot_id, **described)


def open_preference_folder(folder: str | os.PathLike, *, max_tokens: int | None, truncation: str,
                           progress: bool = True, setting: str = "truncation") -> Any:
    """The PreferenceData of a prepared folder: its lines encoded with its own tokenizer."""
    from archlab.data.preference import load_preference_data

    folder = Path(folder)
    return load_preference_data(folder / PREFERENCE_FILE, folder / "tokenizer", max_tokens=max_tokens,
                                truncation=truncation, progress=progress, setting=setting)
