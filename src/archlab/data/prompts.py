"""Prompt data for the RL methods: `.jsonl` lines with a `prompt` and any other columns (a reward function receives
them, as TRL passes a dataset's columns):

    {"prompt": "Reverse: cat =", "answer": "tac"}                               plain text, no template
    {"prompt": [{"role": "user", "content": "Reverse cat"}], "answer": "tac"}    chat messages: the tokenizer's chat
                                                                                  template with the generation prompt

Plain text is encoded as the chat data's plain prompts are (data/chat.py: no template, no end-of-text); messages
render through the chat template with add_generation_prompt, as `archlab chat` prompts the model. Every
bad line is a UserError naming the file and line: not JSON, no `prompt`, a prompt neither text nor messages, a bad
message, a prompt longer than the limit.

    data = load_prompts("prompts.jsonl", "runs/sft/tokenizer", max_tokens=96)
    data.prompts[0].ids, data.prompts[0].columns          # [..], {"answer": "tac"}
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from archlab.data.chat import ChatDataError, NoTemplateForMessages, _messages
from archlab.data.corpora import CorpusError, jsonl_records
from archlab.data.preference import file_sha256
from archlab.errors import UserError
from archlab.tokenizer.chat import ChatTokenizer, NoChatTemplate, apply_chat_template, token_mask

__all__ = ["Prompt", "PromptData", "load_prompts"]


@dataclass(frozen=True)
class Prompt:
    """One line: its encoded prompt `ids`, the prompt as the line gives it (text or messages: what a reward function
    receives) and the line's other fields."""
    line: int
    ids: list[int]
    prompt: str | list[dict]
    columns: dict[str, Any] = field(default_factory=dict)


@dataclass
class PromptData:
    """The prompts of one file, their tokenizer, and what the trainer records of a data source (the file's sha256 as
    fingerprint); is_chat: some prompt is chat messages (its completions end at the template's end of turn too)."""
    path: Path
    prompts: list[Prompt]
    tokenizer_dir: Path
    vocab_size: int
    eot_id: int | None
    fingerprint: str
    is_chat: bool = False
    bytes_per_token: float | None = None

    @property
    def n_tokens(self) -> int:
        return sum(len(p.ids) for p in self.prompts)

    @property
    def meta(self) -> dict:
        return {"corpus": str(self.path), "tokenizer": str(self.tokenizer_dir.resolve())}

    def without_prompts(self) -> PromptData:
        """The same source with no prompts: what stands for a validation split, which a PPO run has none of."""
        return dataclasses.replace(self, prompts=[])


def _encode(chat: ChatTokenizer, template: str | None, prompt: Any, where: str) -> tuple[list[int], Any]:
    """(ids, the prompt as checked) of one line's prompt."""
    if isinstance(prompt, str):
        if not prompt:
            raise ChatDataError(f"{where}: the prompt is empty")
        return token_mask(chat.tokenizer, prompt, [])[0], prompt
    if isinstance(prompt, list):
        messages = _messages(prompt, where, "prompt")
        if template is None:
            raise NoTemplateForMessages(where, "the prompt is chat messages and the tokenizer has no chat template to "
                                        "render them (write the prompt as plain text, or fine-tune with "
                                        "--chat-template)")
        try:
            ids = apply_chat_template(chat, messages, chat_template=template, add_generation_prompt=True)
        except UserError as exc:
            raise ChatDataError(f"{where}: {exc}") from None
        return list(ids), messages
    raise ChatDataError(f"{where}: prompt must be text or a list of messages, not a JSON {type(prompt).__name__}")


def load_prompts(path: str | os.PathLike, tokenizer: str | os.PathLike, *, max_tokens: int | None = None,
                 setting: str = "the prompt limit") -> PromptData:
    """Every line of `path` as a Prompt, encoded with the tokenizer folder `tokenizer` (its chat template for message
    prompts); a prompt past `max_tokens` is refused, naming `setting`.
    Example: data = load_prompts("prompts.jsonl", "runs/sft/tokenizer", max_tokens=96)"""
    path, tokenizer = Path(path), Path(tokenizer)
    if not path.is_file():
        raise UserError(f"{path}: no such file (prompt data is a .jsonl file of {{\"prompt\": ...}} lines)")
    chat = ChatTokenizer.of(tokenizer)
    try:
        template: str | None = chat.template()
    except (NoChatTemplate, UserError):
        template = None
    eot_id = getattr(chat.tokenizer, "eot_id", None)
    prompts: list[Prompt] = []
    try:
        for line, value in jsonl_records(path):
            where = f"{path}:{line}"
            if not isinstance(value, dict):
                raise ChatDataError(f"{where} is a JSON {type(value).__name__}, not an object with a 'prompt'")
            if "prompt" not in value:
                raise ChatDataError(f"{where} has no 'prompt' (prompt lines are {{\"prompt\": text or messages, ...}}"
                                    f"; it has {', '.join(map(repr, value)) or 'no fields'})")
            ids, prompt = _encode(chat, template, value["prompt"], where)
            if max_tokens is not None and len(ids) > max_tokens:
                raise ChatDataError(f"{where}: the prompt has {len(ids)} tokens, more than the {max_tokens} {setting} "
                                    "leaves")
            prompts.append(Prompt(line, ids, prompt, {k: v for k, v in value.items() if k != "prompt"}))
    except CorpusError as exc:
        raise ChatDataError(str(exc)) from None
    if not prompts:
        raise ChatDataError(f"{path}: no prompts (an empty file)")
    return PromptData(path, prompts, tokenizer, int(chat.tokenizer.vocab_size), eot_id, file_sha256(path),
                      is_chat=any(not isinstance(p.prompt, str) for p in prompts))
