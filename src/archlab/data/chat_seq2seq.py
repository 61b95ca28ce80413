"""Chat data for encoder-decoders: each line of a chat .jsonl as one source -> target pair (archlab.data.seq2seq).

    {"prompt": "...", "completion": "..."}      source = the prompt, target = the completion
    {"messages": [...]}  (or prompt/completion as message lists)
                                                target = the last assistant turn's content; source = the
                                                conversation before it, rendered by the chat template with the
                                                generation prompt

Both sides end with the end-of-text id, as archlab.data.seq2seq writes them. A side longer than the limit is
handled by the truncation policy (archlab.data.chat.TRUNCATIONS); any bad line is a UserError naming the file
and line.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from archlab.data.chat import (
    TRUNCATIONS,
    ChatDataError,
    Conversation,
    TooLong,
    check_truncation,
    read_conversations,
    truncation_advice,
)
from archlab.data.prepare import _token_dtype, write_json
from archlab.data.seq2seq import FORMAT_VERSION, SEQ2SEQ_FORMAT, _Seq2SeqWriter
from archlab.data.tokens import META_FILE
from archlab.errors import UserError
from archlab.tokenizer.chat import ChatTemplateError, ChatTokenizer, render_chat

__all__ = ["ChatSeq2Seq", "read_chat_seq2seq", "write_seq2seq_folder"]


@dataclass(frozen=True)
class ChatSeq2Seq:
    """Source and target ids (without the end-of-text id the folder adds) of one line."""
    source: list[int]
    target: list[int]
    line: int


def _texts(chat: ChatTokenizer, conv: Conversation) -> tuple[str, str]:
    if conv.is_plain:
        assert conv.prompt is not None and conv.completion is not None
        return conv.prompt, conv.completion
    last = max((i for i, m in enumerate(conv.messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise UserError("no assistant turn to learn as the target")
    if last == 0:
        raise UserError("nothing before the assistant's turn to read as the source")
    try:
        source = render_chat(chat.template(), list(conv.messages[:last]), add_generation_prompt=True,
                             **chat.special).text
    except ChatTemplateError as exc:
        raise UserError(str(exc)) from None
    return source, conv.messages[last]["content"]


def _cut(ids: list[int], limit: int, policy: str, side: str) -> list[int] | None:
    if len(ids) <= limit:
        return ids
    try:
        cut = TRUNCATIONS[policy](ids, [1] * len(ids), limit)
    except TooLong as exc:
        raise TooLong(f"the {side}: {exc}") from None
    return None if cut is None else cut[0]


def read_chat_seq2seq(path: str | os.PathLike, tokenizer: Any, *, max_len: int, truncation: str = "refuse",
                    setting: str = "truncation") -> Iterator[ChatSeq2Seq]:
    """The pairs of a chat .jsonl, each side at most `max_len` tokens with its end-of-text id (a longer one is
    cut or skipped by `truncation`, or refused naming its line and `setting`, how the user sets the policy)."""
    check_truncation(truncation, setting)
    chat = ChatTokenizer.of(tokenizer)
    for conv in read_conversations(path):
        try:
            source, target = _texts(chat, conv)
            src = _cut(chat.tokenizer.encode(source), max_len - 1, truncation, "source")
            tgt = _cut(chat.tokenizer.encode(target), max_len - 1, truncation, "target")
        except TooLong as exc:
            raise ChatDataError(f"{path}:{conv.line}: {exc}: {truncation_advice(setting)}") from None
        except UserError as exc:
            raise ChatDataError(f"{path}:{conv.line}: {exc}") from None
        if src is not None and tgt is not None:
            yield ChatSeq2Seq(src, tgt, conv.line)


def write_seq2seq_folder(folder: str | os.PathLike, splits: dict[str, list[ChatSeq2Seq]],
                         tokenizer_dir: str | os.PathLike, vocab_size: int, eot_id: int, **described: Any) -> dict:
    """A pairs folder (archlab.data.seq2seq.Seq2SeqDataset reads it) holding `splits` and a copy of the tokenizer."""
    import shutil

    folder = Path(folder)
    folder.mkdir(parents=True)
    dtype = _token_dtype(vocab_size)
    eot = np.array([eot_id], dtype=dtype)
    info = {}
    for split in ("train", "val"):
        writer = _Seq2SeqWriter(folder, split, eot)
        for pair in splits.get(split, []):
            writer.write((np.asarray(pair.source, dtype=dtype), 0), (np.asarray(pair.target, dtype=dtype), 0))
        writer.close()
        info[split] = writer.info()
    shutil.copytree(tokenizer_dir, folder / "tokenizer")
    meta = {"format": SEQ2SEQ_FORMAT, "version": FORMAT_VERSION, **described, "dtype": dtype.name,
            "vocab_size": int(vocab_size), "eot_id": int(eot_id), "splits": info, "tokenizer": "tokenizer"}
    write_json(folder / META_FILE, meta)
    return meta
