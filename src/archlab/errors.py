"""The one error path of the `archlab` command.

A `UserError` is a mistake the user can fix (a bad argument, config, file, a missing network, a model
that cannot fit): the CLI prints its message as one line, `archlab <command>: error: ...`, and exits
with status 2. Every other exception is a bug in archlab: the CLI prints the traceback and asks for a
report. `ARCHLAB_DEBUG=1` shows the traceback for user errors too.

The library's own error classes (`ConfigError`, `DataError`, `CheckpointError`, ...) derive from
`UserError`, so library code raises what it means and the CLI needs no list of exception types.

>>> raise UserError("runs/x exists: pass --overwrite to replace it")
Traceback (most recent call last):
...
archlab.errors.UserError: runs/x exists: pass --overwrite to replace it
"""
from __future__ import annotations

import errno
import os
import sys
import traceback

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
REPORT_HINT = "this is a bug in archlab: please report it with the command and the traceback above"


class UserError(Exception):
    """A mistake the user can fix; the message names the problem (and, where it helps, the fix)."""


class DataError(UserError, ValueError):
    """A data folder, split, tokenizer or sampling request that cannot be served."""


# OS errors that come from the user's environment, not from archlab's code: missing or unreadable
# paths, read-only or full disks, a port in use, no network.
_USER_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT,
                errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ENOTEMPTY, errno.EADDRINUSE,
                errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ECONNREFUSED, errno.ENAMETOOLONG}


def is_user_error(exc: BaseException) -> bool:
    """True for errors a user caused or can fix, which deserve one line and no traceback."""
    if isinstance(exc, (UserError, FileNotFoundError, FileExistsError, PermissionError, NotADirectoryError,
                        IsADirectoryError)):
        return True       # about the user's paths, whether the OS or archlab raised them
    if isinstance(exc, OSError) and exc.errno in _USER_ERRNOS:
        return True
    return isinstance(exc, MemoryError)


def one_line(exc: BaseException) -> str:
    """The message of `exc` on one line (an OSError names its file, a MemoryError says what to do)."""
    if isinstance(exc, OSError) and exc.strerror:
        where = f"{exc.filename}: " if exc.filename else ""
        text = f"{where}{exc.strerror}"
    elif isinstance(exc, MemoryError):
        text = "out of memory" + (f": {exc}" if str(exc) else "") + " (try a smaller model, batch or seq_len)"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def debug_enabled() -> bool:
    return os.environ.get("ARCHLAB_DEBUG", "") not in ("", "0")


def report(exc: BaseException, prog: str = "archlab") -> int:
    """Print `exc` the way the CLI does and return the exit status to use."""
    if isinstance(exc, KeyboardInterrupt):
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if is_user_error(exc):
        if debug_enabled():
            traceback.print_exception(exc)
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USER_ERROR
    traceback.print_exception(exc)
    print(f"{prog}: {REPORT_HINT}", file=sys.stderr)
    return 1
