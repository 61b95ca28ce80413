"""Any Hugging Face tokenizer.json through the `tokenizers` library, behind archlab's tokenizer interface.

`archlab.tokenizer.load` uses this only when its own readers (loading.py) reject a file: SentencePiece-
style tokenizers (Llama 2, Gemma, Mistral: normalizers, Metaspace, byte fallback), WordLevel, and so on.
Encoding is the `tokenizers` library's own, so ids match `transformers` exactly. Differences from
BaseTokenizer: `id_to_token` returns the vocabulary string (e.g. "▁the"), not bytes, and `encode`
adds no BOS/EOS unless asked (the post-processor's template is skipped by default, as in
BaseTokenizer, which has none).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from archlab.tokenizer.base import EOT_NAMES, check_ids, clean_surrogates

__all__ = ["HFTokenizer"]

CONFIG_FILE = "tokenizer_config.json"   # read for `eos_token` when it sits beside tokenizer.json


class HFTokenizer:
    """A `tokenizers.Tokenizer` with archlab's interface: HFTokenizer.from_file("folder_or_json")."""
    kind = "hf"

    def __init__(self, tokenizer, config: dict | None = None):
        self.hf = tokenizer                       # the tokenizers.Tokenizer (public: use it for offsets etc.)
        self.config = dict(config or {})          # tokenizer_config.json, if any (kept for save)
        added = sorted(tokenizer.get_added_tokens_decoder().items())
        self.special_to_id: dict[str, int] = {t.content: i for i, t in added if t.special}
        self.special_tokens = list(self.special_to_id)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> HFTokenizer:
        """Load a folder holding tokenizer.json (and optionally tokenizer_config.json), or the file."""
        from tokenizers import Tokenizer

        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        config = {}
        if (file.parent / CONFIG_FILE).is_file():
            try:
                config = json.loads((file.parent / CONFIG_FILE).read_text(encoding="utf-8"))
            except ValueError:  # a broken side file must not hide a good tokenizer.json
                config = {}
        return cls(Tokenizer.from_file(str(file)), config if isinstance(config, dict) else {})

    # ------------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: bytes | str) -> int | None:
        """Id of a vocabulary string (special or not; bytes are read as UTF-8); None if absent."""
        if isinstance(token, bytes):
            try:
                token = token.decode("utf-8")
            except UnicodeDecodeError:
                return None
        return self.hf.token_to_id(token)

    def id_to_token(self, i: int) -> str:
        token = self.hf.id_to_token(i)
        if token is None:
            raise IndexError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
        return token

    def special_token_id(self, token: str) -> int:
        return self.special_to_id[token]

    @property
    def eot_id(self) -> int | None:
        """End-of-text id: tokenizer_config.json's eos_token if present, else a conventional name, else
        the first special token (as BaseTokenizer), else None."""
        eos = self.config.get("eos_token")
        if isinstance(eos, dict):  # the AddedToken form {"content": "</s>", ...}
            eos = eos.get("content")
        if isinstance(eos, str) and self.hf.token_to_id(eos) is not None:
            return self.hf.token_to_id(eos)
        for name in EOT_NAMES:
            if name in self.special_to_id:
                return self.special_to_id[name]
        return self.special_to_id[self.special_tokens[0]] if self.special_tokens else None

    # ------------------------------------------------------------------ encoding / decoding
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of `text`; special tokens written in the text map to their ids; BOS/EOS of the
        post-processor only with add_special_tokens=True."""
        return self.hf.encode(clean_surrogates(text), add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str) -> list[int]:
        return self.encode(text)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of the ids through the tokenizer's decoder; special tokens are kept (as BaseTokenizer)."""
        ids = list(ids)
        check_ids(ids, self.vocab_size)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode_iterable(self, iterable: Iterable[str], *, buffer_chars: int = 1 << 14) -> Iterator[int]:
        """Lazily encode an iterable of strings; the ids equal encode("".join(iterable)).

        A generic tokenizer has no known safe cut: Metaspace and Prepend("▁") normalizers treat the start
        of the input specially, and a BPE without pre-tokenizer merges across words. So a cut c is taken
        at a token start about three quarters into the buffer, and the text kept for the next round
        starts CONTEXT_CHARS earlier (at a token start c0); the cut is used only when encoding buf[c0:]
        reproduces the buffer's ids from c on, and the ids of buf[c0:c] (already emitted) are skipped
        next time. When no cut verifies, the buffer doubles before the next try (no quadratic work)."""
        buf, skip, threshold = "", 0, buffer_chars
        for chunk in iterable:
            buf += chunk
            if len(buf) < threshold:
                continue
            enc = self.hf.encode(buf, add_special_tokens=False)
            cut = self._verified_cut(buf, enc.ids, enc.offsets, skip)
            if cut is None:
                threshold = 2 * len(buf)
                continue
            k, c0, j = cut
            yield from enc.ids[skip:k]
            buf, skip, threshold = buf[c0:], j, buffer_chars
        if buf:
            yield from self.hf.encode(buf, add_special_tokens=False).ids[skip:]

    CONTEXT_CHARS = 64

    def _verified_cut(self, buf: str, ids: list[int], offsets: list[tuple[int, int]], skip: int,
                      tries: int = 4) -> tuple[int, int, int] | None:
        """(k, c0, j): ids[:k] may be emitted, the text kept is buf[c0:], and its encoding's first j ids
        are the ones of buf[c0:offsets[k][0]]; None when no candidate verifies."""
        def fresh(i: int) -> bool:  # a token that starts a new char, not a 2nd byte-fallback piece
            return i == 0 or (offsets[i][0] >= offsets[i - 1][1] and offsets[i][0] > offsets[i - 1][0])

        limit = (3 * len(buf)) // 4
        k = len(ids) - 1
        while k > skip and offsets[k][0] > limit:
            k -= 1
        for _ in range(tries):
            while k > skip and not fresh(k):
                k -= 1
            c = offsets[k][0]
            i = k - 1
            while i > 0 and (offsets[i][0] > c - self.CONTEXT_CHARS or not fresh(i)):
                i -= 1
            if k <= skip or i <= 0:
                return None
            c0 = offsets[i][0]
            sub = self.hf.encode(buf[c0:], add_special_tokens=False)
            starts = [o[0] for o in sub.offsets]
            if c - c0 in starts:
                j = starts.index(c - c0)
                if sub.ids[j:] == ids[k:]:
                    return k, c0, j
            k -= 1
        return None

    # ------------------------------------------------------------------ saving
    def save(self, directory: str | os.PathLike) -> Path:
        """Write directory/tokenizer.json (and tokenizer_config.json when one was loaded)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / "tokenizer.json.tmp"
        self.hf.save(str(tmp))
        os.replace(tmp, d / "tokenizer.json")
        if self.config:
            (d / CONFIG_FILE).write_text(json.dumps(self.config, ensure_ascii=False, indent=1),
                                         encoding="utf-8")
        return d

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, special_tokens={self.special_tokens})"
