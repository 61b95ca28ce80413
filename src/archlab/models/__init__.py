"""One constructor for every kind of LM: `build_model(cfg)` picks the class `cfg.arch` names.

    decoder          TransformerLM      next-token LM (GPT, LLaMA, ...)             decoder.py
    encoder          EncoderLM          masked LM (BERT, RoBERTa)                   encoder.py
    encoder_decoder  EncoderDecoderLM   seq2seq (T5, BART, the 2017 Transformer)    encoder_decoder.py

The room also holds the presets (presets.py) and the analytic accounting (accounting.py).
"""
from __future__ import annotations

from archlab.config import ConfigError, ModelConfig
from archlab.models.decoder import TransformerLM
from archlab.models.encoder import EncoderLM
from archlab.models.encoder_decoder import EncoderDecoderLM

__all__ = ["MODEL_CLASSES", "LanguageModel", "build_model"]

LanguageModel = TransformerLM | EncoderLM | EncoderDecoderLM
MODEL_CLASSES: dict[str, type[LanguageModel]] = {"decoder": TransformerLM, "encoder": EncoderLM,
                                                  "encoder_decoder": EncoderDecoderLM}


def build_model(cfg: ModelConfig) -> LanguageModel:
    """The model `cfg.arch` names, initialised from cfg.seed. Example: build_model(presets.tiny("bert-base"))"""
    cls = MODEL_CLASSES.get(cfg.arch)
    if cls is None:
        raise ConfigError(f"arch={cfg.arch!r} is not a kind of model (kinds: {', '.join(MODEL_CLASSES)})")
    return cls(cfg)
