"""Progress bars: tqdm, redrawn at most every 30 s when stderr is not a terminal (CI logs, files)."""
from __future__ import annotations

import sys

from tqdm import tqdm


def progress_bar(*args, **kwargs) -> tqdm:
    kwargs.setdefault("dynamic_ncols", True)
    if not sys.stderr.isatty():
        kwargs.setdefault("mininterval", 30.0)
    return tqdm(*args, **kwargs)
