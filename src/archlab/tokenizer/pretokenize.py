"""Pre-tokenization shared by the trainers and encoders: special-token splitting, the GPT-2 regex,
the GPT-2 byte <-> printable-unicode map used by tokenizer.json, and counting pre-tokens of files.

Two facts about the GPT-2 pattern (Radford et al. 2019) this module relies on:

* Special tokens split the text *before* the regex runs, so they are never merged across.
* Every boundary between a non-whitespace and a whitespace character is a pre-token boundary, and the
  pre-tokens on either side depend only on the text on that side (no alternative consumes whitespace
  after a non-space character; the only lookahead, `\\s+(?!\\S)`, sits inside a whitespace run).
  So text can be cut into "segments" `\\s*\\S+` whose pre-tokens are independent. The trainer counts
  distinct segments with the fast stdlib `re` and runs the slower `regex` pattern once per distinct
  segment; chunk boundaries for parallel work are chosen the same way.
"""
from __future__ import annotations

import functools
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import regex

# GPT-2's pre-tokenization pattern (openai/gpt-2 encoder.py; identical to tiktoken's "gpt2" pat_str).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# The characters `regex` matches with \s (the Unicode White_Space property). The stdlib `re` also counts
# U+001C..U+001F as whitespace, so the fast segmenter spells the class out to agree with `regex`.
_WS = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_SEGMENT_RE = re.compile(f"[{_WS}]*[^{_WS}]+|[{_WS}]+")
# A cut point for chunking: after a non-whitespace character and before a whitespace one.
_CUT_RE = re.compile(f"[^{_WS}](?=[{_WS}])")


@functools.lru_cache(maxsize=16)
def compile_pattern(pattern: str = GPT2_PATTERN) -> regex.Pattern:
    return regex.compile(pattern)


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters (Ġ is the space)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


@functools.lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def bytes_to_str(token: bytes) -> str:
    table = bytes_to_unicode()
    return "".join(table[b] for b in token)


def str_to_bytes(token: str) -> bytes:
    table = unicode_to_bytes()
    try:
        return bytes(table[c] for c in token)
    except KeyError as e:
        raise ValueError(f"{token!r} is not a byte-level token string") from e


@functools.lru_cache(maxsize=64)
def special_splitter(special_tokens: tuple[str, ...]) -> re.Pattern | None:
    """A pattern matching any special token, longest first so that overlapping tokens resolve to the
    longest match at the leftmost position (the rule `tokenizers` applies to added tokens)."""
    if not special_tokens:
        return None
    ordered = sorted(set(special_tokens), key=lambda s: (-len(s), s))
    return re.compile("|".join(re.escape(s) for s in ordered))


def split_special(text: str, special_tokens: Iterable[str]) -> Iterator[tuple[str, bool]]:
    """Yield (piece, is_special) in order; ordinary pieces are non-empty."""
    splitter = special_splitter(tuple(special_tokens))
    if splitter is None:
        if text:
            yield text, False
        return
    start = 0
    for m in splitter.finditer(text):
        if m.start() > start:
            yield text[start:m.start()], False
        yield m.group(), True
        start = m.end()
    if start < len(text):
        yield text[start:], False


def pretokenize(text: str, pattern: str = GPT2_PATTERN) -> list[str]:
    return compile_pattern(pattern).findall(text)


def count_pretokens(text: str | Iterable[str], special_tokens: tuple[str, ...] = (),
                    pattern: str = GPT2_PATTERN) -> Counter:
    """Counter of pre-token strings in `text` (or in each text of an iterable of independent texts);
    special tokens split the text and are never counted.

    With the GPT-2 pattern, distinct `\\s*\\S+` segments are counted first (stdlib `re`, fast) and each
    distinct segment is pre-tokenized once with `regex`.
    """
    texts = [text] if isinstance(text, str) else text
    pat = compile_pattern(pattern)
    counts: Counter = Counter()
    segments: Counter = Counter()
    for t in texts:
        for piece, is_special in split_special(t, special_tokens):
            if is_special:
                continue
            if pattern == GPT2_PATTERN:
                segments.update(_SEGMENT_RE.findall(piece))
            else:
                counts.update(pat.findall(piece))
    for seg, n in segments.items():
        for tok in pat.findall(seg):
            counts[tok] += n
    return counts


def safe_cut(text: str, special_tokens: tuple[str, ...] = (), *, min_pos: int = 0) -> int:
    """The largest position p > min_pos at which `text` may be cut into independently pre-tokenized halves:
    just after a special token, or (GPT-2 pattern) between a non-whitespace and a whitespace character
    outside any special token. Returns 0 when there is none.

    Only positions at least `longest special - 1` characters before the end are considered, so a
    special token still being read cannot straddle the cut.
    """
    splitter = special_splitter(tuple(special_tokens))
    longest = max((len(s) for s in special_tokens), default=1)
    limit = len(text) - (longest - 1)
    matches = [(m.start(), m.end()) for m in splitter.finditer(text)] if splitter is not None else []
    last_special_end = max((e for _, e in matches if e <= limit), default=0)
    # The last whitespace boundary after the last complete special token, scanning backwards in blocks.
    open_spans = [(s, e) for s, e in matches if e > last_special_end]
    idx = None
    hi, block = limit, 1 << 16
    while hi > last_special_end and idx is None:
        lo = max(last_special_end, hi - block)
        for m in _CUT_RE.finditer(text, lo, min(hi + 1, len(text))):
            # not inside a special token that contains whitespace
            if m.end() <= limit and not any(s < m.end() < e for s, e in open_spans):
                idx = m.end()
        hi = lo
    best = max(idx or 0, last_special_end)
    return best if best > min_pos else 0


def iter_text_chunks(paths: Iterable[Path], special_tokens: tuple[str, ...] = (),
                     chunk_chars: int = 1 << 22) -> Iterator[str]:
    """Read files as text in chunks of about `chunk_chars` characters, each ending at a safe cut,
    so that memory is bounded by the chunk size and pre-tokens never straddle chunks.
    A file boundary is always a cut (documents are pre-tokenized separately)."""
    for path in paths:
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            buf = ""
            while True:
                data = f.read(chunk_chars)
                if not data:
                    break
                buf += data
                cut = safe_cut(buf, special_tokens)
                if cut > 0:
                    yield buf[:cut]
                    buf = buf[cut:]
            if buf:
                yield buf


def resolve_inputs(input_path) -> list[Path]:
    """A file, a folder (searched recursively for files, sorted, hidden entries skipped) or a list of these."""
    if isinstance(input_path, (str, os.PathLike)):
        items = [input_path]
    else:
        items = list(input_path)
    files: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            for sub in sorted(p.rglob("*")):
                if sub.is_file() and not any(part.startswith(".") for part in sub.relative_to(p).parts):
                    files.append(sub)
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"no such file or folder: {p}")
    if not files:
        raise FileNotFoundError(f"no input files in {input_path!r}")
    return files
