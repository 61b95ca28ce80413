"""The server's text leaves special tokens out, as transformers' decode(ids, skip_special_tokens=True) does and as
vLLM answers by default: /v1/completions on a chat model whose answer writes <|im_start|> mid-way shows the text
around it, never the token. BaseTokenizer.decode(skip_special_tokens=True) is checked against transformers' own
decode of the same tokenizer.json."""
from __future__ import annotations

import asyncio

import pytest
import torch
from chat_run import FIRST, make_chat_run, render

import archlab
from archlab.runs.checkpoint import save_checkpoint

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
transformers = pytest.importorskip("transformers")
from archlab.serve import Engine, create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
START, END = "<|im_start|>", "<|im_end|>"


def hf_tokenizer(folder):
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))


def test_decode_skips_the_tokens_transformers_skips(tmp_path):
    root, _, tok = make_chat_run(tmp_path)
    hf = hf_tokenizer(root / "tokenizer")
    text = f"{START}user\nhello {END}\n{START}assistant\nwørld ✓<|endoftext|> done{END}"
    ids = tok.encode(text)
    specials = {tok.token_to_id(s) for s in (START, END, "<|endoftext|>")}
    assert specials <= set(ids) and None not in specials
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False) == text
    skipped = tok.decode(ids, skip_special_tokens=True)
    assert skipped == hf.decode(ids, skip_special_tokens=True) == "user\nhello \nassistant\nwørld ✓ done"


@pytest.fixture(scope="module")
def writes_a_special(tmp_path_factory):
    """A chat run whose greedy answer writes <|im_start|> at its second token (its head row doubled from the token
    the model would write there), then goes on; the answer's ids as archlab.generate decodes them."""
    root, model, tok = make_chat_run(tmp_path_factory.mktemp("special"))
    prompt = tok.encode(render(root, [{"role": "user", "content": FIRST}]))
    plain = archlab.generate(model, torch.tensor(prompt), 12)[len(prompt):].tolist()
    with torch.no_grad():
        model.lm_head.weight[tok.token_to_id(START)] = 2 * model.lm_head.weight[plain[1]]
    save_checkpoint(root / "checkpoints", 2, model.state_dict(), {})
    answer = archlab.generate(model, torch.tensor(prompt), 12)[len(prompt):].tolist()
    stops = {tok.token_to_id(END), tok.eot_id}
    cut = next((i for i, t in enumerate(answer) if t in stops), len(answer))
    return root, prompt, answer[:cut]


def test_completions_show_no_special_tokens(writes_a_special):
    root, prompt, answer = writes_a_special
    start = archlab.tokenizer.load(root / "tokenizer").token_to_id(START)
    assert start in answer[:2], "the answer must write <|im_start|>: the test would prove nothing"
    assert [t for t in answer if t != start], "the answer must hold ordinary tokens too"

    async def go():
        transport = httpx.ASGITransport(app=create_app(Engine.from_folder(root)))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return await client.post("/v1/completions", json={"prompt": render(root, [{"role": "user",
                                     "content": FIRST}]), "max_tokens": 12, "temperature": 0})
    choice = asyncio.run(go()).json()["choices"][0]
    expected = hf_tokenizer(root / "tokenizer").decode(answer, skip_special_tokens=True)
    assert START not in choice["text"] and choice["text"] == expected
