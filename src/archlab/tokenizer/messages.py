"""Chat messages as users send them, checked once for training data (archlab.data.chat) and the server
(archlab.serve.fields): the same roles, the same content forms, the same refusals.

    {"role": "system" | "user" | "assistant" | "tool", "content": "text"}
    {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}

A content given as a list of parts (OpenAI's and TRL's form) becomes the parts' text joined; a part of another
type (an image, audio) is refused, since these models read text. A message without a role or content, or with a
role the chat templates do not know, is refused, as OpenAI and TRL refuse it.
"""
from __future__ import annotations

from typing import Any

__all__ = ["ROLES", "MessageError", "check_message", "content_text"]

ROLES = ("system", "user", "assistant", "tool")


class MessageError(ValueError):
    """A message that is not a chat message: `field` names what is wrong ("role", "content" or None: the whole)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def content_text(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of {"type": "text", "text": ...} parts joined.
    Example: content_text([{"type": "text", "text": "Hi"}], "messages[0]") -> "Hi" """
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise MessageError(f"{where}: content is a JSON {_kind(content)}, not a string or a list of text parts",
                           "content")
    for k, part in enumerate(content):
        if not isinstance(part, dict):
            raise MessageError(f"{where}: content[{k}] is a JSON {_kind(part)}, not a {{\"type\": \"text\", "
                               "\"text\": ...}} part", "content")
        if part.get("type") != "text":
            raise MessageError(f"{where}: content[{k}] has type {part.get('type')!r}: only text parts are read "
                               "(these models read text)", "content")
        if not isinstance(part.get("text"), str):
            raise MessageError(f"{where}: content[{k}] is a text part without a string 'text'", "content")
    return "".join(part["text"] for part in content)


def check_message(message: Any, where: str, *, null_content: bool = False) -> dict:
    """The message with its content as text (the other keys kept), checked: an object with a known role and a
    content; `null_content`: an assistant's null content reads as "" (OpenAI's turn that only calls tools).
    Example: check_message({"role": "user", "content": "Hi"}, "line 3: messages[0]")"""
    if not isinstance(message, dict):
        raise MessageError(f"{where} is a JSON {_kind(message)}, not an object with role and content")
    for needed in ("role", "content"):
        if needed not in message:
            raise MessageError(f"{where} has no {needed!r}", needed)
    if message["role"] not in ROLES:
        raise MessageError(f"{where} has unknown role {message['role']!r} (roles: {', '.join(ROLES)})", "role")
    content = message["content"]
    if content is None and null_content and message["role"] == "assistant":
        return {**message, "content": ""}
    return {**message, "content": content_text(content, where)}


def _kind(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "object",
            type(None): "null"}.get(type(value), type(value).__name__)
