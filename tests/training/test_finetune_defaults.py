"""What `archlab finetune` takes when it is not told: rows of train.seq_len no longer than the base's context (the
default 256 was past the 128 positions of the post-training demo's base), and the given value when there is one."""
from __future__ import annotations

import yaml
from finetune_runs import VOCAB, finetune_argv

from archlab.cli import main
from archlab.config import ModelConfig


def _seq_len(run) -> int:
    return int(yaml.safe_load((run / "config.yaml").read_text())["train"]["seq_len"])


def test_seq_len_defaults_to_a_shorter_base_context(chat_world, make_base, tmp_path):
    cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=1, max_seq_len=48, attention={"n_heads": 4})
    base = make_base(tmp_path / "base", cfg)
    assert main(finetune_argv(base, chat_world["data"], tmp_path / "run", budget=1, seq_len=None)) == 0
    assert _seq_len(tmp_path / "run") == 48
    assert main(finetune_argv(base, chat_world["data"], tmp_path / "given", budget=1)) == 0     # train.seq_len=32
    assert _seq_len(tmp_path / "given") == 32
