"""BPE Tokenizer: round trips, special tokens, tiktoken fast path, streaming, tokenizer.json interop."""
from __future__ import annotations

import json
import random
import tracemalloc

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from archlab.tokenizer import Tokenizer, bpe_from_counts, load
from archlab.tokenizer.bpe_train import count_file_pretokens
from archlab.tokenizer.pretokenize import GPT2_PATTERN

tokenizers = pytest.importorskip("tokenizers")

EOT = "<|endoftext|>"
CORPUS = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
    "def main(argv):\n    for i in range(10):\n        print(f'{i}: {argv!r}')  # it's done\n"
    "Ünïcödé tèxt — 日本語のテキスト, emoji 😀🎉, numbers 12345 67.89, tabs\tand  double  spaces.\n"
) * 40 + EOT + "the end" + EOT


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "c.txt"
    path.write_text(CORPUS, encoding="utf-8")
    counts = count_file_pretokens(path, [EOT], num_workers=1)
    vocab, merges = bpe_from_counts(counts, 600, [EOT])
    return vocab, merges


@pytest.fixture(scope="module")
def tok(trained):
    return Tokenizer(*trained, special_tokens=[EOT])


@pytest.fixture(scope="module")
def slow_tok(trained):
    return Tokenizer(*trained, special_tokens=[EOT], fast=False)


TEXTS = [
    "", " ", "hello", "Hello world! It's 2024.", "  leading and trailing  ", "\n\n\n", "a\r\nb",
    "日本語 😀 emoji", CORPUS[:3000], f"x{EOT}y", EOT, EOT * 3, "don't you'll we've I'm",
]


@settings(max_examples=150, deadline=None)
@given(st.text())
def test_round_trip_arbitrary_unicode(tok, text):
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(list("ab \n😀é<|>") + ["<|endoftext|>", "<|end", "  "]), max_size=60).map("".join))
def test_fast_path_equals_pure_python(tok, slow_tok, text):
    assert tok.uses_fast_path
    assert tok.encode(text) == slow_tok.encode(text)


def test_fast_path_equals_pure_python_on_text(tok, slow_tok):
    assert not slow_tok.uses_fast_path
    for text in TEXTS:
        assert tok.encode(text) == slow_tok.encode(text)


def test_fast_path_falls_back_without_tiktoken(trained, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "tiktoken":
            raise ImportError("no tiktoken")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    t = Tokenizer(*trained, special_tokens=[EOT])
    assert t.fast_path_reason() == "tiktoken is not installed"
    assert t.decode(t.encode(CORPUS[:500])) == CORPUS[:500]


def test_special_tokens_encode_to_their_ids(tok):
    eot = tok.eot_id
    assert tok.token_to_id(EOT) == eot == 0
    assert tok.encode(EOT) == [eot]
    assert tok.encode(EOT * 3) == [eot] * 3
    ids = tok.encode(f"a{EOT}b")
    assert ids == tok.encode("a") + [eot] + tok.encode("b")
    assert tok.decode(ids) == f"a{EOT}b"


def test_overlapping_special_tokens_longest_match_wins(trained):
    specials = ["<|a|>", "<|a|><|a|>", "<|a"]
    t = Tokenizer(*trained, special_tokens=specials)
    one, two, prefix = (t.token_to_id(s) for s in specials)
    assert len({one, two, prefix}) == 3
    assert t.encode("<|a|><|a|>") == [two]
    assert t.encode("<|a|><|a|><|a|>") == [two, one]
    assert t.encode("<|ab") == [prefix] + t.encode("b")
    assert t.decode(t.encode("x<|a|><|a|>y<|a")) == "x<|a|><|a|>y<|a"


def test_without_special_tokens_the_text_is_ordinary(trained):
    t = Tokenizer(*trained)
    ids = t.encode(EOT)
    assert len(ids) > 1 and t.decode(ids) == EOT


def test_invalid_utf8_decodes_to_replacement_character(tok):
    byte_id = tok.token_to_id(b"\xe6")
    assert tok.decode([byte_id]) == "\ufffd"
    assert tok.decode(tok.encode("ok") + [byte_id]) == "ok\ufffd"


def test_encode_matches_merge_rule_on_training_words(trained, tok):
    vocab, merges = trained
    # A merged token's own text encodes to that single token.
    for k in range(0, len(merges), 17):
        a, b = merges[k]
        tid = tok.token_to_id(a + b)
        assert tok.encode((a + b).decode("utf-8", errors="strict")) == [tid] if _valid(a + b) else True


def _valid(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    # a single pre-token only
    return len(regex.findall(GPT2_PATTERN, b.decode("utf-8"))) == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(list("ab \n\t😀.'s") + [EOT, "<|end", "  "]), max_size=120).map("".join),
       st.integers(1, 7), st.integers(0, 40))
def test_encode_iterable_equals_encode(slow_tok, text, n_pieces, buffer_chars):
    rng = random.Random(len(text) * 31 + n_pieces)
    cuts = sorted(rng.randint(0, len(text)) for _ in range(n_pieces))
    chunks = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
    assert list(slow_tok.encode_iterable(chunks, buffer_chars=buffer_chars)) == slow_tok.encode(text)


def test_encode_iterable_has_bounded_memory(slow_tok):
    lines = [line + "\n" for line in CORPUS.splitlines()]
    slow_tok.encode("".join(lines))  # warm the pre-token cache

    def peak_while_streaming(n_lines: int) -> tuple[int, int]:
        tracemalloc.start()
        count = sum(1 for _ in slow_tok.encode_iterable(lines[i % len(lines)] for i in range(n_lines)))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return peak, count

    small_peak, small_count = peak_while_streaming(4_000)
    big_peak, big_count = peak_while_streaming(32_000)  # ~800 KB of text, never held at once
    big_chars = sum(len(lines[i % len(lines)]) for i in range(32_000))
    assert big_count > 7.5 * small_count
    assert big_peak < 1.3 * small_peak + 20_000, (small_peak, big_peak)  # does not grow with the stream
    assert big_peak < 0.6 * big_chars, (big_peak, big_chars)


def test_save_load_round_trip(tok, tmp_path):
    tok.save(tmp_path / "t")
    assert {p.name for p in (tmp_path / "t").iterdir()} >= {"tokenizer.json", "vocab.json", "merges.txt"}
    again = load(tmp_path / "t")
    assert type(again) is Tokenizer
    assert again.vocab == tok.vocab and again.merges == tok.merges and again.special_tokens == [EOT]
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)
    from_files = Tokenizer.from_files(tmp_path / "t" / "vocab.json", tmp_path / "t" / "merges.txt", [EOT])
    assert from_files.vocab == tok.vocab and from_files.merges == tok.merges
    for text in TEXTS:
        assert from_files.encode(text) == tok.encode(text)


def test_saved_tokenizer_json_loads_in_hf_tokenizers_with_identical_ids(tok, tmp_path):
    tok.save(tmp_path)
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert hf.get_vocab_size() == tok.vocab_size
    for text in TEXTS:
        assert hf.encode(text).ids == tok.encode(text), text


def _hf_trained(merges_as_strings: bool, tmp_path, specials=(EOT, "<pad>")):
    from tokenizers import decoders, models, pre_tokenizers, trainers
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator([CORPUS], trainer)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    data = json.loads(path.read_text(encoding="utf-8"))
    if merges_as_strings:
        data["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    else:
        data["model"]["merges"] = [m.split(" ") if isinstance(m, str) else m for m in data["model"]["merges"]]
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return tokenizers.Tokenizer.from_file(str(path)), path


@pytest.mark.parametrize("merges_as_strings", [True, False], ids=["a b strings", "pairs"])
def test_loads_hf_byte_level_bpe_with_identical_ids(tmp_path, merges_as_strings):
    hf, path = _hf_trained(merges_as_strings, tmp_path)
    ours = load(tmp_path)
    assert ours.vocab_size == hf.get_vocab_size()
    texts = TEXTS + [f"{EOT}<pad>{EOT}", "<pad>x<pad>"]
    for text in texts:
        assert ours.encode(text) == hf.encode(text).ids, text
        assert ours.decode(ours.encode(text)) == text
    slow = load(path, fast=False)
    for text in texts:
        assert slow.encode(text) == hf.encode(text).ids


def test_hf_file_saved_again_is_equivalent(tmp_path):
    hf, _ = _hf_trained(False, tmp_path / "a")
    ours = load(tmp_path / "a")
    ours.save(tmp_path / "b")
    hf2 = tokenizers.Tokenizer.from_file(str(tmp_path / "b" / "tokenizer.json"))
    for text in TEXTS:
        assert hf2.encode(text).ids == hf.encode(text).ids


def test_unsupported_tokenizer_json_is_rejected(tmp_path):
    from tokenizers import models, normalizers, pre_tokenizers
    hf = tokenizers.Tokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    hf.normalizer = normalizers.Lowercase()
    hf.pre_tokenizer = pre_tokenizers.ByteLevel()
    hf.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="normalizer"):   # archlab's own reader refuses it ...
        load(tmp_path, hf_fallback=False)
    assert type(load(tmp_path)).__name__ == "HFTokenizer"  # ... and `tokenizers` reads it instead


def test_vocab_lookups(tok):
    assert tok.vocab_size == 257 + len(tok.merges) and len(tok.merges) > 100
    assert tok.token_to_id(b"a") == tok.encode("a")[0]
    assert tok.token_to_id("a") == tok.token_to_id(b"a")
    assert tok.token_to_id(b"\x00\x01\x02 not a token") is None
    assert tok.special_token_id(EOT) == tok.eot_id
