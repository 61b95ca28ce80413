"""A stopping server answers a request whose body is still arriving with a 503 at once, instead of waiting the
whole graceful-shutdown timeout for a client that may never send the rest (archlab.serve.server)."""
from __future__ import annotations

import socket
import threading
import time

import pytest
from variants import BASE

import archlab
from archlab.tokenizer import Tokenizer

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from archlab.serve import Engine, create_app  # noqa: E402
from archlab.serve.server import make_server  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
GRACE = 10.0          # archlab serve's default --shutdown-timeout: a stalled body used to cost all of it


@pytest.fixture(scope="module")
def engine():
    cfg = BASE.with_overrides({"vocab_size": 257, "max_seq_len": 64})
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    return Engine(archlab.TransformerLM(cfg).eval(), tok, "tiny")


def test_a_stalled_body_does_not_hold_the_shutdown(engine):
    server = make_server(create_app(engine), host="127.0.0.1", port=0, log_level="critical",
                         timeout_graceful_shutdown=GRACE)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    conn = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\":")          # 10 of 1000 bytes, then nothing
        time.sleep(0.3)
        start = time.perf_counter()
        server.should_exit = True
        thread.join(timeout=GRACE + 5)
        took = time.perf_counter() - start
        assert not thread.is_alive() and took < GRACE / 4, f"the shutdown took {took:.1f} s"
        answer = conn.recv(4096).decode(errors="replace")
        assert answer.startswith("HTTP/1.1 503") and "shutting down" in answer, answer[:300]
    finally:
        conn.close()
