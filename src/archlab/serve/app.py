"""An OpenAI-compatible HTTP API over an Engine (FastAPI, imported by this module
only: `archlab.serve.create_app` loads it on demand): the endpoints the `openai` client, curl and
tools built for vLLM or `transformers serve` call.

    GET  /health                 {"status": "ok"}
    GET  /v1/models              the one model served
    POST /v1/completions         prompt, max_tokens, temperature, top_p, stop (at most 4, as OpenAI), seed, n, echo,
                                 stream (server-sent events), stream_options.include_usage; vLLM's top_k, min_p,
                                 repetition_penalty; on a chat model the text also ends at the end-of-turn token
    POST /v1/chat/completions    messages, rendered with the tokenizer's chat template (400 without one); the
                                 same fields but prompt and echo, and max_completion_tokens; messages checked as
                                 training data is (archlab.tokenizer.messages: a known role, a content: a string,
                                 text parts or null); the answer also stops at the template's end-of-turn token
                                 (archlab.generation.chat)

Fields a request leaves out take the model folder's generation_config.json values (listed under
"generation_config" in /v1/models; archlab.serve.settings), else OpenAI's defaults.
Every field is honoured or refused as OpenAI refuses it (archlab.serve.fields): no value is coerced, `logprobs`,
`best_of` other than n, `suffix`, penalties and tools are refused, an unknown field is refused by name, and
`"model"` must name the served model (404 model_not_found). Errors are OpenAI-shaped JSON: {"error": {"message", "type",
"param", "code"}}: 400 for a request the model cannot serve (a prompt past the context says by how much), 404,
408 and 413 (archlab.serve.limits); a stream that fails midway ends with an error event, never cut mid-body.
Nothing a request sends is worked on by the event loop: the body is parsed, the chat template rendered (with a
time limit) and the prompt tokenized on worker threads, and decoding runs on the Engine's batching thread
(concurrent requests share one batched decode), so /health and /v1/models answer whatever a request costs; a
client that disconnects stops its decode at the next step. A prompt sharing a token prefix with what a slot of the
Engine holds (an earlier request's prompt and answer) prefills only the rest; `usage` counts those tokens as
OpenAI does, in prompt_tokens_details.cached_tokens. Stop strings are held back until they cannot
match (archlab.serve.stops): streamed and non-streamed texts are the same, cut just before the stop.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from archlab.serve.engine import CompletionRequest, Delta, Engine
from archlab.serve.fields import Parsed, RequestError, check_fields
from archlab.serve.limits import Limits
from archlab.units import human_bytes

__all__ = ["create_app", "off_loop"]
log = logging.getLogger("archlab.serve")


def create_app(engine: Engine, limits: Limits | None = None):
    """The FastAPI application serving `engine` under `limits` (None: the defaults of archlab.serve.limits).
    Example: uvicorn.run(create_app(Engine.from_folder("runs/demo")), host="127.0.0.1", port=8000)"""
    limits = limits or Limits()
    app = FastAPI(title="archlab", description="OpenAI-compatible completions over an archlab model")
    # set when the server starts stopping (archlab.serve.server): a body still arriving is answered 503 at once,
    # so a stalled client does not hold the shutdown for its whole graceful timeout
    app.state.stopping = asyncio.Event()
    created = int(time.time())
    _error_handlers(app)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": created,
                                            "owned_by": "archlab", "context_length": engine.context,
                                            "generation_config": engine.applied,
                                            "generation_config_not_applied": engine.not_applied}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json(request, limits)
        parsed, prompt = check_fields(body, "completions", model=engine.name, max_n=limits.max_n)
        # a chat model's text also ends at its end-of-turn token, which never shows in the text (as vLLM, whose
        # eos ids hold it, stops there and skips special tokens)
        end_ids = await off_loop(engine.end_of_turn)
        return await _respond(request, parsed, prompt, "text_completion", end_ids)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _json(request, limits)
        parsed, messages = check_fields(body, "chat", model=engine.name, max_n=limits.max_n)
        if engine.chat is None:
            raise RequestError(f"model {engine.name} has no chat template (tokenizer_config.json chat_template): "
                               "use /v1/completions")
        try:
            # the worker is killed at the limit; the thread's own timeout is a safety net past it
            prompt = await off_loop(render_chat, engine, messages, limits.render_timeout_s,
                                    timeout=limits.render_timeout_s + 2.0)
        except TimeoutError:
            raise RequestError(f"the model's chat template did not finish within {limits.render_timeout_s:g} s on "
                               "these messages", param="messages", code="template_timeout") from None
        end_ids = await off_loop(engine.end_of_turn)          # rendered once, on a worker
        return await _respond(request, parsed, prompt, "chat.completion", end_ids)

    async def _respond(request: Request, parsed: Parsed, prompt: str, kind: str, end_ids: tuple[int, ...] = ()):
        base = CompletionRequest(prompt=prompt, end_ids=end_ids, **parsed.fields)
        prepared = await off_loop(engine.prepare, base)      # tokenized off the loop; a 400 before any decoding
        choices = [_nth(base, i) for i in range(parsed.n)]
        cancel = threading.Event()
        rid = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        echo = prompt if parsed.echo else ""
        deltas = _deltas(engine, choices, prepared, cancel)
        if parsed.stream:
            events = _sse(deltas, _Chunks(rid, kind, engine.name, int(time.time())), parsed, echo)
            return StreamingResponse(_until_disconnect(request, events, cancel), media_type="text/event-stream")
        texts, last = [echo] * parsed.n, [None] * parsed.n
        try:
            async for i, delta in deltas:
                if await request.is_disconnected():
                    return JSONResponse({}, status_code=499)
                texts[i], last[i] = texts[i] + delta.text, delta
        finally:
            cancel.set()                                      # no-op once every choice finished
        return _full(rid, kind, engine.name, texts, last)

    return app


def _error_handlers(app: FastAPI) -> None:
    """Every error answers OpenAI-shaped JSON, also an unknown route and an error inside archlab (500)."""
    @app.exception_handler(RequestError)
    async def request_error(_: Request, exc: RequestError):
        return _error(str(exc), exc.status, param=exc.param, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        return _error(f"{where}: {first.get('msg', 'invalid request')}", 400, param=where or None)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException):
        return _error(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def server_error(_: Request, exc: Exception):
        log.exception("archlab serve: the request failed inside archlab", exc_info=exc)
        return _error(f"internal error: {type(exc).__name__}", 500)


# ---- request parsing -----------------------------------------------------------------------------
async def _json(request: Request, limits: Limits) -> dict:
    """The body as a JSON object: at most limits.max_body_bytes (413), arrived within limits.body_timeout_s
    (408), parsed off the event loop; NaN, Infinity and nesting past Python's recursion limit are not JSON."""
    too_large = RequestError(f"the request body is over the server's limit of {human_bytes(limits.max_body_bytes)} "
                             "(archlab serve --max-request-mb)", code="request_too_large", status=413)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise too_large

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)
    raw = await _until_stopping(request, read(), limits.body_timeout_s)
    body = await off_loop(_parse_json, raw)
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


async def _until_stopping(request: Request, reading, seconds: float) -> bytes:
    """The body `reading` gives, unless it has not arrived within `seconds` (408) or the server starts stopping
    first (503: nothing was done for the request yet, so it is not worth the graceful shutdown's wait)."""
    reader = asyncio.ensure_future(reading)
    stopper = asyncio.ensure_future(request.app.state.stopping.wait())
    try:
        done, _ = await asyncio.wait({reader, stopper}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (reader, stopper):
            task.cancel()
    if reader in done:
        return reader.result()
    if stopper in done:
        raise RequestError("the server is shutting down: the request body had not arrived", code="shutting_down",
                           status=503)
    raise RequestError(f"the request body did not arrive within {seconds:g} s", code="timeout", status=408)


def _parse_json(raw: bytes):
    def constant(name: str):
        raise ValueError(f"{name} is not JSON")
    try:
        return json.loads(raw, parse_constant=constant)
    except RecursionError:
        raise RequestError("the request body is not JSON this server reads: nested too deeply") from None
    except ValueError as exc:
        raise RequestError(f"the request body is not JSON ({str(exc)[:80]})") from None


def _nth(request: CompletionRequest, i: int) -> CompletionRequest:
    """Choice i of a request: the first keeps the request's seed, the others draw their own from it."""
    if i == 0 or request.seed is None:
        return request
    return dataclasses.replace(request, seed=(request.seed + i * 0x9E3779B97F4A7C15) % 2 ** 64)


def render_chat(engine: Engine, messages, seconds: float) -> str:
    """The prompt text of `messages` through the folder's chat template (archlab.tokenizer.chat: a sandboxed
    worker process, killed past `seconds`), with the generation prompt; a template error is a 400."""
    from archlab.tokenizer.chat import ChatTemplateError, ChatTemplateTimeout, RenderLimits, apply_chat_template

    try:
        return apply_chat_template(engine.chat, messages, tokenize=False, add_generation_prompt=True,
                                   limits=RenderLimits(seconds=seconds))
    except ChatTemplateTimeout:
        raise TimeoutError from None
    except ChatTemplateError as exc:
        raise RequestError(f"the model's chat template failed on these messages: {exc}", param="messages") from exc


# ---- work off the event loop ------------------------------------------------------------------------
async def off_loop(fn, *args, timeout: float | None = None):
    """fn(*args) on a daemon thread, awaited: the event loop keeps answering meanwhile. TimeoutError after
    `timeout` seconds (the thread runs on to its end; a daemon, it cannot hold the process at exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result, error) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def work() -> None:
        try:
            outcome = (fn(*args), None)
        except Exception as exc:  # handed to the awaiting side, which raises it there
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:      # the loop closed while fn ran
            pass

    threading.Thread(target=work, name="archlab-off-loop", daemon=True).start()
    return await asyncio.wait_for(future, timeout)


async def _deltas(engine: Engine, requests: list[CompletionRequest], prepared, cancel: threading.Event
                  ) -> AsyncIterator[tuple[int, Delta]]:
    """(choice, delta) of each request as the engine produces them, on worker threads, through one queue."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def work(i: int, request: CompletionRequest) -> None:
        try:
            for delta in engine.complete(request, cancel, prepared=prepared):
                loop.call_soon_threadsafe(queue.put_nowait, (i, delta))
        except Exception as exc:  # handed to the awaiting side, which raises it there
            loop.call_soon_threadsafe(queue.put_nowait, (i, exc))
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, (i, None))

    for i, request in enumerate(requests):
        threading.Thread(target=work, args=(i, request), name="archlab-decode", daemon=True).start()
    running = len(requests)
    while running:
        i, item = await queue.get()
        if item is None:
            running -= 1
        elif isinstance(item, Exception):
            raise item
        else:
            yield i, item


# ---- answers -------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Chunks:
    """The server-sent events of one streamed answer."""
    rid: str
    kind: str
    model: str
    created: int

    def event(self, choices: list[dict], **extra) -> str:
        kind = f"{self.kind}.chunk" if self.kind == "chat.completion" else self.kind
        chunk = {"id": self.rid, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        return f"data: {json.dumps({**chunk, **extra})}\n\n"

    def choice(self, i: int, text: str, reason: str | None = None, role: bool = False) -> dict:
        if self.kind == "chat.completion":
            delta = {"role": "assistant", "content": text} if role else {"content": text} if text else {}
            return {"index": i, "delta": delta, "finish_reason": reason}
        return {"index": i, "text": text, "logprobs": None, "finish_reason": reason}


async def _sse(deltas: AsyncIterator[tuple[int, Delta]], chunks: _Chunks, parsed: Parsed, echo: str
               ) -> AsyncIterator[str]:
    """The answer's events; an error midway is an error event (then [DONE]), never a stream cut mid-body."""
    done: dict[int, Delta] = {}
    try:
        for i in range(parsed.n):                  # the role (chat) or the echoed prompt first, as OpenAI sends
            if chunks.kind == "chat.completion" or echo:
                yield chunks.event([chunks.choice(i, echo, role=chunks.kind == "chat.completion")])
        async for i, delta in deltas:
            if delta.finish_reason is not None:
                done[i] = delta
            yield chunks.event([chunks.choice(i, delta.text, delta.finish_reason)])
        if parsed.include_usage:
            yield chunks.event([], usage=_usage(list(done.values())))
    except Exception as exc:
        if not isinstance(exc, RequestError):
            log.exception("archlab serve: a stream failed inside archlab", exc_info=exc)
        status = exc.status if isinstance(exc, RequestError) else 500
        yield f"data: {json.dumps(_error_body(str(exc) or type(exc).__name__, status))}\n\n"
    yield "data: [DONE]\n\n"


async def _until_disconnect(request, events: AsyncIterator[str], cancel: threading.Event) -> AsyncIterator[str]:
    try:
        async for event in events:
            if await request.is_disconnected():
                break
            yield event
    finally:
        cancel.set()                                    # the decode stops at its next token


def _usage(last: list[Delta | None]) -> dict:
    """OpenAI's usage; prompt_tokens_details.cached_tokens: the prompt tokens the server's prefix cache held (the
    first choice's: each choice of n places its prompt on its own)."""
    finished = [d for d in last if d is not None]
    prompt_tokens = finished[0].prompt_tokens if finished else 0
    completion_tokens = sum(d.completion_tokens for d in finished)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": finished[0].cached_tokens if finished else 0}}


def _full(rid: str, kind: str, model: str, texts: list[str], last: list[Delta | None]) -> dict:
    choices = []
    for i, (text, delta) in enumerate(zip(texts, last)):
        reason = delta.finish_reason if delta else "length"
        if kind == "chat.completion":
            choices.append({"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason})
        else:
            choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": reason})
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices,
            "usage": _usage(last)}


def _error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error(message: str, status: int, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(_error_body(message, status, param, code), status_code=status)
