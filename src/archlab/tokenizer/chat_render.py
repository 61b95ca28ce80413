"""Rendering chat templates in a sandboxed worker process: the client side (chat_sandbox.py runs in the worker).

One `python -I chat_sandbox.py` process per parent process (and memory limit), started at the first render,
replaced when it dies or when a render passes the time limit (it is killed), ended at exit. Renders travel as
JSON lines, many per request (`render_many`), under one time limit; each job's output is limited in the
worker, and so is its memory. A parent that forks gets its own worker in the child.

    render_chat("{% for m in messages %}{{ m.content }}{% endfor %}", [{"role": "user", "content": "hi"}])
    render_many([RenderJob(template, messages, {"add_generation_prompt": True}, track=True), ...])
"""
from __future__ import annotations

import atexit
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from archlab.errors import UserError

__all__ = ["ChatTemplateError", "ChatTemplateSyntaxError", "NoChatTemplate", "check_template_syntax",
           "RenderLimits", "Rendered", "RenderJob", "render_chat", "render_many",
           "has_generation_blocks"]

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_SANDBOX = Path(__file__).with_name("chat_sandbox.py")


class ChatTemplateError(UserError, ValueError):
    """A chat template that is missing, raises, runs too long or writes too much; or messages it cannot take."""


class ChatTemplateSyntaxError(ChatTemplateError):
    """A template that is not valid Jinja: the fault of the template, whatever the messages (`line`: where)."""

    def __init__(self, message: str, line: int | None = None):
        super().__init__(message)
        self.line = line


class NoChatTemplate(ChatTemplateError):
    """The tokenizer has no chat template (a command says how its user gives it one)."""


class ChatTemplateTimeout(ChatTemplateError):
    """A render stopped at its time limit (the worker killed)."""


@dataclass(frozen=True)
class RenderLimits:
    """What one render may take: wall-clock seconds, output characters, worker memory (MiB above its start)."""
    seconds: float = 5.0
    chars: int = 4_000_000
    memory_mb: int = 1024


@dataclass(frozen=True)
class Rendered:
    """A rendered conversation: its text and the (start, end) character spans of its {% generation %} blocks."""
    text: str
    spans: tuple[tuple[int, int], ...] = ()


# ---- the worker process ----------------------------------------------------------------------------------------
class _Worker:
    """One `python -I chat_sandbox.py` process, answering one JSON line per request. -I keeps the worker from
    importing archlab or anything on PYTHONPATH; the folders holding jinja2 and markupsafe are passed in."""

    START_SECONDS = 60.0      # interpreter start and `import jinja2` on a loaded machine

    def __init__(self, memory_mb: int):
        import jinja2
        import markupsafe
        paths = sorted({str(Path(m.__file__ or "").parent.parent) for m in (jinja2, markupsafe)})
        self.owner = os.getpid()
        self.proc = subprocess.Popen([sys.executable, "-I", str(_SANDBOX), str(memory_mb), *paths],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     bufsize=0)
        self.pending = b""

    def ask(self, request: str, seconds: float) -> dict:
        """The reply to one request (a JSON object on one line, ASCII: json.dumps escapes the rest)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((request + "\n").encode("ascii"))
        except OSError:
            raise self._stopped() from None
        return json.loads(self._line(seconds))

    def _line(self, seconds: float) -> bytes:
        """The next reply line; the worker is killed when none comes within `seconds`."""
        assert self.proc.stdout is not None
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + seconds
        poller = select.poll()               # not select.select: a busy server's descriptors pass 1024
        poller.register(fd, select.POLLIN)
        chunks, chunk = [self.pending], self.pending
        while b"\n" not in chunk:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                self.close()
                raise ChatTemplateTimeout(f"the chat template ran longer than {seconds:g} s (stopped)")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise self._stopped()
            chunks.append(chunk)
        line, _, self.pending = b"".join(chunks).partition(b"\n")
        return line

    def _stopped(self) -> ChatTemplateError:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        assert self.proc.stderr is not None
        last = (self.proc.stderr.read().decode("utf-8", "replace").strip().splitlines() or ["no message"])[-1]
        self.close()
        return ChatTemplateError(f"the chat template renderer stopped (exit status {self.proc.returncode}: {last})")

    def alive(self) -> bool:
        return self.owner == os.getpid() and self.proc.poll() is None

    def close(self) -> None:
        """End the worker: a closed stdin ends its loop; a busy worker is killed."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


_LOCK = threading.Lock()
_WORKERS: dict[int, _Worker] = {}     # memory_mb -> the live worker of this process


@atexit.register
def _close_workers() -> None:
    for worker in _WORKERS.values():
        if worker.alive():
            worker.close()


def _ask(request: str, limits: RenderLimits) -> dict:
    with _LOCK:
        worker = _WORKERS.get(limits.memory_mb)
        if worker is None or not worker.alive():
            worker = _WORKERS[limits.memory_mb] = _Worker(limits.memory_mb)
            # a first request (an empty template) waits for the interpreter to start, outside the render's limit
            worker.ask('{"jobs": [], "max_chars": 0}', _Worker.START_SECONDS)
        return worker.ask(request, limits.seconds)


# ---- rendering ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RenderJob:
    """One render: `messages` through `template`; `variables` (bos_token, ..., add_generation_prompt, tools,
    documents, anything the template reads) reach it as they are; `track` records {% generation %} spans;
    `parse_only` compiles the template and renders nothing (a syntax check that no template's loop can stall)."""
    template: str
    messages: list
    variables: dict = field(default_factory=dict)
    track: bool = False
    parse_only: bool = False


def render_many(jobs: list[RenderJob], limits: RenderLimits | None = None) -> list[Rendered | ChatTemplateError]:
    """Each job rendered in the sandbox, all in one round trip to the worker, within one time limit: a
    Rendered, or the ChatTemplateError of a job whose template failed. A batch past the time limit (or whose
    worker crashed) raises its ChatTemplateError for the whole batch."""
    limits = limits or RenderLimits()
    try:
        request = json.dumps({"jobs": [{"source": j.template, "variables": {"tools": None, "documents": None,
                                                                             "add_generation_prompt": False,
                                                                             **j.variables, "messages": j.messages},
                                        "track": j.track, "parse_only": j.parse_only} for j in jobs],
                              "max_chars": limits.chars})
    except (TypeError, ValueError) as exc:
        raise ChatTemplateError(f"chat messages must be JSON data (strings, numbers, lists, objects): {exc}") from None
    results = _ask(request, limits)["results"]
    return [_error(r) if "error" in r else Rendered(r["text"], tuple((int(a), int(b)) for a, b in r["spans"]))
            for r in results]


def _error(result: dict) -> ChatTemplateError:
    if "syntax_line" in result:
        return ChatTemplateSyntaxError(f"the chat template is not valid Jinja (line {result['syntax_line']}): "
                                       f"{result['error']}", result["syntax_line"])
    return ChatTemplateError(f"the chat template failed: {result['error']}")


def check_template_syntax(template: str, limits: RenderLimits | None = None) -> None:
    """Raise ChatTemplateSyntaxError when `template` does not parse as Jinja (compiled in the sandbox: nothing of
    it runs), so a broken template is blamed on itself before any data is read.
    Example: check_template_syntax("{{ messages }") raises ChatTemplateSyntaxError (line 1: unexpected '}')"""
    (result,) = render_many([RenderJob(template, [], {}, parse_only=True)], limits)
    if isinstance(result, ChatTemplateSyntaxError):
        raise result


def render_chat(template: str, messages: list, *, add_generation_prompt: bool = False, tools: list | None = None,
                documents: list | None = None, track_generation: bool = False,
                limits: RenderLimits | None = None, **variables: Any) -> Rendered:
    """`messages` through `template` in the sandbox: Rendered(text, spans of {% generation %} when tracked).
    `variables` reach the template as they are (bos_token, eos_token, ... and any the template reads).
    Example: render_chat("{% for m in messages %}{{ m.content }}{% endfor %}", [{"role": "user",
    "content": "hi"}]).text == "hi" """
    context = {"tools": tools, "documents": documents, "add_generation_prompt": add_generation_prompt, **variables}
    (result,) = render_many([RenderJob(template, messages, context, track_generation)], limits)
    if isinstance(result, ChatTemplateError):
        raise result
    return result


def has_generation_blocks(template: str) -> bool:
    """True when the template marks the assistant's text with {% generation %} (the mask needs no other method)."""
    return bool(_GENERATION_TAG.search(template))
