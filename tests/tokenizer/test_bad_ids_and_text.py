"""Every tokenizer kind treats bad ids and unencodable text the same way: an id outside the vocabulary is
one TokenIdError naming it; a lone surrogate encodes as U+FFFD (as tiktoken does)."""
from __future__ import annotations

import pytest

import archlab.tokenizer as tk
from archlab.data.corpora import corpus_files
from archlab.data.tokenizer_adapter import ByteTokenizer
from archlab.tokenizer.base import TokenIdError


@pytest.fixture(scope="module")
def every_kind():
    files = [str(f) for f in corpus_files("pystdlib")[:5]]
    kinds = {k: tk.train(files, 600, ["<|endoftext|>"], kind=k, num_workers=1) for k in ("bpe", "wordpiece",
                                                                                         "unigram")}
    kinds["bytes"] = ByteTokenizer()
    kinds["hf"] = _through_tokenizers(kinds["bpe"])
    return kinds


def _through_tokenizers(tok):
    """The same BPE read by the `tokenizers` library (archlab's HFTokenizer wrapper)."""
    import tempfile

    pytest.importorskip("tokenizers")
    from archlab.tokenizer.hf_wrapper import HFTokenizer
    folder = tempfile.mkdtemp()
    tok.save(folder)
    return HFTokenizer.from_file(folder)


@pytest.mark.parametrize("kind", ["bpe", "wordpiece", "unigram", "bytes", "hf"])
@pytest.mark.parametrize("bad", [-1, 10**6])
def test_an_id_outside_the_vocabulary_is_one_clear_error(every_kind, kind, bad):
    with pytest.raises(TokenIdError, match=f"token id {bad} is outside"):
        every_kind[kind].decode([65, bad])


@pytest.mark.parametrize("kind", ["bpe", "wordpiece", "unigram", "bytes", "hf"])
def test_a_lone_surrogate_encodes_as_the_replacement_character(every_kind, kind):
    tok = every_kind[kind]
    assert tok.encode("a\ud800b") == tok.encode("a\ufffdb")
    assert tok.decode(tok.encode("a\ud800b")) == "a\ufffdb"
