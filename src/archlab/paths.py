"""Where archlab keeps what it downloads or measures once: the cache root."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """The archlab cache root: $ARCHLAB_CACHE, else $XDG_CACHE_HOME/archlab, else ~/.cache/archlab."""
    if os.environ.get("ARCHLAB_CACHE"):
        return Path(os.environ["ARCHLAB_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "archlab"
