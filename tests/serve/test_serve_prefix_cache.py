"""The server's prefix cache (archlab.serve.prefixes): a request sharing a token prefix with what a slot holds prefills
only the rest, and answers exactly what the server without the cache answers (greedy; three families; completions
and chat; concurrent conversations sharing a system prompt); usage.prompt_tokens_details.cached_tokens counts the
tokens found; the memory is the slot cache's, fixed, the least recently used row evicted first."""
from __future__ import annotations

import asyncio

import pytest
import torch
from chat_run import make_chat_run
from test_serve import _live_server, together

import archlab
from archlab.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from archlab.serve import CompletionRequest, Engine, create_app  # noqa: E402
from archlab.serve.prefixes import SlotPrefixes  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
ASCII = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
FAMILIES = ["llama3-8b", "gpt2", "gemma2-2b"]


def _model(family: str) -> archlab.TransformerLM:
    """A tiny model of the family that writes ASCII bytes or end-of-text only: every answer decodes to text that
    encodes back to the same ids, so the number of tokens a follow-up finds cached is known exactly."""
    cfg = archlab.presets.tiny(family, vocab_size=ASCII.vocab_size, window=6, max_seq_len=160)
    model = archlab.TransformerLM(cfg.with_overrides({"init.std": 0.2, "seed": 0})).eval()
    model.register_forward_hook(lambda module, args, logits: logits.index_fill(-1, NOT_ASCII, -1e4))
    return model


NOT_ASCII = torch.arange(128, 256)


def post(engine: Engine, path: str, body: dict) -> dict:
    async def go():
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return await client.post(path, json=body)
    response = asyncio.run(go())
    assert response.status_code == 200, response.text
    return response.json()


def complete(engine: Engine, prompt: str, n: int = 6) -> tuple[str, str, int]:
    """(text, finish_reason, cached_tokens) of a greedy /v1/completions request."""
    body = post(engine, "/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0})
    choice = body["choices"][0]
    return choice["text"], choice["finish_reason"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("family", FAMILIES)
def test_follow_ups_find_their_prefix_and_answer_as_the_uncached_server(family):
    model = _model(family)
    cached = Engine(model, ASCII, "tiny", max_batch=2)
    plain = Engine(model, ASCII, "tiny", max_batch=2, prefix_cache=False)
    prompt, held = "The first turn.", 0
    for turn in range(4):
        text, reason, found = complete(cached, prompt)
        assert (text, reason, 0) == complete(plain, prompt), turn
        assert found == held, turn
        # the row holds the prompt and every answer token fed back (the last one only once another followed)
        held = len(ASCII.encode(prompt + text)) - (reason == "length")
        prompt = prompt + text + f" Turn {turn + 2}."
    assert cached.cached_tokens > cached.prompt_tokens / 2 and plain.cached_tokens == 0


def test_an_earlier_change_is_prefilled_from_there_and_the_row_is_reused_in_place():
    model = _model("llama3-8b")
    cached = Engine(model, ASCII, "tiny", max_batch=1)
    plain = Engine(model, ASCII, "tiny", max_batch=1, prefix_cache=False)
    first = "A conversation about nothing much."
    text, _, _ = complete(cached, first)
    edited = "A conversation about something else." + text
    assert complete(cached, edited) == complete(plain, edited)[:2] + (len("A conversation about "),)
    assert complete(cached, edited)[2] == len(edited) - 1     # the same prompt again: all but its last token


def test_chat_turns_find_their_history_and_answer_as_the_uncached_server(tmp_path):
    root, _, _ = make_chat_run(tmp_path)
    cached, plain = Engine.from_folder(root), Engine.from_folder(root, prefix_cache=False)
    messages = [{"role": "system", "content": "Be brief."}]
    prompt_tokens = 0
    for turn in range(3):
        messages.append({"role": "user", "content": f"question {turn}"})
        body = {"messages": messages, "max_tokens": 10, "temperature": 0}
        got, want = post(cached, "/v1/chat/completions", body), post(plain, "/v1/chat/completions", body)
        assert got["choices"] == want["choices"], turn
        found = got["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert found >= prompt_tokens if turn else found == 0           # at least the whole previous prompt
        prompt_tokens = got["usage"]["prompt_tokens"]
        messages.append({"role": "assistant", "content": got["choices"][0]["message"]["content"]})
    assert want["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_concurrent_conversations_sharing_a_system_prompt_answer_as_the_uncached_server():
    """Three conversations at once over two decoding rows and four cache rows: each turn's answers equal the
    uncached server's; a conversation's first turn finds the shared system prompt in another row (copied, the
    other row keeping its own tokens), its later turns their own history."""
    model = _model("llama3-8b")
    cached = Engine(model, ASCII, "tiny", max_batch=2, cache_rows=4)
    plain = Engine(model, ASCII, "tiny", max_batch=2, prefix_cache=False)
    system = "System: answer briefly and well. "
    histories = {name: system + f"User {name}:" for name in ("ann", "bob", "cy")}
    found: dict[str, list[int]] = {name: [] for name in histories}

    def converse(name: str) -> None:
        for turn in range(3):
            ds = list(cached.complete(CompletionRequest(histories[name], max_tokens=5, temperature=0)))
            found[name].append(ds[-1].cached_tokens)
            histories[name] += "".join(d.text for d in ds) + f" More {turn}:"

    together(model, [lambda name=name: converse(name) for name in histories], delay=0.003, timeout=120)
    assert max(cached.rows_per_step) == 2
    for name, history in histories.items():
        assert _replayed(plain, history, name) == history, name        # every answer as the uncached server's
        assert sum(n >= len(system) for n in found[name]) >= 2, found   # later turns: more than the system prompt
    assert sum(found[name][0] >= len(system) for name in found) >= 2, found   # shared by the later-starting ones


def _replayed(engine: Engine, history: str, name: str) -> str:
    """The conversation rebuilt turn by turn with `engine`'s answers (the user parts are taken from `history`)."""
    prefix = history.split(f"User {name}:")[0] + f"User {name}:"
    out = prefix
    for turn in range(3):
        text = "".join(d.text for d in engine.complete(CompletionRequest(out, max_tokens=5, temperature=0)))
        out += text + f" More {turn}:"
    return out


def test_memory_is_bounded_and_the_least_recently_used_row_is_evicted():
    model = _model("llama3-8b")
    engine = Engine(model, ASCII, "tiny", max_batch=1, cache_rows=2)
    size = engine.slots.nbytes
    answers = {p: complete(engine, p)[0] for p in ("Apples are red.", "Bananas are yellow.")}
    complete(engine, "Apples are red." + answers["Apples are red."] + " Why?")    # Apples used last: Bananas is LRU
    complete(engine, "Cherries are dark.")                       # takes the least recently used row: Bananas'
    assert complete(engine, "Apples are red." + answers["Apples are red."] + " Why? Really.")[2] > len("Apples")
    assert complete(engine, "Bananas are yellow." + answers["Bananas are yellow."] + " Sure?")[2] == 0
    assert engine.slots.nbytes == size and len(engine.slots.length) == 2
    assert engine.prefixes.held_tokens <= 2 * engine.context


def test_a_copied_prefix_gives_the_logits_of_a_fresh_prefill():
    """SlotKVCache.copy then a prefill of the rest equals prefilling the whole prompt into an empty row."""
    from archlab.nn.kv_cache import SlotKVCache
    model = _model("gemma2-2b")
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(0))
    slots = SlotKVCache(model.config, 3, 64)
    prefixes = SlotPrefixes(slots)
    with torch.no_grad():
        model(ids[:, :20], positions=torch.arange(20)[None], cache=slots.view([0]))
        place = prefixes.place(ids[0].tolist(), [1, 2], {0: ids[0, :20].tolist()})
        assert (place.source, place.cached) == (0, 20) and place.row != 0
        prefixes.apply(place)
        continued = model(ids[:, 20:], positions=torch.arange(20, 30)[None], cache=slots.view([place.row]))
        fresh = model(ids, positions=torch.arange(30)[None], cache=SlotKVCache(model.config, 1, 64).view([0]))
    torch.testing.assert_close(continued[0, -1], fresh[0, -1], rtol=0, atol=1e-4)
    assert slots.length[0] == 20                                       # the source row keeps its tokens


def test_a_live_server_reports_cached_tokens_to_the_openai_client():
    openai = pytest.importorskip("openai")
    engine = Engine(_model("gpt2"), ASCII, "tiny")
    server, thread, port = _live_server(engine)                 # 127.0.0.1, a free port
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        first = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=4, temperature=0)
        again = client.completions.create(model="tiny", prompt="Once upon a time" + first.choices[0].text + ".",
                                          max_tokens=4, temperature=0)
        held = len("Once upon a time" + first.choices[0].text) - (first.choices[0].finish_reason == "length")
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens == held
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert not thread.is_alive()


def test_the_command_takes_its_cache_rows(tmp_path, monkeypatch, capsys):
    from test_serve_limits import _run_folder

    from archlab.cli import main
    from archlab.serve.server import Server
    _run_folder(tmp_path)
    monkeypatch.setattr(Server, "run", lambda self: None)
    assert main(["serve", str(tmp_path), "--port", "0", "--max-batch", "2", "--cache-rows", "5"]) == 0
    assert "KV cache: 5 rows x 64 tokens" in capsys.readouterr().out
    assert main(["serve", str(tmp_path), "--max-batch", "4", "--cache-rows", "3"]) == 2
    assert "--cache-rows 3 must be at least --max-batch 4" in capsys.readouterr().err
