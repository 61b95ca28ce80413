"""WordPiece and Unigram: training rules, encoding rules, round trips, save/load, HF interop."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from archlab.tokenizer import UnigramTokenizer, WordPieceTokenizer, load, train_unigram, train_wordpiece
from archlab.tokenizer.unigram import _viterbi, unigram_from_counts
from archlab.tokenizer.wordpiece import wordpiece_from_counts

TEXT = ("the quick brown fox jumps over the lazy dog. the dog sleeps; the fox runs away!\n"
        "unhappiness, happiness and happy hippos hop happily.\n") * 30


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    p = tmp_path_factory.mktemp("wu") / "c.txt"
    p.write_text(TEXT + "<|endoftext|>" + TEXT[:200], encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def wordpiece(corpus):
    return train_wordpiece(corpus, 580, ["<|endoftext|>"], num_workers=1)


@pytest.fixture(scope="module")
def unigram(corpus):
    return train_unigram(corpus, 420, ["<|endoftext|>"], num_workers=1)


def test_wordpiece_likelihood_score_prefers_parts_that_occur_only_together():
    # ("x","##y") is less frequent than ("a","##b") but its parts occur only together: higher score.
    counts = {"ab": 50, "ac": 50, "db": 50, "xy": 10}
    tok = wordpiece_from_counts(counts, 1 + 512 + 1, score="likelihood")  # [UNK] + 512 base tokens + 1 merge
    assert tok.tokens[-1] == "xy"
    # frequency alone (BPE) would pick a pair from the frequent words
    assert tok.encode("ab") == [tok.tokens.index("a"), tok.tokens.index("##b")]


def test_wordpiece_likelihood_skips_pairs_below_the_minimum_frequency():
    counts = {"ab": 50, "ac": 50, "db": 50, "xy": 1}     # a name seen once: the raw score's favourite
    tok = wordpiece_from_counts(counts, 1 + 512 + 1, score="likelihood", min_pair_frequency=2)
    assert tok.tokens[-1] != "xy"


def test_wordpiece_default_merges_the_most_frequent_pair_as_tokenizers_does():
    counts = {"ab": 50, "ac": 50, "db": 50, "xy": 10}
    tok = wordpiece_from_counts(counts, 1 + 512 + 1)
    assert tok.tokens[-1] == "ab"          # 50 times; ties go to the lexicographically first pair


def test_wordpiece_greedy_longest_match_first():
    alphabet = [chr(c) for c in range(33, 127)]
    tokens = ["[UNK]"] + alphabet + ["##" + c for c in alphabet] + ["un", "unh", "##app", "##ap", "##piness"]
    from archlab.tokenizer.pretokenize import bytes_to_unicode
    tokens += [c for c in bytes_to_unicode().values() if c not in alphabet]
    tokens += ["##" + c for c in bytes_to_unicode().values() if c not in alphabet]
    tok = WordPieceTokenizer(tokens)
    ids = tok.encode("unhappiness")
    assert [tok.tokens[i] for i in ids] == ["unh", "##app", "##i", "##n", "##e", "##s", "##s"]


def test_wordpiece_special_token_and_round_trip(wordpiece):
    text = "the happy fox<|endoftext|>runs, 日本 😀!"
    ids = wordpiece.encode(text)
    assert wordpiece.special_to_id["<|endoftext|>"] in ids
    assert wordpiece.decode(ids) == text
    assert wordpiece.vocab_size == 580
    assert len(wordpiece.encode(" happiness")) < len(" happiness")


@settings(max_examples=80, deadline=None)
@given(st.text())
def test_wordpiece_round_trips_arbitrary_unicode(wordpiece, text):
    assert wordpiece.decode(wordpiece.encode(text)) == text


@settings(max_examples=80, deadline=None)
@given(st.text())
def test_unigram_round_trips_arbitrary_unicode(unigram, text):
    assert unigram.decode(unigram.encode(text)) == text


def test_unigram_viterbi_finds_most_probable_segmentation():
    scores = {"a": math.log(0.1), "b": math.log(0.1), "ab": math.log(0.05), "abab": math.log(0.001)}
    # "ab"+"ab" = 0.0025 > "abab" = 0.001 > a+b+a+b = 0.0001
    assert _viterbi("abab", scores, 4)[1] == ["ab", "ab"]
    scores["abab"] = math.log(0.01)
    assert _viterbi("abab", scores, 4)[1] == ["abab"]


def test_unigram_training_shrinks_to_size_and_keeps_frequent_words(unigram):
    assert unigram.vocab_size == 420
    pieces = {p for p, _ in unigram.pieces}
    assert "Ġthe" in pieces  # " the": the most frequent word is one piece
    scores = [s for p, s in unigram.pieces[1:]]
    assert all(s <= 0 for s in scores)
    assert math.isclose(sum(math.exp(s) for s in scores), 1.0, rel_tol=1e-6)
    assert len(unigram.encode(" the")) == 1


def test_unigram_prunes_per_round_within_shrink_fraction():
    counts = {"Ġ" + w: c for w, c in {"abcab": 20, "bcabc": 15, "cab": 30, "ab": 5}.items()}
    sizes = []
    unigram_from_counts(counts, 256 + 4, progress=sizes.append, seed_factor=8, shrink=0.15)
    assert sizes[-1] == 256 + 4
    for before, after in zip(sizes, sizes[1:]):
        assert after >= before - max(1, int(0.15 * before))


@pytest.mark.parametrize("kind", ["wordpiece", "unigram"])
def test_save_load_round_trip_and_hf_parity(kind, wordpiece, unigram, tmp_path):
    tok = wordpiece if kind == "wordpiece" else unigram
    tok.save(tmp_path)
    again = load(tmp_path)
    assert type(again) is type(tok) and again.vocab_size == tok.vocab_size
    texts = [TEXT[:500], "unseen wørds ✓ <|endoftext|> and specials", "  spaces\n\n"]
    for text in texts:
        assert again.encode(text) == tok.encode(text)
        assert again.decode(again.encode(text)) == text
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in texts:
        assert hf.encode(text).ids == tok.encode(text)


def test_unigram_pieces_are_required_to_cover_bytes():
    with pytest.raises(ValueError, match="byte characters"):
        UnigramTokenizer([("a", -1.0)])
