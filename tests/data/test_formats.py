"""The data-format registry (data/formats.py): each format recognised from a .jsonl file and from a prepared folder,
mixed and unknown files refused naming the file and line, and every method reading exactly its formats."""
from __future__ import annotations

import json
import re

import pytest

from archlab.data.formats import FORMATS, detect, line_format, require
from archlab.errors import UserError

LINES = {
    "chat_examples": [{"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "2+2=", "completion": "4"}],
    "preference_pairs": [{"prompt": "Sky?", "chosen": "Blue", "rejected": "Green"},
                         {"chosen": "Sky? Blue", "rejected": "Sky? Green"}],
    "unpaired_preferences": [{"prompt": "Sky?", "completion": "Blue", "label": True},
                             {"prompt": [{"role": "user", "content": "Sky?"}],
                              "completion": [{"role": "assistant", "content": "Green"}], "label": False}],
    "prompts": [{"prompt": "2+2=", "answer": "4"}, {"prompt": [{"role": "user", "content": "hi"}]}],
    "seq2seq_pairs": [{"source": "Hallo", "target": "Hello"}],
}


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("name", sorted(LINES))
def test_a_jsonl_file_is_recognised_by_its_lines(tmp_path, name):
    found = detect(_jsonl(tmp_path / "d.jsonl", LINES[name]))
    assert (found.format, found.folder) == (name, False)


@pytest.mark.parametrize("name", [n for n in FORMATS.names() if FORMATS.get(n).folder_format])
def test_a_prepared_folder_is_recognised_by_its_meta(tmp_path, name):
    (tmp_path / "meta.json").write_text(json.dumps({"format": FORMATS.get(name).folder_format, "splits": {}}))
    assert detect(tmp_path) == type(detect(tmp_path))(name, True)


def test_a_folder_without_format_is_a_token_stream(tmp_path):
    (tmp_path / "meta.json").write_text('{"splits": {}}')
    assert detect(tmp_path).format == "token_stream"


def test_mixed_unknown_and_broken_files_are_refused_naming_file_and_line(tmp_path):
    mixed = _jsonl(tmp_path / "mixed.jsonl", [LINES["chat_examples"][1], LINES["preference_pairs"][0]])
    with pytest.raises(UserError, match=r"mixed\.jsonl:2 holds preference pairs, line 1 chat examples: one format"):
        detect(mixed)
    odd = _jsonl(tmp_path / "odd.jsonl", [LINES["prompts"][0], {"text": "hi"}])
    with pytest.raises(UserError, match=r"odd\.jsonl:2 has 'text', not the fields of preference pairs, "
                                        r"unpaired preferences, chat examples, prompts or .*chat examples: "
                                        r"messages or prompt\+completion"):
        detect(odd)
    with pytest.raises(UserError, match=r"odd\.jsonl:2 has 'text', not the fields of prompts \(prompts: prompt\)$"):
        require(odd, ("prompts",), who="--method grpo")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n\n[1, 2\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:3: not valid JSON"):
        detect(tmp_path / "bad.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(UserError, match=r"empty\.jsonl holds no lines"):
        detect(tmp_path / "empty.jsonl")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(UserError, match=r"notes\.txt is a file but not a \.jsonl"):
        detect(tmp_path / "notes.txt")
    with pytest.raises(UserError, match=r"gone\.jsonl: no such file or folder"):
        detect(tmp_path / "gone.jsonl")


def test_a_line_of_no_format_and_precedence():
    assert line_format({"prompt": "a", "chosen": "b", "rejected": "c"}) == "preference_pairs"   # not prompts
    assert line_format({"prompt": "a", "completion": "b"}) == "chat_examples"                    # not prompts
    assert line_format({"prompt": "a", "chosen": "b"}) == "preference_pairs"   # its reader names the missing field
    assert line_format({"text": "b"}) is None and line_format([1]) is None


def test_require_names_the_format_found_and_those_accepted(tmp_path):
    prefs = _jsonl(tmp_path / "prefs.jsonl", LINES["preference_pairs"])
    with pytest.raises(UserError, match=r"^--data \S+prefs\.jsonl is a file of preference pairs; --method sft reads "
                                        r"chat examples or seq2seq \(source/target\) pairs$"):
        require(prefs, ("chat_examples", "seq2seq_pairs"), who="--method sft")
    assert require(prefs, ("preference_pairs",), who="--method dpo").format == "preference_pairs"


# what each method reads: a table a reviewer can check against the methods' docs
ACCEPTS = {
    "pretrain": {"token_stream", "seq2seq_pairs", "chat_examples"},
    "sft": {"chat_examples", "seq2seq_pairs"},
    "dpo": {"preference_pairs", "unpaired_preferences"},
    "reward": {"preference_pairs"},
    "grpo": {"prompts"},
    "ppo": {"prompts"},
}


def test_every_method_reads_exactly_its_formats(tmp_path):
    from archlab.training.config import TrainConfig
    from archlab.training.methods import METHODS, select

    assert set(METHODS.names()) == set(ACCEPTS)
    paths = {}
    for name in FORMATS.names():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "meta.json").write_text(json.dumps({"format": FORMATS.get(name).folder_format, "splits": {}}))
        paths[name] = folder
    for method, accepted in ACCEPTS.items():
        assert set(METHODS.get(method).data_formats) == accepted, method
        for name, folder in paths.items():
            cfg = TrainConfig(method=method)
            if name in accepted:
                assert select(cfg, folder) == method
            else:
                with pytest.raises(UserError, match=rf"is a folder of {re.escape(FORMATS.get(name).summary)}; "
                                                    rf"train.method={method} reads"):
                    select(cfg, folder)


@pytest.mark.parametrize("name", [n for n in FORMATS.names() if FORMATS.get(n).folder_format])
def test_a_folder_handed_to_another_reader_is_named_with_its_own_reader(tmp_path, name):
    import importlib

    from archlab.data.tokens import load_meta
    fmt = FORMATS.get(name)
    module, _, attr = fmt.reader.rpartition(".")
    assert callable(getattr(importlib.import_module(module), attr))          # the reader named exists
    (tmp_path / "meta.json").write_text(json.dumps({"format": fmt.folder_format, "splits": {}}))
    other = "archlab-pairs" if name == "token_stream" else "archlab-tokens"
    with pytest.raises(UserError, match=re.escape(f"is {fmt.folder_summary}, not ") + ".*" +
                       re.escape(f": read it with {fmt.reader}")):
        load_meta(tmp_path, expect=other)
    assert load_meta(tmp_path, expect=fmt.folder_format)["format"] == fmt.folder_format
