"""Sentence boundaries in prepared data (prepare(sentences=True) / --sentences): the splitting rule, the claim that
encoding sentence by sentence gives the document's ids for the tokenizers archlab trains (and a loud stop where a
tokenizer breaks it), and the {split}.sentences.bin index: each sentence starts where the rule says, documents
start sentences, the index follows a document moved between splits, and folders without it load as before."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from archlab.data.prepare import prepare, split_sentences
from archlab.data.tokenizer_adapter import ByteTokenizer
from archlab.data.tokens import TokenDataset
from archlab.errors import DataError
from archlab.tokenizer import train as train_tokenizer

DOCS = [
    'He said "Stop!" Then he left. Did she? Yes (she did.)  Really.\n\nA new paragraph\nwith a line break',
    "Dr. Smith paid 3.14 dollars... then\n \n\tindented text! «Quoted?» ‘Single.’ End",
    "One sentence without an end",
    "  leading spaces. Trailing spaces.   ",
    "Ünïcödé café. 東京へ行く。 Next one! \r\n\r\nWindows lines. Tabs\t. Done?",
]
SPECIALS = ["<|endoftext|>", "[MASK]", "[CLS]", "[SEP]", "[PAD]"]


@pytest.mark.parametrize("text,sentences", [
    ("Hi. Bye.", ["Hi.", " Bye."]),
    ('He said "Stop!" Then', ['He said "Stop!"', " Then"]),
    ("(Really.)  Next", ["(Really.)", "  Next"]),
    ("para one\n\npara two", ["para one", "\n\npara two"]),
    ("para one\n \t\npara two", ["para one", "\n \t\npara two"]),
    ("one line\nnext line", ["one line\nnext line"]),          # a single newline is no boundary
    ("3.14 and e.g.x", ["3.14 and e.g.x"]),                    # no whitespace after the stop: no boundary
    ("End.  ", ["End.  "]),                                    # trailing whitespace stays with the last sentence
    ("Wait... what?! Ok", ["Wait...", " what?!", " Ok"]),
    ("", [""]),
])
def test_sentences_end_after_stops_and_at_blank_lines(text, sentences):
    assert split_sentences(text) == sentences


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab .!?\"')\n\t\u00a0\u2028»")), max_size=60))
def test_sentences_join_to_the_text_and_cut_only_before_whitespace(text):
    parts = split_sentences(text)
    assert "".join(parts) == text
    for left, right in zip(parts, parts[1:]):
        assert left and right and not left[-1].isspace() and right[0].isspace()


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    (root / "corpus.txt").write_text("\n".join(DOCS * 3))
    return {kind: train_tokenizer([root / "corpus.txt"], 600, SPECIALS, kind=kind)
            for kind in ("bpe", "wordpiece", "unigram")} | {"bytes": ByteTokenizer()}


@pytest.mark.parametrize("kind", ["bpe", "wordpiece", "unigram", "bytes"])
def test_sentence_ids_back_to_back_equal_the_documents(tokenizers, kind):
    tok = tokenizers[kind]
    for doc in DOCS:
        joined = [i for sentence in split_sentences(doc) for i in tok.encode(sentence)]
        assert joined == list(tok.encode(doc))


def _sentences_of(data_dir: Path, split: str) -> list[list[int]]:
    ds = TokenDataset(data_dir, split)
    starts = np.asarray(ds.sentence_starts)
    ends = np.append(starts[1:], ds.n_tokens)
    return [np.asarray(ds.tokens[a:b]).tolist() for a, b in zip(starts, ends)]


@pytest.mark.parametrize("kind", ["bpe", "wordpiece"])
def test_index_round_trips_the_sentences_of_every_document(tokenizers, tmp_path, kind):
    tok = tokenizers[kind]
    meta = prepare(DOCS, tok, tmp_path / "d", sentences=True, num_workers=0, progress=False, val_fraction=0.3)
    assert meta["sentences"] is True
    eot = meta["eot_id"]
    expected = {}      # the first id run of each document -> its sentences' ids (the last one with the eot)
    for doc in DOCS:
        pieces = [tok.encode(s) for s in split_sentences(doc)]
        pieces[-1] = pieces[-1] + [eot]
        expected[tuple(pieces[0])] = pieces
    seen = 0
    for split in ("train", "val"):
        got = _sentences_of(tmp_path / "d", split)
        assert len(got) == meta["splits"][split]["sentences"]
        doc_starts = [0] + [i + 1 for i, s in enumerate(got) if s[-1] == eot][:-1]
        for a, b in zip(doc_starts, doc_starts[1:] + [len(got)]):
            assert got[a:b] == expected[tuple(got[a])]
            seen += 1
    assert seen == len(DOCS)
    stored = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert stored["sentences"] is True and stored["splits"]["train"]["sentence_file"] == "train.sentences.bin"


def test_workers_write_the_same_index(tokenizers, tmp_path):
    tok = tokenizers["bpe"]
    for workers in (0, 2):
        prepare(DOCS * 4, tok, tmp_path / f"w{workers}", sentences=True, num_workers=workers, progress=False)
    for split in ("train", "val"):
        a = (tmp_path / "w0" / f"{split}.sentences.bin").read_bytes()
        assert a == (tmp_path / "w2" / f"{split}.sentences.bin").read_bytes() and a


def test_a_document_moved_into_val_takes_its_sentences(tmp_path):
    """val_fraction tiny: no document draws val, so the lowest-scoring one moves over with its sentences."""
    docs = ["A b. C d. E f.", "G h! I j?", "K l.\n\nM n.", "O p. Q r."]
    meta = prepare(docs, "bytes", tmp_path / "d", sentences=True, num_workers=0, progress=False,
                   val_fraction=1e-12)
    assert meta["splits"]["val"]["documents"] == 1
    texts = []
    for split in ("train", "val"):
        for ids in _sentences_of(tmp_path / "d", split):
            texts.append(bytes(i for i in ids if i < 256).decode())
    assert sorted(texts) == sorted(s for d in docs for s in split_sentences(d))
    assert meta["splits"]["train"]["sentences"] + meta["splits"]["val"]["sentences"] == 9


def test_folders_without_the_index_load_and_a_short_index_is_named(tmp_path):
    prepare(DOCS, "bytes", tmp_path / "plain", num_workers=0, progress=False)
    assert TokenDataset(tmp_path / "plain", "train").sentence_starts is None
    assert not list((tmp_path / "plain").glob("*.sentences.bin"))
    assert "sentences" not in json.loads((tmp_path / "plain" / "meta.json").read_text())
    prepare(DOCS, "bytes", tmp_path / "s", sentences=True, num_workers=0, progress=False)
    path = tmp_path / "s" / "train.sentences.bin"
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(DataError, match="sentence starts"):
        TokenDataset(tmp_path / "s", "train")


def test_a_tokenizer_that_does_not_cut_at_whitespace_stops_prepare(tmp_path):
    """Llama 2's tokenizer.json normalizes every text it encodes to "▁" + text with spaces as "▁": " There."
    encoded alone becomes "▁▁There.", one "▁" more than the document has there."""
    tokenizers_lib = pytest.importorskip("tokenizers")
    from tokenizers import models, normalizers

    text = "Hi. There."
    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(sorted(set(text.replace(" ", "▁") + "▁")))}}
    hf = tokenizers_lib.Tokenizer(models.BPE(vocab, []))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.add_special_tokens(["<|endoftext|>"])
    (tmp_path / "tok").mkdir()
    hf.save(str(tmp_path / "tok" / "tokenizer.json"))
    prepare([text], tmp_path / "tok", tmp_path / "plain", num_workers=0, progress=False)   # fine without
    with pytest.raises(DataError, match="does not cut at whitespace") as err:
        prepare([text], tmp_path / "tok", tmp_path / "d", sentences=True, num_workers=0, progress=False)
    assert "\n" not in str(err.value) and "HFTokenizer" in str(err.value)
    assert not (tmp_path / "d").exists()


def test_cli_prepare_sentences(tmp_path, capsys):
    from archlab.cli import main

    corpus = tmp_path / "c"
    corpus.mkdir()
    for i, doc in enumerate(DOCS):
        (corpus / f"{i}.txt").write_text(doc)
    assert main(["data", "prepare", "--corpus", str(corpus), "--tokenizer", "bytes", "--out",
                 str(tmp_path / "d"), "--workers", "0", "--quiet", "--sentences"]) == 0
    assert "sentences" in capsys.readouterr().out
    ds = TokenDataset(tmp_path / "d", "train")
    assert ds.sentence_starts is not None and len(ds.sentence_starts) == ds.meta["splits"]["train"]["sentences"]
