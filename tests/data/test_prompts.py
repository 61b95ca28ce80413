"""Prompt lines for the RL methods (data/prompts.py): plain and chat prompts encode as the chat data and `archlab chat`
encode them, the other columns are kept for reward functions, and bad lines are one error naming file and line."""
from __future__ import annotations

import json

import pytest

from archlab.data.chat import ChatDataError
from archlab.data.prompts import load_prompts
from archlab.tokenizer.chat import ChatTokenizer, apply_chat_template, token_mask


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from archlab.tokenizer import train as train_bpe
    from archlab.tokenizer.chat_builtin import install_chat_template

    root = tmp_path_factory.mktemp("prompts")
    (root / "corpus.txt").write_text("\n".join(f"Reverse {w}: {w[::-1]}." for w in ["cat", "dog", "bird"] * 20))
    train_bpe(root / "corpus.txt", 280, ["<|endoftext|>"]).save(root / "tok")
    install_chat_template(root / "tok", "chatml")
    return root / "tok"


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_plain_and_chat_prompts_encode_as_the_chat_data_and_keep_their_columns(tok, tmp_path):
    messages = [{"role": "user", "content": "Reverse cat"}]
    data = load_prompts(_write(tmp_path / "p.jsonl", [{"prompt": "Reverse cat:", "answer": "tac"},
                                                      {"prompt": messages, "answer": "tac", "n": 3}]), tok)
    chat = ChatTokenizer.of(tok)
    plain, conv = data.prompts
    assert plain.ids == token_mask(chat.tokenizer, "Reverse cat:", [])[0] and plain.columns == {"answer": "tac"}
    assert conv.ids == list(apply_chat_template(tok, messages, add_generation_prompt=True))
    assert conv.prompt == messages and conv.columns == {"answer": "tac", "n": 3} and conv.line == 2
    assert data.is_chat and data.eot_id == chat.tokenizer.special_to_id["<|endoftext|>"]
    assert data.n_tokens == len(plain.ids) + len(conv.ids)


@pytest.mark.parametrize("rows,message", [
    ([{"prompt": "a"}, {"question": "b"}], r"p.jsonl:2 has no 'prompt' .*'question'"),
    ([{"prompt": 3}], r"p.jsonl:1: prompt must be text or a list of messages"),
    ([{"prompt": ""}], r"p.jsonl:1: the prompt is empty"),
    (["[1, 2]"], r"p.jsonl:1 is a JSON list"),
    (["{not json"], r"p.jsonl:1: not valid JSON"),
    ([], r"no prompts"),
    ([{"prompt": "Reverse cat Reverse dog Reverse bird Reverse cat"}], r"p.jsonl:1: the prompt has \d+ tokens, more "
                                                                      r"than the 4 train.seq_len"),
])
def test_a_bad_line_is_one_error_naming_file_and_line(tok, tmp_path, rows, message):
    with pytest.raises(ChatDataError, match=message):
        load_prompts(_write(tmp_path / "p.jsonl", rows), tok, max_tokens=4, setting="train.seq_len")


def test_chat_prompts_need_a_template(tmp_path, tok):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tok, bare)
    for name in ("chat_template.jinja",):
        (bare / name).unlink(missing_ok=True)
    config = json.loads((bare / "tokenizer_config.json").read_text()) if (bare / "tokenizer_config.json").exists() \
        else {}
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatDataError, match="no chat template"):
        load_prompts(_write(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}]), bare)
    assert not load_prompts(_write(tmp_path / "q.jsonl", [{"prompt": "hi"}]), bare).is_chat
