"""TrainConfig nested by concern: train.lora is the typed LoRA config itself, train.dpo and train.sft the methods'
sections; run folders are written nested and the earlier flat keys read through one rename table
(runs/train_section.py), so old run folders still load, resume and export."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from archlab.config import ConfigError
from archlab.nn.lora import LoRAConfig
from archlab.runs.model_folder import read_run_config
from archlab.runs.train_section import lora_section, upgrade_train_section
from archlab.training.config import DPOConfig, SFTConfig, TrainConfig

FIXTURE = Path(__file__).parents[1] / "fixtures" / "run_v1"
FLAT = {"lr": 1e-3, "objective": "dpo", "lora_r": 4, "lora_alpha": 8.0, "lora_dropout": 0.1, "lora_targets": "q,v,down",
        "lora_rslora": True, "lora_trainable_tokens": "5,3", "lora_modules_to_save": "final_norm", "dpo_beta": 0.2,
        "dpo_loss": "ipo", "dpo_simpo_gamma": 1.0, "dpo_truncation": "skip", "dpo_val_fraction": 0.1,
        "packing": False, "loss_mask": "last", "truncation": "keep_end"}
NESTED = TrainConfig(lr=1e-3, method="dpo",
                     lora=LoRAConfig(r=4, alpha=8.0, dropout=0.1, targets=("q", "v", "down"), use_rslora=True,
                                     trainable_tokens=(3, 5), modules_to_save=("final_norm",)),
                     dpo=DPOConfig(beta=0.2, loss="ipo", simpo_gamma=1.0, truncation="skip", val_fraction=0.1),
                     sft=SFTConfig(packing=False, loss_mask="last", truncation="keep_end"))


def test_an_earlier_flat_train_section_reads_as_the_nested_config():
    assert TrainConfig.from_dict(FLAT) == NESTED
    assert lora_section(FLAT) == NESTED.lora                       # what load_run and export_peft read, typed
    # flat LoRA keys without lora_r did nothing then: they read as LoRA off
    assert TrainConfig.from_dict({"lora_r": None, "lora_alpha": 32.0, "lora_targets": "all-linear"}).lora is None


def test_config_yaml_is_written_nested_and_reads_back_equal():
    written = yaml.safe_load(NESTED.to_yaml())
    assert not [key for key in written if key.startswith(("lora_", "dpo_"))]
    assert written["lora"]["targets"] == ["q", "v", "down"] and written["dpo"]["loss"] == "ipo"
    assert TrainConfig.from_yaml(NESTED.to_yaml()) == NESTED
    assert upgrade_train_section(written) == written                # today's keys pass through unchanged


def test_the_v1_fixture_run_reads_its_train_section():
    cfg = TrainConfig.from_dict(read_run_config(FIXTURE)["train"])
    assert cfg.lora is None and cfg.method == "pretrain" and cfg.batch_size == 4


def test_dotted_overrides_reach_the_sections():
    cfg = TrainConfig().with_overrides({"train.dpo.beta": "0.3", "sft.packing": "false", "train.method": "sft"})
    assert (cfg.dpo.beta, cfg.sft.packing, cfg.method) == (0.3, False, "sft")
    with pytest.raises(ConfigError, match="train.dpo.beta=-1"):
        TrainConfig().with_overrides({"dpo.beta": "-1"})
    with pytest.raises(ConfigError, match="unknown train config key 'train.dpo.gamma'"):
        TrainConfig().with_overrides({"train.dpo.gamma": "1"})
    with pytest.raises(ConfigError, match="is a group"):
        TrainConfig().with_overrides({"train.dpo": "1"})
    assert TrainConfig().with_overrides({"train.lora.r": "2"}).with_overrides({"lora.r": "none"}).lora is None


def test_the_train_config_has_its_sections_and_no_flat_method_keys():
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    assert not [n for n in names if n.startswith(("lora_", "dpo_"))]
    assert {"lora", "dpo", "sft", "method"} <= set(names)


def test_the_train_config_has_at_most_30_direct_fields_and_reads_the_earlier_names():
    assert len(dataclasses.fields(TrainConfig)) <= 30
    flat = {"warmup_steps": 5, "schedule": "wsd", "min_lr_ratio": 0.0, "decay_fraction": 0.3, "betas": [0.9, 0.99],
            "eps": 1e-6, "weight_decay": 0.0, "grad_clip": None, "no_decay": "none", "eval_every": 7,
            "eval_batches": 3, "sample_every": -1, "sample_tokens": 8, "sample_prompt": "a", "sample_temperature": 1.0,
            "checkpoint_every": 2, "keep_last": 1, "mlm_probability": 0.2, "whole_word_mask": True, "mask_token_id": 3,
            "noise_density": 0.3, "mean_span": 2.0, "permute_sentences": False}
    cfg = TrainConfig.from_dict(flat)
    assert cfg == TrainConfig(**flat)                              # Python keywords read through the same table
    assert (cfg.schedule.kind, cfg.schedule.warmup_steps, cfg.optimizer.betas, cfg.optimizer.grad_clip) == \
        ("wsd", 5, (0.9, 0.99), None)
    assert (cfg.eval.every, cfg.sample.every, cfg.checkpoint.keep_last, cfg.mlm.mask_token_id, cfg.noising.density) \
        == (7, -1, 1, 3, 0.3)
    assert TrainConfig.from_yaml(cfg.to_yaml()) == cfg and "warmup_steps" not in yaml.safe_load(cfg.to_yaml())
    assert dataclasses.replace(cfg, warmup_steps=9).schedule == dataclasses.replace(cfg.schedule, warmup_steps=9)
    assert TrainConfig().with_overrides({"train.schedule": "constant", "train.grad_clip": "none"}).schedule.kind \
        == "constant"


@pytest.mark.parametrize("setting, named", [
    ("train.dpo.loss=xyz", "train.dpo.loss='xyz' is not one of"),
    ("train.grpo.num_generations=x", "train.grpo.num_generations='x'"),
    ("train.lora.r=x", "train.lora.r='x'"),
    ("train.lora.rank=2", "unknown train config key 'train.lora.rank'"),
    ("train.schedule.kind=xyz", "train.schedule.kind='xyz' is not one of"),
    ("train.dpo.nokey=1", "unknown train config key 'train.dpo.nokey'"),
    ("train.lr=abc", "train.lr='abc'"),
])
def test_a_bad_set_is_named_as_the_user_typed_it(setting, named, tmp_path, capsys):
    """--set train.X reaches the config without its prefix: the error still says train.X, nothing is written."""
    from archlab.cli import main

    out = tmp_path / "run"
    method = next((m for m in ("dpo", "grpo") if setting.startswith(f"train.{m}.")), "sft")   # its section's reader
    assert main(["finetune", str(tmp_path / "base"), "--method", method, "--data", str(tmp_path / "d.jsonl"),
                 "--out", str(out), "--set", setting]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err
    assert not out.exists()
