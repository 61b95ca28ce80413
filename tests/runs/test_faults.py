"""Crash at every write of a save (ARCHLAB_FAULT), then resume: the losses equal the uninterrupted run's.
SIGTERM saves and stops cleanly; a killed `data prepare` leaves nothing that a rerun trips on."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_checkpoint import make_data, tiny_model

from archlab.data.tokens import load_meta
from archlab.faults import FAULT_EXIT, POINTS
from archlab.runs.checkpoint import latest_checkpoint, list_checkpoints, verify_checkpoint
from archlab.training.trainer import TrainConfig, read_metrics, train

TESTS = os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[1])])   # test_checkpoint, helpers
CFG = dict(batch_size=4, seq_len=16, budget=6, warmup_steps=1, eval_batches=1, sample_every=-1,
           checkpoint_every=2, log_every=1, keep_last=2)


def _losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir / "metrics.jsonl") if "loss" in m]


def _train_in_subprocess(data: Path, run_dir: Path, fault: str | None, **cfg) -> subprocess.Popen:
    code = ("import sys\nfrom archlab.training.trainer import TrainConfig, train\n"
            "from test_checkpoint import tiny_model\n"
            f"train(tiny_model(), TrainConfig(**{ {**CFG, **cfg}!r}), {str(data)!r}, {str(run_dir)!r}, "
            "progress=False)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}
    env.pop("ARCHLAB_FAULT", None)
    if fault:
        env["ARCHLAB_FAULT"] = fault
    return subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    data = make_data(root / "data", n_docs=10, words=100)
    train(tiny_model(), TrainConfig(**CFG), data, root / "full", progress=False)
    return data, _losses(root / "full")


SAVE_POINTS = [p for p in POINTS if p.startswith("save:")]
FAST = {"save:meta", "save:rename"}


@pytest.mark.parametrize("point", [p if p in FAST else pytest.param(p, marks=pytest.mark.slow) for p in SAVE_POINTS])
def test_a_crash_at_each_write_of_a_save_then_resume_equals_the_uninterrupted_run(reference, tmp_path, point):
    data, expected = reference
    proc = _train_in_subprocess(data, tmp_path / "run", f"{point}@2")   # dies inside the step-4 save
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == FAULT_EXIT, err
    survivors = list_checkpoints(tmp_path / "run")
    assert survivors and survivors[-1].name in ("step_0000002", "step_0000004")
    for ckpt in survivors:
        verify_checkpoint(ckpt, full=True)                   # no half-written folder looks complete
    train(tiny_model(), TrainConfig(**CFG), data, tmp_path / "run", resume=True, progress=False)
    assert _losses(tmp_path / "run") == expected
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))


@pytest.mark.slow   # ~11 s: a trainer process stopped by SIGTERM
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(reference, tmp_path):
    import yaml

    data, _ = reference
    run_dir, config = tmp_path / "run", tmp_path / "config.yaml"
    train_cfg = TrainConfig(**{**CFG, "budget": 100_000, "checkpoint_every": 0})
    config.write_text(yaml.safe_dump({"model": tiny_model().to_dict(), "train": train_cfg.to_dict()}))
    proc = subprocess.Popen([sys.executable, "-m", "archlab", "train", "--config", str(config), "--data", str(data),
                             "--out", str(run_dir), "--no-progress"], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not (run_dir / "metrics.jsonl").exists():
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("archlab train: stopped by SIGTERM at step ") and "--resume" in last
    assert "Traceback" not in err
    step = int(last.split("at step ")[1].split(";")[0])
    ckpt = latest_checkpoint(run_dir)
    assert ckpt.name == f"step_{step:07d}"
    verify_checkpoint(ckpt, full=True)
    assert max(m["step"] for m in read_metrics(run_dir / "metrics.jsonl")) == step


def test_a_killed_data_prepare_leaves_nothing_a_rerun_trips_on(tmp_path):
    code = ("from test_checkpoint import make_data\n"
            f"make_data(__import__('pathlib').Path({str(tmp_path / 'data')!r}), n_docs=10, words=100)\n")
    env = {**os.environ, "PYTHONPATH": TESTS, "ARCHLAB_FAULT": "prepare:split"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == FAULT_EXIT, proc.stderr
    assert not (tmp_path / "data").exists() and list(tmp_path.glob(".data.partial-*"))
    make_data(tmp_path / "data", n_docs=10, words=100)
    assert load_meta(tmp_path / "data")["splits"]["train"]["tokens"] > 0
    assert not list(tmp_path.glob(".data.partial-*"))       # the dead process's leftover is gone
