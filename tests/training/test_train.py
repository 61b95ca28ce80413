"""Trainer: config round trips, schedules, decay groups, accumulation, NaN handling, budgets, CLI."""
from __future__ import annotations

import contextlib
import json
import math
import random
from pathlib import Path

import pytest
import torch

from archlab.cli import main as cli_main
from archlab.config import ConfigError, ModelConfig
from archlab.data.prepare import prepare
from archlab.eval.evaluate import bits_per_byte, evaluate
from archlab.models.decoder import TransformerLM
from archlab.training.trainer import Diverged, TrainConfig, lr_multiplier, param_groups, read_metrics, train

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(200)) for _ in range(30)]
    path = tmp_path_factory.mktemp("data") / "d"
    prepare(docs, "bytes", path, num_workers=0, progress=False)
    return path


def tiny(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=257, d_model=32, n_layers=2, max_seq_len=64,
                       attention={"n_heads": 4}, **kw)


FAST = dict(batch_size=4, seq_len=16, warmup_steps=2, eval_batches=2, log_every=1, sample_every=-1,
            lr=3e-3)


def test_train_config_yaml_and_overrides_round_trip():
    cfg = TrainConfig(lr=1e-3, betas=(0.8, 0.9), schedule="wsd", grad_clip=None)
    assert TrainConfig.from_yaml(cfg.to_yaml()) == cfg
    new = cfg.with_overrides({"train.lr": "2e-3", "betas": "0.9,0.99", "budget_unit": "tokens",
                              "grad_clip": "0.5", "compile": "true"})
    assert (new.lr, new.optimizer.betas, new.budget_unit, new.optimizer.grad_clip, new.compile) == (2e-3, (0.9, 0.99),
                                                                                          "tokens", 0.5, True)
    with pytest.raises(ConfigError, match="schedule"):
        cfg.with_overrides({"schedule": "linear"})
    with pytest.raises(ConfigError, match="unknown train config key"):
        cfg.with_overrides({"train.learning_rate": "1"})
    with pytest.raises(ConfigError, match="no_decay"):
        TrainConfig(no_decay="norms,weights")


def test_schedules_warmup_cosine_wsd_constant():
    cos = TrainConfig(warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert [lr_multiplier(cos, s, 0) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert lr_multiplier(cos, 10, 0.0) == 1.0
    assert lr_multiplier(cos, 50, 0.5) == pytest.approx(0.55)        # 0.1 + 0.9 * 0.5
    assert lr_multiplier(cos, 99, 1.0) == pytest.approx(0.1)
    wsd = TrainConfig(warmup_steps=0, schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.0)
    assert lr_multiplier(wsd, 5, 0.79) == 1.0
    assert lr_multiplier(wsd, 5, 0.9) == pytest.approx(0.5)
    assert lr_multiplier(wsd, 5, 1.0) == pytest.approx(0.0)
    const = TrainConfig(warmup_steps=0, schedule="constant")
    assert lr_multiplier(const, 3, 0.99) == 1.0


def test_decay_groups_exclude_norms_biases_embeddings_by_default():
    model = TransformerLM(tiny(bias={"qkv": True}))
    decay, keep = param_groups(model, 0.1)
    assert all(n.endswith(".weight") and "norm" not in n and "embed" not in n for n in decay["names"])
    assert "embed.weight" in keep["names"] and "blocks.0.attn.q_proj.bias" in keep["names"]
    assert any("norm" in n for n in keep["names"])
    assert decay["weight_decay"] == 0.1 and keep["weight_decay"] == 0.0
    all_params = {id(p) for p in model.parameters()}
    assert {id(p) for g in (decay, keep) for p in g["params"]} == all_params
    decay2, keep2 = param_groups(model, 0.1, "biases")    # configurable: embeddings and norms decay
    assert "embed.weight" in decay2["names"] and any("norm" in n for n in decay2["names"])


def test_grad_accumulation_matches_the_full_batch(data_dir, tmp_path):
    a = train(tiny(), TrainConfig(**{**FAST, "batch_size": 8}, budget=4), data_dir, tmp_path / "a",
              progress=False)
    b = train(tiny(), TrainConfig(**{**FAST, "batch_size": 4}, grad_accum=2, budget=4), data_dir,
              tmp_path / "b", progress=False)
    la = [r["loss"] for r in read_metrics(a.metrics_path) if "loss" in r]
    lb = [r["loss"] for r in read_metrics(b.metrics_path) if "loss" in r]
    assert len(la) == 4 and la == pytest.approx(lb, rel=1e-5, abs=1e-6)
    assert a.tokens_seen == b.tokens_seen == 4 * 8 * 16


def test_training_lowers_the_loss_and_writes_the_run_folder(data_dir, tmp_path):
    cfg = TrainConfig(**{**FAST, "sample_every": 0, "sample_tokens": 8}, budget=40, eval_every=20,
                      checkpoint_every=20)
    result = train(tiny(), cfg, data_dir, tmp_path / "run", progress=False)
    rows = read_metrics(result.metrics_path)
    train_rows = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "val_loss" in r]
    assert set(train_rows[0]) >= {"step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"}
    assert set(evals[0]) == {"step", "tokens", "val_loss", "val_ppl", "val_bpb"}
    assert [e["step"] for e in evals] == [20, 40]
    assert evals[-1]["val_loss"] < math.log(257) - 1.0           # learned something over uniform
    assert evals[-1]["val_ppl"] == pytest.approx(math.exp(evals[-1]["val_loss"]))
    assert result.final_val_loss == evals[-1]["val_loss"] and result.steps == 40
    assert result.best_val_loss == min(e["val_loss"] for e in evals)
    for name in ("config.yaml", "metrics.jsonl", "samples.txt", "loss_curve.png", "tokenizer"):
        assert (tmp_path / "run" / name).exists(), name
    with pytest.raises(FileExistsError):
        train(tiny(), cfg, data_dir, tmp_path / "run", progress=False)


def test_bits_per_byte_matches_hand_computation(data_dir):
    from archlab.data.tokens import TokenDataset

    val = TokenDataset(data_dir, "val")
    model = TransformerLM(tiny())
    r = evaluate(model, val, batch_size=2, seq_len=16, max_batches=3)
    assert r.tokens == 3 * 2 * 16
    # byte tokenizer: bytes per token is just below 1 (the end-of-text tokens have no bytes)
    assert r.bpb == pytest.approx(r.loss / math.log(2) / val.bytes_per_token)
    assert bits_per_byte(2.0, 10, 20) == pytest.approx(1.0 / math.log(2))


def test_token_budget_rounds_up_to_whole_steps(data_dir, tmp_path):
    cfg = TrainConfig(**FAST, budget=3 * 4 * 16 + 1, budget_unit="tokens")
    result = train(tiny(), cfg, data_dir, tmp_path / "run", progress=False)
    assert result.steps == 4 and result.tokens_seen == 4 * 64


def test_minutes_budget_stops_on_time(data_dir, tmp_path, capsys):
    import time

    cfg = TrainConfig(**{**FAST, "warmup_steps": 0}, budget=0.03, budget_unit="minutes", eval_every=0)
    t0 = time.perf_counter()
    result = train(tiny(), cfg, data_dir, tmp_path / "run", progress=True)
    assert time.perf_counter() - t0 >= 1.8
    assert "left=0:0" in capsys.readouterr().err          # the bar says how much of the budget is left
    rows = [r for r in read_metrics(result.metrics_path) if "lr" in r]
    assert len(rows) == result.steps >= 2
    assert rows[-1]["lr"] < rows[0]["lr"]     # the cosine followed the clock toward its end


def _nan_after(monkeypatch, n_ok: int):
    original = TransformerLM.loss_from_hidden
    calls = {"n": 0}

    def patched(self, hidden, targets, ignore_index=-100):
        calls["n"] += 1
        out = original(self, hidden, targets, ignore_index)
        if calls["n"] > n_ok:
            out.total = out.total * float("nan")
        return out

    monkeypatch.setattr(TransformerLM, "loss_from_hidden", patched)


def test_nan_loss_stops_naming_step_and_last_checkpoint(data_dir, tmp_path, monkeypatch):
    _nan_after(monkeypatch, 5)
    cfg = TrainConfig(**FAST, budget=10, checkpoint_every=3)
    with pytest.raises(Diverged, match=r"at step 6; last good checkpoint: .*step_0000003") as info:
        train(tiny(), cfg, data_dir, tmp_path / "run", progress=False)
    assert info.value.step == 6 and info.value.result.diverged


def test_nan_policy_skip_keeps_weights_finite(data_dir, tmp_path, monkeypatch):
    original = TransformerLM.loss_from_hidden
    calls = {"n": 0}

    def patched(self, hidden, targets, ignore_index=-100):   # only micro-step 3 is poisoned
        calls["n"] += 1
        out = original(self, hidden, targets, ignore_index)
        if calls["n"] == 3:
            out.total = out.total * float("nan")
        return out

    monkeypatch.setattr(TransformerLM, "loss_from_hidden", patched)
    cfg = TrainConfig(**FAST, budget=6, nan_policy="skip")
    with pytest.warns(UserWarning, match="skipping the update"):
        result = train(tiny(), cfg, data_dir, tmp_path / "run", progress=False)
    assert result.steps == 6 and not result.diverged
    from archlab.runs.model_folder import load_run
    model, _ = load_run(tmp_path / "run")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert [r.get("nonfinite") for r in read_metrics(result.metrics_path) if r["step"] == 3][0]


def test_cli_train_then_eval(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--preset", "tiny:llama2-7b", "--data", str(data_dir), "--out", str(out),
            "--no-progress", "--set", "d_model=32", "--set", "train.batch_size=4",
            "--set", "train.seq_len=16", "--set", "train.budget=3", "--set", "train.eval_batches=1",
            "--set", "train.sample_every=-1"]
    assert cli_main(args) == 0
    import yaml
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model"]["vocab_size"] == 257 and saved["model"]["d_model"] == 32
    assert saved["train"]["budget"] == 3
    capsys.readouterr()
    assert cli_main(["eval", str(out), "--batches", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tokens"] == 2 * 4 * 16 and result["loss"] > 0 and result["seq_len"] == 16   # the run's length
    assert cli_main(["eval", str(out), "--batches", "2", "--seq-len", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tokens"] == 2 * 4 * 8 and result["seq_len"] == 8
    assert cli_main(["eval", str(out), "--seq-len", "0"]) == 2
    assert "--seq-len 0 must be at least 1" in capsys.readouterr().err
    assert cli_main(["train", "--data", str(data_dir), "--out", str(tmp_path / "x")]) == 2


def test_train_states_its_plan_and_expected_memory_then_the_peak(data_dir, tmp_path, capsys):
    from archlab.models.accounting import training_memory_bytes
    from archlab.units import human_bytes
    args = ["train", "--preset", "tiny:llama2-7b", "--data", str(data_dir), "--out", str(tmp_path / "run"),
            "--set", "train.batch_size=4", "--set", "train.seq_len=16", "--set", "train.budget=2",
            "--set", "train.eval_batches=1", "--set", "train.sample_every=-1"]
    assert cli_main(args) == 0
    captured = capsys.readouterr()
    from archlab.cli.train import resolve_preset
    cfg = resolve_preset("tiny:llama2-7b").with_overrides({"vocab_size": 257})
    expected = human_bytes(training_memory_bytes(cfg, 4, 16, "float32"))
    assert f"expected memory per device {expected}" in captured.err
    assert "4 x 16 tokens per step, 2 steps" in captured.err
    assert "peak memory" in captured.out and "done: 2 steps" in captured.out


def test_bf16_autocast_trains_with_float32_master_weights(data_dir, tmp_path):
    """dtype=bfloat16 autocasts the matmuls; parameters and optimizer state stay float32."""
    from archlab.runs.model_folder import load_run
    from archlab.training.precision import has_native_bf16

    cfg = TrainConfig(**FAST, budget=30, eval_every=30, checkpoint_every=30, dtype="bfloat16")
    with (contextlib.nullcontext() if has_native_bf16("cpu")            # else: the cost is named
          else pytest.warns(UserWarning, match="without bf16 matrix units")):
        result = train(tiny(), cfg, data_dir, tmp_path / "run", progress=False)
    assert result.final_val_loss < math.log(257) - 1.0
    model, _ = load_run(tmp_path / "run")
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.slow
def test_compiled_training_matches_eager_losses(data_dir, tmp_path):
    """train.compile=true (torch.compile) gives the eager run's losses up to float rounding."""
    cfg = TrainConfig(**FAST, budget=6, eval_every=6, checkpoint_every=6)
    eager = train(tiny(), cfg, data_dir, tmp_path / "eager", progress=False)
    compiled = train(tiny(), TrainConfig(**FAST, budget=6, eval_every=6, checkpoint_every=6, compile=True),
                     data_dir, tmp_path / "compiled", progress=False)
    a = [r["loss"] for r in read_metrics(eager.metrics_path) if "loss" in r]
    b = [r["loss"] for r in read_metrics(compiled.metrics_path) if "loss" in r]
    assert len(a) == len(b) == 6
    assert b == pytest.approx(a, rel=1e-3)


def test_dist_strategy_is_set_as_the_issue_spells_it():
    """`--set dist.strategy=fsdp` reaches TrainConfig.dist_strategy, as `--set train.dist_strategy=fsdp` does."""
    from archlab.cli.train import parse_sets

    model, train_overrides = parse_sets(["dist.strategy=fsdp", "n_layers=3"])
    assert model == {"n_layers": "3"}
    assert TrainConfig().with_overrides(train_overrides).dist_strategy == "fsdp"
    assert TrainConfig().with_overrides({"train.dist_strategy": "fsdp"}).dist_strategy == "fsdp"
    with pytest.raises(ConfigError, match="dist.strategy='zero3' is not one of"):   # named as written
        TrainConfig().with_overrides({"dist.strategy": "zero3"})


def test_a_vocabulary_padded_past_the_tokenizer_samples_decodable_text(data_dir, tmp_path):
    """vocab_size 320 for the 257-id byte tokenizer (padding to a multiple of 64 is common): the sample
    points draw only ids the tokenizer can decode, so the run does not die at its first sample."""
    cfg = ModelConfig(vocab_size=320, d_model=32, n_layers=2, max_seq_len=64, attention={"n_heads": 4},
                      bias={"head": True})
    result = train(cfg, TrainConfig(**{**FAST, "sample_every": 2, "sample_tokens": 40, "sample_temperature": 1.0},
                                    budget=4), data_dir, tmp_path / "run", progress=False)
    assert result.steps == 4
    samples = (tmp_path / "run" / "samples.txt").read_text()
    assert samples.count("=== step") >= 2
