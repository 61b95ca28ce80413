"""A k-shot task that can only be solved in context: random mappings, fresh in every episode. The `emergence`
suite's second task, beside addition (archlab.data.arithmetic).

An episode is one line of `key>value` pairs, e.g. `q>m f>c q>m j>w f>c ...`: KEYS distinct letters, each mapped to
a uniformly random letter drawn afresh for the episode, each shown SHOTS + 1 times in a random order. The value
of a key's first occurrence cannot be known (chance, 1/26); from its second occurrence on it is written earlier in
the same line, so predicting it is in-context learning (a k-shot lookup, k = the occurrences before), the
behaviour Olsson et al. 2022 (arXiv 2209.11895) tie to induction heads. Since every mapping is fresh, nothing
memorised from training helps.

Corpus names `addition-K+icl`: the addition corpus with an episode line after each addition line with
probability 1/5 (about half the bytes are episodes). Episodes scored (`episodes`) come from another seed than the
training ones, though any episode would do: none can be memorised.
"""
from __future__ import annotations

import random
import string
from collections.abc import Iterable, Iterator

SUFFIX = "+icl"
KEYS = 3                          # distinct keys per episode
SHOTS = 3                         # each key shown SHOTS + 1 times: 0-shot to SHOTS-shot lookups
LETTERS = string.ascii_lowercase
EPISODE_RATE = 0.2                # episodes per addition line in an `addition-K+icl` corpus


def split_corpus(corpus: str) -> tuple[str, bool]:
    """(the corpus without the suffix, whether it carries episodes): split_corpus("addition-2+icl") ->
    ("addition-2", True)"""
    return (corpus[:-len(SUFFIX)], True) if corpus.endswith(SUFFIX) else (corpus, False)


def episode(rng: random.Random, keys: int = KEYS, shots: int = SHOTS) -> list[tuple[str, str]]:
    """The (key, value) pairs of one episode in the order written: `keys` distinct letters, each with a fresh random
    value, each appearing shots + 1 times, shuffled."""
    names = rng.sample(LETTERS, keys)
    mapping = {k: rng.choice(LETTERS) for k in names}
    order = [k for k in names for _ in range(shots + 1)]
    rng.shuffle(order)
    return [(k, mapping[k]) for k in order]


def line(pairs: list[tuple[str, str]]) -> str:
    """The episode as text: line([("q", "m"), ("f", "c")]) -> "q>m f>c" """
    return " ".join(f"{k}>{v}" for k, v in pairs)


def interleave(documents: Iterable[str], seed: int = 0, rate: float = EPISODE_RATE) -> Iterator[str]:
    """Each document with an episode line after each of its lines with probability `rate` (seeded)."""
    rng = random.Random(seed + 7919)
    for doc in documents:
        out = []
        for text in doc.splitlines():
            out.append(text)
            if rng.random() < rate:
                out.append(line(episode(rng)))
        yield "\n".join(out) + "\n"


def episodes(n: int = 512, seed: int = 4321, keys: int = KEYS, shots: int = SHOTS) -> list[list[tuple[str, str]]]:
    """`n` episodes to score, the same for every run of a sweep."""
    rng = random.Random(seed)
    return [episode(rng, keys, shots) for _ in range(n)]


def value_slots(pairs: list[tuple[str, str]]) -> list[tuple[int, int]]:
    """(character offset of each value in "\\n" + line(pairs), the occurrences of its key before it: its shots).
    value_slots([("q", "m"), ("f", "c"), ("q", "m")]) -> [(3, 0), (7, 0), (11, 1)]"""
    seen: dict[str, int] = {}
    out = []
    for i, (k, _) in enumerate(pairs):
        out.append((1 + 4 * i + 2, seen.get(k, 0)))       # "\n", then 4 characters a pair: key, ">", value, " "
        seen[k] = seen.get(k, 0) + 1
    return out
