"""`archlab demo --quick` runs every stage on a local corpus and leaves a complete run folder."""
from __future__ import annotations

import random

import pytest

from archlab.cli import main as cli_main
from archlab.demo import run_demo

WORDS = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    rng = random.Random(0)
    for i in range(2):
        (folder / f"play{i}.txt").write_text(
            "\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(400)))
    return folder


def test_quick_demo_trains_and_leaves_a_run_folder(tmp_path, corpus):
    lines = []
    result = run_demo(tmp_path / "demo", quick=True, corpus=str(corpus), progress=False, log=lines.append)
    assert result.val_ppl_after < result.val_ppl_before
    assert result.sample.startswith("ROMEO:")
    for name in ("config.yaml", "metrics.jsonl", "loss_curve.png", "samples.txt", "tokenizer", "data"):
        assert (tmp_path / "demo" / name).exists(), name
    assert any("run folder:" in line and str(tmp_path / "demo") in line for line in lines)
    # a second demo replaces the first
    run_demo(tmp_path / "demo", quick=True, corpus=str(corpus), progress=False, log=lambda *_: None)


def test_demo_never_clears_a_folder_it_did_not_write(tmp_path, corpus, capsys):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("...")
    assert cli_main(["demo", "--quick", "--out", str(precious), "--corpus", str(corpus)]) == 2
    assert "not an earlier demo run" in capsys.readouterr().err
    assert (precious / "thesis.tex").exists()
