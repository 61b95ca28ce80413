"""An OpenAI-compatible HTTP API over an Engine (FastAPI, imported by this module
only: `archlab.serve.create_app` loads it on demand): the endpoints the `openai` client, curl and
tools built for vLLM or `transformers serve` call.

    GET  /health                 {"status": "ok"}
    GET  /v1/models              the one model served
    POST /v1/completions         prompt, max_tokens, temperature, top_p, stop, seed, stream (server-sent events);
                                 vLLM's top_k, min_p, repetition_penalty
    POST /v1/chat/completions    messages, rendered with the tokenizer's chat template (400 without one)

Fields a request leaves out take the model folder's generation_config.json values (listed under
"generation_config" in /v1/models; archlab.serve.settings), else OpenAI's defaults.
Errors are OpenAI-shaped JSON: {"error": {"message", "type", "param", "code"}}, status 400 for a request
the model cannot serve (a prompt past the context says by how much). Decoding runs on the Engine's batching
thread (concurrent requests share one batched decode), so a long generation never blocks /health or
/v1/models; a client that disconnects stops its decode at the next step.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from archlab.serve.engine import CompletionRequest, Delta, Engine, RequestError

__all__ = ["create_app"]


def create_app(engine: Engine):
    """The FastAPI application serving `engine`.
    Example: uvicorn.run(create_app(Engine.from_folder("runs/demo")), host="127.0.0.1", port=8000)"""
    app = FastAPI(title="archlab", description="OpenAI-compatible completions over an archlab model")
    created = int(time.time())

    @app.exception_handler(RequestError)
    async def request_error(_: Request, exc: RequestError):
        return _error(str(exc), 400)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        return _error(f"{where}: {first.get('msg', 'invalid request')}", 400, param=where or None)

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
        body = await _json(request)
        prompt = body.get("prompt", "")
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise RequestError("prompt: one string (or a list of one string) per request")
            prompt = prompt[0]
        return await _respond(request, body, _parse(body, prompt), "text_completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _json(request)
        if engine.chat_template is None:
            raise RequestError(f"model {engine.name} has no chat template (tokenizer_config.json chat_template): "
                               "use /v1/completions")
        prompt = render_chat(engine, body.get("messages"))
        return await _respond(request, body, _parse(body, prompt), "chat.completion")

    async def _respond(request: Request, body: dict, parsed: CompletionRequest, kind: str):
        engine.encode(parsed)                           # a 400 before any decoding starts
        cancel = threading.Event()
        rid = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if body.get("stream"):
            events = _sse(engine, parsed, cancel, rid, kind, created=int(time.time()))
            return StreamingResponse(_until_disconnect(request, events, cancel), media_type="text/event-stream")
        text, last = "", None
        async for delta in _deltas(engine, parsed, cancel):
            if await request.is_disconnected():
                cancel.set()
                return JSONResponse({}, status_code=499)
            text, last = text + delta.text, delta
        return _full(rid, kind, engine.name, text, last)

    return app


# ---- request parsing -----------------------------------------------------------------------------
async def _json(request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise RequestError("the request body is not JSON") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def _parse(body: dict, prompt) -> CompletionRequest:
    """The request's fields; one it leaves out stays None (the model folder's generation config, else OpenAI's
    default, fills it: archlab.serve.settings)."""
    if not isinstance(prompt, str):
        raise RequestError("prompt must be a string")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop

    def given(name: str, kind):
        return None if body.get(name) is None else kind(body[name])
    try:
        return CompletionRequest(prompt=prompt, max_tokens=given("max_tokens", int),
                                 temperature=given("temperature", float), top_p=given("top_p", float),
                                 top_k=given("top_k", int), min_p=given("min_p", float),
                                 repetition_penalty=given("repetition_penalty", float),
                                 stop=[str(s) for s in stop], seed=body.get("seed"))
    except (TypeError, ValueError) as exc:
        raise RequestError(f"a request field has the wrong type: {exc}") from exc


def render_chat(engine: Engine, messages) -> str:
    """The prompt text of `messages` through the tokenizer's chat template, in a sandboxed Jinja
    environment (a template is data from the model folder: it must not reach Python objects)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise RequestError("messages must be a list of {role, content} objects")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    specials = getattr(engine.tokenizer, "special_tokens", []) or []
    eos = specials[0] if specials else ""
    try:
        return env.from_string(engine.chat_template).render(messages=messages, add_generation_prompt=True,
                                                            bos_token="", eos_token=eos)
    except TemplateError as exc:    # includes the sandbox's SecurityError
        raise RequestError(f"the model's chat template failed on these messages: {exc}") from exc


# ---- decoding off the event loop --------------------------------------------------------------------
async def _deltas(engine: Engine, request: CompletionRequest, cancel: threading.Event) -> AsyncIterator[Delta]:
    """The engine's deltas, produced on a worker thread and handed to the event loop through a queue."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def work() -> None:
        try:
            for delta in engine.complete(request, cancel):
                loop.call_soon_threadsafe(queue.put_nowait, delta)
        except Exception as exc:  # handed to the awaiting side, which raises it there
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    threading.Thread(target=work, name="archlab-decode", daemon=True).start()
    while (item := await queue.get()) is not None:
        if isinstance(item, Exception):
            raise item
        yield item


async def _sse(engine, request, cancel, rid, kind, created) -> AsyncIterator[str]:
    async for delta in _deltas(engine, request, cancel):
        if kind == "chat.completion":
            choice = {"index": 0, "delta": {"content": delta.text} if delta.text else {},
                      "finish_reason": delta.finish_reason}
        else:
            choice = {"index": 0, "text": delta.text, "logprobs": None, "finish_reason": delta.finish_reason}
        chunk = {"id": rid, "object": f"{kind}.chunk" if kind == "chat.completion" else kind, "created": created,
                 "model": engine.name, "choices": [choice]}
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


async def _until_disconnect(request, events: AsyncIterator[str], cancel: threading.Event) -> AsyncIterator[str]:
    try:
        async for event in events:
            if await request.is_disconnected():
                break
            yield event
    finally:
        cancel.set()                                    # the decode stops at its next token


def _full(rid: str, kind: str, model: str, text: str, last: Delta | None) -> dict:
    reason = last.finish_reason if last else "length"
    if kind == "chat.completion":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    prompt_tokens, completion_tokens = (last.prompt_tokens, last.completion_tokens) if last else (0, 0)
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def _error(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": None}}, status_code=status)
