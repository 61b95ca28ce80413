"""One-shot output folders (`convert`, export, `tokenizer train`, `data prepare`): refuse to replace an
existing non-empty folder unless asked, and when asked, replace it atomically.

`fresh_output(target, overwrite=...)` yields a temporary sibling folder to write into. When the block
finishes, the temporary folder takes the target's name with renames (the old folder is moved aside first
and deleted last); when it fails, the temporary folder is deleted and the target is as it was. Leftovers
of killed processes (`.NAME.partial-PID`, `.NAME.old-PID` whose process is gone) are removed first.

`check_output(target, inputs=..., overwrite=...)` is the one rule every command that writes a folder or file
runs before any work and before it takes any lock (`inputs` has no default: a caller names what it reads, or
says `()`): an output may never be, hold, or sit inside one of its inputs (paths compared resolved, symlinks
followed), and a folder a live writer holds (archlab.runs.lock: the folder, a folder above it, or one inside
it; a run written in place may sit inside one: a sweep's runs inside the sweep folder its driver locks) is never
written. A replaced output (convert, export, `data prepare`, `tokenizer train`) that exists
and is not empty needs `overwrite`; a run folder written in place (`in_place=True`: `train`, `finetune`,
`ablate`) keeps its own rule for what it finds there (a run resumed, or refused). `fresh_output` runs the
check again just before the rename.

>>> import tempfile, pathlib
>>> target = pathlib.Path(tempfile.mkdtemp()) / "out"
>>> with fresh_output(target, inputs=()) as tmp:
...     _ = (tmp / "a.txt").write_text("new")
>>> (target / "a.txt").read_text()
'new'
"""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path

from archlab.errors import UserError
from archlab.runs.lock import LockedError

__all__ = ["fresh_output", "OutputExistsError", "OutputConflictError", "LiveWriterError", "is_empty_dir",
           "check_output"]


class OutputExistsError(UserError, FileExistsError):
    """The output folder exists and is not empty, and --overwrite was not given."""


class OutputConflictError(UserError):
    """The output is, holds or sits inside an input, or a live writer uses it."""


class LiveWriterError(OutputConflictError, LockedError):
    """The output is, holds or sits inside a folder another live process writes (what RunLock would refuse)."""


def is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _refuse_existing(target: str | os.PathLike, overwrite: bool, flag: str = "--overwrite") -> None:
    """Raise OutputExistsError for a non-empty (or non-folder) `target` unless `overwrite` (check_output's part;
    never called alone, so no caller forgets the inputs)."""
    target = Path(target)
    if overwrite or not target.exists() or is_empty_dir(target):
        return
    what = "folder" if target.is_dir() else "file"
    raise OutputExistsError(f"{target} already exists and is a non-empty {what}: pass {flag} to replace it")


def _resolved(path: str | os.PathLike) -> Path:
    return Path(os.path.realpath(Path(path).expanduser()))


def _refuse_overlap(target: str | os.PathLike, inputs: Iterable[str | os.PathLike | None],
                    flag: str = "--out") -> None:
    """OutputConflictError when `target` is, holds or sits inside one of the `inputs` that exist on disk
    (None and names that are no path, such as "bytes", are skipped)."""
    out = _resolved(target)
    for given in inputs:
        if given is None or not Path(given).expanduser().exists():
            continue
        source = _resolved(given)
        if out == source:
            how = "is"
        elif source.is_relative_to(out):
            how = "holds"
        elif out.is_relative_to(source):
            how = "sits inside"
        else:
            continue
        raise OutputConflictError(f"{flag} {target} {how} the input {given}: an output may not replace or write "
                                  "into what it is made from; choose another folder")


def _refuse_live_writers(target: str | os.PathLike, flag: str = "--out", above: bool = True) -> None:
    """OutputConflictError when a live writer other than this process holds `target`, one inside it or (`above`)
    a folder above it (archlab.runs.lock): writing there would pull the folder from under that writer."""
    from archlab.runs.lock import LOCK_FILE, describe_holder, live_holder

    out = _resolved(target)
    folders = [out, *out.parents] if above else [out]
    if out.is_dir():
        folders += [Path(root) for root, _, files in os.walk(out) if LOCK_FILE in files]
    for folder in folders:
        holder = live_holder(folder)
        if holder is None or (holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()):
            continue
        how = "is" if folder == out else "sits inside" if out.is_relative_to(folder) else "holds"
        raise LiveWriterError(f"{flag} {target} {how} the folder {folder}, which {describe_holder(holder)} is "
                                  "writing: wait for it to finish or stop it, or choose another folder")


def check_output(target: str | os.PathLike, *, inputs: Iterable[str | os.PathLike | None],
                 overwrite: bool = False, in_place: bool = False, flag: str = "--overwrite",
                 out_flag: str = "--out") -> None:
    """Every check an output gets before any work and any lock: not one of its `inputs`, nor holding or inside
    one (paths that do not exist and None are skipped); not existing and non-empty unless `overwrite` (a replaced
    output) or `in_place` (a run folder written where it is: its caller decides about what is there); and not
    the folder of a live writer, nor above one, nor (unless `in_place`) inside one: a run written in place may sit
    inside a live writer's folder (a sweep's runs inside the sweep its driver locks), it replaces nothing there.
    Raises OutputConflictError / OutputExistsError (one line, exit 2).
    Example: check_output("exported/adapter", inputs=["runs/lora"], overwrite=True)"""
    _refuse_overlap(target, inputs, out_flag)
    if not in_place:
        _refuse_existing(target, overwrite, flag)
    _refuse_live_writers(target, out_flag, above=not in_place)


@contextlib.contextmanager
def fresh_output(target: str | os.PathLike, *, inputs: Iterable[str | os.PathLike | None],
                 overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside `target`; on success it replaces `target` atomically (unless a live
    writer took it meanwhile: then the new folder is dropped and the old one stays). `inputs`: as check_output."""
    target = Path(target).expanduser()
    check_output(target, inputs=list(inputs), overwrite=overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(target)
    tmp = target.parent / f".{target.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        if target.exists():
            _refuse_live_writers(target)    # a writer may have started while this one worked
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
