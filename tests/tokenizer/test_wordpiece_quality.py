"""WordPiece compresses held-out real text as well as `tokenizers`' WordPieceTrainer given the same
pre-tokenization (GPT-2's byte-level split, which keeps every byte: both decode losslessly), on the
Shakespeare texts and the Python standard library, 90% of the files to train on, 10% held out, at
vocabularies 2k / 8k / 32k: bytes per token at least 0.95x theirs.

Measured (AMD EPYC, 2026-11-24): Shakespeare 2.580 / 3.108 / 3.397 bytes/token against 2.612 / 3.102 / 3.379
(0.99x / 1.00x / 1.01x); standard library 2.895 / 3.726 / 4.144 against 2.625 / 3.200 / 3.503. The 0.89x
once reported for Shakespeare at 8k compared against `tokenizers`' default BERT pre-tokenizer, which drops
whitespace and newlines (3.537 bytes/token there): tokens that a lossless tokenizer must spend and BERT's
never decodes back."""
from __future__ import annotations

import pytest

import archlab.tokenizer as tk
from archlab.data.corpora import corpus_files

T = pytest.importorskip("tokenizers")


def _split(name: str) -> tuple[list[str], str]:
    files = corpus_files(name)
    if name == "pystdlib":   # the library's own modules, a 400-file slice (tests and IDLE aside)
        files = [f for f in files if "/test" not in str(f) and "idlelib" not in str(f)][:400]
    cut = len(files) * 9 // 10
    return [str(f) for f in files[:cut]], "".join(f.read_text(errors="replace") for f in files[cut:])


def _theirs(train: list[str], vocab: int):
    tok = T.Tokenizer(T.models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=10**6))
    tok.pre_tokenizer = T.pre_tokenizers.ByteLevel(add_prefix_space=False)     # GPT-2's split, as ours
    trainer = T.trainers.WordPieceTrainer(vocab_size=vocab, special_tokens=["[UNK]", "<|endoftext|>"],
                                          initial_alphabet=T.pre_tokenizers.ByteLevel.alphabet())
    tok.train(train, trainer)
    return tok


def _check(name: str, vocab: int) -> None:
    train, held = _split(name)
    n_bytes = len(held.encode("utf-8"))
    ours = tk.train(train, vocab, ["<|endoftext|>"], kind="wordpiece", num_workers=1)
    ours_bpt = n_bytes / len(ours.encode(held))
    theirs_bpt = n_bytes / len(_theirs(train, vocab).encode(held).ids)
    assert ours_bpt >= 0.95 * theirs_bpt, f"{name} @ {vocab}: {ours_bpt:.3f} vs {theirs_bpt:.3f} bytes/token"
    assert ours.decode(ours.encode(held)) == held


@pytest.mark.slow   # ~13 s
def test_wordpiece_matches_tokenizers_on_the_standard_library_at_8k():
    _check("pystdlib", 8000)


@pytest.mark.slow
@pytest.mark.parametrize("vocab", [2000, 8000, 32000])
@pytest.mark.parametrize("name", ["shakespeare", "pystdlib"])
def test_wordpiece_matches_tokenizers_on_both_corpora_at_every_size(name, vocab):
    _check(name, vocab)


def test_a_word_that_begins_with_the_continuation_prefix_decodes_back():
    """'####' is a word-initial '#' and continuations, never the continuation piece '##' + '##' read at the
    start of a word (which would decode to fewer characters than it consumed)."""
    from archlab.tokenizer.wordpiece import wordpiece_from_counts

    words = {"####": 50, "##": 40, "#": 30, "ab": 20, "Ġ##": 10}
    tok = wordpiece_from_counts(words, 600)
    for text in ("####", "## ab ####", "#####"):
        assert tok.decode(tok.encode(text)) == text
