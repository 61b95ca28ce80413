"""One writer per folder: a lock file holding who writes (pid, host, since) and a heartbeat.

A second writer is refused at once with a line naming the holder. A holder on this host whose process
is gone is taken over with a warning. Across hosts (a Ray cluster, NFS) the pid means nothing, so the
lock is a lease: the holder refreshes `heartbeat` every `lease_s / 3` seconds from a daemon thread,
and another host takes the lock over only after `lease_s` without a refresh.

Every change to the lock file (create, take over, refresh, remove) happens under an exclusive `flock`
of the folder itself, and the record is written to a temporary file and renamed into place: two
processes that start together never both hold the lock, and the lock file never exists empty. A lock
file that cannot be read (a writer of another program killed mid-write) counts as held for
`GRACE_S` seconds after its last change, then as stale.

>>> import tempfile
>>> with RunLock(tempfile.mkdtemp()) as lock:
...     lock.held
True
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from archlab.errors import UserError

try:
    import fcntl
except ImportError:      # not POSIX: the atomic create below still refuses a second fresh writer
    fcntl = None  # type: ignore[assignment]

__all__ = ["RunLock", "LockedError", "LOCK_FILE", "GRACE_S", "pid_alive", "live_holder", "describe_holder"]

LOCK_FILE = ".lock"
GRACE_S = 10.0           # an unreadable lock file younger than this is someone's, being written


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


class _FolderGone(FileNotFoundError):
    """The folder went between this process's mkdir and its flock: a racer that had made it, and found it taken,
    removed it again (RunLock._remove_if_created). The flock then sits on a removed folder: start over."""


@contextlib.contextmanager
def _folder_mutex(folder: Path) -> Iterator[None]:
    """An exclusive flock on the folder (released by the kernel if this process dies): the lock file's
    readers-then-writers run one at a time."""
    if fcntl is None:
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:      # a filesystem without flock on folders (some NFS setups): the exclusive link remains
            pass
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(folder))
        except FileNotFoundError:
            same = False
        if not same:
            raise _FolderGone(folder)
        yield
    finally:
        os.close(fd)         # closing releases the flock


def _read_record(path: Path) -> dict | None:
    """The holder's record; None when there is no lock file; {} when it cannot be read as one."""
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _is_stale(path: Path, holder: dict, lease_s: float) -> bool:
    """Whether `holder` (read from `path`) no longer writes: its process is gone (this host), its lease ran
    out (another host), or the file is unreadable and older than GRACE_S."""
    if not holder:
        try:
            return time.time() - path.stat().st_mtime > GRACE_S
        except FileNotFoundError:
            return True
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        return not pid_alive(holder["pid"])
    try:
        return time.time() - float(holder.get("heartbeat", 0)) > lease_s
    except (TypeError, ValueError):
        return True


def live_holder(folder: str | os.PathLike, *, lease_s: float = 60.0) -> dict | None:
    """The record of a live writer of `folder`, or None when nobody holds it. Read-only: for callers that
    must not replace a folder a writer is using. A `.lock` that holds no writer's record (another program's
    file of that name) is nobody's: RunLock never leaves its lock file empty or half written."""
    path = Path(folder) / LOCK_FILE
    holder = _read_record(path)
    if not holder or "pid" not in holder or _is_stale(path, holder, lease_s):
        return None
    return holder


def describe_holder(holder: dict) -> str:
    """`pid 123 on host since 2026-01-01 00:00:00 UTC` (an unreadable record: a writer still writing it)."""
    if not holder:
        return "a process whose lock file is being written"
    try:
        since = _stamp(float(holder.get("since", 0)))
    except (TypeError, ValueError, OverflowError, OSError):
        since = "an unknown time"
    return f"pid {holder.get('pid')} on {holder.get('host')} since {since}"


def _link_or_create(tmp: Path, path: Path, record: dict) -> None:
    """`path` made to hold `record`, failing with FileExistsError if it exists: a hard link of the full
    `tmp`, or (a filesystem without hard links) an exclusive create written under the folder's flock."""
    try:
        os.link(tmp, path)
        return
    except FileExistsError:
        raise
    except OSError:
        pass
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)


class RunLock:
    """`with RunLock(folder):` holds `folder/.lock` for this process (created, refreshed, removed)."""

    def __init__(self, folder: str | os.PathLike, *, lease_s: float = 60.0, what: str = "run folder"):
        self.folder, self.lease_s, self.what = Path(folder), float(lease_s), what
        self.path = self.folder / LOCK_FILE
        # the token tells this lock from another RunLock of the same process on the same folder
        self.me = {"pid": os.getpid(), "host": socket.gethostname(), "token": uuid.uuid4().hex}
        self.held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- acquire / release
    def acquire(self) -> RunLock:
        for _ in range(100):
            try:
                return self._try_acquire()
            except FileNotFoundError:   # the folder removed by a racer that made it and gave up (_FolderGone)
                continue
        raise LockedError(f"{self.folder} keeps being removed by other processes while this one locks it")

    def _try_acquire(self) -> RunLock:
        self._created = not self.folder.exists()    # removed again on release if left empty
        self.folder.mkdir(parents=True, exist_ok=True)
        record = {**self.me, "since": time.time(), "heartbeat": time.time()}
        try:
            with _folder_mutex(self.folder):
                holder = _read_record(self.path)
                if holder is not None:
                    self._refuse_or_take_over(holder)
                self._write(record, exclusive=holder is None)
        except LockedError:
            self._remove_if_created()
            raise
        self.held = True
        self._thread = threading.Thread(target=self._beat, name=f"lock-heartbeat {self.path}", daemon=True)
        self._thread.start()
        return self

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.held and self.folder.is_dir():
            with contextlib.suppress(FileNotFoundError), _folder_mutex(self.folder):
                if self._is_mine(_read_record(self.path)):
                    self.path.unlink(missing_ok=True)
            self._remove_if_created()
        self.held = False

    @property
    def created(self) -> bool:
        """Whether this lock made the folder (it did not exist when acquire began): what was in it otherwise
        belongs to someone else."""
        return bool(getattr(self, "_created", False))

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    # ---- internals
    def _remove_if_created(self) -> None:
        """A folder this lock created and nothing else wrote (a run refused before it began) goes again."""
        if self._created:
            with contextlib.suppress(OSError):
                self.folder.rmdir()              # fails, as it should, when anything is inside

    def _is_mine(self, record: dict | None) -> bool:
        return bool(record) and all(record.get(k) == v for k, v in self.me.items())

    def _refuse_or_take_over(self, holder: dict) -> None:
        if not _is_stale(self.path, holder, self.lease_s):
            raise LockedError(f"{self.folder} is being written by {describe_holder(holder)}: one writer at a "
                              "time (wait for it, stop it, or use another folder)")
        why = self._why_stale(holder)
        warnings.warn(f"taking over the lock of {self.what} {self.folder} from pid {holder.get('pid')} on "
                      f"{holder.get('host')} ({why})", stacklevel=4)

    def _why_stale(self, holder: dict) -> str:
        if not holder:
            return f"its lock file is unreadable and unchanged for over {GRACE_S:g} s"
        if holder.get("host") == self.me["host"]:
            return "that process is gone"
        return f"no heartbeat for over {self.lease_s:g} s"

    def _write(self, record: dict, exclusive: bool = False) -> None:
        """The record in full, then in place: a temporary file linked (exclusive: fails if a lock file
        appeared) or renamed over the lock file, so the lock file is never empty or half written."""
        tmp = self.path.with_name(f"{LOCK_FILE}.{os.getpid()}.{self.me['token'][:8]}.tmp")
        tmp.write_text(json.dumps(record))
        try:
            if exclusive:
                try:
                    _link_or_create(tmp, self.path, record)
                except FileExistsError:
                    raise LockedError(f"{self.folder} was just locked by another process: one writer at a "
                                      "time") from None
            else:
                os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                with _folder_mutex(self.folder):
                    record = _read_record(self.path)
                    if not self._is_mine(record):   # taken over after a long stall: stop refreshing
                        return
                    self._write({**record, "heartbeat": time.time()})
            except OSError:                         # the folder went away under us: nothing to refresh
                return
