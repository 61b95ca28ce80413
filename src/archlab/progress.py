"""Progress bars: tqdm, redrawn at most every 30 s when stderr is not a terminal (CI logs, files)."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from tqdm import tqdm

# Set by quiet(): a flow that calls many others (a demo) silences every bar beneath it without passing a flag down.
_QUIET: ContextVar[bool] = ContextVar("archlab_progress_quiet", default=False)


def progress_bar(*args, **kwargs) -> tqdm:
    kwargs.setdefault("dynamic_ncols", True)
    if _QUIET.get():
        kwargs["disable"] = True
    if not sys.stderr.isatty():
        kwargs.setdefault("mininterval", 30.0)
    return tqdm(*args, **kwargs)


@contextmanager
def quiet() -> Iterator[None]:
    """No progress bars inside: archlab's and transformers' (its GGUF and checkpoint loaders draw their own).
    Example: with quiet(): run_real_model_demo("runs/real")"""
    token = _QUIET.set(True)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        hf_logging = None
    was_disabled = hf_logging is None or hf_logging.is_progress_bar_enabled() is False
    if hf_logging is not None:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        _QUIET.reset(token)
        if not was_disabled:
            hf_logging.enable_progress_bar()
