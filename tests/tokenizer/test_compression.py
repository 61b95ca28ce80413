"""Each trainer learns a vocabulary that compresses held-out text about as well as HF `tokenizers`'
trainer of the same kind does (bytes per token not more than 10% below), on a real corpus: the Python
standard library's own source (always on disk), 300 KB to train on, 150 KB held out, vocabulary 2,000.
Ours may compress more; a trainer that learns a useless vocabulary (WordPiece's raw likelihood score
filled it with once-seen names: ~1 byte/token) fails."""
from __future__ import annotations

import pytest

import archlab.tokenizer as tk
from archlab.data.corpora import corpus_files
from archlab.tokenizer.wordpiece import train_wordpiece

T = pytest.importorskip("tokenizers")
VOCAB = 2000


@pytest.fixture(scope="module")
def corpus():
    files = [f for f in corpus_files("pystdlib") if "/test" not in str(f) and "idlelib" not in str(f)]
    train, held, size, held_size = [], [], 0, 0
    for f in files:
        if size < 300_000:
            train.append(str(f))
            size += f.stat().st_size
        elif held_size < 150_000:
            held.append(f)
            held_size += f.stat().st_size
    text = "".join(h.read_text(errors="replace") for h in held)
    return train, text, len(text.encode("utf-8"))


def _hf_trainer(kind: str):
    alphabet = T.pre_tokenizers.ByteLevel.alphabet()
    if kind == "wordpiece":
        model = T.models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=10**6)
        trainer = T.trainers.WordPieceTrainer(vocab_size=VOCAB, special_tokens=["[UNK]", "<|endoftext|>"],
                                              initial_alphabet=alphabet)
    elif kind == "bpe":
        model = T.models.BPE()
        trainer = T.trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet)
    else:
        model = T.models.Unigram()
        trainer = T.trainers.UnigramTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                            initial_alphabet=alphabet, unk_token="<|endoftext|>")
    tok = T.Tokenizer(model)
    tok.pre_tokenizer = T.pre_tokenizers.ByteLevel(add_prefix_space=False)   # GPT-2's split, as ours
    return tok, trainer


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "unigram"])
def test_bytes_per_token_is_within_10_percent_of_tokenizers(corpus, kind):
    train, held, n_bytes = corpus
    ours = tk.train(train, VOCAB, ["<|endoftext|>"], kind=kind, num_workers=1)
    theirs, trainer = _hf_trainer(kind)
    theirs.train(train, trainer)
    ours_bpt = n_bytes / len(ours.encode(held))
    theirs_bpt = n_bytes / len(theirs.encode(held).ids)
    assert ours_bpt >= 0.9 * theirs_bpt, f"{kind}: {ours_bpt:.3f} vs tokenizers {theirs_bpt:.3f} bytes/token"
    assert ours.decode(ours.encode(held)) == held                 # and still lossless


def test_the_old_wordpiece_score_would_have_failed_the_guard(corpus):
    train, held, n_bytes = corpus
    old = train_wordpiece(train, VOCAB, ["<|endoftext|>"], score="likelihood", min_pair_frequency=1, num_workers=1)
    new = train_wordpiece(train, VOCAB, ["<|endoftext|>"], num_workers=1)
    old_bpt, new_bpt = n_bytes / len(old.encode(held)), n_bytes / len(new.encode(held))
    assert old_bpt < 0.6 * new_bpt
    used = len(set(new.encode(held)))
    assert used > VOCAB // 2            # the vocabulary is used, not filled with once-seen names
