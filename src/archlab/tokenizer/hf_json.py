"""Reading HF `tokenizer.json` files (the format of the `tokenizers` library) into archlab tokenizers.

Supported: byte-level BPE (GPT-2, RoBERTa, Llama-3/Qwen style: a `ByteLevel` pre-tokenizer, alone or
after a regex `Split`; merges stored as "a b" strings or as [a, b] pairs; `ignore_merges`), and the
WordPiece / Unigram files that archlab itself writes (byte-level pre-tokens). Anything else (normalizers,
byte fallback, other pre-tokenizers) is rejected by these readers, naming the unsupported part, rather than
encoded differently from `tokenizers`; `load_tokenizer` then falls back to the `tokenizers` library
(hf_wrapper.HFTokenizer) when it is installed, else raises that ValueError.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from archlab.errors import UserError
from archlab.tokenizer.pretokenize import GPT2_PATTERN, str_to_bytes

__all__ = ["load_tokenizer", "read_tokenizer_json"]


def _json_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    return p


def read_tokenizer_json(path: str | os.PathLike) -> dict:
    """The parsed tokenizer.json; a file that is not JSON (or not an object) is a TokenizerFileError."""
    file = _json_path(path)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise TokenizerFileError(f"{file} is not a readable tokenizer.json ({exc})") from exc
    if not isinstance(data, dict):
        raise TokenizerFileError(f"{file} is not a tokenizer.json (a JSON {type(data).__name__}, not an object)")
    return data


class TokenizerFileError(UserError, ValueError):
    """A tokenizer.json that cannot be read."""


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


def load_tokenizer(path: str | os.PathLike, *, fast: bool = True, hf_fallback: bool = True):
    """Load a folder holding tokenizer.json (or the file itself) as Tokenizer / WordPieceTokenizer /
    UnigramTokenizer, following `model.type`; a file those readers reject loads as an HFTokenizer
    (the `tokenizers` library, hf_wrapper.py) when hf_fallback and `tokenizers` is installed."""
    data = read_tokenizer_json(path)
    try:
        return _native_tokenizer(data, fast=fast)
    except (ValueError, KeyError, TypeError) as exc:
        if not hf_fallback:
            raise
        reason = str(exc) if isinstance(exc, ValueError) else f"malformed {type(exc).__name__}: {exc}"
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise ValueError(f"archlab cannot read {_json_path(path)}: {reason}; installing `tokenizers` "
                         f"(pip install 'archlab[hf]') would load it through that library") from None
    from archlab.tokenizer.hf_wrapper import HFTokenizer
    try:
        return HFTokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises its own Exception type on files it cannot parse
        raise ValueError(f"neither archlab ({reason}) nor `tokenizers` ({exc}) can read "
                         f"{_json_path(path)}") from exc


def _native_tokenizer(data: dict, *, fast: bool = True):
    """archlab's own reader of a parsed tokenizer.json; ValueError names the unsupported part."""
    if data.get("normalizer") is not None:
        raise ValueError(f"unsupported normalizer {data['normalizer'].get('type')!r}")
    model = data["model"]
    kind = model.get("type")
    if kind is None:  # very old files: guess from the fields
        kind = "BPE" if "merges" in model else "WordPiece" if "continuing_subword_prefix" in model else "Unigram"
    added = sorted(data.get("added_tokens") or [], key=lambda t: t["id"])
    specials = [t["content"] for t in added]
    pattern, prefix = _pre_tokenizer(data)
    if kind == "BPE":
        from archlab.tokenizer.bpe import Tokenizer
        for field in ("continuing_subword_prefix", "end_of_word_suffix"):
            if model.get(field):
                raise ValueError(f"BPE with {field}={model[field]!r} is not supported")
        if model.get("byte_fallback"):
            raise ValueError("BPE with byte_fallback is not supported")
        added_ids = {t["id"]: t["content"] for t in added}
        vocab: dict[int, bytes] = {}
        for s, i in model["vocab"].items():
            vocab[i] = added_ids[i].encode("utf-8") if i in added_ids else str_to_bytes(s)
        for i, s in added_ids.items():
            vocab.setdefault(i, s.encode("utf-8"))
        merges = []
        for m in model["merges"]:
            a, b = m.split(" ") if isinstance(m, str) else m
            merges.append((str_to_bytes(a), str_to_bytes(b)))
        return Tokenizer(vocab, merges, specials, pattern=pattern, add_prefix_space=prefix,
                         ignore_merges=bool(model.get("ignore_merges", False)), fast=fast)
    if kind == "WordPiece":
        from archlab.tokenizer.wordpiece import WordPieceTokenizer
        return WordPieceTokenizer.from_json(data, specials, pattern)
    if kind == "Unigram":
        from archlab.tokenizer.unigram import UnigramTokenizer
        return UnigramTokenizer.from_json(data, specials, pattern)
    raise ValueError(f"unsupported model type {kind!r}")
