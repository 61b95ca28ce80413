"""The lab's executors (archlab.lab.executors): N local processes and Ray tasks give the serial
runner's table (the same final losses, bit for bit); a worker that dies is a failed row; a driver
killed mid-sweep leaves a table the next sweep finishes without duplicates."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from archlab.errors import UserError
from archlab.lab import runner, suites
from archlab.lab.executors import make_executor
from archlab.lab.plan import INTERRUPTED
from archlab.lab.store import ResultStore
from archlab.runs.lock import LOCK_FILE, pid_alive

SUITE = {
    "name": "tiny_exec", "claim": "RMSNorm is no worse than LayerNorm", "seeds": 2,
    "axes": [{"name": "norm", "key": "norm.kind", "values": ["layernorm", "rmsnorm"]}],
    "base": {"model": {"d_model": 32, "n_layers": 2, "attention.n_heads": 2, "mlp.d_ff": 64},
             "train": {"batch_size": 4, "seq_len": 16, "eval_every": 10, "eval_batches": 2, "warmup_steps": 2}},
    "measure": ["sinks"],
}
BUDGET = 12
COMPARED = ("status", "steps", "tokens_seen", "final_val_loss", "best_val_loss", "final_train_loss", "params")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from archlab.data.prepare import prepare

    root = tmp_path_factory.mktemp("exec_data")
    text = "Now is the winter of our discontent made glorious summer by this sun of York. "
    prepare([f"{i} {text * 25}" for i in range(16)], "bytes", root / "data", progress=False, num_workers=0)
    return root / "data"


@pytest.fixture(scope="module")
def serial_table(data, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("serial") / "sweep"
    runner.run_suite(suites.Suite.from_dict(SUITE), out, data_dir=data, budget=BUDGET, progress=False)
    return _table(out)


def _table(sweep: Path) -> dict:
    """(variant, seed) -> the compared columns and the suite's measurements, from a sweep's table."""
    with ResultStore(sweep, readonly=True) as store:
        rows = store.runs()
    assert len({(r.suite, r.variant, r.seed) for r in rows}) == len(rows)
    return {(r.variant, r.seed): {**{k: getattr(r, k) for k in COMPARED},
                                  "first_token_mass": r.extra.get("first_token_mass")} for r in rows}


@pytest.mark.slow   # ~17 s: real worker processes
def test_local_processes_give_the_serial_table_bit_for_bit(data, serial_table, tmp_path):
    rows = runner.run_suite(suites.Suite.from_dict(SUITE), tmp_path / "sweep", data_dir=data, budget=BUDGET,
                            progress=False, executor="local", workers=2)
    assert len(rows) == 4 and {r.status for r in rows} == {"done"}
    assert _table(tmp_path / "sweep") == serial_table        # == on floats: the same bits


def _dies_in_its_worker(model_cfg, train_cfg, data_dir, out_dir, *, resume=False, progress=True):
    """A train_fn whose process dies (as if killed or out of memory) for the LayerNorm seed-0 run."""
    from archlab.training.trainer import train
    if model_cfg.norm.kind == "layernorm" and train_cfg.seed == 0:
        os._exit(9)
    return train(model_cfg, train_cfg, data_dir, out_dir, resume=resume, progress=progress)


@pytest.mark.slow   # ~26 s: a worker killed mid-run
def test_a_worker_that_dies_is_a_failed_row_and_the_next_sweep_runs_it(data, serial_table, tmp_path):
    suite = suites.Suite.from_dict(SUITE)
    kw = dict(data_dir=data, budget=BUDGET, progress=False, executor="local", workers=2)
    rows = runner.run_suite(suite, tmp_path / "sweep", train_fn=_dies_in_its_worker, **kw)
    status = {(r.variant, r.seed): r.status for r in rows}
    assert status[("norm=layernorm", 0)] == "failed"
    assert "worker process died" in next(r.error for r in rows if r.status == "failed")
    assert list(status.values()).count("done") >= 2          # the sweep went on with a fresh pool
    rows = runner.run_suite(suite, tmp_path / "sweep", **kw)
    assert {r.status for r in rows} == {"done"}
    assert _table(tmp_path / "sweep") == serial_table


def test_a_pool_that_broke_after_the_last_wait_takes_the_next_job_on_a_fresh_pool():
    """A worker can die between `wait` and the next `submit` (seen under load): the job goes to a new pool, and
    stopping the sweep afterwards does not trip over the old pool's state."""
    pool = make_executor("local", 1)
    try:
        broken = pool._pool
        broken._broken = "a child process terminated abruptly"      # what a dead worker leaves behind
        future = pool.submit("not a job")                           # must not raise BrokenProcessPool
        fresh = pool._pool
        assert fresh is not broken and future in pool._jobs
        fresh.shutdown(wait=True, cancel_futures=True)
        broken._processes = None                                    # a shut-down pool's state
        pool._pool = broken
        pool.cancel([future])                                       # no AttributeError
    finally:
        pool._pool.shutdown(wait=False, cancel_futures=True)


def test_executor_arguments_are_checked():
    with pytest.raises(UserError, match="at least 1"):
        make_executor("local", workers=0)
    with pytest.raises(UserError, match="--executor ray"):
        make_executor("local", workers=1, address="127.0.0.1:6379")
    with pytest.raises(UserError, match="executor local or ray"):
        make_executor("serial", workers=2)
    local = make_executor("local", workers=3)
    assert local.workers == 3 and local.describe() == "local, 3 workers"
    local.close()
    assert make_executor("serial").workers == 1


# ---- the driver killed mid-sweep ---------------------------------------------------------------------
def _rows(db: Path) -> list[tuple]:
    if not db.is_file():
        return []
    with sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=30) as con:
        try:
            return con.execute("SELECT variant, seed, status, finished_at FROM runs").fetchall()
        except sqlite3.OperationalError:
            return []


def _ablate(suite_yaml: Path, data: Path, out: Path, executor: str, workers: int) -> list[str]:
    return [sys.executable, "-m", "archlab", "ablate", str(suite_yaml), "--data", str(data), "--out", str(out),
            "--budget", str(BUDGET * 4), "--executor", executor, "--workers", str(workers), "--quiet"]


def _kill_mid_sweep_then_resume(data: Path, tmp_path: Path, executor: str) -> tuple[dict, dict]:
    """SIGKILL the driver once a row is done while others run; wait until every run lock's holder is
    gone; sweep again. (rows done before the kill, the final table)."""
    suite_yaml = tmp_path / "suite.yaml"
    suite_yaml.write_text(yaml.safe_dump(SUITE))
    out, db = tmp_path / "sweep", tmp_path / "sweep" / "results.sqlite"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    driver = subprocess.Popen(_ablate(suite_yaml, data, out, executor, 2), env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline and driver.poll() is None:
        rows = _rows(db)
        if any(r[2] == "done" for r in rows) and any(r[2] == "running" for r in rows):
            break
        time.sleep(0.05)
    assert driver.poll() is None, f"the sweep ended before it could be killed: {driver.stderr.read().decode()}"
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    before = {(v, s): f for v, s, status, f in _rows(db) if status == "done"}
    assert 1 <= len(before) < 4
    holders = [json.loads(p.read_text()).get("pid") for p in out.glob(f"runs/*/*/{LOCK_FILE}")]
    deadline = time.time() + 60
    while any(pid and pid_alive(pid) for pid in holders) and time.time() < deadline:
        time.sleep(0.2)          # workers notice the driver is gone and exit (their locks are then stale)
    assert not any(pid and pid_alive(pid) for pid in holders), "a worker outlived its killed driver"
    done = subprocess.run(_ablate(suite_yaml, data, out, executor, 2), env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    after = {(v, s): f for v, s, status, f in _rows(db)}
    assert len(_rows(db)) == 4 and all(r[2] == "done" for r in _rows(db))
    assert {k: after[k] for k in before} == before          # finished rows were not run again
    return before, _table(out)


@pytest.mark.slow   # ~33 s: a driver killed mid-sweep
def test_killing_the_driver_mid_sweep_then_rerunning_finishes_without_duplicates(data, tmp_path):
    from archlab.lab import runner as r

    _, table = _kill_mid_sweep_then_resume(data, tmp_path, "local")
    serial = tmp_path / "serial"
    r.run_suite(suites.Suite.from_dict(SUITE), serial, data_dir=data, budget=BUDGET * 4, progress=False)
    assert table == _table(serial)


# ---- Ray (a local instance on 127.0.0.1, 2 workers) ---------------------------------------------------
@pytest.mark.slow
def test_ray_tasks_give_the_serial_table_bit_for_bit(data, serial_table, tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    try:
        rows = runner.run_suite(suites.Suite.from_dict(SUITE), tmp_path / "sweep", data_dir=data, budget=BUDGET,
                                progress=False, executor="ray", workers=2)
    finally:
        ray.shutdown()
    assert len(rows) == 4 and {r.status for r in rows} == {"done"}
    assert _table(tmp_path / "sweep") == serial_table


@pytest.mark.slow
def test_ray_driver_killed_mid_sweep_then_rerun_finishes_without_duplicates(data, tmp_path):
    pytest.importorskip("ray")
    _, table = _kill_mid_sweep_then_resume(data, tmp_path, "ray")
    serial = tmp_path / "serial"
    runner.run_suite(suites.Suite.from_dict(SUITE), serial, data_dir=data, budget=BUDGET * 4, progress=False)
    assert table == _table(serial)


class _StoppedOnSecondRun:
    """A train_fn whose second run is stopped by SIGTERM (archlab.training.trainer.Stopped), as on a preempted node."""

    def __init__(self):
        self.calls = 0

    def __call__(self, model_cfg, train_cfg, data_dir, out_dir, *, resume=False, progress=True):
        from archlab.training.trainer import Stopped, train
        self.calls += 1
        if self.calls == 2:
            raise Stopped("SIGTERM", 3, None)
        return train(model_cfg, train_cfg, data_dir, out_dir, resume=resume, progress=progress)


def test_a_stopped_run_stops_the_sweep_and_its_row_says_interrupted(data, serial_table, tmp_path):
    suite, fake = suites.Suite.from_dict(SUITE), _StoppedOnSecondRun()
    with pytest.raises(KeyboardInterrupt):
        runner.run_suite(suite, tmp_path / "sweep", data_dir=data, budget=BUDGET, progress=False, train_fn=fake)
    assert fake.calls == 2                                    # no run started after the stopped one
    with ResultStore(tmp_path / "sweep", readonly=True) as store:
        rows = store.runs()
    assert [r.status for r in rows] == ["done", "failed"] and rows[1].error.startswith(INTERRUPTED)
    runner.run_suite(suite, tmp_path / "sweep", data_dir=data, budget=BUDGET, progress=False)
    assert _table(tmp_path / "sweep") == serial_table
