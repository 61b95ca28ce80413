"""Unigram language-model tokenization (Kudo 2018; the SentencePiece "unigram" model).

Each piece has a log-probability; a word's segmentation is the most probable one (Viterbi). Training:

1. seed vocabulary: all characters plus the most frequent substrings (scored by frequency x length);
2. EM: the E-step computes each piece's expected count over all segmentations of every word
   (forward-backward in log space), the M-step sets log p(piece) = log(count / total);
3. prune: for each multi-character piece, the loss increase if it were removed is estimated as
   freq_viterbi(piece) * (log p(piece) - log p(best segmentation of the piece without it)); the
   `shrink` fraction (10-20%) with the smallest increase is dropped; repeat 2-3 until the target size.

Words are GPT-2 pre-tokens in GPT-2's byte-level alphabet; the 256 byte characters are always kept, so
any text encodes and decodes back exactly.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable

from archlab.tokenizer.base import WordTokenizer, tokenizer_json
from archlab.tokenizer.pretokenize import GPT2_PATTERN, bytes_to_str, bytes_to_unicode, compile_pattern, str_to_bytes

__all__ = ["UnigramTokenizer", "train_unigram", "unigram_from_counts"]

_NEG = float("-inf")


def _viterbi(word: str, scores: dict[str, float], max_len: int, exclude: str | None = None
             ) -> tuple[float, list[str]]:
    n = len(word)
    best = [_NEG] * (n + 1)
    back: list[int] = [0] * (n + 1)
    best[0] = 0.0
    for end in range(1, n + 1):
        for start in range(max(0, end - max_len), end):
            if best[start] == _NEG:
                continue
            piece = word[start:end]
            s = scores.get(piece)
            if s is None or piece == exclude:
                continue
            total = best[start] + s
            if total > best[end]:
                best[end] = total
                back[end] = start
    if best[n] == _NEG:
        return _NEG, []
    pieces = []
    end = n
    while end > 0:
        start = back[end]
        pieces.append(word[start:end])
        end = start
    pieces.reverse()
    return best[n], pieces


def _logaddexp(x: float, y: float) -> float:
    if x == _NEG:
        return y
    if y == _NEG:
        return x
    if x > y:
        return x + math.log1p(math.exp(y - x))
    return y + math.log1p(math.exp(x - y))


class UnigramTokenizer(WordTokenizer):
    """`UnigramTokenizer(pieces, special_tokens)`: (byte-level piece, log-probability) in id order."""
    kind = "unigram"

    def __init__(self, pieces: list[tuple[str, float]], special_tokens: Iterable[str] | None = None, *,
                 pattern: str = GPT2_PATTERN):
        specials = list(dict.fromkeys(special_tokens or ()))
        special_set = set(specials)
        self.pieces = [(p, float(s)) for p, s in pieces]
        id_to_bytes = [p.encode("utf-8") if p in special_set else str_to_bytes(p) for p, _ in self.pieces]
        super().__init__(id_to_bytes, specials)
        for s in specials:
            if self.special_to_id[s] >= len(self.pieces):
                self.pieces.append((s, 0.0))
        self.pattern = pattern
        self._pat = compile_pattern(pattern)
        self._scores = {p: s for i, (p, s) in enumerate(self.pieces) if i not in self._special_ids}
        self._ids = {p: i for i, (p, _) in enumerate(self.pieces) if i not in self._special_ids}
        self._max_len = max((len(p) for p in self._scores), default=1)
        missing = [c for c in bytes_to_unicode().values() if c not in self._scores]
        if missing:
            raise ValueError(f"the pieces lack {len(missing)} of the 256 byte characters")
        self._cache: dict[str, tuple[int, ...]] = {}

    def _word(self, word: str) -> tuple[int, ...]:
        _, pieces = _viterbi(word, self._scores, self._max_len)
        return tuple(self._ids[p] for p in pieces)

    def to_json(self) -> dict:
        return tokenizer_json(
            self,
            decoder={"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            model={"type": "Unigram", "unk_id": None, "byte_fallback": False,
                   "vocab": [[p, s] for p, s in self.pieces]},
        )

    @classmethod
    def from_json(cls, data: dict, specials: list[str], pattern: str) -> UnigramTokenizer:
        model = data["model"]
        if model.get("byte_fallback"):
            raise ValueError("Unigram with byte_fallback is not supported")
        return cls([(p, s) for p, s in model["vocab"]], specials, pattern=pattern)


def _em_step(words: list[str], counts: list[int], logp: dict[str, float], max_len: int) -> dict[str, float]:
    """Expected piece counts under the current model (forward-backward over each word's lattice)."""
    expected: dict[str, float] = {}
    for word, c in zip(words, counts):
        n = len(word)
        alpha = [_NEG] * (n + 1)
        alpha[0] = 0.0
        edges: list[tuple[int, int, str, float]] = []
        for end in range(1, n + 1):
            acc = _NEG
            for start in range(max(0, end - max_len), end):
                piece = word[start:end]
                lp = logp.get(piece)
                if lp is None or alpha[start] == _NEG:
                    continue
                edges.append((start, end, piece, lp))
                acc = _logaddexp(acc, alpha[start] + lp)
            alpha[end] = acc
        beta = [_NEG] * (n + 1)
        beta[n] = 0.0
        for start, end, _, lp in reversed(edges):
            beta[start] = _logaddexp(beta[start], lp + beta[end])
        z = alpha[n]
        if z == _NEG:
            continue
        for start, end, piece, lp in edges:
            if beta[end] == _NEG:
                continue
            post = math.exp(alpha[start] + lp + beta[end] - z)
            if post > 0.0:
                expected[piece] = expected.get(piece, 0.0) + c * post
    return expected


def _m_step(expected: dict[str, float], required: set[str]) -> dict[str, float]:
    kept = {p: e for p, e in expected.items() if e > 0.0 or p in required}
    floor = min((e for e in kept.values() if e > 0.0), default=1.0) * 0.5
    kept = {p: (e if e > 0.0 else floor) for p, e in kept.items()}
    for p in required:
        kept.setdefault(p, floor)
    log_total = math.log(sum(kept.values()))
    return {p: math.log(e) - log_total for p, e in kept.items()}


def unigram_from_counts(word_counts: dict[str, int], vocab_size: int, special_tokens: Iterable[str] = (), *,
                        max_piece_len: int = 16, seed_factor: int = 4, shrink: float = 0.2, em_iters: int = 2,
                        progress: Callable[[int], None] | None = None) -> UnigramTokenizer:
    """Train on byte-level word strings -> counts."""
    if not 0.0 < shrink < 1.0:
        raise ValueError(f"shrink={shrink} must be in (0, 1); the lecture suggests 0.1-0.2")
    specials = list(dict.fromkeys(special_tokens))
    required = set(bytes_to_unicode().values())
    target = vocab_size - len(specials)
    if target < len(required):
        raise ValueError(f"vocab_size={vocab_size} is below the 256 byte pieces + {len(specials)} specials")
    words = [w for w, c in word_counts.items() if c > 0]
    counts = [word_counts[w] for w in words]
    # 1. seed: characters + frequent substrings
    subs: Counter = Counter()
    for w, c in zip(words, counts):
        n = len(w)
        for i in range(n):
            for j in range(i + 2, min(n, i + max_piece_len) + 1):
                subs[w[i:j]] += c
    seed_size = max(target * seed_factor, target) - len(required)
    seeds = sorted(subs.items(), key=lambda kv: (-kv[1] * len(kv[0]), kv[0]))[:max(seed_size, 0)]
    char_counts: Counter = Counter()
    for w, c in zip(words, counts):
        for ch in w:
            char_counts[ch] += c
    init = {p: float(f) for p, f in seeds}
    for ch in required:
        init[ch] = float(char_counts.get(ch, 0)) or 0.5
    logp = _m_step(init, required)
    max_len = max(len(p) for p in logp)
    # 2-3. EM and pruning rounds
    while True:
        for _ in range(em_iters):
            logp = _m_step(_em_step(words, counts, logp, max_len), required)
        if progress:
            progress(len(logp))
        if len(logp) <= target:
            break
        viterbi_freq: Counter = Counter()
        for w, c in zip(words, counts):
            for p in _viterbi(w, logp, max_len)[1]:
                viterbi_freq[p] += c
        losses = []
        for p, lp in logp.items():
            if p in required:
                continue
            f = viterbi_freq.get(p, 0)
            if f == 0:
                losses.append((0.0, p))
                continue
            alt, _ = _viterbi(p, logp, max_len, exclude=p)
            losses.append((f * (lp - alt), p))
        losses.sort()
        n_drop = min(len(logp) - target, max(1, int(shrink * len(logp))))
        for _, p in losses[:n_drop]:
            del logp[p]
        max_len = max(len(p) for p in logp)
    ordered = sorted(logp.items(), key=lambda kv: (-kv[1], kv[0]))
    pieces = [(s, 0.0) for s in specials] + ordered
    return UnigramTokenizer(pieces, specials)


def train_unigram(input_path, vocab_size: int, special_tokens: Iterable[str] = (), *,
                  num_workers: int | None = None, progress: Callable[[int], None] | None = None,
                  **kwargs) -> UnigramTokenizer:
    """Train a Unigram tokenizer on a file, a folder or a list of them."""
    from archlab.tokenizer.bpe_train import count_file_pretokens
    counts = count_file_pretokens(input_path, special_tokens, num_workers=num_workers)
    words = {bytes_to_str(w): c for w, c in counts.items()}
    return unigram_from_counts(words, vocab_size, special_tokens, progress=progress, **kwargs)
