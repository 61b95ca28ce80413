"""What the server honours and what it refuses, as OpenAI and vLLM do: every bad value of every field is an
OpenAI-shaped JSON error with status 400/404/413/422 (never a plain-text 500, never a coerced value), `n`
and `echo` are honoured, `"model"` must name the served model, a stream that fails midway ends with an error
event, and an error inside archlab is a JSON 500."""
from __future__ import annotations

import asyncio
import json
import re

import pytest
from test_serve import expected_text
from variants import BASE

import archlab
from archlab.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from archlab.serve import Engine, create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
CHAT = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def engine():
    cfg = BASE.with_overrides({"vocab_size": 257, "init.std": 0.2, "max_seq_len": 64})
    model = archlab.TransformerLM(cfg).eval()
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    return Engine(model, tok, "tiny", chat_template=CHAT)


def send_all(engine, requests: list[tuple[str, object]]) -> list[httpx.Response]:
    """POST each (path, body) in turn through one in-process client; a body given as str/bytes goes raw."""
    async def go():
        # as over a socket: an exception the app re-raises after answering (Starlette does, to log it) stays there
        transport = httpx.ASGITransport(app=create_app(engine), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            out = []
            for path, body in requests:
                raw = isinstance(body, (str, bytes))
                out.append(await client.post(path, **({"content": body} if raw else {"json": body}),
                                             headers={"content-type": "application/json"}))
            return out
    return asyncio.run(go())


def assert_openai_error(response, statuses=(400, 404, 413, 422)):
    assert response.status_code in statuses, (response.status_code, response.text[:200])
    assert response.headers["content-type"].startswith("application/json"), response.text[:200]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    return error


OK = {"prompt": "hi", "max_tokens": 3, "temperature": 0}
BAD_VALUES = {   # field -> values OpenAI or vLLM refuse (or that would be coerced, or would 500)
    "model": ["gpt-4", 5, ["tiny"], True],
    "prompt": [5, ["a", "b"], [1, 2], {"a": 1}, True],
    "max_tokens": ["5", 3.7, True, 0, -1, 10 ** 30, 5.0],
    "temperature": ["1", True, -0.1, 2.5, [1], {"t": 1}],
    "top_p": [0, 1.5, "0.5", False], "top_k": [-2, 1.5, "3"], "min_p": [-1, 2, "0"],
    "repetition_penalty": [0, -1, 1e5, "1.1"],
    "stop": [[1, 2], {"a": 1}, [""], "", [None], ["a"] * 65, ["a", "b", "c", "d", "e"], 5, True],   # OpenAI: <= 4
    "seed": ["abc", 1.5, 2 ** 70, -(2 ** 64), True],
    "n": [0, 1000, 1.5, "2", True, -1],
    "best_of": [3, "2", 1.5],
    "logprobs": [1, 0, True, 5],
    "echo": ["true", 1],
    "suffix": ["x", 5],
    "stream": ["false", 1, "true", 0],
    "stream_options": [{"include_usage": "yes"}, 5, {"x": 1}],
    "presence_penalty": [0.5, "0"], "frequency_penalty": [1], "logit_bias": [{"5": 10}, 3],
    "user": [5],
    "suffix ": [1], "foo": [1], "use_beam_search": [True],
}
CHAT_BAD = {
    "messages": ["hi", [], [{"content": "x"}], [{"role": 5}], [{"role": "user", "content": 5}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], [5], {"a": 1},
                 [{"role": "wizard", "content": "x"}], [{"role": "user"}], [{"role": "user", "content": [5]}]],
    "logprobs": [True, 1], "top_logprobs": [2], "tools": [[{"type": "function"}]], "echo": [True],
    "response_format": [{"type": "json_object"}], "max_completion_tokens": [0, "3"], "prompt": ["hi"],
}
RAW_BAD = ["not json", "[1, 2]", '"text"', "{", "[" * 100_000 + "]" * 100_000,
           '{"prompt": ' + "[" * 50_000 + "]" * 50_000 + "}", '{"prompt": "a", "max_tokens": NaN}',
           '{"prompt": "a", "temperature": Infinity}', '{"prompt": "a", "temperature": 1e400}', b"\xff\xfe{}",
           '{"prompt": "a", "seed": ' + "9" * 5000 + "}", ""]


def test_every_bad_value_of_every_field_is_an_openai_error_never_a_500(engine):
    """Each refusal names the field it is about (a max_tokens past the context: the prompt that does not fit)."""
    messages = [{"role": "user", "content": "hi"}]
    cases = [("/v1/completions", {**OK, field: value}, field) for field, values in BAD_VALUES.items()
             for value in values]
    cases += [("/v1/chat/completions", {"messages": messages, "max_tokens": 3, field: value}, field)
              for field, values in CHAT_BAD.items() for value in values]
    cases += [("/v1/chat/completions", {"messages": messages, "max_tokens": 3, field: value}, field)
              for field in ("n", "stop", "seed", "temperature", "model") for value in BAD_VALUES[field]]
    cases += [(path, raw, None) for raw in RAW_BAD for path in ("/v1/completions", "/v1/chat/completions")]
    answers = send_all(engine, [(path, body) for path, body, _ in cases])
    for (path, body, field), response in zip(cases, answers):
        error = assert_openai_error(response)
        if field is not None:
            named = (error["param"] or "").split("[")[0].split(".")[0]
            assert named == ("prompt" if body.get(field) == 10 ** 30 else field), (path, body, error)


def test_the_named_errors_give_openais_status_and_code(engine):
    wrong_model, deep, coerced, empty_stop, big_seed = send_all(engine, [
        ("/v1/completions", {**OK, "model": "gpt-4"}), ("/v1/completions", "[" * 100_000 + "]" * 100_000),
        ("/v1/completions", {**OK, "max_tokens": "5"}), ("/v1/completions", {**OK, "stop": [""]}),
        ("/v1/completions", {**OK, "seed": 2 ** 70})])
    error = assert_openai_error(wrong_model, (404,))
    assert error["code"] == "model_not_found" and "gpt-4" in error["message"] and "tiny" in error["message"]
    assert "nested too deeply" in assert_openai_error(deep, (400,))["message"]
    assert assert_openai_error(coerced, (400,))["param"] == "max_tokens"
    assert assert_openai_error(empty_stop, (400,))["param"] == "stop"
    assert assert_openai_error(big_seed, (400,))["param"] == "seed"


def test_the_accepted_forms_are_served(engine):
    want = expected_text(engine, "hi", 3)
    plain = {"prompt": "hi", "max_tokens": 3, "temperature": 0}
    answers = send_all(engine, [
        ("/v1/completions", {**plain, "model": "tiny", "stop": None, "seed": 5, "n": 1, "best_of": 1, "echo": False,
                             "suffix": None, "logprobs": None, "stream": False, "user": "u", "presence_penalty": 0,
                             "top_k": -1, "top_p": 1, "min_p": 0.0, "repetition_penalty": 1}),
        ("/v1/completions", {**plain, "prompt": ["hi"], "temperature": 1e-45}),          # below 1e-5: greedy
        ("/v1/completions", {**plain, "stop": "\x00\x01"}),                               # a string: one stop
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "h"},
                                                                              {"type": "text", "text": "i"}]}],
                                  "max_completion_tokens": 3, "temperature": 0, "logprobs": False}),
    ])
    assert [a.status_code for a in answers] == [200] * 4, [a.text[:200] for a in answers]
    assert [a.json()["choices"][0]["text"] for a in answers[:3]] == [want] * 3
    assert answers[3].json()["choices"][0]["message"]["content"] == expected_text(engine, "<user>hi\n<assistant>", 3)


def test_n_choices_and_echo_are_honoured(engine):
    greedy, sampled, again, echoed = [a.json() for a in send_all(engine, [
        ("/v1/completions", {**OK, "n": 3}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 8, "temperature": 1, "n": 4, "seed": 7}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 8, "temperature": 1, "n": 4, "seed": 7}),
        ("/v1/completions", {**OK, "echo": True, "n": 2}),
    ])]
    want = expected_text(engine, "hi", 3)
    assert [c["index"] for c in greedy["choices"]] == [0, 1, 2] and {c["text"] for c in greedy["choices"]} == {want}
    cached = greedy["usage"].pop("prompt_tokens_details")["cached_tokens"]
    assert greedy["usage"] == {"prompt_tokens": 2, "completion_tokens": 9, "total_tokens": 11} and cached in (0, 1)
    texts = [c["text"] for c in sampled["choices"]]
    assert len(set(texts)) > 1 and texts == [c["text"] for c in again["choices"]]     # each its own, reproducible
    assert [c["text"] for c in echoed["choices"]] == ["hi" + want] * 2


def test_a_streamed_n_carries_each_choice_and_usage(engine):
    r, = send_all(engine, [("/v1/completions", {**OK, "n": 2, "stream": True, "echo": True,
                                                "stream_options": {"include_usage": True}})])
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for i in (0, 1):
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i) \
            == "hi" + expected_text(engine, "hi", 3)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_chat_streams_begin_with_the_role(engine):
    r, = send_all(engine, [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 3, "temperature": 0, "stream": True})])
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        expected_text(engine, "<user>hi\n<assistant>", 3)


def failing_engine(engine, after: int) -> Engine:
    """An engine whose model fails at its `after`-th forward (the hook is removed by the caller)."""
    calls = {"n": 0}

    def fail(*_):
        calls["n"] += 1
        if calls["n"] >= after:
            raise RuntimeError("the accelerator fell over")
    return Engine(engine.model, engine.tokenizer, "tiny"), engine.model.register_forward_hook(fail)


def test_a_stream_that_fails_midway_ends_with_an_error_event_and_done(engine):
    broken, hook = failing_engine(engine, after=3)
    try:
        r, = send_all(broken, [("/v1/completions", {**OK, "max_tokens": 10, "stream": True})])
    finally:
        hook.remove()
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 3
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "accelerator" in error["message"]
    assert all("choices" in json.loads(e) for e in events[:-2])          # text chunks came before it


def test_an_error_inside_archlab_is_a_json_500(engine):
    broken, hook = failing_engine(engine, after=1)
    try:
        r, = send_all(broken, [("/v1/completions", OK)])
    finally:
        hook.remove()
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


def test_an_unknown_route_is_an_openai_error(engine):
    r, = send_all(engine, [("/v1/embeddings", {"input": "x"})])
    assert assert_openai_error(r, (404,))["message"] == "Not Found"


def test_messages_are_refused_as_training_data_refuses_them(engine, tmp_path):
    """One rule for both (archlab.tokenizer.messages): an unknown role or a missing content is a 400 naming the
    message's field here and an error naming the line in finetune's data."""
    from archlab.data.chat import ChatDataError, read_conversations

    cases = [([{"role": "wizard", "content": "x"}], "messages[0].role", "unknown role 'wizard'"),
             ([{"role": "user", "content": "a"}, {"role": "user"}], "messages[1].content", "has no 'content'"),
             ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content", "type 'image_url'"),
             ([{"role": "user", "content": None}], "messages[0].content", "content is a JSON null")]
    answers = send_all(engine, [("/v1/chat/completions", {"messages": m, "max_tokens": 2}) for m, _, _ in cases])
    for (messages, param, why), response in zip(cases, answers):
        error = assert_openai_error(response, (400,))
        assert error["param"] == param and why in error["message"], error
        data = tmp_path / "chat.jsonl"
        data.write_text(json.dumps({"messages": messages}) + "\n")
        with pytest.raises(ChatDataError, match=rf"chat\.jsonl:1: .*{re.escape(why)}"):
            list(read_conversations(data))


def test_an_assistant_turn_with_null_content_is_served_as_openai_serves_it(engine):
    """OpenAI's assistant turn that only called tools has content null: it reads as an empty turn."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": "x"}]
    (answer,) = send_all(engine, [("/v1/chat/completions", {"messages": messages, "max_tokens": 2, "temperature": 0})])
    assert answer.status_code == 200, answer.text[:200]
