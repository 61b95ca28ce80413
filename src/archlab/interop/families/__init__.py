"""Hugging Face model families, one module per family (or group of near-identical families).

`FAMILIES.get(model_type)` returns the `Family` registered for an HF `model_type`. Importing this
package imports every family module listed in `FAMILY_MODULES` that exists, so another engineer
adds a family by writing `families/<name>.py` (see `families/base.py` for the contract) and
appending its module name here.
"""
from __future__ import annotations

import importlib
import importlib.util

from archlab.interop.families.base import (  # noqa: F401  (re-exported for family modules)
    FAMILIES,
    Family,
    HFConfig,
    Rule,
    fused,
    read_rope,
    register_family,
    rename,
    transposed,
    write_rope,
)

FAMILY_MODULES = [
    # interop A
    "gpt2", "llama", "gemma", "olmo",
    # interop B
    "gpt_neox", "gptj", "falcon", "bloom", "opt", "phi", "phi3", "cohere", "nemotron",
    # encoders
    "bert",
    # encoder-decoders
    "t5", "bart",
]

for _name in FAMILY_MODULES:
    _module = f"{__name__}.{_name}"
    if importlib.util.find_spec(_module) is not None:
        importlib.import_module(_module)
