"""A prepared preference folder (what `archlab finetune --method dpo|reward` writes to OUT/data): the preference
.jsonl as given (PREFERENCE_FILE), the tokenizer its lines encode with (tokenizer/, the chat template inside), and
meta.json (format "preference", the settings the pairs depend on, written last: its presence marks a complete
folder). The lines are encoded when a run opens the folder (data/preference.load_preference_data), so the folder is
the data and its tokenizer together, as an SFT folder is.

    write_preference_folder(out / "data", "prefs.jsonl", staged_tokenizer, vocab_size=302, eot_id=0, seq_len=256)
    data = open_preference_folder(out / "data", max_tokens=256, truncation="refuse")
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from archlab.data.prepare import write_json
from archlab.data.tokens import META_FILE, load_meta
from archlab.errors import DataError

__all__ = ["PREFERENCE_FORMAT", "PREFERENCE_FILE", "write_preference_folder", "is_preference_folder",
           "open_preference_folder"]

PREFERENCE_FORMAT = "preference"
PREFERENCE_FILE = "preference.jsonl"


def write_preference_folder(folder: str | os.PathLike, data: str | os.PathLike, tokenizer_dir: str | os.PathLike, *,
                            vocab_size: int, eot_id: int | None, **described: Any) -> dict:
    """Copy `data` and the tokenizer folder into `folder` (created) and write meta.json last; `described` (corpus,
    sha256, seq_len, truncation, chat_template ...) goes into meta.json as it is."""
    folder = Path(folder)
    folder.mkdir(parents=True)
    shutil.copy2(data, folder / PREFERENCE_FILE)
    shutil.copytree(tokenizer_dir, folder / "tokenizer")
    meta = {"format": PREFERENCE_FORMAT, "version": 1, **described, "vocab_size": int(vocab_size),
            "eot_id": eot_id, "splits": {"train": {"file": PREFERENCE_FILE}}, "tokenizer": "tokenizer"}
    write_json(folder / META_FILE, meta)
    return meta


def is_preference_folder(data_dir: str | os.PathLike) -> bool:
    """Whether `data_dir` is a prepared preference folder (False for other data folders, files, or nothing)."""
    if not Path(data_dir).is_dir():
        return False
    try:
        return load_meta(data_dir, expect=None).get("format") == PREFERENCE_FORMAT
    except DataError:
        return False


def open_preference_folder(folder: str | os.PathLike, *, max_tokens: int | None, truncation: str,
                           progress: bool = True, setting: str = "truncation") -> Any:
    """The PreferenceData of a prepared folder: its lines encoded with its own tokenizer."""
    from archlab.data.preference import load_preference_data

    folder = Path(folder)
    return load_preference_data(folder / PREFERENCE_FILE, folder / "tokenizer", max_tokens=max_tokens,
                                truncation=truncation, progress=progress, setting=setting)
