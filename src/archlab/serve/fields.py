"""The request fields the server reads, each checked as OpenAI and vLLM check it: one registry per endpoint,
field name -> checker (value -> the value to use). A field the server honours is checked for its type and range
with no coercion (`"5"`, `3.7` and `true` are not a max_tokens); a field it does not honour is refused unless it
holds its no-op value (`suffix: ""`, `logprobs: null`); a field neither endpoint knows is refused by name, as
OpenAI refuses an unrecognized argument. Every refusal is a RequestError naming the field (`param`).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from archlab.errors import UserError
from archlab.tokenizer.messages import MessageError, check_message

__all__ = ["RANGES", "SEED_RANGE", "Parsed", "RequestError", "check_fields"]

SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)             # what torch.Generator.manual_seed takes
MAX_STOPS = 4                                      # OpenAI: "Up to 4 sequences"
RANGES = {   # field -> (test, what it must be)
    "max_tokens": (lambda v: v >= 1, "at least 1"), "max_completion_tokens": (lambda v: v >= 1, "at least 1"),
    "temperature": (lambda v: 0 <= v <= 2, "in [0, 2]"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"), "top_k": (lambda v: v >= -1, "at least 1 (0 or -1: no top-k)"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"), "repetition_penalty": (lambda v: 0 < v <= 1e4, "in (0, 1e4]"),
    "seed": (lambda v: SEED_RANGE[0] <= v <= SEED_RANGE[1], "a 64-bit integer"),
}


class RequestError(UserError):
    """A request the model cannot serve: an OpenAI-shaped error with its HTTP status (400 unless said), the field
    it is about (`param`) and OpenAI's `code` where it has one; the message says what and by how much."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


@dataclass
class Parsed:
    """A request's checked fields: `fields` are CompletionRequest's keywords (prompt aside); n choices, streamed
    or not, the prompt echoed or not, a usage chunk closing the stream or not."""
    fields: dict[str, Any]
    n: int = 1
    stream: bool = False
    echo: bool = False
    include_usage: bool = False


Checker = Callable[[Any, str], Any]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _in_range(value, name: str):
    if name in RANGES and not RANGES[name][0](value):
        raise RequestError(f"{name}={value} must be {RANGES[name][1]}", param=name, code="invalid_value")
    return value


def integer(value, name: str) -> int:
    if not _is_int(value):
        raise RequestError(f"{name} must be an integer, not {_shown(value)}", param=name, code="invalid_type")
    return _in_range(value, name)


def number(value, name: str) -> float:
    if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, not {_shown(value)}", param=name, code="invalid_type")
    return _in_range(float(value), name)


def boolean(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, not {_shown(value)}", param=name, code="invalid_type")
    return value


def stops(value, name: str) -> list[str]:
    """OpenAI's `stop`: a string or a list of strings, none empty (an empty stop would end every text at once)."""
    listed = [value] if isinstance(value, str) else value
    if not isinstance(listed, list) or not all(isinstance(s, str) and s for s in listed):
        raise RequestError(f"{name} must be a non-empty string or a list of non-empty strings, not {_shown(value)}",
                           param=name, code="invalid_value")
    if len(listed) > MAX_STOPS:
        raise RequestError(f"{name} has {len(listed)} strings; at most {MAX_STOPS}", param=name, code="invalid_value")
    return listed


def text(value, name: str) -> str:
    if not isinstance(value, str):
        raise RequestError(f"{name} must be a string, not {_shown(value)}", param=name, code="invalid_type")
    return value


def prompt(value, name: str) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise RequestError(f"{name} must be a string (or a list of one string), not {_shown(value)}", param=name,
                           code="invalid_value")
    return value


def refused(*no_ops) -> Checker:
    """A field the server does not honour: accepted only holding one of its no-op values."""
    def check(value, name: str):
        if not any(type(value) is type(op) and value == op for op in no_ops):
            raise RequestError(f"{name}={_shown(value)} is not supported by this server", param=name,
                               code="unsupported_parameter")
        return None
    return check


def messages(value, name: str) -> list[dict]:
    """Chat messages: a non-empty list of {role, content} checked as training data is (archlab.tokenizer.messages:
    a known role; content a string, a list of text parts, or null for an assistant); a message's `name` is kept."""
    if not isinstance(value, list) or not value:
        raise RequestError(f"{name} must be a non-empty list of {{role, content}} objects", param=name,
                           code="invalid_value")
    out = []
    for i, message in enumerate(value):
        at = f"{name}[{i}]"
        try:
            checked = check_message(message, at, null_content=True)
        except MessageError as exc:
            raise RequestError(str(exc), param=f"{at}.{exc.field}" if exc.field else at,
                               code="invalid_value") from None
        extra = {k: v for k, v in checked.items() if k == "name" and isinstance(v, str)}
        out.append({"role": checked["role"], "content": checked["content"], **extra})
    return out


def stream_options(value, name: str) -> bool:
    if not isinstance(value, dict) or set(value) - {"include_usage"}:
        raise RequestError(f"{name} must be an object with include_usage only", param=name, code="invalid_value")
    return boolean(value.get("include_usage", False), f"{name}.include_usage")


_SAMPLING: dict[str, Checker] = {
    "model": text, "max_tokens": integer, "temperature": number, "top_p": number, "top_k": integer, "min_p": number,
    "repetition_penalty": number, "stop": stops, "seed": integer, "n": integer, "stream": boolean,
    "stream_options": stream_options, "user": text,
    "presence_penalty": refused(0, 0.0), "frequency_penalty": refused(0, 0.0), "logit_bias": refused({}),
}
FIELDS: dict[str, dict[str, Checker]] = {
    "completions": {**_SAMPLING, "prompt": prompt, "echo": boolean, "best_of": integer, "logprobs": refused(),
                    "suffix": refused("")},
    "chat": {**_SAMPLING, "messages": messages, "max_completion_tokens": integer, "logprobs": refused(False),
             "top_logprobs": refused(), "tools": refused([]), "tool_choice": refused("none"),
             "response_format": refused({"type": "text"}), "parallel_tool_calls": refused(True, False)},
}
_REQUEST_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop", "seed")


def check_fields(body: dict, endpoint: str, *, model: str, max_n: int) -> tuple[Parsed, Any]:
    """(the checked fields, the prompt or messages) of a request body to `endpoint` ("completions" | "chat")
    served by `model`; a null field counts as not given. Raises RequestError (404 model_not_found for another
    model, as OpenAI answers)."""
    known = FIELDS[endpoint]
    unknown = [name for name in body if name not in known]
    if unknown:
        raise RequestError(f"unrecognized request argument: {unknown[0]}", param=unknown[0],
                           code="unknown_parameter")
    values = {name: known[name](value, name) for name, value in body.items() if value is not None}
    if "model" in values and values["model"] != model:
        raise RequestError(f"the model `{values['model']}` does not exist: this server serves `{model}`",
                           param="model", code="model_not_found", status=404)
    n = values.get("n", 1)
    if not 1 <= n <= max_n:
        raise RequestError(f"n={n} must be in 1..{max_n}", param="n", code="invalid_value")
    if values.get("best_of", n) != n:
        raise RequestError(f"best_of={values['best_of']} is not supported (only best_of = n = {n})",
                           param="best_of", code="unsupported_parameter")
    if "max_completion_tokens" in values:
        values.setdefault("max_tokens", values["max_completion_tokens"])
    parsed = Parsed({k: values[k] for k in _REQUEST_FIELDS if k in values}, n=n, stream=values.get("stream", False),
                    echo=values.get("echo", False), include_usage=values.get("stream_options", False))
    if endpoint == "chat":
        if "messages" not in values:
            raise RequestError("messages is required", param="messages", code="invalid_value")
        return parsed, values["messages"]
    return parsed, values.get("prompt", "")


def _shown(value) -> str:
    """A value as the error names it: short, and its JSON type."""
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "object",
            type(None): "null"}.get(type(value), type(value).__name__)
    shown = repr(value)
    return f"{shown[:40]}... ({kind})" if len(shown) > 40 else f"{shown} ({kind})"
