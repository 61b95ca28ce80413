"""archlab: language modeling from scratch, one switch per architecture choice.

Names are imported lazily, so `import archlab.tokenizer` (or the data pipeline) does not pay
for importing torch.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "ConfigError": ("archlab.config", "ConfigError"),
    "ModelConfig": ("archlab.config", "ModelConfig"),
    "TransformerLM": ("archlab.model", "TransformerLM"),
    "EncoderLM": ("archlab.encoder", "EncoderLM"),
    "EncoderDecoderLM": ("archlab.encoder_decoder", "EncoderDecoderLM"),
    "build_model": ("archlab.models", "build_model"),
    "generate": ("archlab.generation", "generate"),
}
_SUBMODULES = ("accounting", "presets", "interop", "tokenizer", "data", "corpora", "train",
               "diagnostics", "lab")
__all__ = [*_LAZY, *_SUBMODULES]


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"archlab.{name}")
    else:
        raise AttributeError(f"module 'archlab' has no attribute {name!r}")
    globals()[name] = value
    return value
