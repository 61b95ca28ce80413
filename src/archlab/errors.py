"""The one error path of the `archlab` command.

A `UserError` is a mistake the user can fix (a bad argument, config, file, a missing network, a model
that cannot fit): the CLI prints its message as one line, `archlab <command>: error: ...`, and exits
with status 2. No network (a connection refused, a host that does not answer, an offline mode that
forbids a download) is such a mistake too. A reader that leaves early (`archlab presets | head`) ends
the command quietly with status 141, as a shell reports a writer killed by SIGPIPE. Every other
exception is a bug in archlab: the CLI prints the traceback and asks for a report. A `SignalStop` (SIGTERM or
SIGINT caught by a loop that saved its state and stopped: `train`, `finetune`, the demos) prints its line and
exits 128 + the signal's number, as the signal would have. `ARCHLAB_DEBUG=1`
shows the traceback for user errors too.

The library's own error classes (`ConfigError`, `DataError`, `CheckpointError`, ...) derive from
`UserError`, so library code raises what it means and the CLI needs no list of exception types.

>>> raise UserError("runs/x exists: pass --overwrite to replace it")
Traceback (most recent call last):
...
archlab.errors.UserError: runs/x exists: pass --overwrite to replace it
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import socket
import sys
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141      # 128 + SIGPIPE
REPORT_HINT = "this is a bug in archlab: please report it with the command and the traceback above"


class UserError(Exception):
    """A mistake the user can fix; the message names the problem (and, where it helps, the fix)."""


class DataError(UserError, ValueError):
    """A data folder, split, tokenizer or sampling request that cannot be served."""


class SignalStop(Exception):
    """A signal stopped the command cleanly (its state saved); `signal_name` is "SIGTERM" or "SIGINT"."""

    signal_name: str = "SIGTERM"


# OS errors that come from the user's environment, not from archlab's code: missing or unreadable
# paths, read-only or full disks, a port in use, no network.
_USER_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT,
                errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ENOTEMPTY, errno.EADDRINUSE,
                errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ECONNREFUSED, errno.ENAMETOOLONG, errno.EFBIG}
_ERRNO_HINTS = {errno.EFBIG: "a file-size limit (ulimit -f) or the file system's largest file"}


# Connection failures of the HTTP clients that datasets / huggingface_hub use, by class name so that
# none of them is imported here: requests' ConnectionError and Timeout, httpx's NetworkError and
# TimeoutException (builtin ConnectionError covers huggingface_hub's OfflineModeIsEnabled and datasets').
_NETWORK_ERROR_CLASSES = {"ConnectionError", "Timeout", "NetworkError", "TimeoutException"}


def read_json_object(file: str | os.PathLike, error: type[Exception] = UserError) -> dict:
    """The JSON object in `file` (config.json, tokenizer.json, generation_config.json, ...); `error`, one line
    naming the file, when its text is not UTF-8 or not JSON, or it holds another JSON value.
    Example: read_json_object("runs/x/tokenizer/tokenizer.json", TokenizerFileError)["model"]["type"] -> "BPE" """
    try:
        data = json.loads(Path(file).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:          # json.JSONDecodeError is a ValueError
        raise error(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise error(f"{file}: expected a JSON object, got a JSON {type(data).__name__}")
    return data


def is_network_error(exc: BaseException) -> bool:
    """True when `exc` says the network is missing or a host does not answer."""
    if isinstance(exc, BrokenPipeError):
        return False          # a reader that left, not the network (see report)
    if isinstance(exc, (ConnectionError, socket.gaierror)):
        return True
    return any(cls.__name__ in _NETWORK_ERROR_CLASSES for cls in type(exc).__mro__)


def is_user_error(exc: BaseException) -> bool:
    """True for errors a user caused or can fix, which deserve one line and no traceback."""
    if is_network_error(exc):
        return True
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
        hint = f" ({_ERRNO_HINTS[exc.errno]})" if exc.errno in _ERRNO_HINTS else ""
        text = f"{where}{exc.strerror}{hint}"
    elif isinstance(exc, MemoryError):
        text = "out of memory" + (f": {exc}" if str(exc) else "") + " (try a smaller model, batch or seq_len)"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


@contextlib.contextmanager
def os_errors_of(path: str | os.PathLike) -> Iterator[None]:
    """A library's failed write that names its OS error only in its message (safetensors: "... I/O error: File
    too large (os error 27)") raised as that OSError on `path`, so a full disk or a file-size limit is one line."""
    try:
        yield
    except OSError:
        raise
    except Exception as exc:
        code = re.search(r"\(os error (\d+)\)", str(exc))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), os.fspath(path)) from exc


@contextlib.contextmanager
def one_line_warnings(prog: str) -> Iterator[None]:
    """Warnings print as `PROG: warning: message`, one line, without the source line Python adds (the CLI, and
    a lab worker process, which the CLI's setting does not reach)."""
    previous = warnings.formatwarning
    warnings.formatwarning = lambda message, *_, **__: f"{prog}: warning: {message}\n"
    try:
        yield
    finally:
        warnings.formatwarning = previous


def debug_enabled() -> bool:
    return os.environ.get("ARCHLAB_DEBUG", "") not in ("", "0")


def report(exc: BaseException, prog: str = "archlab") -> int:
    """Print `exc` the way the CLI does and return the exit status to use."""
    if isinstance(exc, KeyboardInterrupt):
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if isinstance(exc, SignalStop):
        import signal

        print(f"{prog}: {exc}", file=sys.stderr)
        return 128 + int(signal.Signals[exc.signal_name])
    if isinstance(exc, BrokenPipeError):
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    if is_user_error(exc):
        if debug_enabled():
            traceback.print_exception(exc)
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USER_ERROR
    traceback.print_exception(exc)
    print(f"{prog}: {REPORT_HINT}", file=sys.stderr)
    return 1


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of text nobody reads raises nothing
    (Python's documented recipe for SIGPIPE, library/signal.html#note-on-sigpipe)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):
        return                # not a real file (a test's capture): nothing will be flushed to a closed pipe
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
