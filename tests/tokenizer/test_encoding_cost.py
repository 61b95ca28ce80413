"""Encoding cost is linear (up to a log) in the length of a pre-token, for every tokenizer kind and both
BPE encoders: one 1 MB word encodes in seconds (it took 144 s through the pure-Python BPE loop), with the
same ids as before."""
from __future__ import annotations

import random
import time

import pytest

import archlab.tokenizer as tk
from archlab.data.corpora import corpus_files
from archlab.tokenizer.bpe import _bpe_heap


@pytest.fixture(scope="module")
def tokenizers_by_kind():
    files = [str(f) for f in corpus_files("pystdlib")[:15]]
    return {kind: tk.train(files, 1000, ["<|endoftext|>"], kind=kind, num_workers=1)
            for kind in ("bpe", "wordpiece", "unigram")}


def _loop_bpe(tok, word: bytes) -> list[bytes]:
    """The pass-per-merge loop of Tokenizer._bpe, as the reference."""
    saved = tk.bpe._LONG_WORD
    tk.bpe._LONG_WORD = 10**12
    try:
        return [tok.id_to_bytes[i] for i in tok._bpe(word)]
    finally:
        tk.bpe._LONG_WORD = saved


def test_heap_bpe_merges_exactly_as_the_loop(tokenizers_by_kind):
    tok = tokenizers_by_kind["bpe"]
    rng = random.Random(0)
    alphabet = b"etaoin shrdlu_()=.:\n" + bytes(range(0xC0, 0xC4))
    for _ in range(300):
        word = bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 400)))
        assert _bpe_heap(word, tok._ranks) == _loop_bpe(tok, word)


def _word(n: int) -> str:
    rng = random.Random(1)
    return "".join(rng.choice("etaoinshrdlucmfwypvbgkqjxz") for _ in range(n))   # one \p{L}+ pre-token


@pytest.mark.parametrize("kind,path", [("bpe", "python"), ("bpe", "tiktoken"),
                                       pytest.param("wordpiece", "", marks=pytest.mark.slow),   # ~10 s
                                       pytest.param("unigram", "", marks=pytest.mark.slow)])
def test_a_one_megabyte_word_encodes_in_seconds_and_round_trips(tokenizers_by_kind, kind, path):
    tok = tokenizers_by_kind[kind]
    text = _word(1_000_000)
    if path == "tiktoken" and not tok.uses_fast_path:
        pytest.skip(f"tiktoken path unavailable: {tok.fast_path_reason()}")
    encode = tok._encode_python if path == "python" else tok.encode
    start = time.perf_counter()
    ids = encode(text)
    seconds = time.perf_counter() - start
    assert tok.decode(ids) == text
    assert seconds < 60, f"{kind} {path}: {seconds:.1f} s for 1 MB (quadratic?)"


@pytest.mark.parametrize("kind", ["bpe", "wordpiece", "unigram"])
def test_cost_grows_linearly_with_the_word(tokenizers_by_kind, kind):
    """Operation count, not wall time: 4x the word may cost at most ~5x (n log n), never 16x (n^2)."""
    tok = tokenizers_by_kind[kind]
    encode = tok._encode_python if kind == "bpe" else tok.encode

    def cost(n: int) -> float:
        text = _word(n)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            encode(text)
            best = min(best, time.perf_counter() - start)
            if hasattr(tok, "_cache"):
                tok._cache.clear()
        return best
    small, large = cost(25_000), cost(100_000)
    assert large < 8 * small, f"{kind}: 25k {small:.3f}s, 100k {large:.3f}s"
