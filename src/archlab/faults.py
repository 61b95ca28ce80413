"""Deterministic fault points for crash tests: `ARCHLAB_FAULT=NAME[@N]` ends the process (exit 97, no
clean-up, like a kill -9) the N-th time (default: the first) the code passes `fault_point(NAME)`.

Points: save:weights, save:trainer, save:meta, save:fsync, save:rename, save:prune (checkpoint.py, in the
order a save passes them) and prepare:split (data.py and seq2seq.py, after the splits' tokens are written). Costs one
dictionary lookup when the variable is unset.

    ARCHLAB_FAULT=save:rename@2 archlab train ...   # dies right after its second checkpoint's rename
"""
from __future__ import annotations

import os

__all__ = ["fault_point", "FAULT_EXIT", "POINTS"]

FAULT_EXIT = 97
POINTS = ("save:weights", "save:trainer", "save:meta", "save:fsync", "save:rename", "save:prune",
          "prepare:split")
_passes: dict[str, int] = {}


def fault_point(name: str) -> None:
    spec = os.environ.get("ARCHLAB_FAULT")
    if not spec:
        return
    target, _, nth = spec.partition("@")
    if target != name:
        return
    _passes[name] = _passes.get(name, 0) + 1
    if _passes[name] == int(nth or 1):
        os._exit(FAULT_EXIT)
