"""Multi-digit addition as a generated corpus (nothing downloaded), and held-out problems to score it: the
`emergence` suite's task.

A line is `a+b=s` with a and b uniform DIGITS-digit numbers (leading zeros kept, so every line has the same
width) and s their sum written least-significant digit first in DIGITS + 1 digits: each digit of the answer
then depends only on digits already written (Lee et al. 2023, arXiv 2307.03381: small causal models learn
reversed sums). Pairs with (a + 7 b) % 20 == 0 never appear in the corpus: the problems scored are drawn
from them, so a model that memorised its training lines gains nothing.
"""
from __future__ import annotations

import random
from collections.abc import Iterator

DIGITS = 3
GENERATED = ("addition",)      # corpus names a sweep generates instead of reading files


def answer(a: int, b: int) -> str:
    """The sum's DIGITS + 1 digits, least significant first: answer(57, 68) == "5210"."""
    return str(a + b).zfill(DIGITS + 1)[::-1]


def held_out(a: int, b: int) -> bool:
    return (a + 7 * b) % 20 == 0


def prompt(a: int, b: int) -> str:
    """What the model reads before the answer: a line break (as after the previous line), then `a+b=`."""
    return f"\n{a:0{DIGITS}d}+{b:0{DIGITS}d}="


def _pairs(rng: random.Random, want_held_out: bool) -> Iterator[tuple[int, int]]:
    top = 10 ** DIGITS
    while True:
        a, b = rng.randrange(top), rng.randrange(top)
        if held_out(a, b) == want_held_out:
            yield a, b


def documents(n_docs: int = 400, per_doc: int = 1000, seed: int = 0) -> Iterator[str]:
    """The training corpus: `n_docs` documents of `per_doc` lines (400 x 1,000 lines = 5.2M bytes)."""
    rng = random.Random(seed)
    pairs = _pairs(rng, want_held_out=False)
    for _ in range(n_docs):
        yield "\n".join(f"{a:0{DIGITS}d}+{b:0{DIGITS}d}={answer(a, b)}" for a, b in
                        (next(pairs) for _ in range(per_doc))) + "\n"


def problems(n: int = 512, seed: int = 1234) -> list[tuple[str, str]]:
    """`n` held-out (prompt, answer) pairs, the same for every run of a sweep."""
    pairs = _pairs(random.Random(seed), want_held_out=True)
    return [(prompt(a, b), answer(a, b)) for a, b in (next(pairs) for _ in range(n))]


def generate(name: str) -> Iterator[str]:
    """The documents of a generated corpus by name (one of GENERATED)."""
    if name != "addition":
        raise ValueError(f"{name!r} is not a generated corpus ({', '.join(GENERATED)})")
    return documents()
