"""What a training run tells its user: a budget that ends inside the warmup, plain log lines without a progress bar
(the plan, the resume notice, loss lines), and a machine that other processes keep busy."""
from __future__ import annotations

import io
import random
import warnings
from pathlib import Path

import pytest

from archlab.cli import main as cli_main
from archlab.config import ModelConfig
from archlab.data.prepare import prepare
from archlab.training.loglines import LogLines
from archlab.training.optim import warmup_shortfall
from archlab.training.throughput import CpuShare, busy_note
from archlab.training.trainer import TrainConfig, train

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()
FAST = dict(batch_size=4, seq_len=16, eval_batches=1, log_every=2, sample_every=-1, checkpoint_every=6, lr=3e-3)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(200)) for _ in range(20)]
    path = tmp_path_factory.mktemp("data") / "d"
    prepare(docs, "bytes", path, num_workers=0, progress=False)
    return path


def tiny() -> ModelConfig:
    return ModelConfig(vocab_size=257, d_model=32, n_layers=2, max_seq_len=64, attention={"n_heads": 4})


def _warnings_of(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught]


# ---- a budget shorter than the warmup ----------------------------------------------------------------------------
def test_budget_shorter_than_warmup_warns_once_naming_both(data_dir, tmp_path):
    cfg = TrainConfig(**FAST, budget=3, warmup_steps=10)
    said = _warnings_of(lambda: train(tiny(), cfg, data_dir, tmp_path / "short", progress=False))
    about = [m for m in said if "warmup" in m]
    assert about == ["train.budget=3 steps ends inside train.schedule.warmup_steps=10: the LR peaks at 30% of "
                     "train.lr=0.003 (0.0009); lower train.schedule.warmup_steps or raise the budget"]
    enough = TrainConfig(**FAST, budget=3, warmup_steps=3)
    assert not [m for m in _warnings_of(lambda: train(tiny(), enough, data_dir, tmp_path / "ok", progress=False))
                if "warmup" in m]


def test_minutes_budget_that_ends_inside_the_warmup_says_so_at_the_end(data_dir, tmp_path):
    cfg = TrainConfig(**{**FAST, "checkpoint_every": 0}, budget=0.005, budget_unit="minutes", warmup_steps=10_000,
                      eval_every=0)
    result = None

    def run():
        nonlocal result
        result = train(tiny(), cfg, data_dir, tmp_path / "run", progress=False)
    about = [m for m in _warnings_of(run) if "warmup" in m]
    assert len(about) == 1 and about[0].startswith(f"train.budget=0.005 minutes ended at step {result.steps:,}, "
                                                   "inside train.schedule.warmup_steps=10000: the LR peaked at")


def test_warmup_shortfall_counts_a_tokens_budget_in_steps():
    cfg = TrainConfig(batch_size=4, seq_len=32, budget=4096, budget_unit="tokens", warmup_steps=100, lr=1e-3)
    assert warmup_shortfall(cfg, cfg.total_steps()).startswith(
        "train.budget=4096 tokens (32 steps) ends inside train.schedule.warmup_steps=100: the LR peaks at 32% of "
        "train.lr=0.001")


# ---- plain log lines ---------------------------------------------------------------------------------------------
def test_log_lines_print_the_first_then_at_most_every_interval_and_the_last():
    now = [0.0]
    out = io.StringIO()
    lines = LogLines(total_steps=100, every_s=30.0, file=out, clock=lambda: now[0])
    printed = []
    for step in range(10, 101, 10):
        now[0] = step * 1.0                                  # one second per step
        if lines.step(step, loss=2.0, lr=1e-3, tokens_per_s=1000.0, mfu=0.1):
            printed.append(step)
    assert printed == [10, 40, 70, 100]                      # first, every 30 s, and the last step
    first = out.getvalue().splitlines()[0]
    assert first.startswith("step 10/100  loss 2.0000  lr 1.00e-03  1,000 tok/s  mfu 10.0%")


def test_no_progress_prints_the_plan_the_resume_notice_and_loss_lines(data_dir, tmp_path, capsys):
    args = ["train", "--preset", "tiny:llama2-7b", "--set", "n_layers=1", "--data", str(data_dir), "--out",
            str(tmp_path / "run"), "--no-progress"]
    sets = [f"train.{k}={v}" for k, v in {**FAST, "warmup_steps": 1, "budget": 6}.items()]
    assert cli_main([*args, *[x for s in sets for x in ("--set", s)]]) == 0
    err = capsys.readouterr().err
    assert "expected memory per device" in err                      # the plan
    assert "step 2/6  loss " in err and "step 6/6  loss " in err    # the first loss line and the last
    assert "\r" not in err                                          # no bar
    longer = [x for s in sets for x in ("--set", s.replace("budget=6", "budget=8"))]
    assert cli_main([*args, "--resume", *longer]) == 0
    err = capsys.readouterr().err
    assert f"resuming from {tmp_path / 'run' / 'checkpoints' / 'step_0000006'} at step 6" in err
    assert "step 8/8  loss " in err


def test_library_default_without_progress_stays_silent(data_dir, tmp_path, capsys):
    train(tiny(), TrainConfig(**FAST, budget=2, warmup_steps=1), data_dir, tmp_path / "run", progress=False)
    assert capsys.readouterr().err == ""


# ---- a busy machine ----------------------------------------------------------------------------------------------
def _machine(monkeypatch, busy_share: float, own_share: float = 0.0) -> None:
    """A fake /proc/stat and process clock on CpuShare: each read advances the machine 10 CPU-seconds,
    `busy_share` of them busy, `own_share` of them this process's (not its real CPU time, which a slow machine
    makes anything)."""
    clock = [0.0, 0.0]

    def read():
        clock[0] += 10.0
        return busy_share * clock[0], clock[0]

    def own():
        clock[1] += 10.0 * own_share
        return clock[1]
    monkeypatch.setattr(CpuShare, "read", staticmethod(read))
    monkeypatch.setattr(CpuShare, "own", staticmethod(own))


def test_cpu_share_is_the_machines_busy_time_less_this_process(monkeypatch):
    _machine(monkeypatch, 0.9, own_share=0.2)                                          # this process: 2 of 10 s
    assert CpuShare().others() == pytest.approx(0.7)
    monkeypatch.setattr(CpuShare, "read", staticmethod(lambda: None))                 # no /proc/stat
    assert CpuShare().others() is None
    assert busy_note(0.2, "x") is None and "used 70% of this machine's CPU time while x" in busy_note(0.7, "x")


def test_a_busy_machine_is_named_beside_the_throughput(data_dir, tmp_path, capsys, monkeypatch):
    cfg = TrainConfig(**FAST, budget=2, warmup_steps=1)
    _machine(monkeypatch, 1.0, own_share=0.1)       # the machine all busy, a tenth of it this process
    result = train(tiny(), cfg, data_dir, tmp_path / "busy", progress=True)
    err = capsys.readouterr().err
    assert "other processes used 90% of this machine's CPU time while the matmul peak was measured" in err
    assert "other processes used 90% of this machine's CPU time while this run trained" in err
    assert result.cpu_others_share == pytest.approx(0.9)
    _machine(monkeypatch, 0.2, own_share=0.1)       # 10% others: below BUSY_SHARE, nothing said
    result = train(tiny(), cfg, data_dir, tmp_path / "quiet", progress=True)
    assert "other processes used" not in capsys.readouterr().err
    assert result.cpu_others_share == pytest.approx(0.1)
    _machine(monkeypatch, 0.0)
    result = train(tiny(), cfg, data_dir, tmp_path / "idle", progress=True)
    assert "other processes used" not in capsys.readouterr().err
    assert result.cpu_others_share == 0.0


def test_the_demo_names_a_busy_machine_under_its_throughput_line():
    from types import SimpleNamespace

    from archlab.demo.stages import busy_machine
    lines: list[str] = []
    busy_machine(SimpleNamespace(cpu_others_share=0.8), False, lines.append)
    assert len(lines) == 1 and "other processes used 80% of this machine's CPU time while the model trained" in lines[0]
    busy_machine(SimpleNamespace(cpu_others_share=0.8), True, lines.append)    # the trainer's own note said it
    busy_machine(SimpleNamespace(cpu_others_share=0.1), False, lines.append)
    busy_machine(SimpleNamespace(cpu_others_share=None), False, lines.append)  # a GPU, or no /proc/stat
    assert len(lines) == 1
