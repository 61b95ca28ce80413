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
    "TransformerLM": ("archlab.models.decoder", "TransformerLM"),
    "EncoderLM": ("archlab.models.encoder", "EncoderLM"),
    "EncoderDecoderLM": ("archlab.models.encoder_decoder", "EncoderDecoderLM"),
    "build_model": ("archlab.models", "build_model"),
    "generate": ("archlab.generation", "generate"),
}
# the short names users reach from `archlab.` -> the module in its room
_SUBMODULES = {"accounting": "archlab.models.accounting", "presets": "archlab.models.presets",
               "interop": "archlab.interop", "tokenizer": "archlab.tokenizer", "data": "archlab.data",
               "corpora": "archlab.data.corpora", "train": "archlab.training.trainer",
               "diagnostics": "archlab.eval.diagnostics", "lab": "archlab.lab", "chat": "archlab.tokenizer.chat"}
__all__ = [*_LAZY, *_SUBMODULES]


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
    elif name in _SUBMODULES:
        value = importlib.import_module(_SUBMODULES[name])
    else:
        raise AttributeError(f"module 'archlab' has no attribute {name!r}")
    globals()[name] = value
    return value
