"""Chat and preference lines in the forms users have them (TRL's implicit prompt, content as text parts) read as
their explicit forms do; bytes that are not UTF-8 and over-long examples are refused naming the file, the line and
the setting to change."""
from __future__ import annotations

import json

import pytest

import archlab
from archlab.data.chat import ChatDataError, load_chat_data, read_conversations
from archlab.data.chat_seq2seq import read_chat_seq2seq
from archlab.data.preference import extract_prompt, load_preference_data
from archlab.tokenizer import Tokenizer
from archlab.tokenizer.chat_builtin import install_chat_template

U, A = "user", "assistant"


def _m(role: str, content) -> dict:
    return {"role": role, "content": content}


IMPLICIT = [   # TRL's implicit-prompt lines: chosen and rejected share the prompt as their start
    {"chosen": [_m(U, "sky?"), _m(A, "blue")], "rejected": [_m(U, "sky?"), _m(A, "green")]},
    {"chosen": [_m("system", "be brief"), _m(U, "sun?"), _m(A, "up")],
     "rejected": [_m("system", "be brief"), _m(U, "sun?"), _m(A, "down there")]},
    {"chosen": "The sky is blue.", "rejected": "The sky is green."},
    {"chosen": "Q: 2+2? A: 4", "rejected": "Q: 2+2? A: 5 or so"},
    {"chosen": "abc xyz", "rejected": "abd"},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"]).save(root / "tok")
    install_chat_template(root / "tok", "chatml")
    return root / "tok"


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_extract_prompt_equals_trls(tmp_path):
    trl_data_utils = pytest.importorskip("trl.data_utils")
    for line in IMPLICIT + [{"chosen": "same start", "rejected": "same start and more"}]:
        assert extract_prompt(line["chosen"], line["rejected"]) == trl_data_utils.extract_prompt(dict(line))


def test_implicit_prompt_lines_encode_as_trls_explicit_split(tmp_path, tok):
    trl_data_utils = pytest.importorskip("trl.data_utils")
    implicit = load_preference_data(_jsonl(tmp_path / "implicit.jsonl", IMPLICIT), tok, progress=False)
    explicit = load_preference_data(_jsonl(tmp_path / "explicit.jsonl",
                                           [trl_data_utils.extract_prompt(dict(r)) for r in IMPLICIT]), tok,
                                    progress=False)
    assert [(p.chosen, p.rejected) for p in implicit.pairs] == [(p.chosen, p.rejected) for p in explicit.pairs]
    assert len(implicit.pairs) == len(IMPLICIT)


def test_implicit_lines_without_a_shared_start_are_refused_naming_the_line(tmp_path, tok):
    path = _jsonl(tmp_path / "p.jsonl", [IMPLICIT[2], {"chosen": "yes", "rejected": "no"}])
    with pytest.raises(ChatDataError, match=r"p\.jsonl:2 has no .prompt.*share no start"):
        load_preference_data(path, tok, progress=False)
    path = _jsonl(tmp_path / "q.jsonl", [{"chosen": "yes", "rejected": [_m(A, "no")]}])
    with pytest.raises(ChatDataError, match=r"q\.jsonl:1 has no 'prompt', and chosen and rejected are not both"):
        load_preference_data(path, tok, progress=False)


def test_content_as_text_parts_reads_as_its_text(tmp_path, tok):
    parts = [{"messages": [_m(U, [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]),
                           _m(A, [{"type": "text", "text": "hi"}])]}]
    plain = [{"messages": [_m(U, "hello"), _m(A, "hi")]}]
    a = load_chat_data(_jsonl(tmp_path / "parts.jsonl", parts), tok, progress=False).examples
    b = load_chat_data(_jsonl(tmp_path / "plain.jsonl", plain), tok, progress=False).examples
    assert [(e.input_ids, e.labels) for e in a] == [(e.input_ids, e.labels) for e in b]
    odd = [{"messages": [_m(U, [{"type": "image_url", "image_url": {"url": "x.png"}}]), _m(A, "hi")]}]
    with pytest.raises(ChatDataError, match=r"odd\.jsonl:1: messages\[0\]: content\[0\] has type 'image_url': "
                                            "only text parts"):
        list(read_conversations(_jsonl(tmp_path / "odd.jsonl", odd)))


@pytest.mark.parametrize("kind", ["chat", "preference"])
def test_bytes_that_are_not_utf8_are_refused_naming_file_and_line(tmp_path, tok, kind):
    line = ({"messages": [_m(U, "caf\u00e9"), _m(A, "ok")]} if kind == "chat"
            else {"prompt": "caf\u00e9", "chosen": " a", "rejected": " b"})
    good = json.dumps(line, ensure_ascii=False).encode()
    path = tmp_path / "bad.jsonl"
    path.write_bytes(good + b"\n" + good.replace("\u00e9".encode(), b"\xe9") + b"\n")   # latin-1 on line 2
    with pytest.raises(ChatDataError, match=r"bad\.jsonl:2: not valid UTF-8 \(byte 0xe9"):
        if kind == "chat":
            load_chat_data(path, tok, progress=False)
        else:
            load_preference_data(path, tok, progress=False)
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\n")              # a byte-order mark is no error
    assert len(list(read_conversations(path)) if kind == "chat" else
               load_preference_data(path, tok, progress=False).pairs) == 1


def test_the_truncation_error_names_the_setting(tmp_path, tok):
    path = _jsonl(tmp_path / "long.jsonl", [{"messages": [_m(U, "x" * 80), _m(A, "y" * 40)]}])
    with pytest.raises(ChatDataError, match=r"long\.jsonl:1: .*more than the limit of 32: choose a policy with "
                                            r"train\.truncation \(refuse, keep_start"):
        load_chat_data(path, tok, max_tokens=32, progress=False, setting="train.truncation")
    with pytest.raises(ChatDataError, match=r"long\.jsonl:1: the source: .*choose a policy with train\.truncation"):
        list(read_chat_seq2seq(path, tok, max_len=32, setting="train.truncation"))


def test_finetune_names_train_truncation(tmp_path, tok, capsys):
    """Through the command line: the key a user sets (train.sft.truncation), not the Python argument."""
    import shutil

    from archlab.cli import main
    from archlab.runs.checkpoint import save_checkpoint
    from archlab.runs.model_folder import write_run_config

    cfg = archlab.presets.tiny("llama2-7b").with_overrides({"vocab_size": 260, "max_seq_len": 64})
    base = tmp_path / "base"
    base.mkdir()
    write_run_config(base, cfg.to_dict(), {}, {})
    save_checkpoint(base / "checkpoints", 1, archlab.TransformerLM(cfg).state_dict(), {})
    shutil.copytree(tok, base / "tokenizer")
    data = _jsonl(tmp_path / "long.jsonl", [{"messages": [_m(U, "x" * 80), _m(A, "y" * 40)]}] * 4)
    capsys.readouterr()
    rc = main(["finetune", str(base), "--data", data, "--out", str(tmp_path / "run"), "--no-progress",
               "--set", "train.seq_len=32"])
    err = capsys.readouterr().err
    assert rc == 2 and "choose a policy with train.sft.truncation" in err, err
