"""Loading a tokenizer: the one place that reads a tokenizer.json folder back into a tokenizer object.

`load(path)` reads HF's `tokenizer.json` (the format of the `tokenizers` library) and hands it to the
kind its `model.type` names, each of which parses its own section (`from_json`, beside its `to_json`):

- BPE (bpe.Tokenizer): byte-level BPE as GPT-2, RoBERTa, Llama-3/Qwen write it (a `ByteLevel`
  pre-tokenizer, alone or after a regex `Split`; merges stored as "a b" strings or as [a, b] pairs;
  `ignore_merges`);
- WordPiece and Unigram: the files archlab itself writes (byte-level pre-tokens).

Anything else (normalizers, byte fallback, other pre-tokenizers) is rejected by these readers, naming
the unsupported part, rather than encoded differently from `tokenizers`; `load` then falls back to the
`tokenizers` library (hf_wrapper.HFTokenizer) when it is installed, else raises that ValueError.

The kinds never import this module: it imports them (layers read downward).
"""
from __future__ import annotations

import os
from pathlib import Path

from archlab.errors import UserError, read_json_object
from archlab.tokenizer.base import BaseTokenizer
from archlab.tokenizer.bpe import Tokenizer
from archlab.tokenizer.hf_wrapper import HFTokenizer
from archlab.tokenizer.pretokenize import GPT2_PATTERN
from archlab.tokenizer.unigram import UnigramTokenizer
from archlab.tokenizer.wordpiece import WordPieceTokenizer

__all__ = ["load", "read_tokenizer_json", "TokenizerFileError"]


class TokenizerFileError(UserError, ValueError):
    """A tokenizer.json that cannot be read."""


def _json_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    return p


def read_tokenizer_json(path: str | os.PathLike) -> dict:
    """The parsed tokenizer.json; a file that is not JSON (or not an object) is a TokenizerFileError."""
    return read_json_object(_json_path(path), TokenizerFileError)


def load(path: str | os.PathLike, *, fast: bool = True, hf_fallback: bool = True) -> BaseTokenizer | HFTokenizer:
    """Load a folder holding tokenizer.json (or the file itself) as Tokenizer / WordPieceTokenizer /
    UnigramTokenizer, following `model.type`; a file those readers reject loads as an HFTokenizer
    (the `tokenizers` library, hf_wrapper.py) when hf_fallback and `tokenizers` is installed.
    fast=False: a BPE Tokenizer encodes with its pure-Python loop only."""
    data = read_tokenizer_json(path)
    try:
        return _native_tokenizer(data, fast=fast)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:   # a field of the wrong JSON type
        if not hf_fallback:
            raise
        reason = str(exc) if isinstance(exc, ValueError) else f"malformed {type(exc).__name__}: {exc}"
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise TokenizerFileError(f"archlab cannot read {_json_path(path)}: {reason}; installing `tokenizers` "
                         f"(pip install 'archlab[hf]') would load it through that library") from None
    try:
        return HFTokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises its own Exception type on files it cannot parse
        raise TokenizerFileError(f"neither archlab ({reason}) nor `tokenizers` ({exc}) can read "
                         f"{_json_path(path)}") from exc


def _pre_tokenizer(data: dict) -> tuple[str, bool]:
    """(regex pattern, add_prefix_space) of a byte-level pre-tokenizer."""
    pre = data.get("pre_tokenizer")
    if pre is None:
        raise ValueError("tokenizer.json without a pre_tokenizer is not a byte-level tokenizer")
    steps = pre["pretokenizers"] if pre.get("type") == "Sequence" else [pre]
    pattern, prefix, seen_byte_level = None, False, False
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel":
            seen_byte_level = True
            prefix = bool(step.get("add_prefix_space", False))
            if step.get("use_regex", True):
                if pattern is not None:
                    raise ValueError("a Split followed by a ByteLevel with use_regex=true is not supported")
                pattern = GPT2_PATTERN
        elif kind == "Split":
            pat = step.get("pattern", {})
            if "Regex" not in pat or step.get("behavior") != "Isolated" or step.get("invert"):
                raise ValueError(f"unsupported Split pre-tokenizer: {step}")
            pattern = pat["Regex"]
        else:
            raise ValueError(f"unsupported pre-tokenizer {kind!r}")
    if not seen_byte_level:
        raise ValueError("only byte-level tokenizers (a ByteLevel pre-tokenizer) are supported")
    return pattern or GPT2_PATTERN, prefix


def _native_tokenizer(data: dict, *, fast: bool = True) -> BaseTokenizer:
    """archlab's own reader of a parsed tokenizer.json; ValueError names the unsupported part."""
    if data.get("normalizer") is not None:
        raise ValueError(f"unsupported normalizer {data['normalizer'].get('type')!r}")
    model = data["model"]
    if not isinstance(model, dict):
        raise ValueError(f"its \"model\" is a JSON {type(model).__name__}, not an object")
    kind = model.get("type")
    if kind is None:  # very old files: guess from the fields
        kind = "BPE" if "merges" in model else "WordPiece" if "continuing_subword_prefix" in model else "Unigram"
    added = sorted(data.get("added_tokens") or [], key=lambda t: t["id"])
    specials = [t["content"] for t in added]
    pattern, prefix = _pre_tokenizer(data)
    if kind == "BPE":
        return Tokenizer.from_json(data, specials, pattern, add_prefix_space=prefix, fast=fast)
    if kind == "WordPiece":
        return WordPieceTokenizer.from_json(data, specials, pattern)
    if kind == "Unigram":
        return UnigramTokenizer.from_json(data, specials, pattern)
    raise ValueError(f"unsupported model type {kind!r}")
