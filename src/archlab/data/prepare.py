"""Preparing a token data folder: a corpus tokenized in worker processes into one flat file per split, split by
document (a seeded hash of its text), with meta.json and a copy of the tokenizer; optionally a sentence index.
The layout and the split rule are described in data/tokens.py, which reads what this writes. The writers and the
worker pool here also serve the pairs (data/seq2seq.py) and chat (data/chat.py) preparers.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import warnings
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import regex

from archlab.data import corpora
from archlab.data.tokenizer_adapter import EOT_TOKEN, load_tokenizer, special_token_id, vocab_size_of
from archlab.data.tokens import FORMAT_VERSION, META_FILE, SENTENCES_SUFFIX, SPLITS, load_meta
from archlab.errors import DataError
from archlab.faults import fault_point
from archlab.runs.outputs import check_output, fresh_output

__all__ = ["prepare", "split_sentences", "input_paths", "SplitWriter", "encoded", "default_workers", "doc_score",
           "split_by_line", "held_out_indices", "checked_output", "write_json"]

# a sentence ends after . ! ? (and closing quotes / brackets), or before a blank line, when more text follows
_SENTENCE_CUT = regex.compile(r"""(?:[.!?]["'\)\]}\u00bb\u201d\u2019]*|\S(?=[^\S\n]*\n[^\S\n]*\n))(?=\s+\S)""")


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


# --------------------------------------------------------------------------- prepare: workers
# Set once per worker process (Pool initializer) so the tokenizer is sent once, not with every batch.
_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: Any, seed: int, dtype: np.dtype, sentences: bool = False) -> None:
    _WORKER.update(tokenizer=tokenizer, seed=seed, dtype=dtype, vocab_size=vocab_size_of(tokenizer),
                   sentences=sentences)


def doc_score(data: bytes, seed: int) -> float:
    """A uniform number in [0, 1) from the seed and the document's bytes: decides its split."""
    h = hashlib.blake2b(digest_size=8)
    h.update(int(seed).to_bytes(8, "little", signed=True))
    h.update(data)
    return int.from_bytes(h.digest(), "little") / 2.0**64


def split_by_line(path: Path, examples: list, seed: int, val_fraction: float) -> tuple[list, list]:
    """(train, val): an example is validation when a seeded hash of its line's text is below val_fraction; with
    two or more examples neither split is empty (the one nearest the threshold moves over). `examples`: anything
    with a 1-based `.line` in `path`. Example: train, val = split_by_line(Path("sft.jsonl"), examples, 0, 0.05)"""
    lines = path.read_bytes().splitlines()
    scores = [doc_score(lines[e.line - 1], seed) for e in examples]
    is_val = [s < val_fraction for s in scores]
    if len(examples) >= 2 and val_fraction > 0:
        if not any(is_val):
            is_val[min(range(len(scores)), key=scores.__getitem__)] = True
        elif all(is_val):
            is_val[max(range(len(scores)), key=scores.__getitem__)] = False
    return ([e for e, v in zip(examples, is_val) if not v], [e for e, v in zip(examples, is_val) if v])


def held_out_indices(path: Path, examples: list, seed: int, val_fraction: float) -> list[int]:
    """The indices of the `examples` held out for validation: those whose line split_by_line holds out, so every
    example of a held-out line goes with it (a preference pair's two sides as KTO's completions); [] when
    val_fraction <= 0 (the file is not read). Example: held_out_indices(Path("prefs.jsonl"), data.pairs, 0, 0.1)"""
    if val_fraction <= 0:
        return []
    lines = {e.line for e in split_by_line(path, examples, seed, val_fraction)[1]}
    return [i for i, e in enumerate(examples) if e.line in lines]


def _encode_batch(texts: list[str]) -> list[tuple[np.ndarray, float, int, np.ndarray | None]]:
    """(ids, split score, UTF-8 byte count, sentence starts or None) per document, in order."""
    tokenizer, seed, dtype, vocab_size = (_WORKER[k] for k in ("tokenizer", "seed", "dtype", "vocab_size"))
    out = []
    for text in texts:
        data = text.encode("utf-8", errors="surrogatepass")
        ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise DataError(f"the tokenizer produced id {int(ids.max())} outside vocab_size={vocab_size}")
        starts = _sentence_starts(tokenizer, text, ids) if _WORKER.get("sentences") else None
        out.append((ids.astype(dtype), doc_score(data, seed), len(data), starts))
    return out


def split_sentences(text: str) -> list[str]:
    """A document's sentences (the rule: module docstring), whitespace kept with the sentence after it, so that
    "".join(split_sentences(text)) == text.
    Example: split_sentences('Hi. "Bye!"\\n\\nNew') -> ['Hi.', ' "Bye!"', '\\n\\nNew']"""
    cuts = [m.end() for m in _SENTENCE_CUT.finditer(text)]
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _sentence_starts(tokenizer: Any, text: str, ids: np.ndarray) -> np.ndarray:
    """(n,) int64 offsets into `ids` where the document's sentences start (0 first; a sentence that encodes to
    no ids has none). A DataError where the sentences' ids back to back are not the document's."""
    pieces = [np.asarray(tokenizer.encode(s), dtype=np.int64) for s in split_sentences(text)]
    if not np.array_equal(np.concatenate(pieces), ids):
        raise DataError(f"{type(tokenizer).__name__} encodes the sentences of {text[:40]!r}... differently from "
                        "the whole document (it does not cut at whitespace): prepare without --sentences")
    starts = np.unique(np.cumsum([0] + [p.size for p in pieces[:-1]]))
    return starts[(starts == 0) | (starts < ids.size)]


# A unit of work sent to a tokenizing process: at most this many documents / characters.
BATCH_DOCS, BATCH_CHARS = 512, 1 << 20


def _batched(docs: Iterable[str]) -> Iterator[list[str]]:
    max_docs, max_chars = BATCH_DOCS, BATCH_CHARS
    batch: list[str] = []
    chars = 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if chars >= max_chars or len(batch) >= max_docs:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def encoded(docs: Iterable[str], tokenizer: Any, seed: int, dtype: np.dtype, num_workers: int,
             sentences: bool = False) -> Iterator[list[tuple[np.ndarray, float, int, np.ndarray | None]]]:
    """Encoded batches in corpus order. At most 2 * num_workers batches are in flight, so memory stays
    bounded however long the corpus (Pool.imap would read the whole input ahead)."""
    if num_workers <= 1:
        _init_worker(tokenizer, seed, dtype, sentences)
        for batch in _batched(docs):
            yield _encode_batch(batch)
        return
    import multiprocessing

    pool = multiprocessing.Pool(num_workers, initializer=_init_worker, initargs=(tokenizer, seed, dtype, sentences))
    pending: deque = deque()
    try:
        for batch in _batched(docs):
            pending.append(pool.apply_async(_encode_batch, (batch,)))
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
    finally:
        _shut(pool, pending)


def _shut(pool: Any, pending: deque, patience_s: float = 60.0) -> None:
    """Let the batches in flight finish, then close the pool. Pool.terminate (what `with Pool` does) kills
    workers that may hold the result queue's lock mid-write, and its task thread then waits on that lock
    forever; a generator closed early (a consumer that stopped reading) would hang there. Terminate only
    when the workers do not finish within `patience_s` (a worker lost to a signal)."""
    deadline = time.monotonic() + patience_s
    for result in pending:
        result.wait(max(0.0, deadline - time.monotonic()))
    if all(result.ready() for result in pending):
        pool.close()
    else:
        pool.terminate()
    pool.join()


def default_workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


# --------------------------------------------------------------------------- prepare
class SplitWriter:
    """Appends documents (ids + eot) to one split file and counts tokens, bytes and documents; with
    `sentences`, their sentence starts (split-wide int64 offsets) to {split}.sentences.bin beside it."""

    def __init__(self, path: Path, eot: np.ndarray, sentences: bool = False) -> None:
        self.path, self.eot = path, eot
        self.file = open(path, "wb")
        self.tokens = self.bytes = self.documents = self.sentences = 0
        self.sentence_path = path.with_name(path.stem + SENTENCES_SUFFIX) if sentences else None
        self.sentence_file = open(self.sentence_path, "wb") if self.sentence_path else None

    def write(self, ids: np.ndarray, n_bytes: int, starts: np.ndarray | None = None) -> tuple[int, int]:
        start = self.tokens
        self.file.write(ids.tobytes())
        self.file.write(self.eot.tobytes())
        if self.sentence_file is not None and starts is not None:
            self.sentence_file.write((starts + start).astype("<i8").tobytes())
            self.sentences += len(starts)
        self.tokens += ids.size + 1
        self.bytes += n_bytes
        self.documents += 1
        return start, self.tokens

    def close(self) -> None:
        self.file.close()
        if self.sentence_file is not None:
            self.sentence_file.close()


def _move_document(src: SplitWriter, dst: SplitWriter, start: int, end: int, n_bytes: int) -> None:
    """Move tokens [start, end) of a closed split file to the end of another, in bounded-size chunks."""
    itemsize, chunk = src.eot.itemsize, 1 << 24
    with open(src.path, "rb") as fs, open(dst.path, "ab") as fd:
        fs.seek(start * itemsize)
        left = (end - start) * itemsize
        while left:
            data = fs.read(min(chunk, left))
            fd.write(data)
            left -= len(data)
    with open(src.path, "r+b") as f:  # shift the tail left over the moved document
        read, write = end * itemsize, start * itemsize
        while True:
            f.seek(read)
            data = f.read(chunk)
            if not data:
                break
            f.seek(write)
            f.write(data)
            read, write = read + len(data), write + len(data)
        f.truncate(write)
    if src.sentence_path is not None and dst.sentence_path is not None:
        _move_sentences(src, dst, start, end)
    for writer, sign in ((src, -1), (dst, 1)):
        writer.tokens += sign * (end - start)
        writer.bytes += sign * n_bytes
        writer.documents += sign


def _move_sentences(src: SplitWriter, dst: SplitWriter, start: int, end: int) -> None:
    """_move_document's sentence starts: those in [start, end) go to the end of dst's file (at dst's end), and
    src's later ones move back by end - start, in bounded-size chunks. Before the token counts change."""
    assert src.sentence_path is not None and dst.sentence_path is not None
    offsets = np.memmap(src.sentence_path, dtype="<i8", mode="r+")   # src holds >= 1 document: not empty
    lo, hi = (int(i) for i in np.searchsorted(offsets, [start, end]))
    with open(dst.sentence_path, "ab") as f:
        f.write((offsets[lo:hi] - start + dst.tokens).tobytes())
    chunk, moved = 1 << 21, hi - lo
    for i in range(hi, len(offsets), chunk):
        block = offsets[i:i + chunk] - (end - start)
        offsets[i - moved:i - moved + len(block)] = block
    offsets.flush()
    del offsets
    os.truncate(src.sentence_path, (src.sentences - moved) * 8)
    src.sentences -= moved
    dst.sentences += moved


def input_paths(corpus: Any, tokenizer: Any) -> list[str | os.PathLike]:
    """The paths a prepare reads (a corpus file or folder, a tokenizer folder), for runs.outputs.check_output:
    built-in corpus names, hf: ids, "bytes" and in-memory objects are not paths."""
    found: list[str | os.PathLike] = []
    if isinstance(corpus, (str, os.PathLike)):
        name = os.fspath(corpus)
        if name not in corpora.BUILTIN_CORPORA and not name.startswith("hf:"):
            found.append(corpus)
    if isinstance(tokenizer, (str, os.PathLike)) and tokenizer != "bytes":
        found.append(tokenizer)
    return found


def checked_output(out_dir: str | os.PathLike, tokenizer: Any, eot_token: str, val_fraction: float,
                    overwrite: bool, inputs: list[str | os.PathLike]) -> tuple[Path, Any, int, int, np.dtype]:
    """The checks a prepare runs before any work (here and in archlab.data.seq2seq):
    (out folder, tokenizer, vocab_size, end-of-text id, token dtype). `inputs`: what it reads (input_paths),
    which the output may not be, hold or sit inside."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction} must be in [0, 1)")
    out = Path(out_dir).expanduser()
    check_output(out, inputs=inputs, overwrite=overwrite)
    tok = load_tokenizer(tokenizer)
    if not callable(getattr(tok, "save", None)):
        raise DataError(f"{type(tok).__name__} has no save(dir): the data folder must carry its tokenizer")
    vocab_size = vocab_size_of(tok)
    return out, tok, vocab_size, special_token_id(tok, eot_token), _token_dtype(vocab_size)


def prepare(
    corpus: str | os.PathLike | Iterable[str],
    tokenizer: Any,
    out_dir: str | os.PathLike,
    *,
    val_fraction: float = 0.05,
    seed: int = 0,
    num_workers: int | None = None,
    eot_token: str = EOT_TOKEN,
    text_field: str = "text",
    overwrite: bool = False,
    progress: bool = True,
    corpus_name: str | None = None,
    sentences: bool = False,
) -> dict:
    """Tokenize a corpus into `out_dir` (train.bin, val.bin, meta.json, tokenizer/) and return the meta.

    corpus: a name or path for `archlab.data.corpora.iter_documents`, or any iterable of document strings.
    tokenizer: "bytes", a tokenizer folder, or an object with encode / vocab_size / token_to_id / save.
    num_workers: processes that tokenize (None: the usable CPUs, at most 8; 0 or 1: this process).
    sentences: also write each split's sentence starts ({split}.sentences.bin; module docstring), for
    next-sentence prediction (archlab.data.next_sentence.next_sentence_for).
    The folder is built beside out_dir under a temporary name and renamed into place at the end, so
    a crash never leaves a folder that looks complete. An existing out_dir is an error unless overwrite.
    """
    inputs = input_paths(corpus, tokenizer)
    out, tok, vocab_size, eot_id, dtype = checked_output(out_dir, tokenizer, eot_token, val_fraction, overwrite,
                                                          inputs)
    report = None
    if isinstance(corpus, (str, os.PathLike)):
        name = corpus_name or os.fspath(corpus)
        docs: Iterable[str] = corpora.iter_documents(corpus, text_field=text_field)
        if not name.startswith("hf:"):
            files = corpora.corpus_files(corpus)
            report = corpora.scan_files(files)
            try:
                corpora.refuse_non_text(files, report)         # before anything is written
            except corpora.CorpusError as exc:
                raise DataError(f"{name}: {exc}") from None
            if not report.clean:
                warnings.warn(report.summary(), stacklevel=2)
    else:
        name, docs = corpus_name or "<iterable>", corpus
    workers = default_workers() if num_workers is None else max(0, int(num_workers))

    # built beside `out` and renamed into place: a crash never leaves a folder that looks complete
    with fresh_output(out, overwrite=overwrite, inputs=inputs) as tmp:
        meta = _write_splits(docs, tok, tmp, dtype=dtype, eot_id=eot_id, seed=seed,
                             val_fraction=val_fraction, workers=workers, progress=progress, sentences=sentences)
        if not any(s["tokens"] for s in meta["splits"].values()):
            raise DataError(f"the corpus {name} holds no text: every document is empty (nothing written)")
        fault_point("prepare:split")
        meta.update(corpus=name, seed=seed, val_fraction=val_fraction, eot_token=eot_token,
                    vocab_size=vocab_size, text_field=text_field,
                    corpus_report=report.to_dict() if report is not None else None)
        (tmp / "tokenizer").mkdir()
        tok.save(tmp / "tokenizer")
        write_json(tmp / META_FILE, ordered_meta(meta))  # written last: its presence marks completeness
    return load_meta(out)


def _write_splits(docs: Iterable[str], tok: Any, tmp: Path, *, dtype: np.dtype, eot_id: int, seed: int,
                  val_fraction: float, workers: int, progress: bool, sentences: bool = False) -> dict:
    from archlab.progress import progress_bar

    eot = np.array([eot_id], dtype=dtype)
    writers = {s: SplitWriter(tmp / f"{s}.bin", eot, sentences) for s in SPLITS}
    # The train document with the lowest score and the val one with the highest: the ones to move
    # if a split ends up empty. (score, start, end, n_bytes)
    lowest_train: tuple | None = None
    highest_val: tuple | None = None
    bar = progress_bar(desc="tokenizing", unit=" docs", disable=not progress, file=sys.stderr)
    try:
        for batch in encoded(docs, tok, seed, dtype, workers, sentences):
            for ids, score, n_bytes, starts in batch:
                if n_bytes == 0:  # an empty document adds nothing, not even an end-of-text
                    continue
                split = "val" if score < val_fraction else "train"
                start, end = writers[split].write(ids, n_bytes, starts)
                record = (score, start, end, n_bytes)
                if split == "train" and (lowest_train is None or score < lowest_train[0]):
                    lowest_train = record
                if split == "val" and (highest_val is None or score > highest_val[0]):
                    highest_val = record
            bar.update(len(batch))
            bar.set_postfix(tokens=writers["train"].tokens + writers["val"].tokens, refresh=False)
    finally:
        bar.close()
        for w in writers.values():
            w.close()
    train, val = writers["train"], writers["val"]
    if train.documents == 0 and highest_val is not None:  # a lone document trains; 2+: keep one for val
        _move_document(val, train, *highest_val[1:])
    elif val.documents == 0 and train.documents >= 2 and val_fraction > 0:
        _move_document(train, val, *lowest_train[1:])
    splits = {s: {"file": w.path.name, "tokens": w.tokens, "bytes": w.bytes, "documents": w.documents}
              for s, w in writers.items()}
    for s, w in writers.items():
        if w.sentence_path is not None:
            splits[s].update(sentence_file=w.sentence_path.name, sentences=w.sentences)
    return {"dtype": dtype.name, "eot_id": eot_id, "splits": splits, **({"sentences": True} if sentences else {})}


def ordered_meta(meta: dict) -> dict:
    head = {"format": "archlab-tokens", "version": FORMAT_VERSION}
    keys = ["corpus", "dtype", "vocab_size", "eot_token", "eot_id", "seed", "val_fraction", "text_field",
            "splits"]
    extra = {"corpus_report": meta["corpus_report"]} if meta.get("corpus_report") else {}
    if meta.get("sentences"):
        extra["sentences"] = True
    return {**head, **{k: meta[k] for k in keys}, **extra, "tokenizer": "tokenizer"}


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)
