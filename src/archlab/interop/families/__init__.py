"""Hugging Face model families, one module per family (or group of near-identical families).

`FAMILIES.get(model_type)` returns the `Family` registered for an HF `model_type`. Importing this
package imports every family module listed in `FAMILY_MODULES`: a family is added by writing
`families/<name>.py` (see `families/base.py` for the contract) and appending its module name here.
"""
from __future__ import annotations

import importlib

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
    # decoders
    "gpt2", "llama", "gemma", "olmo",
    "gpt_neox", "gptj", "falcon", "bloom", "opt", "phi", "phi3", "cohere", "nemotron",
    # encoders
    "bert",
    # encoder-decoders
    "t5", "bart",
]

for _name in FAMILY_MODULES:
    importlib.import_module(f"{__name__}.{_name}")
