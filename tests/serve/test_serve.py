"""archlab serve: the OpenAI completions API over a tiny model, in-process (httpx's ASGI transport) and
once over a real socket on 127.0.0.1. Greedy texts equal archlab.generate's."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch
from variants import BASE

import archlab
from archlab.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from archlab.serve import CompletionRequest, Engine, create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine():
    cfg = BASE.with_overrides({"vocab_size": 257, "init.std": 0.2, "max_seq_len": 64})
    model = archlab.TransformerLM(cfg).eval()
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    return Engine(model, tok, "tiny")


def call(engine, method: str, path: str, **kw):
    async def go():
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kw)
    return asyncio.run(go())


def expected_text(engine, prompt: str, n: int) -> str:
    ids = engine.tokenizer.encode(prompt)
    out = archlab.generate(engine.model, torch.tensor(ids), n)[len(ids):].tolist()
    return engine.tokenizer.decode(ids + out)[len(prompt):]


def test_health_and_models(engine):
    assert call(engine, "GET", "/health").json() == {"status": "ok"}
    data = call(engine, "GET", "/v1/models").json()
    assert data["object"] == "list" and data["data"][0]["id"] == "tiny" and data["data"][0]["context_length"] == 64


def test_greedy_completion_equals_generate(engine):
    r = call(engine, "POST", "/v1/completions", json={"prompt": "hello", "max_tokens": 12, "temperature": 0})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == expected_text(engine, "hello", 12)
    assert body["choices"][0]["finish_reason"] == "length"
    cached = body["usage"].pop("prompt_tokens_details")["cached_tokens"]   # earlier tests' "hello" may be held
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17} and 0 <= cached <= 4


def test_streamed_chunks_join_to_the_full_text(engine):
    r = call(engine, "POST", "/v1/completions",
             json={"prompt": "hello", "max_tokens": 12, "temperature": 0, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text(engine, "hello", 12)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and len(chunks) > 2


def test_stop_strings_cut_the_text(engine):
    full = expected_text(engine, "hello", 12)
    stop = full[3:5]
    body = call(engine, "POST", "/v1/completions",
                json={"prompt": "hello", "max_tokens": 12, "temperature": 0, "stop": [stop]}).json()
    assert body["choices"][0]["text"] == full[:full.find(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_a_prompt_past_the_context_is_an_openai_400_with_the_numbers(engine):
    r = call(engine, "POST", "/v1/completions", json={"prompt": "x" * 60, "max_tokens": 10})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "60 tokens" in error["message"] and "64" in error["message"]
    r = call(engine, "POST", "/v1/completions", content=b"not json")
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    r = call(engine, "POST", "/v1/completions", json={"prompt": "hi", "temperature": 5})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]


def test_chat_needs_a_template_and_uses_it(engine):
    messages = [{"role": "user", "content": "hi"}]
    r = call(engine, "POST", "/v1/chat/completions", json={"messages": messages})
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
    templated = Engine(engine.model, engine.tokenizer, "tiny",
                       chat_template="{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                                     "{% if add_generation_prompt %}<assistant>{% endif %}")
    body = call(templated, "POST", "/v1/chat/completions",
                json={"messages": messages, "max_tokens": 6, "temperature": 0}).json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant",
                                             "content": expected_text(engine, "<user>hi\n<assistant>", 6)}


def test_a_template_cannot_reach_python(engine):
    evil = Engine(engine.model, engine.tokenizer, "tiny",
                  chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    r = call(evil, "POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and "unsafe" in r.json()["error"]["message"]


def test_a_long_generation_does_not_block_the_model_list(engine):
    slow = Engine(engine.model, engine.tokenizer, "tiny")
    hook = engine.model.register_forward_hook(lambda *args: time.sleep(0.05))    # ~3 s for 60 tokens

    async def go():
        transport = httpx.ASGITransport(app=create_app(slow))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            long = asyncio.create_task(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 60,
                                                                              "temperature": 0}))
            await asyncio.sleep(0.05)
            start = time.perf_counter()
            models = await client.get("/v1/models")
            waited = time.perf_counter() - start
            done_first = long.done()
            await long
            return models.status_code, waited, done_first
    try:
        status, waited, done_first = asyncio.run(go())
    finally:
        hook.remove()
    # answered while the generation runs, in well under half its time (a loaded CI machine can stall a second)
    assert status == 200 and not done_first and waited < 1.5


def test_cancel_stops_the_decode_at_the_next_token(engine):
    cancel = threading.Event()
    deltas = []
    for delta in engine.complete(CompletionRequest("hello", max_tokens=40, temperature=0), cancel):
        deltas.append(delta)
        cancel.set()                                # the client went away after the first delta
    assert len(deltas) == 1 and deltas[0].finish_reason is None
    deadline = time.time() + 5
    while engine._active and time.time() < deadline:          # the scheduler gives the row back
        time.sleep(0.01)
    assert not engine._active


def test_a_real_socket_on_localhost(engine):
    server, thread, port = _live_server(engine)
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"prompt": "hello", "max_tokens": 5, "temperature": 0}, timeout=30)
        assert r.json()["choices"][0]["text"] == expected_text(engine, "hello", 5)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert not thread.is_alive()


def complete_together(engine, prompts: list[tuple[str, int]], delay: float = 0.005) -> dict[str, str]:
    """prompt -> greedy text of (prompt, max_tokens) requests sent at once from threads; each forward sleeps
    `delay` seconds, so the requests surely overlap in the batch."""
    results: dict[str, str] = {}

    def ask(prompt: str, n: int) -> None:
        request = CompletionRequest(prompt, max_tokens=n, temperature=0)
        results[prompt] = "".join(d.text for d in engine.complete(request))

    together(engine.model, [lambda p=p: ask(*p) for p in prompts], delay)
    return results


def together(model, calls: list, delay: float = 0.005, timeout: float = 60) -> None:
    """Run `calls` on threads at once while each forward of `model` sleeps `delay` seconds (they surely overlap)."""
    threads = [threading.Thread(target=call) for call in calls]
    hook = model.register_forward_hook(lambda *args: time.sleep(delay))
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=timeout)
    finally:
        hook.remove()


def _live_server(engine):
    """A uvicorn server on 127.0.0.1 (a free port) in a thread: (server, thread, port)."""
    import uvicorn
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    return server, thread, server.servers[0].sockets[0].getsockname()[1]


def _readme_client_snippet() -> str:
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Serving", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readme_openai_client_snippet_talks_to_the_server(engine, capsys):
    """The README's `openai` snippet, as written but for the port, against a live server; then the
    client's greedy and streamed completions equal archlab.generate's text."""
    openai = pytest.importorskip("openai")
    demo = Engine(engine.model, engine.tokenizer, "demo")     # the README names the model `demo`
    server, thread, port = _live_server(demo)
    try:
        code = _readme_client_snippet().replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        assert f"127.0.0.1:{port}" in code
        exec(compile(code, "README.md", "exec"), {})
        assert capsys.readouterr().out.strip()               # it printed the completion
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        want = expected_text(engine, "hello", 10)
        got = client.completions.create(model="demo", prompt="hello", max_tokens=10, temperature=0)
        assert got.choices[0].text == want and got.usage.completion_tokens == 10
        chunks = client.completions.create(model="demo", prompt="hello", max_tokens=10, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks) == want
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert not thread.is_alive()


def test_concurrent_requests_are_decoded_together_with_the_texts_they_get_alone(engine):
    """Requests of different lengths join one batch (rows_per_step shows steps over several rows), and
    each greedy text equals the one archlab.generate gives that prompt alone."""
    batched = Engine(engine.model, engine.tokenizer, "tiny", max_batch=4)
    prompts = [("hello", 14), ("a much longer prompt", 9), ("x", 20), ("mid size", 12), ("fifth waits", 6)]
    results = complete_together(batched, prompts)
    for prompt, n in prompts:
        assert results[prompt] == expected_text(engine, prompt, n), prompt
    assert max(batched.rows_per_step) >= 2                      # steps carried several rows at once
    assert max(batched.rows_per_step) <= 4                      # never more than the slots
    assert not batched._active and not batched._waiting        # every row was given back


def test_batched_streams_join_to_their_texts(engine):
    batched = Engine(engine.model, engine.tokenizer, "tiny", max_batch=2)

    async def go():
        transport = httpx.ASGITransport(app=create_app(batched))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            bodies = [{"prompt": p, "max_tokens": 10, "temperature": 0, "stream": True} for p in ("hello", "yo")]
            return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
    for response, prompt in zip(asyncio.run(go()), ("hello", "yo")):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")][:-1]
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events) == expected_text(engine, prompt, 10)
