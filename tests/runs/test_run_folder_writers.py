"""One writer per run folder, resume checks before any write, provenance, and `archlab check`."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from test_checkpoint import make_data, tiny_model

import archlab
from archlab.cli import main as cli_main
from archlab.config import ConfigError
from archlab.data.prepare import prepare
from archlab.errors import DataError
from archlab.runs.checkpoint import latest_checkpoint
from archlab.runs.lock import LOCK_FILE, LockedError, RunLock
from archlab.training.trainer import TrainConfig, train

CFG = TrainConfig(batch_size=4, seq_len=16, budget=2, warmup_steps=1, eval_batches=1, sample_every=-1)


def _snapshot(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture()
def run(tmp_path):
    data = make_data(tmp_path / "data", n_docs=10, words=100)
    train(tiny_model(), CFG, data, tmp_path / "run", progress=False)
    return data, tmp_path / "run"


@pytest.fixture()
def live_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _hold(folder, pid, host=None, heartbeat=None):
    now = time.time()
    (folder / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(),
                                                "since": now - 5, "heartbeat": heartbeat or now}))


def test_a_second_writer_is_refused_and_nothing_changes(run, live_pid):
    data, run_dir = run
    _hold(run_dir, live_pid)
    before = _snapshot(run_dir)
    with pytest.raises(LockedError, match=f"pid {live_pid} on {socket.gethostname()} since"):
        train(tiny_model(), CFG.with_overrides({"budget": 4}), data, run_dir, resume=True, progress=False)
    assert _snapshot(run_dir) == before


def test_a_dead_holder_on_this_host_is_taken_over_with_a_message(run):
    data, run_dir = run
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _hold(run_dir, int(proc.stdout))
    with pytest.warns(UserWarning, match=r"taking over the lock .* \(that process is gone\)"):
        train(tiny_model(), CFG.with_overrides({"budget": 3}), data, run_dir, resume=True, progress=False)
    assert latest_checkpoint(run_dir).name == "step_0000003"
    assert not (run_dir / LOCK_FILE).exists()          # released at the end


def test_another_hosts_lock_is_a_lease(tmp_path):
    _hold(tmp_path, 1, host="elsewhere", heartbeat=time.time())
    with pytest.raises(LockedError, match="elsewhere"):
        RunLock(tmp_path, lease_s=60).acquire()
    _hold(tmp_path, 1, host="elsewhere", heartbeat=time.time() - 120)
    with pytest.warns(UserWarning, match="no heartbeat for over 60 s"), RunLock(tmp_path, lease_s=60) as lock:
        assert lock.held and json.loads((tmp_path / LOCK_FILE).read_text())["host"] == socket.gethostname()


def test_the_holder_refreshes_its_heartbeat(tmp_path):
    with RunLock(tmp_path, lease_s=0.3):
        first = json.loads((tmp_path / LOCK_FILE).read_text())["heartbeat"]
        time.sleep(0.5)
        assert json.loads((tmp_path / LOCK_FILE).read_text())["heartbeat"] > first


@pytest.mark.slow   # ~11 s: two training processes
def test_two_real_writers_the_second_refused_the_first_intact(tmp_path):
    data = make_data(tmp_path / "data", n_docs=10, words=100)
    run_dir = tmp_path / "run"
    code = (f"from archlab.training.trainer import TrainConfig, train\nfrom test_checkpoint import tiny_model\n"
            f"train(tiny_model(), TrainConfig(batch_size=4, seq_len=16, budget=400, warmup_steps=1, eval_batches=1,"
            f" sample_every=-1, checkpoint_every=100), {str(data)!r}, {str(run_dir)!r}, progress=False)\n")
    first = subprocess.Popen([sys.executable, "-c", code], cwd=str(tmp_path),
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                 [str(Path(__file__).parent), str(Path(archlab.__file__).parents[1])])})
    try:
        deadline = time.time() + 240          # a loaded machine may take minutes to import torch
        while not (run_dir / LOCK_FILE).exists() and time.time() < deadline:
            time.sleep(0.05)
        with pytest.raises(LockedError, match=f"pid {first.pid}"):
            train(tiny_model(), CFG, data, run_dir, resume=True, progress=False)
    finally:
        assert first.wait(timeout=600) == 0
    assert latest_checkpoint(run_dir).name == "step_0000400"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(tiny_model(), CFG.with_overrides({"budget": 401}), data, run_dir, resume=True, progress=False)
    assert latest_checkpoint(run_dir).name == "step_0000401"


# ---- resume checks come before any write --------------------------------------------------------
def test_resume_on_other_data_is_refused_unless_allowed(run, tmp_path):
    data, run_dir = run
    other = make_data(tmp_path / "other", n_docs=12, words=90)
    before = _snapshot(run_dir)
    with pytest.raises(DataError, match="--allow-new-data"):
        train(tiny_model(), CFG.with_overrides({"budget": 3}), other, run_dir, resume=True, progress=False)
    assert _snapshot(run_dir) == before
    train(tiny_model(), CFG.with_overrides({"budget": 3}), other, run_dir, resume=True, progress=False,
          allow_new_data=True)
    assert latest_checkpoint(run_dir).name == "step_0000003"


def test_resume_with_another_model_or_tokenizer_changes_nothing(run, tmp_path):
    data, run_dir = run
    before = _snapshot(run_dir)
    with pytest.raises(ConfigError, match="different model config"):
        train(tiny_model().with_overrides({"d_model": 64}), CFG, data, run_dir,
              resume=True, progress=False)
    import archlab.tokenizer as tk
    (tmp_path / "text.txt").write_text("a b c " * 50)
    bpe = tk.train([tmp_path / "text.txt"], 257, ["<|endoftext|>"])    # as many ids as bytes, other ids
    other_tok = tmp_path / "other_tok"
    prepare(["a b c " * 50] * 10, bpe, other_tok, num_workers=0, progress=False)
    with pytest.raises(DataError, match="different tokenizer"):
        train(tiny_model(), CFG, other_tok, run_dir, resume=True, progress=False, allow_new_data=True)
    assert _snapshot(run_dir) == before


def test_run_folder_records_provenance(run):
    _, run_dir = run
    record = json.loads((run_dir / "provenance.json").read_text())["sessions"][-1]
    import torch

    import archlab
    assert record["archlab"] == archlab.__version__ and record["torch"] == torch.__version__
    assert record["dtype"] == "float32" and record["attention_backends"] == ["sdpa", "sdpa"]
    assert record["device"] and "cpu_flags" in record


# ---- archlab check -----------------------------------------------------------------------------
def test_check_passes_a_good_run_and_names_a_damaged_file(run, capsys):
    _, run_dir = run
    assert cli_main(["check", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "step_0000002  ok (2 files, sha256 verified)" in out and out.rstrip().endswith("OK")
    weights = latest_checkpoint(run_dir) / "trainer.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 1
    weights.write_bytes(bytes(data))
    assert cli_main(["check", str(run_dir)]) == 1
    assert "DAMAGED" in capsys.readouterr().out and cli_main(["check", str(run_dir), "--quick"]) == 0


def test_check_on_a_folder_that_is_no_run_is_one_line(tmp_path, capsys):
    assert cli_main(["check", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a run folder" in err


def test_a_resume_past_the_budget_still_reports_the_final_train_loss(run):
    data, run_dir = run
    result = train(tiny_model(), CFG, data, run_dir, resume=True, progress=False)   # nothing left to run
    from archlab.training.trainer import read_metrics
    last = [m["loss"] for m in read_metrics(run_dir / "metrics.jsonl") if "loss" in m][-1]
    assert result.steps == 2 and result.final_train_loss == last


def test_benchmark_provenance_line_is_json_with_versions():
    import torch

    from archlab.runs.provenance import provenance_line
    line = provenance_line("cpu", threads=3)
    record = json.loads(line.removeprefix("provenance: "))
    assert record["torch"] == torch.__version__ and record["threads"] == 3 and record["cpu_capability"]


def test_a_model_that_cannot_fit_is_refused_before_anything_is_built(tmp_path, capsys, monkeypatch):
    """llama2-7b on this machine: one line naming what it needs, before any allocation or folder."""
    import archlab.training.placement as placement
    import archlab.training.trainer as train_mod
    from archlab.cli import main
    data = make_data(tmp_path / "data", n_docs=10, words=100)
    monkeypatch.setattr(placement, "available_memory", lambda device: 24 * 2**30)
    built = []
    monkeypatch.setattr(train_mod, "_Run", lambda *a, **k: built.append(1))
    rc = main(["train", "--preset", "llama2-7b", "--data", str(data), "--out", str(tmp_path / "big"),
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and not built and not (tmp_path / "big").exists()
    assert "this run needs about" in err and "GiB" in err and "train.memory_check=false" in err


def test_the_memory_check_can_be_overridden(tmp_path, monkeypatch):
    import archlab.training.placement as placement
    data = make_data(tmp_path / "data", n_docs=10, words=100)
    monkeypatch.setattr(placement, "available_memory", lambda device: 1024)     # "1 KiB free"
    with pytest.raises(placement.MemoryCheckError):
        train(tiny_model(), CFG, data, tmp_path / "a", progress=False)
    result = train(tiny_model(), CFG.with_overrides({"memory_check": False}), data, tmp_path / "b", progress=False)
    assert result.steps == 2
