"""The n-gram baseline: interpolated modified Kneser-Ney (Chen & Goodman 1998) over a prepared data folder's tokens,
counted in numpy on the train split and scored on the validation split in the trainer's bits per byte.

For an order-n model and a history h of n-1 tokens (h' is h without its first token):

    P_n(w | h) = max(c(hw) - D(c(hw)), 0) / c(h.)  +  gamma(h) P_{n-1}(w | h')
    gamma(h)   = (D1 N1(h.) + D2 N2(h.) + D3+ N3+(h.)) / c(h.)

where c is the raw count at the highest order and the continuation count N1+(.hw) (how many distinct tokens
precede hw) at every lower order; N_r(h.) counts the tokens w with c(hw) = r; a history never seen in training
(c(h.) = 0) hands its whole mass to P_{n-1}. The base case interpolates with the uniform distribution over the
vocabulary, so every token has mass: P_0(w) = 1 / V. Each order's three discounts come from its counts of
counts n_r:  Y = n1 / (n1 + 2 n2),  D_r = r - (r + 1) Y n_{r+1} / n_r  (r = 1, 2, 3); where those are undefined or
outside (0, r] (tiny corpora) the discount is Y, or 0.5 where Y is undefined too.

Counting: each position's k-gram becomes one uint64 key (token ids packed into bits when k * bits(V) <= 64,
else a 64-bit polynomial hash), so a table is np.unique over the keys and a lookup is np.searchsorted. The
train stream and the scored stream each start with an end-of-text token (a document boundary), so every token
of the validation split is scored and bits per byte divides by the split's own UTF-8 bytes, as the trainer's.

Beside it, the unsmoothed estimate the notes' n trade-off is about: maximum likelihood with add-k (Laplace at
k = 1), P(w | h) = (c(hw) + k) / (c(h.) + k V) from the same raw counts. It has no back-off: a history never seen
in training gets the uniform 1 / V, so once the counts of long histories run out its bits per byte rise with n
while Kneser-Ney's flatten.
"""
from __future__ import annotations

import math
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from archlab.errors import UserError

__all__ = ["ESTIMATORS", "AddK", "NgramCounts", "KneserNey", "NgramResult", "discounts", "evaluate_ngram"]

_HASH_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)   # odd: the polynomial hash of k-grams of too many bits


def discounts(counts: np.ndarray) -> tuple[float, float, float]:
    """(D1, D2, D3+) of one order from its counts (Chen & Goodman 1998, eq. 26), with the fallback above."""
    n1, n2, n3, n4 = (int(np.count_nonzero(counts == r)) for r in (1, 2, 3, 4))
    y = n1 / (n1 + 2 * n2) if n1 + 2 * n2 else 0.5
    out = []
    for r, (n_r, n_next) in enumerate(((n1, n2), (n2, n3), (n3, n4)), start=1):
        d = r - (r + 1) * y * n_next / n_r if n_r else float("nan")
        out.append(d if 0.0 < d <= r else (y if 0.0 < y <= 1.0 else 0.5))
    return out[0], out[1], out[2]


def _unique(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(sorted distinct keys, the index of one occurrence of each, counts, each key's index among the distinct):
    np.unique's answer from one unstable sort (any occurrence will do; a sorted input is not sorted again)."""
    if len(keys) and bool(np.all(keys[1:] >= keys[:-1])):
        order = np.arange(len(keys))
        ordered = keys
    else:
        order = np.argsort(keys)
        ordered = keys[order]
    new = np.concatenate(([True], ordered[1:] != ordered[:-1])) if len(keys) else np.zeros(0, bool)
    starts = np.flatnonzero(new)
    counts = np.diff(np.append(starts, len(keys)))
    inverse = np.empty(len(keys), np.int64)
    inverse[order] = np.cumsum(new) - 1
    return ordered[starts], order[starts], counts, inverse


class _Keys:
    """uint64 keys of k-grams: key(k tokens) = combine(key(first k-1 tokens), last token), key() = 0."""

    def __init__(self, vocab_size: int, max_order: int) -> None:
        self.bits = max(1, int(vocab_size - 1).bit_length())
        self.exact = self.bits * max_order <= 64

    def combine(self, prefix: np.ndarray, token: np.ndarray) -> np.ndarray:
        token = token.astype(np.uint64)
        if self.exact:
            return (prefix << np.uint64(self.bits)) | token
        return prefix * _HASH_MULTIPLIER + token + np.uint64(1)     # wraps modulo 2**64

    def windows(self, stream: np.ndarray, max_order: int) -> list[np.ndarray]:
        """[K_0, ..., K_max]: K_k[i] is the key of stream[i:i+k], shape (len - k + 1,)."""
        stream = np.asarray(stream)
        keys = [np.zeros(len(stream) + 1, np.uint64)]
        for k in range(1, max_order + 1):
            n = max(0, len(stream) - k + 1)                   # a stream shorter than k has no k-grams
            keys.append(self.combine(keys[-1][:n], stream[k - 1:k - 1 + n]))
        return keys


@dataclass
class _Level:
    """One order's table: sorted k-gram keys with their discounted counts, sorted history keys with c(h.) and
    gamma(h)."""
    grams: np.ndarray         # (g,) uint64, sorted
    counts: np.ndarray        # (g,) c(hw), raw or continuation counts
    numerators: np.ndarray    # (g,) max(c - D(c), 0)
    histories: np.ndarray     # (h,) uint64, sorted
    totals: np.ndarray        # (h,) c(h.)
    gammas: np.ndarray        # (h,)
    discounts: tuple[float, float, float]

    @classmethod
    def build(cls, grams: np.ndarray, counts: np.ndarray, histories: np.ndarray) -> _Level:
        """grams sorted unique with their counts and each one's history key."""
        d = discounts(counts)
        table = np.array((0.0, *d), dtype=np.float64)
        which = np.minimum(counts, 3)                                   # 1, 2 or 3+
        numerators = counts - table[which]
        hist, _, _, inverse = _unique(histories)                      # inverse: each gram's history, (g,) -> (h,)
        totals = np.bincount(inverse, weights=counts, minlength=len(hist))
        mass = np.bincount(inverse, weights=table[which], minlength=len(hist))   # D1 N1 + D2 N2 + D3 N3+
        return cls(grams, counts, numerators, hist, totals, mass / totals, d)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.grams, self.counts, self.numerators, self.histories, self.totals,
                                      self.gammas))

    def lookup(self, table: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(index, found) of `keys` in a sorted key table."""
        idx = np.searchsorted(table, keys)
        idx = np.minimum(idx, max(len(table) - 1, 0))
        found = table[idx] == keys if len(table) else np.zeros(len(keys), bool)
        return idx, found


class NgramCounts:
    """Every table a Kneser-Ney model up to `max_order` needs, counted once from a token stream: for each order the
    raw counts (that order's top level) and the continuation counts (a lower level of a longer model).
    Example: counts = NgramCounts(np.array([0, 1, 0, 1, 2]), vocab_size=3, max_order=2); counts.model(2)"""

    def __init__(self, tokens: np.ndarray, vocab_size: int, max_order: int, *, bos: int | None = None,
                 progress: bool = False) -> None:
        if max_order < 1:
            raise UserError(f"order {max_order} must be at least 1")
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
            raise UserError(f"token ids must lie in [0, {vocab_size}); found {int(tokens.min())}..{int(tokens.max())}")
        self.vocab_size, self.max_order, self.bos = int(vocab_size), int(max_order), bos
        self.keys = _Keys(vocab_size, max_order)
        stream = tokens if bos is None else np.concatenate(([bos], tokens))
        self.n_tokens = int(tokens.size)
        self.raw: dict[int, _Level] = {}
        self.continuation: dict[int, _Level] = {}
        from archlab.progress import progress_bar
        windows = self.keys.windows(stream, max_order)    # K_0 .. K_max over the train stream
        bar = progress_bar(total=max_order, desc="n-gram counts", unit=" order", disable=not progress,
                           file=sys.stderr)
        with bar:
            for k in range(1, max_order + 1):
                skip = max(0, len(stream) - self.n_tokens - (k - 1))   # the start token alone is no 1-gram
                grams, first, counts, _ = _unique(windows[k][skip:])
                first += skip
                self.raw[k] = _Level.build(grams, counts, windows[k - 1][first])
                # the distinct k-grams' (k-1)-suffixes: how many distinct tokens precede each (k-1)-gram
                if k >= 2:
                    suffix_grams, where, continuation, _ = _unique(windows[k - 1][first + 1])
                    self.continuation[k - 1] = _Level.build(suffix_grams, continuation,
                                                            windows[k - 2][first[where] + 1])
                bar.update(1)

    def model(self, order: int) -> KneserNey:
        """The order-`order` model: raw counts at its top level, continuation counts below."""
        if not 1 <= order <= self.max_order:
            raise UserError(f"order {order} must be in 1..{self.max_order} (the counted orders)")
        levels = [self.continuation[k] for k in range(1, order)] + [self.raw[order]]
        return KneserNey(levels, self.keys, self.vocab_size, self.bos)

    def add_k(self, order: int, k: float = 1.0) -> AddK:
        """The order-`order` maximum-likelihood estimate with add-k smoothing over the raw counts."""
        if not 1 <= order <= self.max_order:
            raise UserError(f"order {order} must be in 1..{self.max_order} (the counted orders)")
        if not k > 0:
            raise UserError(f"add-k smoothing needs k > 0, got {k}")
        return AddK([self.raw[j] for j in range(1, order + 1)], self.keys, self.vocab_size, self.bos, k)


def _scored_rows(keys: _Keys, bos: int | None, order: int, tokens: np.ndarray
                 ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Per order k = 1..order, for each token of a stream: its (k-1)-token history key, its k-gram key and whether
    the stream (with the start token) holds k-1 tokens before it."""
    tokens = np.asarray(tokens, dtype=np.int64)
    stream = tokens if bos is None else np.concatenate(([bos], tokens))
    offset = len(stream) - len(tokens)                    # index in `stream` of the first scored token
    windows = keys.windows(stream, order)
    targets = np.arange(offset, len(stream))
    histories, grams, valid = [], [], []
    for k in range(1, order + 1):
        start = targets - (k - 1)                         # where the k-gram ending at the target begins
        at = np.maximum(start, 0)
        histories.append(windows[k - 1][at])
        grams.append(windows[k][at])
        valid.append(start >= 0)
    return histories, grams, valid


def _seen_share(top: _Level, keys: _Keys, bos: int | None, order: int, tokens: np.ndarray, start: int) -> float:
    """Share of the stream's tokens (from `start` on) whose whole order-n gram (history and token) occurs in
    training."""
    tokens = np.asarray(tokens, dtype=np.int64)
    stream = tokens if bos is None else np.concatenate(([bos], tokens))
    grams = keys.windows(stream, order)[order]
    grams = grams[max(0, len(grams) - (len(tokens) - start)):]    # the n-grams that end at a scored token
    _, found = top.lookup(top.grams, grams)
    return float(found.sum()) / max(1, len(tokens) - start)


class AddK:
    """Maximum likelihood with add-k smoothing: P(w | h) = (c(hw) + k) / (c(h.) + k V), `levels[j-1]` order j's
    raw counts. A token with fewer than n-1 tokens before it (the stream's first ones) uses the longest history
    it has."""

    def __init__(self, levels: list[_Level], keys: _Keys, vocab_size: int, bos: int | None, k: float) -> None:
        self.levels, self.keys, self.vocab_size, self.bos, self.k = levels, keys, vocab_size, bos, float(k)
        self.order = len(levels)

    def nbytes(self) -> int:
        top = self.levels[-1]
        return top.grams.nbytes + top.counts.nbytes + top.histories.nbytes + top.totals.nbytes

    def _probabilities(self, histories: list[np.ndarray], grams: list[np.ndarray], valid: list[np.ndarray]
                       ) -> np.ndarray:
        p = np.full(len(grams[0]), 1.0 / self.vocab_size)            # nothing counted: uniform
        for level, hist, gram, ok in zip(self.levels, histories, grams, valid):
            hi, h_found = level.lookup(level.histories, hist)
            gi, g_found = level.lookup(level.grams, gram)
            total = np.where(h_found, level.totals[hi] if len(level.totals) else 0.0, 0.0)     # c(h.)
            count = np.where(g_found, level.counts[gi] if len(level.counts) else 0.0, 0.0)     # c(hw)
            p = np.where(ok, (count + self.k) / (total + self.k * self.vocab_size), p)
        return p

    def token_nats(self, tokens: np.ndarray) -> np.ndarray:
        """-ln P of each token of a stream, (len,), each given the tokens before it (and the start token)."""
        return -np.log(self._probabilities(*_scored_rows(self.keys, self.bos, self.order, tokens)))

    def seen_share(self, tokens: np.ndarray, start: int = 0) -> float:
        return _seen_share(self.levels[-1], self.keys, self.bos, self.order, tokens, start)


class KneserNey:
    """An interpolated modified Kneser-Ney model: `levels[k-1]` is order k's table (NgramCounts.model builds one)."""

    def __init__(self, levels: list[_Level], keys: _Keys, vocab_size: int, bos: int | None) -> None:
        self.levels, self.keys, self.vocab_size, self.bos = levels, keys, vocab_size, bos
        self.order = len(levels)

    def nbytes(self) -> int:
        return sum(level.nbytes() for level in self.levels)

    def _probabilities(self, histories: list[np.ndarray], grams: list[np.ndarray], valid: list[np.ndarray]
                       ) -> np.ndarray:
        """P(w | h) for m rows: per order k, each row's history key, k-gram key and whether the row has k-1 tokens
        of history (else the order passes its lower order's probability through)."""
        m = len(grams[0])
        p = np.full(m, 1.0 / self.vocab_size)                         # P_0: uniform over the vocabulary
        for level, hist, gram, ok in zip(self.levels, histories, grams, valid):
            if not len(level.grams):                                  # nothing counted at this order
                continue
            hi, h_found = level.lookup(level.histories, hist)         # (m,) each
            h_found &= ok
            gi, g_found = level.lookup(level.grams, gram)
            numerator = np.where(g_found & h_found, level.numerators[gi], 0.0)
            interpolated = numerator / level.totals[hi] + level.gammas[hi] * p
            p = np.where(h_found, interpolated, p)                    # an unseen history: the lower order alone
        return p

    def token_nats(self, tokens: np.ndarray) -> np.ndarray:
        """-ln P of each token of a stream, (len,), each given the tokens before it (and the start token)."""
        return -np.log(self._probabilities(*_scored_rows(self.keys, self.bos, self.order, tokens)))

    def distribution(self, history: list[int] | tuple[int, ...], words: np.ndarray | None = None) -> np.ndarray:
        """P(w | history) for every w in the vocabulary, (V,), or for the ids `words` only; the last order-1 tokens
        of `history` count."""
        words = np.arange(self.vocab_size) if words is None else np.asarray(words, dtype=np.int64)
        history = [int(t) for t in history][-(self.order - 1):] if self.order > 1 else []
        histories, grams, valid = [], [], []
        for k in range(1, self.order + 1):
            ok = len(history) >= k - 1
            context = np.zeros(1, np.uint64)
            for t in (history[len(history) - (k - 1):] if ok and k > 1 else []):
                context = self.keys.combine(context, np.array([t]))
            histories.append(np.repeat(context, len(words)))
            grams.append(self.keys.combine(np.repeat(context, len(words)), words))
            valid.append(np.full(len(words), ok))
        return self._probabilities(histories, grams, valid)

    def seen_share(self, tokens: np.ndarray, start: int = 0) -> float:
        """Share of the stream's tokens (from `start` on) whose whole order-n gram (history and token) occurs in
        training."""
        return _seen_share(self.levels[-1], self.keys, self.bos, self.order, tokens, start)


# estimator name -> its model of one order from the counts (k: add-k's pseudo-count)
ESTIMATORS: dict[str, Callable[[NgramCounts, int, float], KneserNey | AddK]] = {
    "kneser_ney": lambda counts, order, k: counts.model(order),
    "add_k": lambda counts, order, k: counts.add_k(order, k),
}


@dataclass(frozen=True)
class NgramResult:
    order: int
    estimator: str             # a key of ESTIMATORS
    bpb: float                 # validation bits per UTF-8 byte (the trainer's unit)
    bits_per_token: float
    ppl: float                 # exp(mean nats per token)
    tokens: int                # validation tokens scored (every one, end-of-text tokens included)
    n_bytes: int               # the UTF-8 bytes they encode
    seen: float                # share of validation tokens whose whole n-gram occurs in training
    ngrams: int                # distinct top-order n-grams counted in training
    table_bytes: int           # the model's tables in memory
    peak_rss_bytes: int        # the process's peak resident memory so far
    seconds: float             # counting (shared by every order of one call) and scoring this order

    def to_dict(self) -> dict:
        return asdict(self)


def _peak_rss() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def evaluate_ngram(data_dir: str | os.PathLike, orders: list[int], *, span: tuple[int, int] | None = None,
                   progress: bool = False, estimators: tuple[str, ...] = ("kneser_ney",), k: float = 1.0
                   ) -> list[NgramResult]:
    """Each estimator (ESTIMATORS: modified Kneser-Ney, add-k with pseudo-count `k`) of each order in `orders`,
    counted once on the train split of a prepared token folder and scored on its validation split: every token,
    or the tokens [start, end) of `span` (each still given the tokens before it), e.g. the targets a model's
    evaluation scored, (1, 1 + EvalResult.tokens). Results by order, then estimator.
    Example: evaluate_ngram("runs/demo/data", [5])[0].bpb"""
    from archlab.data.tokens import TokenDataset
    from archlab.errors import DataError
    from archlab.units import bits_per_byte

    if not orders or min(orders) < 1:
        raise UserError(f"n-gram orders {orders}: each must be at least 1")
    unknown = [e for e in estimators if e not in ESTIMATORS]
    if unknown or not estimators:
        raise UserError(f"n-gram estimator(s) {unknown or '(none)'}: known {', '.join(ESTIMATORS)}")
    if not Path(data_dir).is_dir():
        raise DataError(f"{data_dir} is not a folder: pass a prepared data folder (archlab data prepare)")
    t0 = time.perf_counter()
    train, val = TokenDataset(data_dir, "train"), TokenDataset(data_dir, "val")
    if val.n_tokens == 0 or train.n_tokens == 0:
        raise DataError(f"{data_dir} has {train.n_tokens} train and {val.n_tokens} validation tokens: both are needed")
    counts = NgramCounts(np.asarray(train.tokens), train.vocab_size, max(orders), bos=train.eot_id,
                         progress=progress)
    stream = np.asarray(val.tokens)
    start, end = span if span is not None else (0, len(stream))
    if not 0 <= start < end <= len(stream):
        raise DataError(f"span {start}..{end} is not inside the validation split's {len(stream)} tokens")
    counted = time.perf_counter() - t0
    results = []
    for order, estimator in ((o, e) for o in orders for e in estimators):
        t1 = time.perf_counter()
        model = ESTIMATORS[estimator](counts, order, k)
        nats = float(model.token_nats(stream[:end])[start:].sum())
        tokens = end - start
        loss = nats / tokens                               # mean nats per scored token
        n_bytes = val.bytes_per_token * tokens             # as evaluate(): the split's bytes per token x tokens scored
        results.append(NgramResult(
            order=order, estimator=estimator, bpb=bits_per_byte(loss, tokens, n_bytes),
            bits_per_token=loss / math.log(2), ppl=math.exp(min(loss, 700.0)), tokens=tokens, n_bytes=round(n_bytes),
            seen=model.seen_share(stream[:end], start), ngrams=len(counts.raw[order].grams),
            table_bytes=model.nbytes(), peak_rss_bytes=_peak_rss(), seconds=counted + time.perf_counter() - t1))
    return results
