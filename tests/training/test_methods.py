"""The trainer drives methods and names none (training/methods); each method is registered once."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import archlab.training.trainer as trainer
from archlab.training.config import TrainConfig
from archlab.training.methods import METHODS, select

METHOD_NAMES = ("pretrain", "sft", "dpo", "reward", "grpo", "ppo", "kto", "orpo")


def test_trainer_names_no_method():
    source = Path(trainer.__file__).read_text().lower()
    found = [name for name in METHOD_NAMES if re.search(rf"\b{name}\b", source)]
    assert found == [], f"training/trainer.py names {found}: a method's code belongs in training/methods"


def test_registered_methods_open_runs():
    assert {"pretrain", "dpo"} <= set(METHODS.names())
    for name in METHODS.names():
        method = METHODS.get(name)
        assert method.name == name and callable(method.open) and method.summary


def test_select_reads_the_config_and_the_data(tmp_path):
    from archlab.errors import UserError

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "meta.json").write_text('{"format": "archlab-tokens", "splits": {}}')
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    assert select(TrainConfig(), folder) == "pretrain"
    assert select(TrainConfig(method="dpo"), prefs) == "dpo"
    assert select(TrainConfig().with_overrides({"train.objective": "dpo"}), prefs) == "dpo"   # the earlier key
    with pytest.raises(UserError, match=r"prefs.jsonl is a file of preference pairs; train.method=pretrain reads "
                                        r"a token stream, seq2seq \(source/target\) pairs or chat examples"):
        select(TrainConfig(), prefs)
    with pytest.raises(UserError, match=r"data is a folder of a token stream; train.method=dpo reads preference"):
        select(TrainConfig(method="dpo"), folder)


def test_unknown_method_is_a_config_error():
    from archlab.config import ConfigError

    with pytest.raises(ConfigError, match="unknown method 'nope'"):
        METHODS.get("nope")
