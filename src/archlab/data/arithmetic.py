"""Multi-digit addition as a generated corpus (nothing downloaded), and held-out problems to score it: the
`emergence` suite's task.

Corpus names `addition-K` (K = 1..9 digits; `addition` is `addition-2`). A line is `a+b=s` with a and b
uniform K-digit numbers (leading zeros kept, so every line has the same width) and s their sum written
least-significant digit first in K + 1 digits: each digit of the answer then depends only on digits
already written (Lee et al. 2023, arXiv 2307.03381: small causal models learn reversed sums). Pairs with
(a + 7 b) % 20 == 0 never appear in the corpus: the problems scored are drawn from them, so a model that
memorised its training lines gains nothing.
"""
from __future__ import annotations

import random
import re
from collections.abc import Iterator

DEFAULT_DIGITS = 2


def digits_of(corpus: str) -> int | None:
    """K of a corpus named `addition-K` (`addition`: DEFAULT_DIGITS); None for any other name."""
    if corpus == "addition":
        return DEFAULT_DIGITS
    m = re.fullmatch(r"addition-([1-9])", corpus)
    return int(m.group(1)) if m else None


def answer(a: int, b: int, digits: int) -> str:
    """The sum's digits + 1 digits, least significant first: answer(57, 68, 2) == "521"."""
    return str(a + b).zfill(digits + 1)[::-1]


def held_out(a: int, b: int) -> bool:
    return (a + 7 * b) % 20 == 0


def prompt(a: int, b: int, digits: int) -> str:
    """What the model reads before the answer: a line break (as after the previous line), then `a+b=`."""
    return f"\n{a:0{digits}d}+{b:0{digits}d}="


def _pairs(rng: random.Random, digits: int, want_held_out: bool) -> Iterator[tuple[int, int]]:
    top = 10 ** digits
    while True:
        a, b = rng.randrange(top), rng.randrange(top)
        if held_out(a, b) == want_held_out:
            yield a, b


def documents(digits: int = DEFAULT_DIGITS, n_docs: int = 400, per_doc: int = 1000, seed: int = 0
              ) -> Iterator[str]:
    """The training corpus: `n_docs` documents of `per_doc` lines (2 digits: 400 x 1,000 lines = 4.0M bytes)."""
    rng = random.Random(seed)
    pairs = _pairs(rng, digits, want_held_out=False)
    for _ in range(n_docs):
        yield "\n".join(f"{a:0{digits}d}+{b:0{digits}d}={answer(a, b, digits)}" for a, b in
                        (next(pairs) for _ in range(per_doc))) + "\n"


def problems(digits: int = DEFAULT_DIGITS, n: int = 512, seed: int = 1234) -> list[tuple[str, str]]:
    """`n` held-out (prompt, answer) pairs, the same for every run of a sweep."""
    pairs = _pairs(random.Random(seed), digits, want_held_out=True)
    return [(prompt(a, b, digits), answer(a, b, digits)) for a, b in (next(pairs) for _ in range(n))]
