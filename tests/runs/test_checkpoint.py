"""Checkpoints: atomic, keep-last-K, corrupt files named, and kill -9 + resume == uninterrupted run."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from archlab.config import ModelConfig
from archlab.data.prepare import prepare
from archlab.models.decoder import TransformerLM
from archlab.runs.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from archlab.runs.model_folder import load_run
from archlab.training.trainer import TrainConfig, read_metrics, train

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()


def make_data(path: Path, n_docs: int = 40, words: int = 300) -> Path:
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n_docs)]
    prepare(docs, "bytes", path, num_workers=0, progress=False)
    return path


def tiny_model(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=257, d_model=32, n_layers=2, max_seq_len=64,
                       attention={"n_heads": 4}, **kw)


def test_save_is_atomic_and_keeps_last_k(tmp_path):
    model = TransformerLM(tiny_model())
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model.state_dict(), {"step": step}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000003", "step_0000004"]
    assert not list(tmp_path.glob(".tmp-*"))
    state, trainer = load_checkpoint(latest_checkpoint(tmp_path))
    assert trainer["step"] == 4
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor), name


def test_half_written_checkpoint_is_invisible(tmp_path):
    """A save killed before its rename leaves only a .tmp folder: the good checkpoint stays latest."""
    model = TransformerLM(tiny_model())
    good = save_checkpoint(tmp_path, 5, model.state_dict(), {"step": 5})
    (tmp_path / ".tmp-step_0000010-999").mkdir()
    (tmp_path / ".tmp-step_0000010-999" / "model.safetensors").write_bytes(b"garbage")
    assert latest_checkpoint(tmp_path) == good


@pytest.mark.parametrize("victim", ["model.safetensors", "trainer.safetensors"])
def test_corrupt_checkpoint_error_names_the_file(tmp_path, victim):
    model = TransformerLM(tiny_model())
    path = save_checkpoint(tmp_path, 1, model.state_dict(), {"step": 1, "x": torch.zeros(100)})
    data = (path / victim).read_bytes()
    (path / victim).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=victim):
        load_checkpoint(path)
    # same size, garbled content: still a clear error naming the file
    (path / victim).write_bytes(b"\x00" * len(data))
    if victim == "trainer.safetensors":
        with pytest.raises(CheckpointError, match=victim):
            load_checkpoint(path)


def test_load_run_restores_model_and_tokenizer(tmp_path):
    data = make_data(tmp_path / "data", n_docs=10, words=100)
    cfg = TrainConfig(batch_size=4, seq_len=16, budget=3, warmup_steps=1, eval_batches=2,
                      log_every=1, sample_every=-1)
    train(tiny_model(), cfg, data, tmp_path / "run", progress=False)
    model, tok = load_run(tmp_path / "run")
    state, _ = load_checkpoint(latest_checkpoint(tmp_path / "run"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name])
    assert tok.encode("ab") == [97, 98]
    cfg_yaml = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert set(cfg_yaml) == {"model", "train", "data"}


def _run_cli(cfg_path: Path, data: Path, out: Path, resume: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "archlab.cli", "train", "--config", str(cfg_path), "--data", str(data),
           "--out", str(out), "--no-progress"] + (["--resume"] if resume else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _losses(path: Path) -> list[tuple]:
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_metrics(path)]


def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path):
    data = make_data(tmp_path / "data")
    model = tiny_model(**{"block": {"residual_dropout": 0.1}})   # dropout: the RNG state must resume too
    train_cfg = TrainConfig(batch_size=8, seq_len=32, grad_accum=2, budget=60, warmup_steps=5,
                            lr=3e-3, eval_every=10, eval_batches=2, checkpoint_every=10, log_every=1,
                            sample_every=-1, keep_last=2)
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump({"model": model.to_dict(), "train": train_cfg.to_dict()}))

    full = _run_cli(cfg_path, data, tmp_path / "full")
    out, err = full.communicate(timeout=300)
    assert full.returncode == 0, err

    victim = _run_cli(cfg_path, data, tmp_path / "killed")
    ckpts = tmp_path / "killed" / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and victim.poll() is None:
        found = list_checkpoints(ckpts)
        if found and found[-1].name >= "step_0000020":
            victim.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    victim.communicate(timeout=60)
    assert victim.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = latest_checkpoint(ckpts)
    assert killed_at.name < "step_0000060"

    resumed = _run_cli(cfg_path, data, tmp_path / "killed", resume=True)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    expected = _losses(tmp_path / "full" / "metrics.jsonl")
    got = _losses(tmp_path / "killed" / "metrics.jsonl")
    assert len(expected) == 60 + 6
    assert got == expected     # exact, step for step, train and validation
    a, _ = load_checkpoint(latest_checkpoint(tmp_path / "full"))
    b, _ = load_checkpoint(latest_checkpoint(tmp_path / "killed"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_a_corrupt_checkpoint(tmp_path):
    data = make_data(tmp_path / "data", n_docs=10, words=100)
    cfg = TrainConfig(batch_size=4, seq_len=16, budget=2, warmup_steps=1, eval_batches=1,
                      sample_every=-1)
    train(tiny_model(), cfg, data, tmp_path / "run", progress=False)
    weights = latest_checkpoint(tmp_path / "run") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        train(tiny_model(), cfg.with_overrides({"budget": 4}), data, tmp_path / "run", resume=True,
              progress=False)


@pytest.mark.slow
def test_three_random_kills_then_resume_match_the_uninterrupted_run(tmp_path):
    """SIGKILL at random moments (mid-step, mid-save, mid-eval), three times in one run."""
    data = make_data(tmp_path / "data")
    train_cfg = TrainConfig(batch_size=8, seq_len=32, budget=60, warmup_steps=5, lr=3e-3, eval_every=10,
                            eval_batches=2, checkpoint_every=5, log_every=1, sample_every=-1, keep_last=2)
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump({"model": tiny_model().to_dict(), "train": train_cfg.to_dict()}))
    full = _run_cli(cfg_path, data, tmp_path / "full")
    assert full.wait(timeout=300) == 0
    rng = random.Random(1)
    for attempt in range(3):
        victim = _run_cli(cfg_path, data, tmp_path / "killed", resume=attempt > 0)
        time.sleep(2.0 + rng.random() * 2.0)         # past start-up, somewhere in the loop
        victim.send_signal(signal.SIGKILL)
        victim.communicate(timeout=60)
    resumed = _run_cli(cfg_path, data, tmp_path / "killed", resume=True)
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert _losses(tmp_path / "killed" / "metrics.jsonl") == _losses(tmp_path / "full" / "metrics.jsonl")
