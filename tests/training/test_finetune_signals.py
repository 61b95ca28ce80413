"""Ctrl-C (SIGINT) or SIGTERM during `archlab finetune`: the step finishes, a checkpoint is saved, and the command
ends with one line and exit status 128 + the signal, as `archlab train` does; finetune used to end with a
traceback and "this is a bug in archlab", exit 1."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from finetune_runs import finetune_argv

import archlab
from archlab.runs.checkpoint import latest_checkpoint, verify_checkpoint

SRC = str(Path(archlab.__file__).parents[1])


@pytest.mark.slow   # ~20 s each on a loaded 2-core machine: a fine-tune process started and stopped
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_saves_a_checkpoint_and_exits_128_plus_the_signal(chat_world, make_base, tmp_path, sig):
    base, out = make_base(tmp_path / "base"), tmp_path / "run"
    argv = finetune_argv(base, chat_world["data"], out, budget=100_000)
    proc = subprocess.Popen([sys.executable, "-m", "archlab", *argv, "--set", "train.checkpoint_every=0"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": SRC})
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "metrics.jsonl").exists() and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"archlab finetune: stopped by {sig.name} at step ") and "--resume" in last, err
    assert "Traceback" not in err
    step = int(last.split("at step ")[1].split(";")[0])
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and ckpt.name == f"step_{step:07d}"
    verify_checkpoint(ckpt, full=True)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_every_command_reports_a_signal_stop_as_the_signal(sig, capsys):
    """The CLI's one error path (errors.report) turns the trainer's Stopped into its line and 128 + the signal,
    whatever command trained (train, finetune, a demo)."""
    from archlab.errors import report
    from archlab.training.trainer import Stopped

    assert report(Stopped(sig.name, 7, Path("run/checkpoints/step_0000007")), "archlab finetune") == 128 + sig
    err = capsys.readouterr().err
    assert err == (f"archlab finetune: stopped by {sig.name} at step 7; checkpoint run/checkpoints/step_0000007 "
                   "saved: continue with --resume\n")
