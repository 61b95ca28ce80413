"""The server's /v1/chat/completions on a run folder with the built-in ChatML template: streamed and
non-streamed greedy answers equal `archlab generate` on the rendered conversation, cut at the template's
end-of-turn token (finish_reason "stop" there, "length" at max_tokens), as `archlab chat` answers."""
from __future__ import annotations

import asyncio
import json

import pytest
from chat_run import END, FIRST, make_chat_run, render

from archlab.cli import main

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from archlab.serve import Engine, create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
CONVERSATIONS = [
    [{"role": "user", "content": FIRST}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": FIRST}],
    [{"role": "user", "content": FIRST}, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "and?"}],
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root, _, _ = make_chat_run(tmp_path_factory.mktemp("chat"))
    return root, Engine.from_folder(root)


def post(engine, body: dict) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return await client.post("/v1/chat/completions", json=body)
    return asyncio.run(go())


def generated(root, prompt: str, capsys) -> tuple[str, str]:
    """(`archlab generate --prompt PROMPT --max-new-tokens 12` cut at <|im_end|>, finish reason)."""
    capsys.readouterr()
    assert main(["generate", str(root), "--prompt", prompt, "--max-new-tokens", "12"]) == 0
    whole = capsys.readouterr().out[len(prompt):-1]
    return whole.split(END)[0], "stop" if END in whole else "length"


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one-turn", "system", "history"])
def test_chat_answers_equal_generate_on_the_rendered_prompt(served, capsys, messages):
    root, engine = served
    expected, reason = generated(root, render(root, messages), capsys)
    body = {"messages": messages, "max_tokens": 12, "temperature": 0}
    full = post(engine, body).json()["choices"][0]
    assert full["message"]["content"] == expected and full["finish_reason"] == reason
    r = post(engine, {**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == reason


def test_the_end_of_turn_token_is_the_templates(served):
    """ChatML writes <|im_end|> after an answer: the server stops there besides the end-of-text token."""
    _, engine = served
    assert engine.end_of_turn() == (engine.tokenizer.token_to_id(END),)
    assert generated_reasons(engine) >= {"stop"}


def generated_reasons(engine) -> set[str]:
    return {post(engine, {"messages": m, "max_tokens": 12, "temperature": 0}).json()["choices"][0]["finish_reason"]
            for m in CONVERSATIONS}


def test_completions_on_a_chat_model_end_at_the_end_of_turn_without_showing_it(served, capsys):
    """/v1/completions of the rendered prompt answers what the chat endpoint answers: cut at <|im_end|>, which is
    not in the text (finish_reason "stop"), as vLLM stops at a chat model's end-of-turn and skips special tokens."""
    root, engine = served
    messages = CONVERSATIONS[0]
    expected, reason = generated(root, render(root, messages), capsys)
    assert reason == "stop", "the fixture's answer must reach <|im_end|>: the test would prove nothing"

    async def go():
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return await client.post("/v1/completions", json={"prompt": render(root, messages), "max_tokens": 12,
                                                              "temperature": 0})
    choice = asyncio.run(go()).json()["choices"][0]
    assert END not in choice["text"]
    assert choice["text"] == expected and choice["finish_reason"] == "stop"
