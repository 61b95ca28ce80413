"""Byte-level BPE encoder/decoder (GPT-2 semantics) with an optional tiktoken fast path.

Encoding a pre-token: start from its bytes, repeatedly merge every left-to-right occurrence of the
adjacent pair with the lowest merge rank, until no adjacent pair is a merge. The fast path builds a
`tiktoken.Encoding` whose ranks are our token ids; it is used only when it provably matches this rule on
the vocabulary (every multi-byte token is the result of exactly one merge, merge results have increasing
ids, and each token's own bytes encode to that token), and the tests compare ids on real text.
"""
from __future__ import annotations

import heapq
import json
import os
from collections.abc import Iterable
from pathlib import Path

from archlab.tokenizer.base import BaseTokenizer, added_tokens_json
from archlab.tokenizer.pretokenize import GPT2_PATTERN, bytes_to_str, compile_pattern, str_to_bytes

__all__ = ["Tokenizer"]

_CACHE_LIMIT = 1 << 17


class Tokenizer(BaseTokenizer):
    """Byte-level BPE tokenizer: `Tokenizer(vocab, merges, special_tokens)`.

    vocab: id -> bytes; merges: (left bytes, right bytes) in merge order; special_tokens: strings matched
    before pre-tokenization (overlapping ones: the longest match wins); a special token missing from the
    vocabulary gets the next free id.
    """
    kind = "bpe"

    def __init__(self, vocab: dict[int, bytes], merges: list[tuple[bytes, bytes]],
                 special_tokens: Iterable[str] | None = None, *, pattern: str = GPT2_PATTERN,
                 add_prefix_space: bool = False, ignore_merges: bool = False, fast: bool = True):
        n = len(vocab)
        if sorted(vocab) != list(range(n)):
            raise ValueError("vocab ids must be 0..len(vocab)-1 without gaps")
        super().__init__([bytes(vocab[i]) for i in range(n)], special_tokens)
        self.merges = [(bytes(a), bytes(b)) for a, b in merges]
        self.pattern = pattern
        self.add_prefix_space = add_prefix_space
        self.ignore_merges = ignore_merges
        self._pat = compile_pattern(pattern)
        self._ranks = {pair: r for r, pair in reversed(list(enumerate(self.merges)))}
        by_bytes = self._bytes_lookup()
        missing = [b for b in range(256) if bytes([b]) not in by_bytes]
        if missing:
            raise ValueError(f"vocab lacks {len(missing)} of the 256 single bytes (e.g. {bytes([missing[0]])!r})")
        for a, b in self.merges:
            if a + b not in by_bytes:
                raise ValueError(f"merge {(a, b)!r} produces a token missing from the vocab")
        self._cache: dict[str, tuple[int, ...]] = {}
        self._byte_ids = [by_bytes[bytes([b])] for b in range(256)]
        self._fast_requested = fast
        self._tiktoken = None
        self._fast_checked = False

    # ------------------------------------------------------------------ pure Python BPE
    def _bpe(self, word: bytes) -> tuple[int, ...]:
        by_bytes = self._bytes_lookup()
        if self.ignore_merges and word in by_bytes:
            return (by_bytes[word],)
        if len(word) > _LONG_WORD:
            return tuple(by_bytes[p] for p in _bpe_heap(word, self._ranks))
        parts = [word[i:i + 1] for i in range(len(word))]
        ranks = self._ranks
        while len(parts) > 1:
            best, best_rank = None, None
            for pair in zip(parts, parts[1:]):
                r = ranks.get(pair)
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = pair, r
            if best is None:
                break
            a, b = best
            merged: list[bytes] = []
            i = 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return tuple(by_bytes[p] for p in parts)

    def _encode_python(self, text: str) -> list[int]:
        """Pre-tokens through the BPE merges; O(n log n) in a pre-token's length (`_bpe_heap` past
        _LONG_WORD bytes), so one 1 MB word takes seconds, not minutes."""
        ids: list[int] = []
        cache = self._cache
        for tok in self._pat.findall(text):
            hit = cache.get(tok)
            if hit is None:
                hit = self._bpe(tok.encode("utf-8"))
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()  # bounded memory over long streams
                cache[tok] = hit
            ids.extend(hit)
        return ids

    # ------------------------------------------------------------------ tiktoken fast path
    def fast_path_reason(self) -> str | None:
        """None when encoding goes through tiktoken, else why not."""
        self._setup_fast()
        return self._fast_reason

    def _setup_fast(self) -> None:
        if self._fast_checked:
            return
        self._fast_checked = True
        self._fast_reason = None
        if not self._fast_requested or os.environ.get("ARCHLAB_NO_TIKTOKEN"):
            self._fast_reason = "disabled"
            return
        try:
            import tiktoken
        except ImportError:
            self._fast_reason = "tiktoken is not installed"
            return
        by_bytes = self._bytes_lookup()
        ordinary = [i for i in range(self.vocab_size) if i not in self._special_ids]
        if len({self.id_to_bytes[i] for i in ordinary}) != len(ordinary):
            self._fast_reason = "duplicate token bytes"
            return
        results = [by_bytes[a + b] for a, b in self.merges]
        if len(set(results)) != len(results) or any(x >= y for x, y in zip(results, results[1:])):
            self._fast_reason = "merge results are not one token per merge with increasing ids"
            return
        multi = {i for i in ordinary if len(self.id_to_bytes[i]) > 1}
        if multi != set(results):
            self._fast_reason = "multi-byte tokens that no merge produces"
            return
        for i in results:  # each token's own bytes must encode to itself (tiktoken's whole-piece shortcut)
            if self._bpe(self.id_to_bytes[i]) != (i,):
                self._fast_reason = f"token {self.id_to_bytes[i]!r} does not encode to itself"
                return
        ranks = {self.id_to_bytes[i]: i for i in ordinary}
        try:
            self._tiktoken = tiktoken.Encoding(name=f"archlab-{id(self)}", pat_str=self.pattern,
                                               mergeable_ranks=ranks, special_tokens={})
        except Exception as e:  # e.g. a pattern tiktoken's regex engine rejects
            self._fast_reason = f"tiktoken rejected the encoding: {e}"

    @property
    def uses_fast_path(self) -> bool:
        return self.fast_path_reason() is None

    def _encode_ordinary(self, text: str) -> list[int]:
        self._setup_fast()
        if self._tiktoken is not None:
            return self._tiktoken.encode_ordinary(text)
        return self._encode_python(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    # ------------------------------------------------------------------ files
    def to_json(self) -> dict:
        vocab: dict[str, int] = {}
        for i, b in enumerate(self.id_to_bytes):
            if i in self._special_ids:
                key = b.decode("utf-8")
            else:
                key = bytes_to_str(b)
            vocab.setdefault(key, i)
        if len(vocab) != self.vocab_size:
            raise ValueError("the vocabulary holds duplicate tokens, which tokenizer.json cannot store")
        if self.pattern == GPT2_PATTERN:
            pre = {"type": "ByteLevel", "add_prefix_space": self.add_prefix_space, "trim_offsets": True,
                   "use_regex": True}
        else:
            pre = {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": self.pattern}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": self.add_prefix_space, "trim_offsets": False,
                 "use_regex": False}]}
        return {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": added_tokens_json(self),
            "normalizer": None,
            "pre_tokenizer": pre,
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": self.ignore_merges, "vocab": vocab,
                      "merges": [[bytes_to_str(a), bytes_to_str(b)] for a, b in self.merges]},
        }

    def save(self, directory: str | os.PathLike) -> Path:
        """Write tokenizer.json (canonical) plus GPT-2 style vocab.json / merges.txt into `directory`."""
        d = super().save(directory)
        self.save_vocab_merges(d)
        return d

    def save_vocab_merges(self, directory: str | os.PathLike) -> tuple[Path, Path]:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        vocab = {bytes_to_str(b): i for i, b in enumerate(self.id_to_bytes) if i not in self._special_ids}
        vocab.update({s: i for s, i in self.special_to_id.items()})
        (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=0), encoding="utf-8")
        lines = ["#version: 0.2"] + [f"{bytes_to_str(a)} {bytes_to_str(b)}" for a, b in self.merges]
        (d / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        return d / "vocab.json", d / "merges.txt"

    @classmethod
    def from_json(cls, data: dict, specials: list[str], pattern: str, *, add_prefix_space: bool = False,
                  fast: bool = True) -> Tokenizer:
        """The tokenizer of a parsed tokenizer.json's BPE `model` (archlab.tokenizer.loading reads the file
        and its pre-tokenizer); ValueError names a BPE feature that is not supported."""
        model = data["model"]
        for field in ("continuing_subword_prefix", "end_of_word_suffix"):
            if model.get(field):
                raise ValueError(f"BPE with {field}={model[field]!r} is not supported")
        if model.get("byte_fallback"):
            raise ValueError("BPE with byte_fallback is not supported")
        added_ids = {t["id"]: t["content"] for t in data.get("added_tokens") or []}
        vocab: dict[int, bytes] = {}
        for s, i in model["vocab"].items():
            vocab[i] = added_ids[i].encode("utf-8") if i in added_ids else str_to_bytes(s)
        for i, s in added_ids.items():
            vocab.setdefault(i, s.encode("utf-8"))
        merges = []
        for m in model["merges"]:
            a, b = m.split(" ") if isinstance(m, str) else m
            merges.append((str_to_bytes(a), str_to_bytes(b)))
        return cls(vocab, merges, specials, pattern=pattern, add_prefix_space=add_prefix_space,
                   ignore_merges=bool(model.get("ignore_merges", False)), fast=fast)

    @classmethod
    def from_files(cls, vocab_path: str | os.PathLike, merges_path: str | os.PathLike,
                   special_tokens: Iterable[str] | None = None, **kwargs) -> Tokenizer:
        """Load GPT-2 style vocab.json (byte-level strings -> id) and merges.txt ("a b" per line)."""
        raw = json.loads(Path(vocab_path).read_text(encoding="utf-8"))
        specials = list(special_tokens or ())
        vocab: dict[int, bytes] = {}
        for s, i in raw.items():
            try:
                vocab[i] = str_to_bytes(s)
            except ValueError:  # not a byte-level string: a special token stored verbatim
                vocab[i] = s.encode("utf-8")
                if s not in specials:
                    specials.append(s)
        merges = []
        for line in Path(merges_path).read_text(encoding="utf-8").splitlines():
            if not line or line.startswith("#version"):
                continue
            a, b = line.split(" ")
            merges.append((str_to_bytes(a), str_to_bytes(b)))
        return cls(vocab, merges, specials, **kwargs)


_LONG_WORD = 128  # bytes: past this a pre-token merges through the heap (the pass loop is O(n * merges))


def _bpe_heap(word: bytes, ranks: dict[tuple[bytes, bytes], int]) -> list[bytes]:
    """The same merges as the pass-per-merge loop in `_bpe`, in O(n log n): a linked list of parts and a
    heap of (rank, position) for adjacent pairs. Equal ranks merge left to right, as the loop's pass does,
    and a merge made from token `ab` always ranks after the merge that made `ab`, so popping by
    (rank, position) reproduces the loop exactly (tested against it)."""
    parts: list[bytes | None] = [word[i:i + 1] for i in range(len(word))]
    nxt = list(range(1, len(word) + 1))      # len(word): no next part
    prv = list(range(-1, len(word) - 1))
    heap = [(r, i) for i in range(len(word) - 1) if (r := ranks.get((parts[i], parts[i + 1]))) is not None]
    heapq.heapify(heap)
    while heap:
        rank, i = heapq.heappop(heap)
        j = nxt[i]
        if parts[i] is None or j >= len(word) or ranks.get((parts[i], parts[j])) != rank:
            continue                          # stale: one side was merged away or changed
        parts[i] += parts[j]
        parts[j] = None
        nxt[i] = nxt[j]
        if nxt[i] < len(word):
            prv[nxt[i]] = i
        for left in (prv[i], i):              # the two pairs the merge created
            right = nxt[left] if left >= 0 else len(word)
            if left >= 0 and right < len(word):
                r = ranks.get((parts[left], parts[right]))
                if r is not None:
                    heapq.heappush(heap, (r, left))
    return [p for p in parts if p is not None]
