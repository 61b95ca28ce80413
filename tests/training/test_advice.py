"""Errors that tell a command-line user what to do in command-line terms: DPO on chat messages without a template,
`eval` on a DPO run, `--init-from` on data another tokenizer prepared (which tokenizers differ, not "set
vocab_size")."""
from __future__ import annotations

import json
import random

import pytest
from test_checkpoint import tiny_model

from archlab.cli import main
from archlab.tokenizer import train as train_tokenizer
from archlab.tokenizer.chat import ChatTokenizer
from archlab.training.config import TrainConfig
from archlab.training.trainer import train

WORDS = ["red", "green", "blue", "cat", "dog", "good", "bad"]
COMMON = ["--no-progress", "--set", "train.batch_size=4", "--set", "train.seq_len=32", "--set", "train.budget=2",
          "--set", "train.sample_every=-1", "--set", "train.warmup_steps=0"]


def _prepare(root, corpus_text: str, vocab: int, name: str):
    corpus = root / f"corpus-{name}"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"d{i}.txt").write_text(corpus_text)
    train_tokenizer(corpus / "d0.txt", vocab, ["<|endoftext|>"]).save(root / f"tok-{name}")
    assert main(["data", "prepare", "--corpus", str(corpus), "--tokenizer", str(root / f"tok-{name}"), "--out",
                 str(root / f"data-{name}"), "--workers", "0", "--quiet"]) == 0
    return root / f"tok-{name}", root / f"data-{name}"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tokenizer without a chat template, a base trained 2 steps on its data, and data of a larger tokenizer."""
    root = tmp_path_factory.mktemp("advice")
    rng = random.Random(0)
    tok, data = _prepare(root, " ".join(rng.choice(WORDS) for _ in range(300)) + ": good bad\n", 270, "base")
    vocab = ChatTokenizer.of(tok).tokenizer.vocab_size
    train(tiny_model().with_overrides({"vocab_size": int(vocab)}), TrainConfig(
        batch_size=4, seq_len=32, budget=2, lr=3e-3, warmup_steps=0, eval_batches=1, sample_every=-1),
        data, root / "base", progress=False)
    letters = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(6000))
    other_tok, other = _prepare(root, letters, 400, "other")
    assert ChatTokenizer.of(other_tok).tokenizer.vocab_size > vocab, "the test needs a larger vocabulary"
    line = {"prompt": [{"role": "user", "content": "red cat"}], "chosen": [{"role": "assistant", "content": "good"}],
            "rejected": [{"role": "assistant", "content": "bad"}]}
    (root / "messages.jsonl").write_text(json.dumps(line) + "\n" * 2)
    (root / "prefs.jsonl").write_text("".join(json.dumps({"prompt": f"{w} cat:", "chosen": " good",
                                                          "rejected": " bad"}) + "\n" for w in WORDS))
    return root


def _error(capsys, argv) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_dpo_on_messages_without_a_template_says_the_command_line_way(world, tmp_path, capsys):
    err = _error(capsys, ["train", "--init-from", str(world / "base"), "--data", str(world / "messages.jsonl"),
                          "--out", str(tmp_path / "run"), *COMMON, "--set", "train.objective=dpo"])
    assert "messages.jsonl:1: these lines are chat messages" in err
    assert "--chat-template chatml" in err and "archlab finetune" in err and "plain text" in err
    assert "archlab.tokenizer" not in err and "chat_template=" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow                 # a DPO run and an eval: ~9 s on a loaded 2-core machine
def test_eval_on_a_dpo_run_says_what_eval_needs_and_where_the_dpo_figures_are(world, tmp_path, capsys):
    run = tmp_path / "dpo"
    assert main(["train", "--init-from", str(world / "base"), "--data", str(world / "prefs.jsonl"), "--out",
                 str(run), *COMMON, "--set", "train.objective=dpo", "--set", "train.dpo_val_fraction=0.3"]) == 0
    err = _error(capsys, ["eval", str(run)])
    assert "not a prepared data folder" not in err
    assert "DPO run" in err and "--data" in err and "archlab data prepare" in err
    assert "metrics.jsonl" in err and "val_rewards/accuracies" in err
    assert main(["eval", str(run), "--data", str(world / "data-base")]) == 0     # the way it names works


def test_init_from_on_another_tokenizers_data_names_both_tokenizers(world, tmp_path, capsys):
    err = _error(capsys, ["train", "--init-from", str(world / "base"), "--data", str(world / "data-other"),
                          "--out", str(tmp_path / "run"), *COMMON])
    assert "set vocab_size" not in err and "different tokenizer" in err
    assert str(world / "base" / "tokenizer") in err and str(world / "data-other" / "tokenizer") in err
    assert "the tokenizers differ" in err
    assert not (tmp_path / "run").exists()
