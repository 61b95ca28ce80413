"""BPE training: GPT-2 rules, identical merges to a naive reference, C loop == Python loop."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import regex

from archlab.tokenizer import bpe_from_counts, bpe_train, train_bpe
from archlab.tokenizer.pretokenize import (
    _SEGMENT_RE,
    GPT2_PATTERN,
    count_pretokens,
    iter_text_chunks,
    safe_cut,
)

BACKENDS = ["python"] + (["c"] if bpe_train.c_backend_available() else [])


def naive_bpe(text: str, vocab_size: int, special_tokens: list[str]) -> list[tuple[bytes, bytes]]:
    """The textbook trainer: split on specials, pre-tokenize, recount every pair after every merge."""
    pieces = regex.split("|".join(regex.escape(s) for s in sorted(special_tokens, key=len, reverse=True)),
                         text) if special_tokens else [text]
    words: Counter = Counter()
    for piece in pieces:
        for tok in regex.findall(GPT2_PATTERN, piece):
            words[tuple(bytes([b]) for b in tok.encode("utf-8"))] += 1
    merges = []
    for _ in range(vocab_size - 256 - len(special_tokens)):
        pairs: Counter = Counter()
        for w, c in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += c
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        new_words: Counter = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] += c
        words = new_words
    return merges


def _random_corpus(seed: int) -> str:
    rng = random.Random(seed)
    alphabet = rng.choice(["ab", "abc ", "aab \n", "xyz  \n\t", "héé ü", "low lower newest widest "])
    words = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8))) for _ in range(30)]
    return "".join(rng.choice(words) + rng.choice([" ", "", "\n", "  ", "<|eot|>"]) for _ in range(150))


@pytest.fixture
def write(tmp_path):
    def _write(text: str, name: str = "corpus.txt"):
        p = tmp_path / name
        p.write_text(text, encoding="utf-8")
        return p
    return _write


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(8))
def test_merges_match_naive_reference(write, backend, seed):
    text = _random_corpus(seed)
    specials = ["<|eot|>"]
    vocab, merges = train_bpe(write(text), 256 + 1 + 60, specials, num_workers=1, backend=backend)
    assert merges == naive_bpe(text, 256 + 1 + 60, specials)


def test_c_and_python_loops_give_identical_merges_on_larger_text(write):
    if "c" not in BACKENDS:
        pytest.skip(f"compiled loop unavailable: {bpe_train._lib_error}")
    rng = random.Random(0)
    vocab_words = ["".join(rng.choice("etaoinshrdlu") for _ in range(rng.randint(1, 9))) for _ in range(400)]
    text = " ".join(rng.choice(vocab_words) for _ in range(20000))
    counts = bpe_train.count_file_pretokens(write(text), num_workers=1)
    _, c_merges = bpe_from_counts(counts, 1200, backend="c")
    _, py_merges = bpe_from_counts(counts, 1200, backend="python")
    assert len(c_merges) > 500
    assert c_merges == py_merges


def test_tie_break_prefers_lexicographically_greater_pair():
    # Sennrich et al.'s example: ("e","s") and ("s","t") both occur 9 times; ("s","t") is greater.
    counts = {b"low": 5, b"lower": 2, b"widest": 3, b"newest": 6}
    for backend in BACKENDS:
        _, merges = bpe_from_counts(counts, 256 + 6, backend=backend)
        assert merges == [(b"s", b"t"), (b"e", b"st"), (b"o", b"w"), (b"l", b"ow"), (b"w", b"est"), (b"n", b"e")]
    # Prefix rule: b"a" < b"ab", so the pair starting with "ab" wins a tie.
    _, merges = bpe_from_counts({b"ab": 1, b"xy": 1}, 256 + 1)
    assert merges == [(b"x", b"y")]


def test_vocab_layout_specials_then_bytes_then_merges(write):
    specials = ["<|endoftext|>", "<pad>"]
    vocab, merges = train_bpe(write("the cat<pad> the hat <|endoftext|>the bat " * 20), 300, specials)
    assert sorted(vocab) == list(range(len(vocab)))
    assert vocab[0] == b"<|endoftext|>" and vocab[1] == b"<pad>"
    assert [vocab[2 + b] for b in range(256)] == [bytes([b]) for b in range(256)]
    assert [vocab[258 + k] for k in range(len(merges))] == [a + b for a, b in merges]


def test_special_tokens_are_never_merged_across(write):
    # "XY" only ever occurs as the special token, inside words: without the split, "bXYc" would merge.
    text = "abXYcd abXYcd XY XYXY " * 200
    vocab, merges = train_bpe(write(text), 256 + 1 + 40, ["XY"], num_workers=1)
    assert merges == [(b"c", b"d"), (b"a", b"b"), (b" ", b"ab")]  # then nothing is left to merge
    for i, token in vocab.items():
        if i != 0:
            assert b"X" not in token and b"Y" not in token or len(token) == 1
    assert all(b"X" not in a + b and b"Y" not in a + b for a, b in merges)


def test_stops_when_no_pair_is_left(write):
    vocab, merges = train_bpe(write("ab ab ab"), 10_000, [])
    assert merges == naive_bpe("ab ab ab", 10_000, [])
    assert len(vocab) == 256 + len(merges)


def test_vocab_size_below_bytes_raises(write):
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(write("abc"), 200, [])


def test_folder_and_list_inputs_count_every_file(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("hello hello")
    (tmp_path / "d" / "b.txt").write_text("world world")
    (tmp_path / "d" / ".hidden.txt").write_text("secret secret")
    from_dir = bpe_train.count_file_pretokens(tmp_path / "d")
    from_list = bpe_train.count_file_pretokens([tmp_path / "d" / "a.txt", tmp_path / "d" / "b.txt"])
    assert from_dir == from_list == Counter({b"hello": 1, b" hello": 1, b"world": 1, b" world": 1})


def test_parallel_counting_equals_serial(write):
    text = _random_corpus(3) * 50
    path = write(text)
    serial = bpe_train.count_file_pretokens(path, ["<|eot|>"], num_workers=1)
    parallel = bpe_train.count_file_pretokens(path, ["<|eot|>"], num_workers=2, chunk_chars=997,
                                              max_job_chars=3000)
    assert parallel == serial
    direct = Counter({k.encode(): v for k, v in Counter(
        t for piece in regex.split(r"<\|eot\|>", text) for t in regex.findall(GPT2_PATTERN, piece)).items()})
    assert serial == direct


@pytest.mark.parametrize("seed", range(5))
def test_chunked_reading_never_splits_a_pretoken(tmp_path, seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(["a", "b", " ", "  ", "\n", "\t", "<|x|>", "'s", "1", "é", "\u2003", "\x1c", "!"])
                   for _ in range(3000))
    path = tmp_path / "c.txt"
    path.write_text(text, encoding="utf-8")
    chunks = list(iter_text_chunks([path], ("<|x|>",), chunk_chars=rng.randint(5, 50)))
    assert "".join(chunks) == text
    assert len(chunks) > 5
    whole = [t for piece in regex.split(r"<\|x\|>", text) for t in regex.findall(GPT2_PATTERN, piece)]
    parts = [t for c in chunks for piece in regex.split(r"<\|x\|>", c) for t in regex.findall(GPT2_PATTERN, piece)]
    assert parts == whole


def test_segment_counting_equals_plain_pretokenization():
    text = "Hello  world!\n\n   def f(x):\n\treturn x's  \u3000 \x1c1234 \n" * 3
    assert count_pretokens(text) == Counter(regex.findall(GPT2_PATTERN, text))
    assert "".join(_SEGMENT_RE.findall(text)) == text


def test_segmenter_whitespace_class_agrees_with_regex():
    ws = regex.compile(r"\s")
    for cp in range(0x3001):  # every White_Space code point is below U+3001
        ch = chr(cp)
        segs = _SEGMENT_RE.findall("a" + ch + "b")
        assert (len(segs) == 2) == bool(ws.match(ch)), hex(cp)


def test_safe_cut_respects_special_tokens_with_spaces():
    text = "abc <|a b|> def"
    cut = safe_cut(text, ("<|a b|>",))
    assert cut in (3, 11)
    assert not (4 < cut < 11)
