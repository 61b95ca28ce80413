"""`archlab tokenizer train|stats` end to end on a tiny corpus."""
from __future__ import annotations

import json

import pytest

from archlab.cli import build_parser, main
from archlab.tokenizer import load

TEXT = "to be or not to be, that is the question.\nwhether 'tis nobler in the mind to suffer\n" * 50


@pytest.mark.parametrize("kind,vocab", [("bpe", 300), ("wordpiece", 540), ("unigram", 300)])
def test_train_then_stats(tmp_path, capsys, kind, vocab):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(TEXT)
    (tmp_path / "b.txt").write_text(TEXT.upper())
    out = tmp_path / "tok"
    rc = main(["tokenizer", "train", "--input", str(tmp_path / "corpus"), str(tmp_path / "b.txt"),
               "--vocab-size", str(vocab), "--kind", kind, "--out", str(out), "--workers", "1", "--no-progress"])
    assert rc == 0
    tok = load(out)
    assert tok.kind == kind and tok.vocab_size <= vocab
    assert tok.decode(tok.encode(TEXT)) == TEXT
    capsys.readouterr()
    assert main(["tokenizer", "stats", str(out), "--input", str(tmp_path / "b.txt"), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["bytes"] == len(TEXT.encode())
    assert stats["tokens"] == len(tok.encode(TEXT.upper()))
    assert 1.0 < stats["bytes_per_token"] and 0 < stats["vocab_used_fraction"] <= 1


def test_every_option_has_help_and_commands_have_examples():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    tok_parser = sub.choices["tokenizer"]
    tok_sub = next(a for a in tok_parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name in ("train", "stats"):
        p = tok_sub.choices[name]
        assert "example" in p.description.lower()
        for action in p._actions:
            assert action.help, f"{name} {action.dest} has no help"


def test_missing_input_is_an_error(tmp_path, capsys):
    rc = main(["tokenizer", "train", "--input", str(tmp_path / "nope"), "--vocab-size", "300",
               "--out", str(tmp_path / "o"), "--no-progress"])
    assert rc == 2 and "no such file" in capsys.readouterr().err


def test_train_refuses_an_existing_folder_before_any_work(tmp_path, capsys):
    (tmp_path / "c.txt").write_text("hello world " * 20)
    out = tmp_path / "tok"
    out.mkdir()
    (out / "tokenizer.json").write_text("precious")
    rc = main(["tokenizer", "train", "--input", str(tmp_path / "c.txt"), "--vocab-size", "300", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 2 and "--overwrite" in captured.err and "train bpe" not in captured.err   # no bar drawn
    assert (out / "tokenizer.json").read_text() == "precious"
    rc = main(["tokenizer", "train", "--input", str(tmp_path / "c.txt"), "--vocab-size", "300", "--out", str(out),
               "--overwrite", "--no-progress"])
    assert rc == 0 and (out / "tokenizer.json").read_text().startswith("{")


def test_an_empty_special_token_is_one_line(tmp_path, capsys):
    (tmp_path / "c.txt").write_text("hello world " * 20)
    rc = main(["tokenizer", "train", "--input", str(tmp_path / "c.txt"), "--vocab-size", "300",
               "--special-tokens", "", "--out", str(tmp_path / "tok")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "empty string" in err and not (tmp_path / "tok").exists()


@pytest.mark.parametrize("kind", ["bpe", "wordpiece", "unigram"])
def test_a_single_byte_special_token_is_refused_clearly(tmp_path, capsys, kind):
    (tmp_path / "c.txt").write_text("hello world a b c " * 30)
    rc = main(["tokenizer", "train", "--input", str(tmp_path / "c.txt"), "--vocab-size", "600", "--kind", kind,
               "--special-tokens", "a", "--out", str(tmp_path / "tok"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "'a' must be at least two bytes" in err
    assert not (tmp_path / "tok").exists()


def test_input_takes_builtin_corpus_names_as_data_prepare_does(tmp_path):
    """`--input pystdlib` reads the files `data prepare --corpus pystdlib` reads (listing only: no training)."""
    from archlab.cli.tokenizer import text_files
    from archlab.data.corpora import corpus_files

    (tmp_path / "extra.txt").write_text(TEXT)
    assert text_files(["pystdlib", str(tmp_path / "extra.txt")]) == [*corpus_files("pystdlib"), tmp_path / "extra.txt"]


def test_help_example_inputs_are_text():
    """The first --help example trains on a corpus name, not on a prepared data folder's token files."""
    import shlex

    from archlab.cli.tokenizer import TRAIN_EXAMPLE
    from archlab.data.corpora import BUILTIN_CORPORA

    first = shlex.split(TRAIN_EXAMPLE.split("\n", 1)[1].replace("\\\n", " ").split("\n")[0])
    assert first[first.index("--input") + 1] in BUILTIN_CORPORA


def test_binary_input_is_refused_naming_the_file(tmp_path, capsys):
    """A prepared data folder (token ids in train.bin) is refused before any training, not warned about."""
    import numpy as np

    folder = tmp_path / "data"
    folder.mkdir()
    np.arange(300, dtype=np.uint16).tofile(folder / "train.bin")
    (folder / "meta.json").write_text("{}")
    rc = main(["tokenizer", "train", "--input", str(folder), "--vocab-size", "300", "--no-progress",
               "--out", str(tmp_path / "tok")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "train.bin is binary (a NUL byte at offset 0)" in err
    assert not (tmp_path / "tok").exists()


def test_a_vocabulary_the_text_cannot_fill_is_reported(tmp_path, capsys):
    """`--vocab-size 1000000000` on a small text: as many tokens as the text yields, and a note saying so."""
    (tmp_path / "a.txt").write_text(TEXT)
    assert main(["tokenizer", "train", "--input", str(tmp_path / "a.txt"), "--vocab-size", "1000000000",
                 "--no-progress", "--workers", "1", "--out", str(tmp_path / "tok")]) == 0
    n = load(tmp_path / "tok").vocab_size
    assert n < 1000
    assert f"note: {n:,} tokens, not the 1,000,000,000 asked for" in capsys.readouterr().err
