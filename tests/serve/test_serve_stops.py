"""Stop strings in served completions: the text ends just before the first stop, and no delta ever carries text
that a later token turns into a stop (it cannot be taken back), so streamed and non-streamed answers are the
same. The model here follows a script (a forward hook sets its logits), so any text and any stop can be tried;
the reference cut is a regular expression's leftmost match."""
from __future__ import annotations

import asyncio
import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from variants import BASE

import archlab
from archlab.serve.stops import first_stop, releasable, settled_stop
from archlab.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from archlab.serve import CompletionRequest, Engine, create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "x"


def reference_cut(text: str, stops: list[str]) -> str:
    """OpenAI's stop rule, independently: the text before the leftmost occurrence of any stop."""
    return re.split("|".join(map(re.escape, stops)), text, maxsplit=1)[0]


class Script:
    """A tiny model whose greedy (and sampled) continuation of PROMPT is `text`, then end-of-text."""

    def __init__(self):
        cfg = BASE.with_overrides({"vocab_size": 257, "max_seq_len": 64})
        self.model = archlab.TransformerLM(cfg).eval()
        self.tokenizer = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
        self.ids: list[int] = []
        self.model.register_forward_hook(self._logits, with_kwargs=True)

    def say(self, text: str) -> Script:
        self.ids = self.tokenizer.encode(PROMPT + text)
        return self

    def _logits(self, module, args, kwargs, output):
        positions = kwargs["positions"]                                         # (b, t): each row's own
        eot = self.tokenizer.eot_id
        following = [[self.ids[p + 1] if p + 1 < len(self.ids) else eot for p in row] for row in positions.tolist()]
        logits = torch.full_like(output, -1e4)                                  # (b, t, v)
        return logits.scatter_(-1, torch.tensor(following)[..., None], 0.0)


@pytest.fixture(scope="module")
def script():
    return Script()


@pytest.fixture(scope="module")
def engine(script):
    return Engine(script.model, script.tokenizer, "tiny")


def call(engine, body: dict):
    async def go():
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return await client.post("/v1/completions", json=body)
    return asyncio.run(go())


def streamed(engine, body: dict) -> tuple[list[str], str | None]:
    """(the text of each chunk, the last finish_reason) of a streamed request."""
    r = call(engine, {**body, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return [e["choices"][0]["text"] for e in events], events[-1]["choices"][0]["finish_reason"]


@pytest.mark.parametrize("said, stop, want, reason", [
    (" ant at the end", [" the"], " ant at", "stop"),
    (" ant at th", [" the"], " ant at th", "stop"),                 # end-of-text: the held " th" goes out
    (" the end", [" the"], "", "stop"),
    (" ant at the end", ["zz", "t a", " the"], " an", "stop"),      # the earliest of several
    (" ant at the end", ["end", "nt"], " a", "stop"),
])
def test_streamed_and_whole_answers_stop_just_before_the_stop(script, engine, said, stop, want, reason):
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stop": stop}
    script.say(said)
    whole = call(engine, body).json()["choices"][0]
    chunks, last_reason = streamed(engine, body)
    assert whole["text"] == "".join(chunks) == want == reference_cut(said, stop)
    assert whole["finish_reason"] == last_reason == reason


def test_a_length_stop_releases_what_was_held(script, engine):
    script.say(" ant at the end")
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "stop": [" the"]}   # ends inside " th"
    chunks, reason = streamed(engine, body)
    assert "".join(chunks) == call(engine, body).json()["choices"][0]["text"] == " ant at th" and reason == "length"
    assert chunks[-1].endswith(" th")                               # held until the last chunk, not leaked before


ALPHABET = "ab \né"           # é is two byte tokens: a partly decoded character is held back too


@settings(max_examples=40, deadline=None)
@given(text=st.text(ALPHABET, max_size=16), stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1,
                                                           max_size=3), cut=st.integers(1, 40))
def test_deltas_join_to_the_reference_cut_for_any_text_and_stops(script, engine, text, stops, cut):
    """Over random texts, stops and max_tokens: the deltas join to the reference cut of the text the tokens
    decode to, and the finish reason is `length` only where max_tokens ended it before any stop."""
    script.say(text)
    deltas = list(engine.complete(CompletionRequest(PROMPT, max_tokens=cut, temperature=0, stop=stops)))
    data = text.encode()
    decoded = data[:cut].decode("utf-8", errors="replace")
    want = reference_cut(decoded, stops)
    assert "".join(d.text for d in deltas) == want
    stopped_by_string = want != decoded
    assert deltas[-1].finish_reason == ("length" if cut <= len(data) and not stopped_by_string else "stop")


@pytest.mark.parametrize("cut", [2, 3, 9])
def test_a_stop_that_starts_earlier_wins_over_one_found_first(script, engine, cut):
    """' ' is found when 'a ' is out, but 'a a' starts before it: OpenAI's leftmost rule waits for the next
    token (found by the test above: the engine once ended at ' ' and answered 'a')."""
    script.say("a a")
    deltas = list(engine.complete(CompletionRequest(PROMPT, max_tokens=cut, temperature=0, stop=[" ", "a a"])))
    assert "".join(d.text for d in deltas) == ("a" if cut == 2 else "")
    assert deltas[-1].finish_reason == "stop"
    assert settled_stop("a ", [" ", "a a"]) is None and settled_stop("a a", [" ", "a a"]) == 0
    assert settled_stop("b a", [" ", "a a"]) == 1


@settings(max_examples=300, deadline=None)
@given(text=st.text("ab \n", max_size=12), stops=st.lists(st.text("ab \n", min_size=1, max_size=4), min_size=1,
                                                          max_size=3))
def test_only_a_possible_stop_beginning_is_held(text, stops):
    """What releasable holds back is the beginning of some stop (nothing more), and what it releases never
    reaches into an occurrence of a stop in any continuation."""
    if first_stop(text, stops) is not None:
        return
    end = releasable(text, stops)
    held = text[end:]
    assert held == "" or any(s.startswith(held) and s != held for s in stops)
    for stop in stops:                                              # the worst continuation: a stop right away
        for k in range(len(stop)):
            longer = text + stop[k:]
            assert len(reference_cut(longer, stops)) >= end or not longer.endswith(stop)


def test_first_stop_is_the_leftmost_of_all_stops():
    assert first_stop("abcdef", ["de", "bc", "zz"]) == 1 and first_stop("abc", ["x"]) is None
    assert releasable("ant at th", [" the"]) == 6 and releasable("ab\ufffd", ["zz"]) == 2
