"""One-shot output folders (`convert`, export, `tokenizer train`, `data prepare`): refuse to replace an
existing non-empty folder unless asked, and when asked, replace it atomically.

`fresh_output(target, overwrite=...)` yields a temporary sibling folder to write into. When the block
finishes, the temporary folder takes the target's name with renames (the old folder is moved aside first
and deleted last); when it fails, the temporary folder is deleted and the target is as it was. Leftovers
of killed processes (`.NAME.partial-PID`, `.NAME.old-PID` whose process is gone) are removed first.

>>> import tempfile, pathlib
>>> target = pathlib.Path(tempfile.mkdtemp()) / "out"
>>> with fresh_output(target) as tmp:
...     _ = (tmp / "a.txt").write_text("new")
>>> (target / "a.txt").read_text()
'new'
"""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from archlab.errors import UserError

__all__ = ["fresh_output", "OutputExistsError", "is_empty_dir", "refuse_existing"]


class OutputExistsError(UserError, FileExistsError):
    """The output folder exists and is not empty, and --overwrite was not given."""


def is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def refuse_existing(target: str | os.PathLike, overwrite: bool, flag: str = "--overwrite") -> None:
    """Raise OutputExistsError for a non-empty (or non-folder) `target` unless `overwrite`: a check to run
    before any work, so a refusal costs nothing."""
    target = Path(target)
    if overwrite or not target.exists() or is_empty_dir(target):
        return
    what = "folder" if target.is_dir() else "file"
    raise OutputExistsError(f"{target} already exists and is a non-empty {what}: pass {flag} to replace it")


@contextlib.contextmanager
def fresh_output(target: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside `target`; on success it replaces `target` atomically."""
    target = Path(target).expanduser()
    refuse_existing(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(target)
    tmp = target.parent / f".{target.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_dir(new: Path, target: Path) -> None:
    """Rename `new` to `target`; an existing target is moved aside first and deleted after."""
    old = None
    if is_empty_dir(target):
        target.rmdir()
    elif target.exists():
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        os.rename(target, old)
    os.rename(new, target)
    if old is not None:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def _remove_leftovers(target: Path) -> None:
    """Delete `.NAME.partial-PID` / `.NAME.old-PID` of earlier runs that were killed (their process is
    gone); a live process's are left alone."""
    from archlab.runs.lock import pid_alive

    for kind in ("partial", "old"):
        for leftover in target.parent.glob(f".{glob.escape(target.name)}.{kind}-*"):
            pid = leftover.name.rsplit("-", 1)[-1]
            if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                shutil.rmtree(leftover, ignore_errors=True)
