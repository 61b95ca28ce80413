"""What a request may cost the server (archlab.serve.limits) and what keeps it answering and stoppable: a body
past the size limit is a 413 (declared or counted), a body that never finishes a 408, a chat template that
does not finish a 400 while /health answers, tokenizing a prompt never holds the event loop, SIGTERM ends the
server while a client holds a half-sent body, and a tokenizer larger than the model's vocabulary is refused
at start."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_serve_generation_config import _run_folder
from variants import BASE

import archlab
from archlab.cli import main
from archlab.errors import UserError
from archlab.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from archlab.serve import Engine, Limits, create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
CHAT = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
LOOP = "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}{% endfor %}" \
       "{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def engine():
    cfg = BASE.with_overrides({"vocab_size": 257, "init.std": 0.2, "max_seq_len": 64})
    model = archlab.TransformerLM(cfg).eval()
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    return Engine(model, tok, "tiny", chat_template=CHAT)


async def _client(engine, limits: Limits):
    transport = httpx.ASGITransport(app=create_app(engine, limits))
    return httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60)


def test_a_body_past_the_limit_is_a_413_declared_or_counted(engine):
    limits = Limits(max_body_bytes=1000)

    async def chunked():                                # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * 100
        yield b'"}'

    async def go():
        async with await _client(engine, limits) as client:
            declared = await client.post("/v1/completions", json={"prompt": "x" * 2000})
            counted = await client.post("/v1/completions", content=chunked())
            small = await client.post("/v1/completions", json={"prompt": "x" * 900, "max_tokens": 1})
            return declared, counted, small
    declared, counted, small = asyncio.run(go())
    for r in (declared, counted):
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert "over the server's limit of 1000 B" in r.json()["error"]["message"], r.json()
    assert "content-length" not in counted.request.headers
    assert small.status_code == 400 and "context" in small.json()["error"]["message"]   # read, then refused


def test_a_body_that_never_finishes_is_a_408(engine):
    app = create_app(engine, Limits(body_timeout_s=0.2))
    sent: list[dict] = []

    async def go():
        first = True

        async def receive():
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": b'{"prompt": "', "more_body": True}
            await asyncio.Event().wait()                # the client holds the rest

        async def send(message):
            sent.append(message)
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json"), (b"content-length", b"500")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        await asyncio.wait_for(app(scope, receive, send), 10)
    asyncio.run(go())
    assert sent[0]["status"] == 408
    assert json.loads(sent[1]["body"])["error"]["code"] == "timeout"


def _health_while(engine, limits: Limits, path: str, body: dict, busy: float):
    """(the answer to `body`, seconds /health took while it was being worked on, whether it was done then)."""
    async def go():
        async with await _client(engine, limits) as client:
            slow = asyncio.create_task(client.post(path, json=body))
            await asyncio.sleep(busy / 4)
            start = time.perf_counter()
            health = await client.get("/health")
            waited, done = time.perf_counter() - start, slow.done()
            assert health.json() == {"status": "ok"}
            return await slow, waited, done
    return asyncio.run(go())


class _SlowTokenizer:
    """The byte tokenizer, one second per encode (as a 50 MB prompt takes)."""

    def __init__(self, inner):
        self.inner = inner

    def encode(self, text):
        time.sleep(1.0)
        return self.inner.encode(text)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_tokenizing_a_prompt_does_not_hold_the_event_loop(engine):
    slow = Engine(engine.model, _SlowTokenizer(engine.tokenizer), "tiny")
    answer, waited, done = _health_while(slow, Limits(), "/v1/completions",
                                         {"prompt": "hi", "max_tokens": 2, "temperature": 0}, busy=1.0)
    assert answer.status_code == 200 and not done and waited < 0.5


def test_a_chat_template_that_does_not_finish_is_a_400_and_health_answers_meanwhile(engine):
    """A template that loops without output: its render worker is killed at the limit, the request is a 400,
    /health answers meanwhile, and the next chat request renders (a fresh worker)."""
    looping = Engine(engine.model, engine.tokenizer, "tiny", chat_template=LOOP)
    start = time.perf_counter()
    answer, waited, done = _health_while(looping, Limits(render_timeout_s=0.4), "/v1/chat/completions",
                                         {"messages": [{"role": "user", "content": "hi"}]}, busy=0.4)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "template_timeout"
    assert not done and waited < 0.3 and time.perf_counter() - start < 1.8
    async def again():
        async with await _client(Engine(engine.model, engine.tokenizer, "tiny", chat_template=CHAT), Limits()) as c:
            return await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 2})
    assert asyncio.run(again()).status_code == 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _half_sent_body(port: int) -> socket.socket:
    """A connection whose request promises 1000 bytes of body and sends 10."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=5)
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"prompt\":")
    return conn


def test_stopping_the_server_cancels_a_half_sent_body_after_the_shutdown_timeout(engine):
    import uvicorn
    config = uvicorn.Config(create_app(engine), host="127.0.0.1", port=0, log_level="critical",
                            timeout_graceful_shutdown=0.5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    conn = _half_sent_body(server.servers[0].sockets[0].getsockname()[1])
    try:
        time.sleep(0.3)
        start = time.perf_counter()
        server.should_exit = True
        thread.join(timeout=10)
        assert not thread.is_alive() and time.perf_counter() - start < 5
    finally:
        conn.close()


def test_the_command_passes_its_limits_to_uvicorn(tmp_path, monkeypatch, capsys):
    _run_folder(tmp_path)
    seen = {}
    from archlab.serve.server import Server
    monkeypatch.setattr(Server, "run", lambda self: seen.update(vars(self.config)))
    assert main(["serve", str(tmp_path), "--port", "0", "--shutdown-timeout", "2.5", "--max-request-mb", "1"]) == 0
    assert seen["timeout_graceful_shutdown"] == 2.5 and seen["host"] == "127.0.0.1"
    assert main(["serve", str(tmp_path), "--max-request-mb", "0"]) == 2
    assert "--max-request-mb 0 must be a number of MB > 0" in capsys.readouterr().err


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_at_start(engine, tmp_path, capsys):
    small = archlab.TransformerLM(BASE.with_overrides({"vocab_size": 200}))
    with pytest.raises(UserError, match="the tokenizer has 257 tokens but the model's vocabulary has 200"):
        Engine(small, engine.tokenizer, "tiny")
    model, tok = _run_folder(tmp_path)
    Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>", "<|pad|>", "<|x|>"]).save(
        tmp_path / "tokenizer")
    assert main(["serve", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "the tokenizer has 259 tokens but the model's vocabulary has 257" in err and len(err.splitlines()) == 1


@pytest.mark.slow                                      # ~10 s: a fresh process imports torch
def test_sigterm_stops_the_server_during_a_looping_template_and_a_half_sent_body(tmp_path):
    """`archlab serve` as a process: a chat template that never ends renders off the event loop (/health
    answers), a client holds a half-sent body, and SIGTERM still ends the server within its shutdown timeout."""
    _run_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": LOOP}))
    port = _free_port()
    src = str(Path(archlab.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    process = subprocess.Popen([sys.executable, "-m", "archlab", "serve", str(tmp_path), "--port", str(port),
                                "--shutdown-timeout", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    conn = None
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        conn = _half_sent_body(port)
        chat = threading.Thread(target=lambda: _ignore(httpx.post, f"http://127.0.0.1:{port}/v1/chat/completions",
                                                       json={"messages": [{"role": "user", "content": "x"}]},
                                                       timeout=20), daemon=True)
        chat.start()
        time.sleep(0.5)                                             # the template is looping now
        start = time.perf_counter()
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json() == {"status": "ok"}
        assert time.perf_counter() - start < 2
        process.send_signal(signal.SIGTERM)
        start = time.perf_counter()
        process.wait(timeout=15)
        assert time.perf_counter() - start < 8
    finally:
        if conn is not None:
            conn.close()
        if process.poll() is None:
            process.kill()
            process.wait()


def _ignore(fn, *args, **kw):
    try:
        fn(*args, **kw)
    except httpx.TransportError:
        pass
