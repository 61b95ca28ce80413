"""What every archlab tokenizer shares: special-token handling, lazy `encode_iterable`, decoding of
byte tokens, the vocabulary look-ups, and saving as a folder holding an HF-style tokenizer.json.

Subclasses (BPE in bpe.py, WordPiece, Unigram) implement `_encode_ordinary(text) -> list[int]` for text
free of special tokens, `token_bytes` for decoding, `to_json() -> dict`, and a `from_json` classmethod
that loading.py calls to read a saved folder back (archlab.tokenizer.load). `WordTokenizer` is the
`_encode_ordinary` of the tokenizers that segment one pre-token at a time (WordPiece, Unigram).
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from archlab.errors import UserError
from archlab.tokenizer.pretokenize import (
    GPT2_PATTERN,
    bytes_to_str,
    compile_pattern,
    safe_cut,
    split_special,
)

EOT_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


class TokenIdError(UserError, ValueError):
    """An id that is not in the vocabulary (negative, too large, not an int): the same error in every kind."""


_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_surrogates(text: str) -> str:
    """`text` with each lone surrogate (which UTF-8 cannot encode) replaced by one U+FFFD, as tiktoken does."""
    return _SURROGATE.sub("\ufffd", text) if not text.isascii() else text


def check_ids(ids: list[int], vocab_size: int) -> None:
    """Raise TokenIdError naming the first id outside 0..vocab_size-1 (the same message in every kind)."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(i for i in ids if not 0 <= i < vocab_size)
        raise TokenIdError(f"token id {bad} is outside this tokenizer's vocabulary (0..{vocab_size - 1})")


class BaseTokenizer:
    kind = "base"
    pattern: str = GPT2_PATTERN
    add_prefix_space: bool = False

    def __init__(self, id_to_bytes: list[bytes], special_tokens: Iterable[str] | None = None):
        self.id_to_bytes = id_to_bytes
        specials = list(dict.fromkeys(special_tokens or ()))
        self.special_to_id: dict[str, int] = {}
        by_bytes: dict[bytes, int] = {}
        for i, b in enumerate(id_to_bytes):
            by_bytes.setdefault(b, i)
        for s in specials:
            sb = s.encode("utf-8")
            if sb not in by_bytes:  # a special token missing from the vocabulary is appended to it
                id_to_bytes.append(sb)
                by_bytes[sb] = len(id_to_bytes) - 1
            self.special_to_id[s] = by_bytes[sb]
        self.special_tokens = specials
        self._special_tuple = tuple(specials)
        self._special_ids = frozenset(self.special_to_id.values())

    # ------------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        return len(self.id_to_bytes)

    @property
    def vocab(self) -> dict[int, bytes]:
        return dict(enumerate(self.id_to_bytes))

    def token_to_id(self, token: bytes | str) -> int | None:
        """Id of a special token (str) or of a token given as bytes or text; None if absent."""
        if isinstance(token, str):
            if token in self.special_to_id:
                return self.special_to_id[token]
            token = token.encode("utf-8")
        return self._bytes_lookup().get(token)

    def _bytes_lookup(self) -> dict[bytes, int]:
        if getattr(self, "_by_bytes", None) is None:
            table: dict[bytes, int] = {}
            for i, b in enumerate(self.id_to_bytes):
                if i not in self._special_ids:
                    table.setdefault(b, i)
            for i in sorted(self._special_ids):  # special bytes that no ordinary token has
                table.setdefault(self.id_to_bytes[i], i)
            self._by_bytes = table
        return self._by_bytes

    def id_to_token(self, i: int) -> bytes:
        return self.id_to_bytes[i]

    def special_token_id(self, token: str) -> int:
        return self.special_to_id[token]

    @property
    def eot_id(self) -> int | None:
        """The end-of-text id: a conventional name if present, else the first special token, else None."""
        for name in EOT_NAMES:
            if name in self.special_to_id:
                return self.special_to_id[name]
        return self.special_to_id[self.special_tokens[0]] if self.special_tokens else None

    # ------------------------------------------------------------------ encoding
    def _encode_ordinary(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        """Ids of `text`. A lone surrogate (not encodable as UTF-8) becomes U+FFFD, in every kind, as
        tiktoken does; special tokens match whole, before pre-tokenization."""
        text = clean_surrogates(text)
        ids: list[int] = []
        for piece, is_special in split_special(text, self._special_tuple):
            if is_special:
                ids.append(self.special_to_id[piece])
            else:
                if self.add_prefix_space and not piece.startswith(" "):
                    piece = " " + piece
                ids.extend(self._encode_ordinary(piece))
        return ids

    def _safe_cut(self, text: str) -> int:
        """A position where `text` may be cut so that encode(a) + encode(b) == encode(a + b), or 0."""
        if self.pattern == GPT2_PATTERN and not self.add_prefix_space:
            return safe_cut(text, self._special_tuple)
        # Generic pattern: cut just after the last complete special token, or at the start of the last
        # pre-token match (earlier matches cannot change when more text arrives).
        longest = max((len(s) for s in self._special_tuple), default=1)
        limit = len(text) - (longest - 1)
        last_end = 0
        for piece_start, (piece, is_special) in _with_offsets(split_special(text, self._special_tuple)):
            end = piece_start + len(piece)
            if is_special and end <= limit:
                last_end = end
        if self.add_prefix_space:
            return last_end
        start = None
        for m in compile_pattern(self.pattern).finditer(text, last_end, limit):
            start = m.start()
        cut = max(last_end, start or 0)
        return cut

    def encode_iterable(self, iterable: Iterable[str], *, buffer_chars: int = 1 << 14) -> Iterator[int]:
        """Lazily encode an iterable of strings (e.g. an open file): memory stays bounded by the buffer
        plus one pre-token; pre-tokens and special tokens are never split across chunk boundaries, so the
        ids equal encode("".join(iterable))."""
        buf = ""
        for chunk in iterable:
            buf += chunk
            if len(buf) < buffer_chars:
                continue
            cut = self._safe_cut(buf)
            if cut > 0:
                yield from self.encode(buf[:cut])
                buf = buf[cut:]
        if buf:
            yield from self.encode(buf)

    def __call__(self, text: str) -> list[int]:
        return self.encode(text)

    # ------------------------------------------------------------------ decoding
    def token_bytes(self, i: int) -> bytes:
        return self.id_to_bytes[i]

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        """The ids' bytes; skip_special_tokens: the special tokens' ids contribute nothing."""
        table, ids = self.id_to_bytes, list(ids)
        check_ids(ids, len(table))
        if skip_special_tokens and self._special_ids:
            special = self._special_ids
            return b"".join([table[i] for i in ids if i not in special])
        return b"".join([table[i] for i in ids])

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of the ids; byte sequences that are not valid UTF-8 become U+FFFD. skip_special_tokens: the special
        tokens are left out, as transformers' decode(ids, skip_special_tokens=True) leaves out the tokens its
        tokenizer.json marks special (what an OpenAI-compatible server shows).
        Example: tok.decode(tok.encode("hi<|im_end|>"), skip_special_tokens=True) == "hi"
        """
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ saving
    def to_json(self) -> dict:
        raise NotImplementedError

    def save(self, directory: str | os.PathLike) -> Path:
        """Write `directory/tokenizer.json` (the canonical on-disk form; HF `tokenizers` loads it)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        path = d / "tokenizer.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_json(), ensure_ascii=False, indent=1), encoding="utf-8")
        os.replace(tmp, path)
        return d

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, special_tokens={self.special_tokens})"


class WordTokenizer(BaseTokenizer):
    """A tokenizer that segments each pre-token on its own (WordPiece, Unigram): `_word` maps one
    pre-token, written in GPT-2's byte-level alphabet, to ids. Subclasses set `self._pat` (the
    compiled pre-tokenizer pattern) and `self._cache` (an empty dict) in __init__."""

    CACHE_LIMIT = 1 << 17   # pre-tokens memoized before the cache is cleared (bounded memory)

    def _word(self, word: str) -> tuple[int, ...]:
        raise NotImplementedError

    def _encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        cache = self._cache
        for tok in self._pat.findall(text):
            hit = cache.get(tok)
            if hit is None:
                hit = self._word(bytes_to_str(tok.encode("utf-8")))
                if len(cache) >= self.CACHE_LIMIT:
                    cache.clear()
                cache[tok] = hit
            ids.extend(hit)
        return ids


def byte_level_pre_tokenizer_json(pattern: str, add_prefix_space: bool = False) -> dict:
    """tokenizer.json `pre_tokenizer` of a byte-level tokenizer: HF's ByteLevel (GPT-2 regex
    built in) for the GPT-2 pattern, else a Split on `pattern` followed by a regex-free ByteLevel."""
    if pattern == GPT2_PATTERN:
        return {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": True,
                "use_regex": True}
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": False,
         "use_regex": False}]}


def tokenizer_json(tok: BaseTokenizer, *, decoder: dict, model: dict,
                   add_prefix_space: bool = False) -> dict:
    """A byte-level tokenizer's tokenizer.json: the fields every one writes the same way around its
    own `decoder` and `model` sections."""
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": added_tokens_json(tok), "normalizer": None,
        "pre_tokenizer": byte_level_pre_tokenizer_json(tok.pattern, add_prefix_space),
        "post_processor": None,
        "decoder": decoder,
        "model": model,
    }


def _with_offsets(pieces):
    pos = 0
    for piece, is_special in pieces:
        yield pos, (piece, is_special)
        pos += len(piece)


def added_tokens_json(tok: BaseTokenizer) -> list[dict]:
    return [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True} for s, i in sorted(tok.special_to_id.items(), key=lambda x: x[1])]
