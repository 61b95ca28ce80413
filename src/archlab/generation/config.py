"""Decoding settings as a model folder's generation_config.json names them, read as data (json only).

    cfg = archlab.generation.read_generation_config("path/to/folder")      # None when there is none
    ids = archlab.generate(model, prompt, generation_config=cfg, max_new_tokens=20)   # arguments win

The fields are transformers' and mean what they mean there:
  stopping        eos_token_id (an id or a list), pad_token_id, max_new_tokens, max_length (prompt +
                  new tokens; max_new_tokens wins), min_length, min_new_tokens, stop_strings
  beam search     num_beams, length_penalty, early_stopping (True, False or "never")
  processors      no_repeat_ngram_size, bad_words_ids, forced_bos_token_id, forced_eos_token_id,
                  repetition_penalty (archlab.generation.processors)
  sampling        do_sample: true samples with the file's temperature, top_k, top_p and min_p, and
                  transformers' defaults where it names none (temperature 1, top_k 50); without
                  do_sample they are ignored, as transformers ignores them; sampling_order (archlab's own,
                  e.g. "notes" or ["top_k", "top_p", "temperature"]) reorders those filters
A field that would change what transformers generates but that archlab does not implement (say
suppress_tokens or typical_p) is named in a warning; fields that change nothing (output flags,
cache settings, transformers_version) and switched-off values pass silently.
"""
from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archlab.config import ConfigError
from archlab.errors import read_json_object

FILE = "generation_config.json"

# fields that leave the generated tokens as they are
_NEUTRAL = {
    "_from_model_config", "_commit_hash", "transformers_version", "bos_token_id", "use_cache",
    "output_attentions", "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate",
    "cache_implementation", "cache_config", "max_cache_len", "compile_config", "disable_compile",
    "is_assistant", "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
    "prompt_lookup_num_tokens", "max_matching_ngram_size", "assistant_early_exit", "assistant_lookbehind",
    "target_lookbehind", "low_memory", "prefill_chunk_size", "continuous_batching_config", "trust_remote_code",
}
# transformers' values that switch a feature off (None, [] and {} do too)
_OFF: dict[str, Any] = {
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "encoder_repetition_penalty": 1.0,
    "encoder_no_repeat_ngram_size": 0, "diversity_penalty": 0.0, "num_beam_groups": 1,
    "remove_invalid_values": False, "renormalize_logits": False, "guidance_scale": 1.0, "token_healing": False,
    "num_return_sequences": 1,
}
_SAMPLING = ("temperature", "top_k", "top_p", "min_p")


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding defaults (None: not set). `merged(**arguments)` lets explicit arguments win."""

    max_new_tokens: int | None = None
    max_length: int | None = None
    min_length: int | None = None
    min_new_tokens: int | None = None
    num_beams: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | str | None = None
    temperature: float | None = None        # 0 or None: greedy
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    eos_token_id: tuple[int, ...] | None = None
    pad_token_id: int | None = None
    no_repeat_ngram_size: int | None = None
    bad_words_ids: tuple[tuple[int, ...], ...] | None = None
    forced_bos_token_id: int | None = None
    forced_eos_token_id: tuple[int, ...] | None = None
    stop_strings: tuple[str, ...] | None = None
    decoder_start_token_id: int | None = None    # encoder-decoders: the decoder's first token
    sampling_order: tuple[str, ...] | None = None   # archlab's: the filter order (generation.sampling.sampling_order)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                object.__setattr__(self, f.name, _checked(f.name, value, ""))

    def merged(self, **arguments) -> GenerationConfig:
        """A copy with every argument that is not None in place of the stored value."""
        given = {k: v for k, v in arguments.items() if v is not None}
        unknown = set(given) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"not a generation setting: {sorted(unknown)}")
        return dataclasses.replace(self, **given) if given else self

    @property
    def eos(self) -> list[int]:
        return list(self.eos_token_id or ())

    @classmethod
    def from_dict(cls, data: dict, source: str = FILE) -> GenerationConfig:
        """The settings a generation_config.json dict names (see the module docstring); warns once,
        naming every field that would change transformers' output and that archlab does not apply."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        skipped = []
        sample = bool(data.get("do_sample"))
        for key, value in data.items():
            if key == "do_sample" or (key in _SAMPLING and not sample) or key in _NEUTRAL:
                continue
            if key in names:
                if value is not None:
                    values[key] = _checked(key, value, source)
            elif not _is_off(key, value):
                skipped.append(f"{key}={json.dumps(value)}")
        if sample:
            values.setdefault("temperature", 1.0)
            values.setdefault("top_k", 50)
            if (values.get("num_beams") or 1) > 1:
                skipped.append("do_sample=true with num_beams > 1 (beam sampling; archlab's beam search is "
                               "deterministic)")
                for key in _SAMPLING:
                    values.pop(key, None)
        for key, off in (("top_k", 0), ("top_p", 1.0)):     # transformers' "no filter" values
            if values.get(key) == off:
                values.pop(key)
        if skipped:
            warnings.warn(f"{source}: not applied by archlab (transformers would use them): {', '.join(skipped)}",
                          stacklevel=2)
        return cls(**values)


def read_generation_config(folder: str | Path) -> GenerationConfig | None:
    """The folder's generation_config.json as a GenerationConfig, None when the folder has none."""
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    return GenerationConfig.from_dict(read_json_object(path, ConfigError), source=str(path))


def _is_off(key: str, value) -> bool:
    return value is None or value is False or value == [] or value == {} or (key in _OFF and value == _OFF[key])


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _token_ids(items) -> bool:
    return isinstance(items, (list, tuple)) and all(_is_int(i) and i >= 0 for i in items)


_INT_MIN = {"max_new_tokens": 0, "max_length": 1, "min_length": 0, "min_new_tokens": 0, "num_beams": 1,
            "top_k": 0, "pad_token_id": None, "no_repeat_ngram_size": 0, "forced_bos_token_id": 0,
            "decoder_start_token_id": 0}


def _checked(key: str, value, source: str):
    """`value` for field `key` in its stored form (tuples for lists), or a ConfigError naming the field."""
    try:
        return _convert(key, value)
    except ValueError as exc:
        where = f"{source}: " if source else ""
        raise ConfigError(f"{where}{key}={value!r}: {exc}") from None


def _convert(key: str, value):
    if key in _INT_MIN:
        low = _INT_MIN[key]
        if not _is_int(value) or (low is not None and value < low):
            raise ValueError("must be an integer" + (f" >= {low}" if low is not None else ""))
        return value
    if key in ("eos_token_id", "forced_eos_token_id"):
        items = [value] if _is_int(value) else value
        if _token_ids(items) and (items or key == "eos_token_id"):     # eos_token_id=[]: no EOS
            return tuple(items)
        raise ValueError("must be a token id or a list of token ids")
    if key == "bad_words_ids":
        if isinstance(value, (list, tuple)) and value and all(_token_ids(w) and w for w in value):
            return tuple(tuple(w) for w in value)
        raise ValueError("must be a non-empty list of non-empty lists of token ids")
    if key == "early_stopping":
        if value in (True, False) or value == "never":
            return value
        raise ValueError('must be true, false or "never"')
    if key == "sampling_order":
        from archlab.generation.sampling import sampling_order
        return sampling_order(value)
    if key == "stop_strings":
        items = [value] if isinstance(value, str) else value
        if isinstance(items, (list, tuple)) and items and all(isinstance(s, str) and s for s in items):
            return tuple(items)
        raise ValueError("must be a non-empty string or a list of them")
    if key in ("length_penalty", "temperature", "top_p", "min_p", "repetition_penalty"):
        if not _is_number(value):
            raise ValueError("must be a finite number")
        if key == "temperature" and value < 0:
            raise ValueError("must be >= 0 (0: greedy)")
        if key == "top_p" and not 0 < value <= 1:
            raise ValueError("must be in (0, 1]")
        if key == "min_p" and not 0 <= value <= 1:
            raise ValueError("must be in [0, 1]")
        if key == "repetition_penalty" and value <= 0:
            raise ValueError("must be > 0")
        return float(value)
    raise ValueError("is not a generation setting")
