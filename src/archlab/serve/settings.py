"""What one served request decodes with: the model folder's generation_config.json (archlab.generation.config)
as defaults, the request's own fields over them.

As vLLM's `--generation-config auto` does, only the fields the file names move the OpenAI defaults
(temperature 1, 16 tokens): a file without do_sample leaves sampling at temperature 1, a file with
do_sample sets temperature / top_k / top_p / min_p. Applied (SERVED): max_new_tokens (else max_length minus
the prompt) as the default max_tokens, the sampling fields, repetition_penalty, eos_token_id (else the
tokenizer's end-of-text token), stop_strings as the default `stop`, and the logits processors
(archlab.generation.processors: no_repeat_ngram_size, bad_words_ids, min_length, min_new_tokens, forced
bos/eos), each built per request over that request's own prompt and tokens, so a processor with per-sequence
state (n-gram blocking) sees one row's history whatever else shares the batch. Beam settings are not
applied (the server decodes one sequence per request) and are named at start.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from archlab.config import ConfigError
from archlab.generation.config import GenerationConfig
from archlab.generation.processors import Processor, build

__all__ = ["SERVED", "applied", "defaults_for", "not_served", "processors_for", "request_settings"]

SERVED = ("max_new_tokens", "max_length", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
          "eos_token_id", "stop_strings", "no_repeat_ngram_size", "bad_words_ids", "min_length", "min_new_tokens",
          "forced_bos_token_id", "forced_eos_token_id")
OPENAI_MAX_TOKENS, OPENAI_TEMPERATURE = 16, 1.0


def defaults_for(folder: GenerationConfig | None, eot_id: int | None, vocab: int) -> GenerationConfig:
    """The server's defaults: the folder's settings, its EOS ids or else the tokenizer's end-of-text token.
    Token ids past the model's vocabulary are a ConfigError at start, not a failure on the first request."""
    cfg = folder or GenerationConfig()
    if cfg.eos_token_id is None and eot_id is not None:
        cfg = cfg.merged(eos_token_id=(eot_id,))
    named = {"eos_token_id": cfg.eos, "forced_eos_token_id": list(cfg.forced_eos_token_id or ()),
             "forced_bos_token_id": [] if cfg.forced_bos_token_id is None else [cfg.forced_bos_token_id],
             "bad_words_ids": [t for word in cfg.bad_words_ids or () for t in word]}
    for field, ids in named.items():
        past = sorted({t for t in ids if t >= vocab})
        if past:
            raise ConfigError(f"generation_config.json: {field} names token(s) {past} past the model's "
                              f"vocabulary of {vocab}")
    return cfg


def applied(folder: GenerationConfig | None) -> dict[str, Any]:
    """The folder's settings that the server applies, JSON-ready (lists for tuples)."""
    if folder is None:
        return {}
    out = {}
    for name in SERVED:
        value = getattr(folder, name)
        if value is not None:
            out[name] = [list(v) if isinstance(v, tuple) else v for v in value] if isinstance(value, tuple) else value
    return out


def not_served(folder: GenerationConfig | None) -> list[str]:
    """`field=value` for the folder's beam settings, which the server does not apply (one sequence a request)."""
    if folder is None or (folder.num_beams or 1) == 1:
        return []
    return [f"{name}={getattr(folder, name)!r}" for name in ("num_beams", "length_penalty", "early_stopping")
            if getattr(folder, name) is not None]


def request_settings(defaults: GenerationConfig, *, prompt_tokens: int, max_tokens: int | None = None,
                     temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                     min_p: float | None = None, repetition_penalty: float | None = None,
                     stop: list[str] | None = None) -> GenerationConfig:
    """`defaults` with the request's fields (None: not given) in their place, and max_new_tokens resolved:
    the request's max_tokens, else the folder's max_new_tokens, else what its max_length leaves after the prompt,
    else 16. top_k 0 or -1 (vLLM's "off") turns a default top-k off."""
    cfg = defaults.merged(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, min_p=min_p,
                          top_k=top_k if top_k is not None and top_k > 0 else None,
                          repetition_penalty=repetition_penalty, stop_strings=tuple(stop) if stop else None)
    if top_k is not None and top_k <= 0:
        cfg = dataclasses.replace(cfg, top_k=None)
    if cfg.max_new_tokens is None:
        new = OPENAI_MAX_TOKENS if cfg.max_length is None else cfg.max_length - prompt_tokens
        cfg = dataclasses.replace(cfg, max_new_tokens=max(new, 0))     # 0: the caller names the problem
    if cfg.temperature is None:
        cfg = dataclasses.replace(cfg, temperature=OPENAI_TEMPERATURE)
    return cfg


def processors_for(cfg: GenerationConfig, prompt_tokens: int) -> list[Processor]:
    """One request's logits processors (repetition penalty included), over its own prompt and new tokens."""
    new = cfg.max_new_tokens or 0
    return build(cfg, eos=cfg.eos, prompt_width=prompt_tokens, max_length=prompt_tokens + new)
