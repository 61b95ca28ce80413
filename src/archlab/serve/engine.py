"""The model behind the server: one request decoded at a time through archlab.generation.stream, on a
worker thread so the event loop (health, model list, other clients' connections) never waits on it.

Requests queue on a lock; each yields text deltas as tokens are decoded and stops when its `cancel` event
is set (a client that disconnected). Continuous batching (rows joining and leaving one KV cache between
decode steps) is the next slice of issue 16 and replaces `_decode` only.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from archlab.errors import UserError

__all__ = ["Engine", "CompletionRequest", "RequestError"]


class RequestError(UserError):
    """A request the model cannot serve (an HTTP 400): the message says what and by how much."""


@dataclass
class CompletionRequest:
    prompt: str
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class Delta:
    text: str                              # new text since the previous delta ("" on the last one)
    finish_reason: str | None = None       # "stop" (EOS or a stop string) | "length" on the last one
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Engine:
    """A loaded model and tokenizer, serving one decode at a time.
    Example: Engine.from_folder("runs/demo").complete(CompletionRequest("ROMEO:", max_tokens=8))"""

    def __init__(self, model, tokenizer, name: str, chat_template: str | None = None):
        self.model, self.tokenizer, self.name, self.chat_template = model, tokenizer, name, chat_template
        self.context = model.config.max_seq_len
        self.eos = getattr(tokenizer, "eot_id", None)
        self._lock = threading.Lock()

    @classmethod
    def from_folder(cls, path: str | Path, device: str = "cpu") -> Engine:
        from archlab.model_folder import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(path, device)
        return cls(model, tokenizer, Path(path).resolve().name, _chat_template(Path(path)))

    # ---- requests
    def encode(self, request: CompletionRequest) -> list[int]:
        """The prompt's ids, checked against the context: a RequestError names the numbers."""
        _check(request)
        ids = self.tokenizer.encode(request.prompt)
        if not ids:
            raise RequestError("the prompt encodes to no tokens")
        if len(ids) + request.max_tokens > self.context:
            raise RequestError(f"the prompt has {len(ids)} tokens and max_tokens is {request.max_tokens}: "
                               f"{len(ids) + request.max_tokens} tokens do not fit the model's context of "
                               f"{self.context}")
        return ids

    def complete(self, request: CompletionRequest, cancel: threading.Event | None = None) -> Iterator[Delta]:
        """Text deltas of one completion (the last one carries finish_reason and token counts)."""
        ids = self.encode(request)
        with self._lock:
            yield from self._decode(ids, request, cancel or threading.Event())

    def _decode(self, ids: list[int], request: CompletionRequest, cancel: threading.Event) -> Iterator[Delta]:
        from archlab.generation import stream

        tokens = stream(self.model, torch.tensor(ids), request.max_tokens, temperature=request.temperature,
                        top_p=request.top_p, seed=request.seed, eos_token_id=self.eos)
        new: list[int] = []
        head = self.tokenizer.decode(ids)
        text, sent, reason = "", "", "length"
        for step in tokens:
            if cancel.is_set():
                return
            token = int(step.reshape(-1)[0])
            if token == self.eos:
                reason = "stop"
                break
            new.append(token)
            text = _continuation(self.tokenizer.decode(ids + new), head)
            cut = _first_stop(text, request.stop)
            if cut is not None:
                text, reason = text[:cut], "stop"
                break
            if not text.endswith("\ufffd"):                  # hold back a partly decoded character
                yield Delta(text[len(sent):])
                sent = text
        yield Delta(text[len(sent):], reason, len(ids), len(new))   # the rest, and why it ended


def _check(request: CompletionRequest) -> None:
    if not 1 <= request.max_tokens:
        raise RequestError(f"max_tokens={request.max_tokens} must be at least 1")
    if not 0 <= request.temperature <= 2:
        raise RequestError(f"temperature={request.temperature} must be in [0, 2]")
    if request.top_p is not None and not 0 < request.top_p <= 1:
        raise RequestError(f"top_p={request.top_p} must be in (0, 1]")


def _continuation(whole: str, head: str) -> str:
    return whole[len(head):] if whole.startswith(head) else whole


def _first_stop(text: str, stops: list[str]) -> int | None:
    found = [text.find(s) for s in stops if s and s in text]
    return min(found) if found else None


def _chat_template(folder: Path) -> str | None:
    """The chat template of an HF tokenizer (tokenizer_config.json), if the folder has one."""
    import json
    for candidate in (folder / "tokenizer_config.json", folder / "tokenizer" / "tokenizer_config.json"):
        if candidate.is_file():
            try:
                template = json.loads(candidate.read_text()).get("chat_template")
            except (ValueError, AttributeError):
                return None
            return template if isinstance(template, str) else None
    return None
