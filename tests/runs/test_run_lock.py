"""RunLock admits one holder at a time: racers behind a barrier, stale and unreadable lock files, and
one process's two locks on one folder."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
import warnings

import pytest

from archlab.runs.lock import GRACE_S, LOCK_FILE, LockedError, RunLock, live_holder

TRIALS, RACERS = 25, 4


def _race(folder, barrier, holders, most, acquired):
    """One racer: wait for all, try the lock, and while holding it count how many hold it at once."""
    warnings.simplefilter("ignore")          # "taking over" warnings of the stale-record trials
    barrier.wait()
    try:
        lock = RunLock(folder).acquire()
    except LockedError:
        os._exit(0)
    with holders.get_lock():
        holders.value += 1
        most.value = max(most.value, holders.value)
        acquired.value += 1
    time.sleep(0.02)
    with holders.get_lock():
        holders.value -= 1
    lock.release()
    os._exit(0)


def _trials(tmp_path, prepare):
    ctx = mp.get_context("fork")
    overlaps, winners = 0, []
    for trial in range(TRIALS):
        folder = tmp_path / f"t{trial}"
        prepare(folder)
        barrier = ctx.Barrier(RACERS)
        holders, most, acquired = ctx.Value("i", 0), ctx.Value("i", 0), ctx.Value("i", 0)
        procs = [ctx.Process(target=_race, args=(folder, barrier, holders, most, acquired)) for _ in range(RACERS)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
        overlaps += most.value > 1
        winners.append(acquired.value)
    return overlaps, winners


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def test_racers_on_a_fresh_folder_never_hold_it_together(tmp_path):
    overlaps, winners = _trials(tmp_path, lambda folder: None)
    assert overlaps == 0 and min(winners) >= 1


def test_racers_taking_over_a_dead_holder_never_hold_it_together(tmp_path):
    dead = _dead_pid()

    def stale(folder):
        folder.mkdir()
        (folder / LOCK_FILE).write_text(json.dumps({"pid": dead, "host": socket.gethostname(), "since": 0,
                                                    "heartbeat": 0}))
    overlaps, winners = _trials(tmp_path, stale)
    assert overlaps == 0 and min(winners) >= 1


def test_an_empty_lock_file_is_held_for_a_grace_period_then_stale(tmp_path):
    (tmp_path / LOCK_FILE).write_text("")
    with pytest.raises(LockedError, match="being written"):
        RunLock(tmp_path).acquire()
    assert live_holder(tmp_path) is None        # not a record: outputs above or below do not wait for it
    old = time.time() - GRACE_S - 5
    os.utime(tmp_path / LOCK_FILE, (old, old))
    with pytest.warns(UserWarning, match="unreadable"), RunLock(tmp_path) as lock:
        record = json.loads((tmp_path / LOCK_FILE).read_text())
        assert lock.held and record["pid"] == os.getpid()
    assert not (tmp_path / LOCK_FILE).exists()


def test_two_locks_of_one_process_on_one_folder_are_refused(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(LockedError, match=f"pid {os.getpid()}"):
            RunLock(tmp_path).acquire()
        assert (tmp_path / LOCK_FILE).exists()          # the refused one did not remove the holder's file
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_refused_lock_leaves_no_folder_it_created(tmp_path):
    folder = tmp_path / "new"
    with RunLock(folder):
        pass
    assert not folder.exists()                          # created for the lock, left empty: removed
    assert not list(tmp_path.iterdir())
