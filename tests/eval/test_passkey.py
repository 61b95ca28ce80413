"""Passkey retrieval (Mohtashami & Jaggi 2023): prompts of the asked length with the key at the asked depth; a
trial passes exactly when the greedy continuation repeats the key; the CLI's accuracy table."""
from __future__ import annotations

import json

import pytest
import torch

from archlab.data.tokenizer_adapter import ByteTokenizer
from archlab.eval import passkey
from archlab.eval.passkey import FILLER, NEEDLE, PREAMBLE, QUESTION, passkey_accuracy, passkey_prompt

TOK = ByteTokenizer()


@pytest.mark.parametrize("n, depth", [(400, 0.0), (400, 1.0), (1000, 0.5), (1000, 0.25)])
def test_prompt_has_the_asked_length_and_the_key_at_the_asked_depth(n, depth):
    prompt = passkey_prompt(TOK, n, depth, "40917")
    text = TOK.decode(prompt.ids)
    assert n - len(FILLER) < len(prompt.ids) <= n          # bytes: one token per byte
    needle = NEEDLE.format(key="40917")
    assert text.startswith(PREAMBLE) and text.endswith(QUESTION) and text.count(needle) == 1
    before, after = text[len(PREAMBLE):-len(QUESTION)].split(needle)
    n_before, n_after = before.count(FILLER), after.count(FILLER)
    assert before == FILLER * n_before and after == FILLER * n_after
    assert abs(n_before / (n_before + n_after) - depth) <= 0.5 / (n_before + n_after)
    assert prompt.depth == pytest.approx(n_before / (n_before + n_after))


def test_prompt_too_short_for_the_text_is_refused():
    with pytest.raises(ValueError, match="cannot hold the passkey prompt"):
        passkey_prompt(TOK, 100, 0.5, "12345")


def test_accuracy_counts_the_continuations_that_repeat_the_key(monkeypatch):
    """A stand-in for greedy decoding that reads the key out of the prompt and answers right only when the
    needle sits in the first half: accuracy 1 at depth 0, 0 at depth 1, whatever the length."""
    def fake_decode(model, ids, n_new, device="cpu"):
        text = TOK.decode(ids)
        key = text.split("The pass key is ")[1][:5]
        answer = key if text.index(key) < len(text) / 2 else "00000"
        return TOK.encode(" " + answer + ".")[:n_new]

    monkeypatch.setattr(passkey, "greedy_continuation", fake_decode)
    table = passkey_accuracy(torch.nn.Linear(1, 1), TOK, lengths=[400, 800], depths=[0.0, 1.0], trials=3)
    assert table == {400: {0.0: 1.0, 1.0: 0.0}, 800: {0.0: 1.0, 1.0: 0.0}}
    assert passkey.passkey_trial(torch.nn.Linear(1, 1), TOK, passkey_prompt(TOK, 400, 0.0, "55555"))


def test_greedy_continuation_equals_generate_within_the_context():
    from archlab.config import ModelConfig
    from archlab.generation import generate
    from archlab.models.decoder import TransformerLM

    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=257, d_model=32, n_layers=2, max_seq_len=64,
                                      attention={"n_heads": 4}, init={"std": 0.3})).eval()
    ids = TOK.encode("The pass key is")
    want = generate(model, torch.tensor(ids), 12, eos_token_id=[])[len(ids):].tolist()
    assert passkey.greedy_continuation(model, ids, 12) == want


def test_cli_passkey_prints_a_table_by_length_and_depth(tmp_path, capsys):
    """A tiny random model on the byte tokenizer: the table has one cell per (length, depth), shares in [0, 1]."""
    import random

    from archlab.cli import main
    from archlab.data.prepare import prepare

    rng = random.Random(0)
    prepare([" ".join(rng.choice(["a", "bb", "ccc"]) for _ in range(300)) for _ in range(4)], "bytes",
            tmp_path / "d", num_workers=0, progress=False)
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny:llama2-7b", "--data", str(tmp_path / "d"), "--out", str(run),
                 "--no-progress", "--set", "d_model=32", "--set", "n_layers=1", "--set", "train.batch_size=1",
                 "--set", "train.seq_len=16", "--set", "train.budget=1", "--set", "train.eval_batches=1",
                 "--set", "train.sample_every=-1"]) == 0
    capsys.readouterr()
    assert main(["eval", str(run), "--passkey", "--lengths", "300,400", "--depths", "0,1", "--trials", "2",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["passkey"]
    assert set(got) == {"300", "400"} and all(set(row) == {"0.0", "1.0"} for row in got.values())
    assert all(0.0 <= a <= 1.0 for row in got.values() for a in row.values())
    assert main(["eval", str(run), "--passkey", "--lengths", "100"]) == 2
    assert "cannot hold the passkey prompt" in capsys.readouterr().err
