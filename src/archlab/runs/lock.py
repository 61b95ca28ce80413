"""One writer per folder: a lock file holding who writes (pid, host, since) and a heartbeat.

A second writer is refused at once with a line naming the holder. A holder on this host whose process
is gone is taken over with a warning. Across hosts (a Ray cluster, NFS) the pid means nothing, so the
lock is a lease: the holder refreshes `heartbeat` every `lease_s / 3` seconds from a daemon thread,
and another host takes the lock over only after `lease_s` without a refresh.

>>> import tempfile
>>> with RunLock(tempfile.mkdtemp()) as lock:
...     lock.held
True
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

from archlab.errors import UserError

__all__ = ["RunLock", "LockedError", "LOCK_FILE", "pid_alive"]

LOCK_FILE = ".lock"


class LockedError(UserError):
    """Another live process writes this folder."""


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _stamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


class RunLock:
    """`with RunLock(folder):` holds `folder/.lock` for this process (created, refreshed, removed)."""

    def __init__(self, folder: str | os.PathLike, *, lease_s: float = 60.0, what: str = "run folder"):
        self.folder, self.lease_s, self.what = Path(folder), float(lease_s), what
        self.path = self.folder / LOCK_FILE
        self.me = {"pid": os.getpid(), "host": socket.gethostname()}
        self.held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- acquire / release
    def acquire(self) -> RunLock:
        self._created = not self.folder.exists()    # removed again on release if left empty
        self.folder.mkdir(parents=True, exist_ok=True)
        record = {**self.me, "since": time.time(), "heartbeat": time.time()}
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            self._take_over_or_refuse(record)
        else:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
        self.held = True
        self._thread = threading.Thread(target=self._beat, name=f"lock-heartbeat {self.path}", daemon=True)
        self._thread.start()
        return self

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.held and self._is_mine(self._read()):
            self.path.unlink(missing_ok=True)
            if self._created and not any(self.folder.iterdir()):
                self.folder.rmdir()                 # a run refused before it wrote anything
        self.held = False

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    # ---- internals
    def _read(self) -> dict | None:
        try:
            record = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}                       # garbled (a writer killed mid-write): stale
        return record if isinstance(record, dict) else {}

    def _is_mine(self, record: dict | None) -> bool:
        return bool(record) and all(record.get(k) == v for k, v in self.me.items())

    def _take_over_or_refuse(self, record: dict) -> None:
        holder = self._read() or {}
        if holder and not self._is_mine(holder) and not self._is_stale(holder):
            raise LockedError(
                f"{self.folder} is being written by pid {holder.get('pid')} on {holder.get('host')} since "
                f"{_stamp(holder.get('since', 0))}: one writer at a time (wait for it, stop it, or use another "
                f"folder)")
        if holder and not self._is_mine(holder):
            warnings.warn(f"taking over the lock of {self.what} {self.folder} from pid {holder.get('pid')} on "
                          f"{holder.get('host')} ({self._why_stale(holder)})", stacklevel=3)
        self._write(record)
        if not self._is_mine(self._read()):  # another process took it over in the same instant
            raise LockedError(f"{self.folder} was just locked by another process: one writer at a time")

    def _is_stale(self, holder: dict) -> bool:
        if holder.get("host") == self.me["host"] and isinstance(holder.get("pid"), int):
            return not pid_alive(holder["pid"])
        return time.time() - float(holder.get("heartbeat", 0)) > self.lease_s

    def _why_stale(self, holder: dict) -> str:
        if holder.get("host") == self.me["host"]:
            return "that process is gone"
        return f"no heartbeat for over {self.lease_s:g} s"

    def _write(self, record: dict) -> None:
        tmp = self.path.with_name(f"{LOCK_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path)

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            record = self._read()
            if not self._is_mine(record):   # taken over after a long stall: stop refreshing
                return
            self._write({**record, "heartbeat": time.time()})
