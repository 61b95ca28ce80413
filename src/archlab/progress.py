"""Progress bars: tqdm, redrawn at most every 30 s when stderr is not a terminal (CI logs, files)."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

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
        with transformers_quiet():
            yield
    finally:
        _QUIET.reset(token)


@contextmanager
def transformers_quiet() -> Iterator[None]:
    """transformers' own progress bars off inside: its logging switch (checkpoint loading) and its GGUF loader's
    bar, which calls tqdm directly and which that switch does not reach.
    Example: with transformers_quiet(): AutoModelForCausalLM.from_pretrained(folder, gguf_file="m.gguf")"""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    import functools
    import importlib

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        gguf_utils: Any = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    except ImportError:              # a transformers without GGUF support (or without its gguf dependency)
        gguf_utils = None
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if was_enabled:
            hf_logging.enable_progress_bar()
