"""archlab: language modeling from scratch, one switch per architecture choice."""
from archlab.config import ConfigError, ModelConfig
from archlab.model import TransformerLM
from archlab import accounting, presets
from archlab.generation import generate

__version__ = "0.1.0"
__all__ = ["ConfigError", "ModelConfig", "TransformerLM", "accounting", "presets", "generate"]
