"""Chat and instruction data: `.jsonl` conversations -> (input_ids, labels) with the loss on the chosen tokens.

Two shapes of line, as users have them (TRL's "conversational" and "prompt-completion" datasets):

    {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...]}
    {"prompt": "...", "completion": "..."}            (or both as lists of messages)

A message's content may be a list of text parts (`[{"type": "text", "text": "..."}]`, OpenAI's and TRL's form):
it reads as their text joined; messages are checked by archlab.tokenizer.messages, as the server checks them.

A conversation renders through the tokenizer's chat template (archlab.tokenizer.chat, the one renderer; CHUNK
conversations per round trip to its worker) and is tokenized once; plain prompt/completion text is prompt +
completion + the end-of-text token, no template. Text in the data that spells a special token (say
"<|im_end|>") encodes as that token, as in transformers' apply_chat_template by default.
Which tokens the loss scores is named by `mask` (LOSS_MASKS):

    assistant    the assistant's turns (default): the template's {% generation %} spans, or, for a template
                 without them, the rendered-prefix difference: turn i is render(messages[:i+1]) minus
                 render(messages[:i], add_generation_prompt=True); for prompt/completion data, the completion
    all          every token
    last         the last assistant turn only
    completion   the completion of prompt/completion data (refused for "messages" lines)

A token is scored when it overlaps a scored character span (as transformers' assistant mask). labels follow
archlab's convention (archlab.data.batches): slot j holds the target of position j, token j + 1, or IGNORE.
An example longer than `max_tokens` is handled by the policy `truncation` names (TRUNCATIONS): refuse it
naming its line (default), keep its start, keep its end, or skip it. Any bad line is a UserError naming the
file and line: not JSON, neither shape, a message without role or content, an unknown role, nothing to
score, a template that raises, loops or floods its output.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from archlab.data.corpora import CorpusError, jsonl_records
from archlab.data.objectives import IGNORE
from archlab.errors import UserError
from archlab.progress import progress_bar
from archlab.tokenizer.chat import (
    ChatTemplateError,
    ChatTokenizer,
    NoChatTemplate,
    Rendered,
    RenderJob,
    RenderLimits,
    has_generation_blocks,
    render_many,
    token_mask,
)
from archlab.tokenizer.messages import ROLES, MessageError, check_message

__all__ = ["ROLES", "LOSS_MASKS", "TRUNCATIONS", "ChatExample", "ChatData", "ChatDataError", "NoTemplateForMessages",
           "Conversation",
           "read_conversations", "encode_conversation", "load_chat_data"]

class ChatDataError(UserError, ValueError):
    """A line of chat data that cannot become a training example (the message names the file and line)."""


class NoTemplateForMessages(ChatDataError):
    """Message lines and a tokenizer without a chat template: a command replaces the advice with its own
    (`where`: the file and line)."""

    def __init__(self, where: str, message: str):
        super().__init__(f"{where}: {message}")
        self.where = where


@dataclass(frozen=True)
class Conversation:
    """One line: `messages` (the whole conversation) and, for prompt/completion data, where the completion starts
    (`prompt_len` messages of prompt) or the plain texts `prompt` / `completion`."""
    line: int
    messages: tuple[dict, ...] = ()
    prompt_len: int | None = None
    prompt: str | None = None
    completion: str | None = None

    @property
    def is_plain(self) -> bool:
        return self.prompt is not None

    @property
    def has_completion(self) -> bool:
        return self.is_plain or self.prompt_len is not None


@dataclass(frozen=True)
class ChatExample:
    """input_ids (n,) and labels (n,): labels[j] is input_ids[j + 1] where scored, else IGNORE."""
    input_ids: list[int]
    labels: list[int]
    line: int

    @property
    def n_scored(self) -> int:
        return sum(1 for t in self.labels if t != IGNORE)


@dataclass
class ChatData:
    """The examples of a file and what happened on the way (lines read, truncated, skipped)."""
    examples: list[ChatExample] = field(default_factory=list)
    truncated: int = 0
    skipped: int = 0


# ---- reading and checking lines --------------------------------------------------------------------------------
def _messages(value: Any, where: str, key: str) -> list[dict]:
    """The checked messages of a line (archlab.tokenizer.messages: roles and content forms, as the server
    checks them); a content of text parts becomes its text."""
    if not isinstance(value, list) or not value:
        raise ChatDataError(f"{where}: {key!r} must be a non-empty list of messages")
    try:
        return [check_message(message, f"{where}: {key}[{k}]") for k, message in enumerate(value)]
    except MessageError as exc:
        raise ChatDataError(str(exc)) from None


def _conversation(record: Any, where: str, line: int) -> Conversation:
    if not isinstance(record, dict):
        raise ChatDataError(f"{where} is a JSON {type(record).__name__}, not an object")
    if "messages" in record:
        return Conversation(line, tuple(_messages(record["messages"], where, "messages")))
    if "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return Conversation(line, prompt=prompt, completion=completion)
        if isinstance(prompt, list) and isinstance(completion, list):
            head, tail = _messages(prompt, where, "prompt"), _messages(completion, where, "completion")
            return Conversation(line, tuple(head + tail), prompt_len=len(head))
        raise ChatDataError(f"{where}: prompt and completion must both be strings or both lists of messages")
    raise ChatDataError(f"{where} has neither 'messages' nor 'prompt' and 'completion' "
                        f"(it has {', '.join(map(repr, record)) or 'no fields'})")


def read_conversations(path: str | os.PathLike) -> Iterator[Conversation]:
    """The checked conversations of a .jsonl file, one per non-blank line."""
    path = Path(path)
    try:
        for line, record in jsonl_records(path):
            yield _conversation(record, f"{path}:{line}", line)
    except CorpusError as exc:
        raise ChatDataError(str(exc)) from None


# ---- character spans of the scored text ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _Spans:
    """A rendered example: its text, the spans of each assistant turn, and of the completion (if any)."""
    text: str
    turns: tuple[tuple[int, int], ...]
    completion: tuple[int, int] | None


def _jobs(chat: ChatTokenizer, template: str, conv: Conversation) -> list[RenderJob]:
    """The renders a conversation needs, in the order _read_spans reads them: the whole conversation (its
    {% generation %} spans tracked when the template has them), else also, per assistant turn i, the prompt
    before it (messages[:i] with the generation prompt) and the conversation up to it (messages[:i + 1]); then,
    for prompt/completion data, the prompt with the generation prompt."""
    def job(messages, prompt=False, track=False):
        return RenderJob(template, list(messages), {**chat.special, "add_generation_prompt": prompt}, track)

    m = conv.messages
    tagged = has_generation_blocks(template)
    jobs = [job(m, track=tagged)]
    if not tagged:
        for i in (i for i, message in enumerate(m) if message["role"] == "assistant"):
            jobs += [job(m[:i], prompt=True), job(m[:i + 1])]
    if conv.prompt_len is not None:
        jobs.append(job(m[:conv.prompt_len], prompt=True))
    return jobs


def _read_spans(template: str, conv: Conversation, rendered: list[Rendered]) -> _Spans:
    """The spans of a conversation from the renders _jobs asked for. The rendered-prefix difference needs a
    template that renders the start of a conversation as it does inside the whole: else refused."""
    text, rest = rendered[0].text, rendered[1:]
    if has_generation_blocks(template):
        turns = list(rendered[0].spans)
    else:
        n = sum(1 for message in conv.messages if message["role"] == "assistant")
        turns = []
        for before, after in zip(rest[0:2 * n:2], rest[1:2 * n:2]):
            if not (after.text.startswith(before.text) and text.startswith(after.text)):
                raise UserError("the chat template renders the start of a conversation differently from the "
                                "whole, so the assistant's turns cannot be found: mark them with {% generation %}")
            turns.append((len(before.text), len(after.text)))
        rest = rest[2 * n:]
    completion = None
    if conv.prompt_len is not None:
        if not text.startswith(rest[0].text):
            raise UserError("the chat template renders the prompt differently inside the whole conversation")
        completion = (len(rest[0].text), len(text))
    return _Spans(text, tuple(turns), completion)


def _plain_spans(chat: ChatTokenizer, conv: Conversation) -> _Spans:
    """Plain prompt/completion text: prompt + completion + the end-of-text token, no template."""
    eot_id = getattr(chat.tokenizer, "eot_id", None)
    eot = chat.tokenizer.decode([eot_id]) if eot_id is not None else ""
    assert conv.prompt is not None and conv.completion is not None
    text = conv.prompt + conv.completion + eot
    return _Spans(text, ((len(conv.prompt), len(text)),), (len(conv.prompt), len(text)))


def _assistant(s: _Spans) -> list:
    return [s.completion] if s.completion is not None else list(s.turns)


def _completion(s: _Spans) -> list:
    if s.completion is None:
        raise UserError("loss mask 'completion' needs prompt/completion data; this line has 'messages' "
                        "(use 'assistant' or 'last')")
    return [s.completion]


LOSS_MASKS: dict[str, Callable[[_Spans], list]] = {
    "assistant": _assistant,
    "all": lambda s: [(0, len(s.text))],
    "last": lambda s: list(s.turns[-1:]) if s.completion is None else [s.completion],
    "completion": _completion,
}


# ---- truncation ----------------------------------------------------------------------------------------------
class TooLong(UserError):
    """An example past the token limit under the policy "refuse" (the loader names the setting to change)."""


def _refuse(ids: list[int], mask: list[int], limit: int) -> tuple[list[int], list[int]] | None:
    raise TooLong(f"{len(ids)} tokens, more than the limit of {limit}")


def truncation_advice(setting: str) -> str:
    """How an error names the truncation setting: "choose a policy with train.sft.truncation (refuse, ...)"."""
    return f"choose a policy with {setting} ({', '.join(TRUNCATIONS)})"


def check_truncation(truncation: str, setting: str) -> None:
    if truncation not in TRUNCATIONS:
        raise UserError(f"{setting}={truncation!r} is no truncation policy: choose one of {', '.join(TRUNCATIONS)}")


TRUNCATIONS: dict[str, Callable[[list[int], list[int], int], tuple[list[int], list[int]] | None]] = {
    "refuse": _refuse,
    "keep_start": lambda ids, mask, limit: (ids[:limit], mask[:limit]),
    "keep_end": lambda ids, mask, limit: (ids[-limit:], mask[-limit:]),
    "skip": lambda ids, mask, limit: None,
}


def _labels(ids: list[int], mask: list[int]) -> list[int]:
    """Slot j predicts token j + 1: labels[j] = ids[j + 1] where that token is scored, else IGNORE."""
    if not ids:
        return []
    targets = np.asarray(ids[1:] + [IGNORE], dtype=np.int64)                                  # (n,)
    scored = np.asarray(mask[1:] + [0], dtype=bool)
    return np.where(scored, targets, IGNORE).tolist()


def _checked(results: list) -> list[Rendered]:
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results


def _encoded(chat: ChatTokenizer, conv: Conversation, spans: _Spans, mask: str) -> tuple[list[int], list[int]]:
    scored = sorted(LOSS_MASKS[mask](spans))
    if not any(b > a for a, b in scored):
        raise UserError(f"nothing to learn from: loss mask {mask!r} selects no text (no assistant turn?)")
    return token_mask(chat.tokenizer, spans.text, scored)


def encode_conversation(chat: ChatTokenizer, conv: Conversation, *, mask: str = "assistant",
                        template: str | None = None, limits: RenderLimits | None = None) -> tuple[list[int], list[int]]:
    """(ids, score mask) of one conversation: the mask is 1 on the tokens the loss scores (before the shift)."""
    if mask not in LOSS_MASKS:
        raise UserError(f"unknown loss mask {mask!r}: choose one of {', '.join(LOSS_MASKS)}")
    if conv.is_plain:
        return _encoded(chat, conv, _plain_spans(chat, conv), mask)
    template = template or chat.template()
    rendered = _checked(render_many(_jobs(chat, template, conv), limits))
    return _encoded(chat, conv, _read_spans(template, conv, rendered), mask)


CHUNK = 64      # conversations rendered in one round trip to the template worker


def _chunks(items: Iterator[Conversation], size: int) -> Iterator[list[Conversation]]:
    chunk: list[Conversation] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _rendered_chunk(chat: ChatTokenizer, template: str | None, chunk: list[Conversation],
                    limits) -> list[list | None]:
    """Per conversation, its renders (None for plain text): a chunk's renders travel in one request; when that
    one runs past the time limit, each conversation is rendered alone, so the error can name its line."""
    plans = [None if c.is_plain or template is None else _jobs(chat, template, c) for c in chunk]
    flat = [job for plan in plans if plan for job in plan]
    failed: ChatTemplateError | None = None
    try:
        results = render_many(flat, limits) if flat else []
    except ChatTemplateError as exc:
        results, failed = None, exc
    alone = sum(1 for plan in plans if plan) == 1          # the chunk's error is this conversation's: no rerun
    out: list[list | None] = []
    at = 0
    for conv, plan in zip(chunk, plans):
        if plan is None:
            out.append(None)
            continue
        try:
            if failed is not None and alone:
                raise failed
            mine = results[at:at + len(plan)] if results is not None else render_many(plan, limits)
        except ChatTemplateError as exc:
            raise ChatDataError(f"{conv.line}: {exc}") from None
        out.append(mine)
        at += len(plan)
    return out


def _example(chat, template, conv, rendered, mask, max_tokens, truncation, data: ChatData) -> ChatExample | None:
    if rendered is None:
        spans = _plain_spans(chat, conv)
    else:
        assert template is not None
        spans = _read_spans(template, conv, _checked(rendered))
    ids, scored = _encoded(chat, conv, spans, mask)
    if max_tokens is not None and len(ids) > max_tokens:
        cut = TRUNCATIONS[truncation](ids, scored, max_tokens)
        if cut is None:
            data.skipped += 1
            return None
        ids, scored = cut
        data.truncated += 1
    return ChatExample(ids, _labels(ids, scored), conv.line)


def load_chat_data(path: str | os.PathLike, tokenizer: Any, *, mask: str = "assistant", max_tokens: int | None = None,
                   truncation: str = "refuse", chat_template: str | None = None,
                   limits: RenderLimits | None = None, progress: bool = True,
                   setting: str = "truncation") -> ChatData:
    """Every line of `path` as a ChatExample. `tokenizer`: a tokenizer folder (its chat template and special
    tokens come along), a ChatTokenizer, or a tokenizer object with `chat_template` (a source, or a name among
    the folder's templates). `max_tokens`: the longest input_ids (train.seq_len). Errors name the file and line,
    and `setting` (how the caller's user sets `truncation`, e.g. train.sft.truncation) where an example is too long.
    Example: data = load_chat_data("sft.jsonl", "runs/x/tokenizer", max_tokens=512, truncation="keep_start")"""
    if mask not in LOSS_MASKS:
        raise UserError(f"unknown loss mask {mask!r}: choose one of {', '.join(LOSS_MASKS)}")
    check_truncation(truncation, setting)
    chat = ChatTokenizer.of(tokenizer)
    template: str | None = None
    data = ChatData()
    bar = progress_bar(desc=f"reading {Path(path).name}", unit=" examples", disable=not progress)
    try:
        for chunk in _chunks(read_conversations(path), CHUNK):
            if template is None and not all(c.is_plain for c in chunk):
                try:
                    template = chat.template(chat_template)
                except NoChatTemplate:
                    line = next(c.line for c in chunk if not c.is_plain)
                    raise NoTemplateForMessages(f"{path}:{line}", "these lines are chat messages and the tokenizer "
                                                "has no chat template to render them (pass chat_template=, or "
                                                "write prompt and completion as plain text)") from None
                except UserError as exc:
                    raise ChatDataError(f"{path}: {exc}") from None
            try:
                rendered = _rendered_chunk(chat, template, chunk, limits)
            except ChatDataError as exc:            # "LINE: message" from a conversation rendered alone
                raise ChatDataError(f"{path}:{exc}") from None
            for conv, renders in zip(chunk, rendered):
                try:
                    example = _example(chat, template, conv, renders, mask, max_tokens, truncation, data)
                except TooLong as exc:
                    raise ChatDataError(f"{path}:{conv.line}: {exc}: {truncation_advice(setting)}") from None
                except UserError as exc:
                    raise ChatDataError(f"{path}:{conv.line}: {exc}") from None
                if example is not None:
                    data.examples.append(example)
                bar.update()
    finally:
        bar.close()
    return data
