"""`data prepare` refuses a corpus that holds no text before writing anything: every file empty (or, from an
iterable, every document), a binary file (a NUL byte, or mostly bytes that are not UTF-8); text in a legacy
encoding with a few odd bytes still prepares, with the warning that counts them."""
from __future__ import annotations

import random

import pytest

from archlab.data.prepare import prepare
from archlab.errors import DataError


def _refused(tmp_path, corpus, match):
    out = tmp_path / "out"
    with pytest.raises(DataError, match=match):
        prepare(corpus, "bytes", out, num_workers=0, progress=False)
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith("out")] == []


def test_an_empty_corpus_is_refused(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("")
    (tmp_path / "c" / "b.txt").write_text("")
    _refused(tmp_path, tmp_path / "c", r"holds no text: all its files are empty")
    _refused(tmp_path, ["", ""], r"the corpus <iterable> holds no text")


def test_random_bytes_are_refused_as_binary(tmp_path):
    (tmp_path / "c").mkdir()
    noise = random.Random(0).randbytes(50_000)
    (tmp_path / "c" / "noise.txt").write_bytes(noise)
    _refused(tmp_path, tmp_path / "c", r"noise\.txt is binary, not text \(a NUL byte at offset")
    (tmp_path / "c" / "noise.txt").write_bytes(noise.replace(b"\0", b"\x80"))   # no NUL: the share decides
    _refused(tmp_path, tmp_path / "c", r"noise\.txt: \d+% of its bytes are not UTF-8 \(more than 10%\)")


def test_latin1_text_with_a_few_accents_still_prepares_with_a_warning(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "fr.txt").write_bytes(("Le caf\u00e9 est ferm\u00e9 le dimanche. " * 200).encode("latin-1"))
    with pytest.warns(UserWarning, match="not UTF-8, replaced by U\\+FFFD"):
        meta = prepare(tmp_path / "c", "bytes", tmp_path / "out", num_workers=0, progress=False)
    assert sum(s["tokens"] for s in meta["splits"].values()) > 0
