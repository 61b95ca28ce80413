"""The tokenizer a data folder is prepared with, as the data pipeline sees it: anything with encode / decode and
a vocabulary size (archlab's tokenizers, an HF tokenizer.json folder), or "bytes" (ByteTokenizer: 256 byte ids
and an end-of-text id). `load_tokenizer(spec)` turns a name, a folder or an object into one.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from archlab.errors import DataError

__all__ = ["EOT_TOKEN", "TokenizerLike", "ByteTokenizer", "load_tokenizer", "special_token_id", "vocab_size_of"]

EOT_TOKEN = "<|endoftext|>"


# --------------------------------------------------------------------------- tokenizers
@runtime_checkable
class TokenizerLike(Protocol):
    """What `prepare` needs from a tokenizer (archlab.tokenizer.Tokenizer and ByteTokenizer both fit)."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def token_to_id(self, token: str) -> int | None: ...
    def save(self, directory: str | os.PathLike) -> Any: ...


class ByteTokenizer:
    """Byte-level tokenizer: ids 0-255 are the UTF-8 bytes, 256 is <|endoftext|> (vocab 257)."""

    FILE = "byte_tokenizer.json"
    vocab_size = 257
    eot_id = 256

    def encode(self, text: str) -> list[int]:
        from archlab.tokenizer.base import clean_surrogates
        return list(clean_surrogates(text).encode("utf-8"))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Bytes back to text; the end-of-text id decodes to nothing (skip_special_tokens or not: the same text),
        an id outside 0..256 is an error."""
        from archlab.tokenizer.base import check_ids
        ids = list(ids)
        check_ids(ids, self.vocab_size)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        return self.eot_id if token == EOT_TOKEN else None

    special_tokens = [EOT_TOKEN]

    def id_to_token(self, i: int) -> bytes | str | None:
        """The piece of an id, as the other tokenizers give it: its byte, or the end-of-text token's name (whole
        words and sentence ends are found from the pieces)."""
        if i == self.eot_id:
            return EOT_TOKEN
        return bytes([i]) if 0 <= i < 256 else None

    def save(self, directory: str | os.PathLike) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / self.FILE).write_text(json.dumps(
            {"kind": "bytes", "vocab_size": self.vocab_size, "special_tokens": {EOT_TOKEN: self.eot_id}}) + "\n")

    @classmethod
    def load(cls, directory: str | os.PathLike) -> ByteTokenizer:
        spec = json.loads((Path(directory) / cls.FILE).read_text())
        if spec.get("kind") != "bytes":
            raise DataError(f"{directory}/{cls.FILE} is not a byte tokenizer")
        return cls()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByteTokenizer)

    def __hash__(self) -> int:
        return hash(ByteTokenizer)


def load_tokenizer(spec: Any) -> TokenizerLike:
    """A tokenizer from "bytes", a folder (a saved ByteTokenizer or archlab.tokenizer.Tokenizer), or
    an object that already has `encode` (returned as is)."""
    if not isinstance(spec, (str, os.PathLike)):
        if not hasattr(spec, "encode"):
            raise DataError(f"{type(spec).__name__} is not a tokenizer: it has no encode()")
        return spec
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.exists():
        raise DataError(f"tokenizer {str(spec)!r} is neither 'bytes' nor an existing tokenizer folder")
    if (path / ByteTokenizer.FILE).is_file():
        return ByteTokenizer.load(path)
    from archlab.tokenizer import load
    return load(path)


def special_token_id(tokenizer: Any, token: str) -> int:
    """The id of a special token: token_to_id when the tokenizer has it, else a one-id encoding."""
    token_id = None
    if hasattr(tokenizer, "token_to_id"):
        token_id = tokenizer.token_to_id(token)
    else:
        ids = list(tokenizer.encode(token))
        token_id = ids[0] if len(ids) == 1 else None
    if token_id is None:
        raise DataError(f"the tokenizer has no {token!r} token: add it as a special token "
                        "or pass another eot_token")
    if not 0 <= int(token_id) < vocab_size_of(tokenizer):
        raise DataError(f"{token!r} has id {token_id}, outside vocab_size={vocab_size_of(tokenizer)}")
    return int(token_id)


def vocab_size_of(tokenizer: Any) -> int:
    """vocab_size as an attribute or property (or a method, or len(tokenizer), for other tokenizers)."""
    size = getattr(tokenizer, "vocab_size", None)
    if callable(size):
        size = size()
    if size is None and hasattr(tokenizer, "__len__"):
        size = len(tokenizer)
    if size is None:
        raise DataError(f"{type(tokenizer).__name__} has no vocab_size")
    return int(size)
