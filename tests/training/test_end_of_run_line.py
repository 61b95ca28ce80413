"""After the last step a run validates, samples and checkpoints (minutes on a real model): it says so first."""
from __future__ import annotations

import random

from test_advice import _prepare
from test_checkpoint import tiny_model

from archlab.tokenizer.chat import ChatTokenizer
from archlab.training.config import TrainConfig
from archlab.training.trainer import train


def test_the_end_of_run_work_is_announced_before_it_runs(tmp_path, capsys):
    rng = random.Random(0)
    tok, data = _prepare(tmp_path, " ".join(rng.choice(["red", "cat", "dog"]) for _ in range(300)) + "\n", 270, "x")
    vocab = ChatTokenizer.of(tok).tokenizer.vocab_size
    capsys.readouterr()
    train(tiny_model().with_overrides({"vocab_size": int(vocab)}), TrainConfig(
        batch_size=4, seq_len=32, budget=2, lr=3e-3, warmup_steps=0, eval_batches=1), data, tmp_path / "run",
        progress="lines")
    err = capsys.readouterr().err
    line = "step 2 was the last: now validation (up to 1 batches), a 64-token sample (samples.txt), the checkpoint"
    assert line in err, err
    assert err.index(line) > err.index("step 2/2")          # after the last step's log line
    assert (tmp_path / "run" / "samples.txt").exists()
