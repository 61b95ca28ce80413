"""A single text file is one document: data prepare holds out none of it, says so, and eval's error names the fix."""
from __future__ import annotations

from pathlib import Path

from archlab.cli import main

FIXTURE = Path(__file__).parents[1] / "fixtures" / "run_v1"


def test_one_file_leaves_val_empty_which_prepare_and_eval_say(tmp_path, capsys):
    (tmp_path / "one.txt").write_text("to be or not to be, that is the question. " * 50)
    assert main(["data", "prepare", "--corpus", str(tmp_path / "one.txt"), "--tokenizer", str(FIXTURE / "tokenizer"),
                 "--out", str(tmp_path / "data"), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "note: the val split is empty" in err and "a .jsonl of documents" in err, err
    assert main(["eval", str(FIXTURE), "--data", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "the val split of" in err and "is empty" in err and "--split train" in err, err
    assert main(["eval", str(FIXTURE), "--data", str(tmp_path / "data"), "--split", "train", "--batches", "1"]) == 0


def test_a_corpus_with_a_val_split_gets_no_note(tmp_path, capsys):
    (tmp_path / "corpus").mkdir()
    for i in range(40):
        (tmp_path / "corpus" / f"d{i}.txt").write_text(f"document {i} says something. " * 5)
    assert main(["data", "prepare", "--corpus", str(tmp_path / "corpus"), "--tokenizer", str(FIXTURE / "tokenizer"),
                 "--out", str(tmp_path / "data"), "--quiet"]) == 0
    out = capsys.readouterr()
    assert "val split is empty" not in out.err and " 0 docs" not in out.out, out
