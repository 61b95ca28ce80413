"""The Jinja environment that renders chat templates, and the worker process that runs it.

A chat template is data from a model folder, written by whoever published the model, so it is rendered as
transformers renders it (`ImmutableSandboxedEnvironment` with trim_blocks and lstrip_blocks, the
`{% generation %}` tag that records the assistant's character spans, `raise_exception`, `strftime_now`,
a `tojson` that does not escape HTML, a `namespace` that refuses underscore names, loop controls), and
in a separate process: the sandbox keeps a template away from Python objects, the process keeps it from
running forever or filling memory. A loop without output, an exponential macro or `'a' * 10**10` cannot
be stopped from inside the interpreter that runs it (one C call may allocate for minutes), a process can
be killed. The worker holds an address-space limit (RLIMIT_AS, so a huge allocation fails with
MemoryError) and an output limit (characters yielded); the parent (archlab.tokenizer.chat) holds the time
limit and kills the worker when it passes.

This file imports only the standard library and jinja2: it runs as a script (`python -I chat_sandbox.py
MEMORY_MB [PATH...]`, the paths where jinja2 and markupsafe live), without importing archlab or torch, and
speaks one JSON object per line on stdin/stdout:
    request  {"jobs": [{"source": str, "variables": {...}, "track": bool, "parse_only": bool}, ...],
              "max_chars": int}  (parse_only: compile the template, render nothing)
    reply    {"results": [{"text": str, "spans": [[start, end], ...]}  or  {"error": str}, ...]}
             (a template that does not parse adds "syntax_line": its line number to the error)
Several renders travel in one request (a conversation and its prefixes, a chunk of training data), so the
cost of the round trip is paid once for them.
"""
from __future__ import annotations

import json
import sys

if __name__ == "__main__":           # run as the worker: find jinja2 where the parent found it
    sys.path[:0] = sys.argv[2:]

from collections import OrderedDict  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from contextvars import ContextVar  # noqa: E402
from datetime import datetime  # noqa: E402

import jinja2  # noqa: E402
import jinja2.ext  # noqa: E402
import jinja2.nodes  # noqa: E402
import jinja2.utils  # noqa: E402
from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: E402

__all__ = ["OutputLimitError", "environment", "render", "serve"]


class OutputLimitError(Exception):
    """The template's output passed the character limit."""


class GenerationSpans(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body and, while tracking, records the body's
    (start, end) character span in the output, counted as the characters yielded before it."""
    tags = {"generation"}

    def __init__(self, env):
        super().__init__(env)
        self._tracking: ContextVar = ContextVar("archlab_generation_spans", default=None)
        env.extend(track_generation=self.track)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

    def _span(self, caller):
        text = caller()
        tracking = self._tracking.get()
        if tracking is not None:
            emitted, spans = tracking
            spans.append((emitted[0], emitted[0] + len(text)))
        return text

    @contextmanager
    def track(self, emitted: list[int], spans: list[tuple[int, int]]):
        """Record spans while the block runs; `emitted[0]` is kept equal to the characters yielded so far."""
        token = self._tracking.set((emitted, spans))
        try:
            yield
        finally:
            self._tracking.reset(token)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters (<, >, &, '): chat templates expect plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` in a template, without handing it the `dict` type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore-prefixed names (no reaching CPython internals through it)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


def environment() -> ImmutableSandboxedEnvironment:
    """The sandboxed environment chat templates render in (the same globals and filters as transformers)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationSpans, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace)
    return env


_ENV = None
_COMPILED: OrderedDict = OrderedDict()     # template source -> compiled template, the last few used
_CACHE_SIZE = 16


def _compiled(source: str):
    global _ENV
    if _ENV is None:
        _ENV = environment()
    template = _COMPILED.pop(source, None) or _ENV.from_string(source)
    _COMPILED[source] = template
    while len(_COMPILED) > _CACHE_SIZE:
        _COMPILED.popitem(last=False)
    return template


def render(source: str, variables: dict, *, track: bool = False,
           max_chars: int | None = None) -> tuple[str, list[tuple[int, int]]]:
    """(text, generation spans) of `source` rendered with `variables`; spans only when `track`.
    OutputLimitError once the output passes `max_chars` characters."""
    template = _compiled(source)
    env = template.environment
    emitted: list[int] = [0]                  # characters yielded so far, read by GenerationSpans
    spans: list[tuple[int, int]] = []
    pieces: list[str] = []
    with env.track_generation(emitted, spans) if track else _nothing():
        for piece in template.generate(**variables):
            pieces.append(piece)
            emitted[0] += len(piece)
            if max_chars is not None and emitted[0] > max_chars:
                raise OutputLimitError(f"the chat template's output passed {max_chars:,} characters")
    return "".join(pieces), spans


@contextmanager
def _nothing():
    yield


def _limit_memory(megabytes: int) -> None:
    """Cap this process's address space at its present size plus `megabytes` (Linux; elsewhere a no-op)."""
    try:
        import resource
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[0])
        limit = pages * resource.getpagesize() + megabytes * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, OSError, ValueError):
        pass


def _result(job: dict, max_chars: int) -> dict:
    try:
        if job.get("parse_only"):
            _compiled(job["source"])
            return {"text": "", "spans": []}
        text, spans = render(job["source"], job["variables"], track=job["track"], max_chars=max_chars)
        return {"text": text, "spans": spans}
    except MemoryError:
        return {"error": "the chat template used more memory than the renderer allows"}
    except RecursionError:
        return {"error": "the chat template recursed too deeply"}
    except jinja2.exceptions.TemplateSyntaxError as exc:     # the template itself, not the messages: its line
        return {"error": " ".join(str(exc).split()) or type(exc).__name__, "syntax_line": exc.lineno}
    except (jinja2.exceptions.TemplateError, OutputLimitError) as exc:
        return {"error": " ".join(str(exc).split()) or type(exc).__name__}
    except Exception as exc:  # whatever else a template raises (TypeError, ZeroDivisionError, ...) is its own
        return {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"}


def serve(stdin, stdout) -> None:
    """Answer one JSON request per line until stdin closes."""
    for line in stdin:
        request = json.loads(line)
        results = []
        for job in request["jobs"]:
            try:
                results.append(_result(job, request["max_chars"]))
            except MemoryError:   # raised again while reporting the first one
                results.append({"error": "the chat template used more memory than the renderer allows"})
        stdout.write(json.dumps({"results": results}) + "\n")
        stdout.flush()


def _exit_with_parent() -> None:
    """End this worker when its parent is gone. A parent killed mid-render (SIGKILL, a crash, a test run stopped)
    never closes stdin, and a looping template would spin here for ever; a thread checks twice a second (a
    template's Python loop yields the GIL to it)."""
    import os
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


if __name__ == "__main__":
    _exit_with_parent()
    _limit_memory(int(sys.argv[1]) if len(sys.argv) > 1 else 1024)
    serve(sys.stdin, sys.stdout)
