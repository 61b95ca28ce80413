"""Token data: a corpus tokenized into flat memmap files, and the batch samplers that read them.

Data folder layout (written by `prepare`, read by `TokenDataset`)::

    DATA_DIR/
      meta.json      dtype, vocab_size, eot id, per-split token / byte / document counts, corpus, seed
      train.bin      every training document's ids followed by the end-of-text id, back to back,
      val.bin        as raw little-endian uint16 (vocab_size <= 65536) or uint32; no header
      tokenizer/     a copy of the tokenizer (`tokenizer.save(dir)`), so the folder describes itself
      train.sentences.bin, val.sentences.bin   (prepare(sentences=True) only) int64 token offsets, raw
                     little-endian, where each sentence of the split starts, ascending; every document's first
                     token starts one; a document's end-of-text closes its last sentence. meta.json then
                     records "sentences": true and each split's count. An optional addition, so the format
                     version stays 1: folders without it load as before (TokenDataset.sentence_starts is None).

Sentences (`split_sentences`): a document is cut where a whitespace run follows . ! or ? (optionally closed by
quotes or brackets) and where a whitespace run holds a blank line; the whitespace goes with the sentence after
it. Every cut sits between a non-space and a space character, which GPT-2's pre-tokenization (byte-level BPE,
and archlab's WordPiece and Unigram, which pre-tokenize alike) never merges across: the sentences' ids, back to
back, equal the document's. prepare checks that for every document and stops, naming the document, where a
tokenizer breaks it (Llama 2's tokenizer.json, which prepends "▁" to every text it encodes, does).

One flat file per split (no shards): `np.memmap` reads any size, and appending is how it is written.
The split is by document: document d goes to validation when
`blake2b(seed, utf8(d)) / 2**64 < val_fraction` -- a function of the seed and the text alone, so it does
not depend on worker count or read order, and exact duplicates never straddle train and val. With two or
more documents both splits hold at least one (the document nearest the threshold moves over).

Sampling is a pure function of (seed, step, rank): the training stream cuts the token file into
non-overlapping windows of seq_len + 1 tokens at a random offset, permuted per epoch; global sample i of
step s is `s * global_batch + i`, and rank r of world_size takes rows [r*B, (r+1)*B) of the global batch,
so a DDP run sees the same global batch as one process with batch B * world_size, and resuming needs only
the step counter.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import regex
import torch

from archlab.data import corpora
from archlab.errors import UserError
from archlab.faults import fault_point
from archlab.runs.outputs import check_output, fresh_output

__all__ = [
    "EOT_TOKEN", "TokenizerLike", "ByteTokenizer", "load_tokenizer", "prepare", "load_meta",
    "TokenDataset", "BatchSampler", "eval_batches", "DataError", "split_sentences",
]

EOT_TOKEN = "<|endoftext|>"
META_FILE = "meta.json"
FORMAT_VERSION = 1
SPLITS = ("train", "val")
SENTENCES_SUFFIX = ".sentences.bin"
# a sentence ends after . ! ? (and closing quotes / brackets), or before a blank line, when more text follows
_SENTENCE_CUT = regex.compile(r"""(?:[.!?]["'\)\]}\u00bb\u201d\u2019]*|\S(?=[^\S\n]*\n[^\S\n]*\n))(?=\s+\S)""")


class DataError(UserError, ValueError):
    """A data folder, split or sampling request that cannot be served."""


# --------------------------------------------------------------------------- tokenizers
@runtime_checkable
class TokenizerLike(Protocol):
    """What `prepare` needs from a tokenizer (archlab.tokenizer.Tokenizer and ByteTokenizer both fit)."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def token_to_id(self, token: str) -> int | None: ...
    def save(self, directory: str | os.PathLike) -> Any: ...


class ByteTokenizer:
    """Byte-level tokenizer: ids 0-255 are the UTF-8 bytes, 256 is <|endoftext|> (vocab 257)."""

    FILE = "byte_tokenizer.json"
    vocab_size = 257
    eot_id = 256

    def encode(self, text: str) -> list[int]:
        from archlab.tokenizer.base import clean_surrogates
        return list(clean_surrogates(text).encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; the end-of-text id decodes to nothing, an id outside 0..256 is an error."""
        from archlab.tokenizer.base import check_ids
        ids = list(ids)
        check_ids(ids, self.vocab_size)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        return self.eot_id if token == EOT_TOKEN else None

    special_tokens = [EOT_TOKEN]

    def id_to_token(self, i: int) -> bytes | str | None:
        """The piece of an id, as the other tokenizers give it: its byte, or the end-of-text token's name (whole
        words and sentence ends are found from the pieces)."""
        if i == self.eot_id:
            return EOT_TOKEN
        return bytes([i]) if 0 <= i < 256 else None

    def save(self, directory: str | os.PathLike) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / self.FILE).write_text(json.dumps(
            {"kind": "bytes", "vocab_size": self.vocab_size, "special_tokens": {EOT_TOKEN: self.eot_id}}) + "\n")

    @classmethod
    def load(cls, directory: str | os.PathLike) -> ByteTokenizer:
        spec = json.loads((Path(directory) / cls.FILE).read_text())
        if spec.get("kind") != "bytes":
            raise DataError(f"{directory}/{cls.FILE} is not a byte tokenizer")
        return cls()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByteTokenizer)

    def __hash__(self) -> int:
        return hash(ByteTokenizer)


def load_tokenizer(spec: Any) -> TokenizerLike:
    """A tokenizer from "bytes", a folder (a saved ByteTokenizer or archlab.tokenizer.Tokenizer), or
    an object that already has `encode` (returned as is)."""
    if not isinstance(spec, (str, os.PathLike)):
        if not hasattr(spec, "encode"):
            raise DataError(f"{type(spec).__name__} is not a tokenizer: it has no encode()")
        return spec
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.exists():
        raise DataError(f"tokenizer {str(spec)!r} is neither 'bytes' nor an existing tokenizer folder")
    if (path / ByteTokenizer.FILE).is_file():
        return ByteTokenizer.load(path)
    from archlab.tokenizer import load
    return load(path)


def _special_token_id(tokenizer: Any, token: str) -> int:
    """The id of a special token: token_to_id when the tokenizer has it, else a one-id encoding."""
    token_id = None
    if hasattr(tokenizer, "token_to_id"):
        token_id = tokenizer.token_to_id(token)
    else:
        ids = list(tokenizer.encode(token))
        token_id = ids[0] if len(ids) == 1 else None
    if token_id is None:
        raise DataError(f"the tokenizer has no {token!r} token: add it as a special token "
                        "or pass another eot_token")
    if not 0 <= int(token_id) < _vocab_size(tokenizer):
        raise DataError(f"{token!r} has id {token_id}, outside vocab_size={_vocab_size(tokenizer)}")
    return int(token_id)


def _vocab_size(tokenizer: Any) -> int:
    """vocab_size as an attribute or property (or a method, or len(tokenizer), for other tokenizers)."""
    size = getattr(tokenizer, "vocab_size", None)
    if callable(size):
        size = size()
    if size is None and hasattr(tokenizer, "__len__"):
        size = len(tokenizer)
    if size is None:
        raise DataError(f"{type(tokenizer).__name__} has no vocab_size")
    return int(size)


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


# --------------------------------------------------------------------------- prepare: workers
# Set once per worker process (Pool initializer) so the tokenizer is sent once, not with every batch.
_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: Any, seed: int, dtype: np.dtype, sentences: bool = False) -> None:
    _WORKER.update(tokenizer=tokenizer, seed=seed, dtype=dtype, vocab_size=_vocab_size(tokenizer),
                   sentences=sentences)


def _doc_score(data: bytes, seed: int) -> float:
    """A uniform number in [0, 1) from the seed and the document's bytes: decides its split."""
    h = hashlib.blake2b(digest_size=8)
    h.update(int(seed).to_bytes(8, "little", signed=True))
    h.update(data)
    return int.from_bytes(h.digest(), "little") / 2.0**64


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
        out.append((ids.astype(dtype), _doc_score(data, seed), len(data), starts))
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


def _encoded(docs: Iterable[str], tokenizer: Any, seed: int, dtype: np.dtype, num_workers: int,
             sentences: bool = False) -> Iterator[list[tuple[np.ndarray, float, int, np.ndarray | None]]]:
    """Encoded batches in corpus order. At most 2 * num_workers batches are in flight, so memory stays
    bounded however long the corpus (Pool.imap would read the whole input ahead)."""
    if num_workers <= 1:
        _init_worker(tokenizer, seed, dtype, sentences)
        for batch in _batched(docs):
            yield _encode_batch(batch)
        return
    import multiprocessing

    with multiprocessing.Pool(num_workers, initializer=_init_worker,
                              initargs=(tokenizer, seed, dtype, sentences)) as pool:
        pending: deque = deque()
        for batch in _batched(docs):
            pending.append(pool.apply_async(_encode_batch, (batch,)))
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _default_workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


# --------------------------------------------------------------------------- prepare
class _SplitWriter:
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


def _move_document(src: _SplitWriter, dst: _SplitWriter, start: int, end: int, n_bytes: int) -> None:
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


def _move_sentences(src: _SplitWriter, dst: _SplitWriter, start: int, end: int) -> None:
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


def _checked_output(out_dir: str | os.PathLike, tokenizer: Any, eot_token: str, val_fraction: float,
                    overwrite: bool, inputs: list[str | os.PathLike]) -> tuple[Path, Any, int, int, np.dtype]:
    """The checks a prepare runs before any work (here and in archlab.data.pairs):
    (out folder, tokenizer, vocab_size, end-of-text id, token dtype). `inputs`: what it reads (input_paths),
    which the output may not be, hold or sit inside."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction} must be in [0, 1)")
    out = Path(out_dir).expanduser()
    check_output(out, inputs=inputs, overwrite=overwrite)
    tok = load_tokenizer(tokenizer)
    if not callable(getattr(tok, "save", None)):
        raise DataError(f"{type(tok).__name__} has no save(dir): the data folder must carry its tokenizer")
    vocab_size = _vocab_size(tok)
    return out, tok, vocab_size, _special_token_id(tok, eot_token), _token_dtype(vocab_size)


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
    next-sentence prediction (archlab.data.objectives.next_sentence_for).
    The folder is built beside out_dir under a temporary name and renamed into place at the end, so
    a crash never leaves a folder that looks complete. An existing out_dir is an error unless overwrite.
    """
    inputs = input_paths(corpus, tokenizer)
    out, tok, vocab_size, eot_id, dtype = _checked_output(out_dir, tokenizer, eot_token, val_fraction, overwrite,
                                                          inputs)
    report = None
    if isinstance(corpus, (str, os.PathLike)):
        name = corpus_name or os.fspath(corpus)
        docs: Iterable[str] = corpora.iter_documents(corpus, text_field=text_field)
        if not name.startswith("hf:"):
            report = corpora.scan_files(corpora.corpus_files(corpus))
            if not report.clean:
                warnings.warn(report.summary(), stacklevel=2)
    else:
        name, docs = corpus_name or "<iterable>", corpus
    workers = _default_workers() if num_workers is None else max(0, int(num_workers))

    # built beside `out` and renamed into place: a crash never leaves a folder that looks complete
    with fresh_output(out, overwrite=overwrite, inputs=inputs) as tmp:
        meta = _write_splits(docs, tok, tmp, dtype=dtype, eot_id=eot_id, seed=seed,
                             val_fraction=val_fraction, workers=workers, progress=progress, sentences=sentences)
        fault_point("prepare:split")
        meta.update(corpus=name, seed=seed, val_fraction=val_fraction, eot_token=eot_token,
                    vocab_size=vocab_size, text_field=text_field,
                    corpus_report=report.to_dict() if report is not None else None)
        (tmp / "tokenizer").mkdir()
        tok.save(tmp / "tokenizer")
        _write_json(tmp / META_FILE, _ordered_meta(meta))  # written last: its presence marks completeness
    return load_meta(out)


def _write_splits(docs: Iterable[str], tok: Any, tmp: Path, *, dtype: np.dtype, eot_id: int, seed: int,
                  val_fraction: float, workers: int, progress: bool, sentences: bool = False) -> dict:
    from archlab.progress import progress_bar

    eot = np.array([eot_id], dtype=dtype)
    writers = {s: _SplitWriter(tmp / f"{s}.bin", eot, sentences) for s in SPLITS}
    # The train document with the lowest score and the val one with the highest: the ones to move
    # if a split ends up empty. (score, start, end, n_bytes)
    lowest_train: tuple | None = None
    highest_val: tuple | None = None
    bar = progress_bar(desc="tokenizing", unit=" docs", disable=not progress, file=sys.stderr)
    try:
        for batch in _encoded(docs, tok, seed, dtype, workers, sentences):
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


def _ordered_meta(meta: dict) -> dict:
    head = {"format": "archlab-tokens", "version": FORMAT_VERSION}
    keys = ["corpus", "dtype", "vocab_size", "eot_token", "eot_id", "seed", "val_fraction", "text_field",
            "splits"]
    extra = {"corpus_report": meta["corpus_report"]} if meta.get("corpus_report") else {}
    if meta.get("sentences"):
        extra["sentences"] = True
    return {**head, **{k: meta[k] for k in keys}, **extra, "tokenizer": "tokenizer"}


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- reading
# meta.json "format": what a folder of that format holds, and what reads it
FORMATS = {
    "archlab-tokens": ("a token-stream folder", "archlab.data.tokens.TokenDataset"),
    "archlab-pairs": ("a source/target pairs folder", "archlab.data.pairs.PairDataset"),
    "archlab-sft": ("a folder of chat examples (archlab finetune)", "archlab.data.sft.SFTDataset"),
}


def load_meta(data_dir: str | os.PathLike, expect: str | None = "archlab-tokens") -> dict:
    """A data folder's meta.json; a folder of another format than `expect` (None: any) is a DataError
    that names what the folder is and what reads it."""
    path = Path(data_dir) / META_FILE
    if not path.is_file():
        raise DataError(f"{data_dir} is not a prepared data folder (no {META_FILE}); "
                        "run `archlab data prepare` first")
    try:
        meta = json.loads(path.read_text())
    except ValueError as exc:
        raise DataError(f"{path} is corrupt (not JSON: {exc}); prepare the data folder again") from exc
    if not isinstance(meta, dict) or "splits" not in meta:
        raise DataError(f"{path} is not an archlab data folder's meta.json (no `splits`)")
    found = meta.get("format", "archlab-tokens")
    if expect is not None and found != expect:
        if found not in FORMATS:
            raise DataError(f"{data_dir} has format {found!r}, which this archlab cannot read")
        holds, reader = FORMATS[found]
        raise DataError(f"{data_dir} is {holds}, not {FORMATS[expect][0]}: read it with {reader}")
    return meta


class TokenDataset:
    """A read-only memmap view of one split of a prepared data folder.

    n_tokens counts the end-of-text tokens too; bytes_per_token = UTF-8 bytes / n_tokens, so
    bits per byte = (mean loss in nats) / ln 2 / bytes_per_token.
    """

    def __init__(self, data_dir: str | os.PathLike, split: str = "train") -> None:
        split = {"validation": "val", "valid": "val"}.get(split, split)
        self.data_dir = Path(data_dir)
        self.meta = load_meta(self.data_dir)
        if split not in self.meta["splits"]:
            raise DataError(f"no split {split!r} in {data_dir} (has {sorted(self.meta['splits'])})")
        self.split = split
        info = self.meta["splits"][split]
        self.dtype = np.dtype(self.meta["dtype"])
        path = self.data_dir / info["file"]
        n = path.stat().st_size // self.dtype.itemsize
        if n != info["tokens"]:
            raise DataError(f"{path} holds {n} tokens but {META_FILE} says {info['tokens']}")
        # np.memmap cannot map an empty file
        self.tokens = np.memmap(path, dtype=self.dtype, mode="r") if n else np.zeros(0, self.dtype)
        self.n_tokens = int(n)
        self.n_bytes = int(info["bytes"])
        self.n_documents = int(info.get("documents", 0))
        self.vocab_size = int(self.meta["vocab_size"])
        self.eot_id = int(self.meta["eot_id"])
        self.sentence_starts = self._sentence_starts(info) if self.meta.get("sentences") else None

    def _sentence_starts(self, info: dict) -> np.ndarray:
        """(n,) int64 memmap: token offsets where this split's sentences start (prepare(sentences=True))."""
        path = self.data_dir / info.get("sentence_file", f"{self.split}{SENTENCES_SUFFIX}")
        n = path.stat().st_size // 8 if path.is_file() else -1
        if n != info.get("sentences"):
            raise DataError(f"{path} holds {max(n, 0)} sentence starts but {META_FILE} says {info.get('sentences')}"
                            "; prepare the data folder again")
        return np.memmap(path, dtype="<i8", mode="r") if n else np.zeros(0, "<i8")

    @property
    def bytes_per_token(self) -> float:
        return self.n_bytes / self.n_tokens if self.n_tokens else 0.0

    def __len__(self) -> int:
        return self.n_tokens

    def window(self, start: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) for one window: tokens [start, start+seq_len) and the same shifted by one."""
        chunk = torch.from_numpy(self.tokens[start:start + seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]

    def load_tokenizer(self) -> TokenizerLike:
        return load_tokenizer(self.data_dir / self.meta.get("tokenizer", "tokenizer"))

    def __repr__(self) -> str:
        return f"TokenDataset({str(self.data_dir)!r}, {self.split!r}, n_tokens={self.n_tokens})"


def _mix_seed(*parts: int) -> int:
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(int(p).to_bytes(8, "little", signed=True))
    return int.from_bytes(h.digest(), "little") & (2**63 - 1)


class StepSampler:
    """What every training sampler shares: `batch(step)` is a pure function of the step, so iterating moves a
    counter and resuming restores it. Subclasses set step, global_batch_size and the STATE_KEYS that a resumed
    sampler must match (the global batch may be split over another world_size), and define batch(step)."""

    STATE_KEYS: tuple[str, ...] = ("seed", "global_batch_size")
    step: int
    batch_size: int
    global_batch_size: int
    rank: int

    def batch(self, step: int) -> Any:
        raise NotImplementedError

    def _rows(self, step: int, per_epoch: int) -> Iterator[tuple[int, int]]:
        """(epoch, position in its permutation) of this rank's rows at `step`: global sample i of step s is
        s * global_batch + i, an epoch holds per_epoch samples, and rank r takes rows [r*B, (r+1)*B)."""
        first = step * self.global_batch_size + self.rank * self.batch_size
        return (divmod(i, per_epoch) for i in range(first, first + self.batch_size))

    def __iter__(self) -> StepSampler:
        return self

    def __next__(self) -> Any:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict:
        return {"step": self.step, **{key: getattr(self, key) for key in self.STATE_KEYS}}

    def load_state_dict(self, state: dict) -> None:
        """Resume at state["step"]."""
        for key in self.STATE_KEYS:
            if key in state and state[key] != getattr(self, key):
                raise DataError(f"sampler state has {key}={state[key]}, this sampler {getattr(self, key)}")
        self.step = int(state["step"])


class BatchSampler(StepSampler):
    """Training batches (x, y), int64 tensors of shape (batch_size, seq_len), y = x shifted by one.

    Each epoch cuts the tokens into non-overlapping windows of seq_len + 1 at an offset drawn from
    (seed, epoch) and visits them in a permutation drawn from (seed, epoch). Batch `step` on `rank` is a
    pure function of (seed, step, rank, batch_size * world_size): the state is the step counter.
    """

    STATE_KEYS = ("seed", "seq_len", "global_batch_size")

    def __init__(self, dataset: TokenDataset, batch_size: int, seq_len: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1) -> None:
        if batch_size < 1 or seq_len < 1:
            raise DataError(f"batch_size={batch_size} and seq_len={seq_len} must be positive")
        if not 0 <= rank < world_size:
            raise DataError(f"rank={rank} must be in [0, world_size={world_size})")
        n = dataset.n_tokens
        if n < seq_len + 1:
            raise DataError(f"split {dataset.split!r} has {n} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        self.dataset, self.batch_size, self.seq_len = dataset, batch_size, seq_len
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.global_batch_size = batch_size * world_size
        # Keep one window spare when we can, so the per-epoch offset ranges over all of [0, seq_len).
        most = (n - 1) // seq_len
        self.windows_per_epoch = most - 1 if most >= 2 else most
        self._max_offset = min(seq_len - 1, n - 1 - self.windows_per_epoch * seq_len)
        self.step = 0
        self._epochs: dict[int, tuple[int, torch.Tensor]] = {}

    def _epoch(self, epoch: int) -> tuple[int, torch.Tensor]:
        if epoch not in self._epochs:
            g = torch.Generator().manual_seed(_mix_seed(self.seed, epoch))
            offset = int(torch.randint(0, self._max_offset + 1, (1,), generator=g))
            perm = torch.randperm(self.windows_per_epoch, generator=g)
            if len(self._epochs) >= 2:  # a batch spans at most two epochs
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = (offset, perm)
        return self._epochs[epoch]

    def starts(self, step: int) -> list[int]:
        """Token offsets of this rank's windows at `step`."""
        out = []
        for epoch, pos in self._rows(step, self.windows_per_epoch):
            offset, perm = self._epoch(epoch)
            out.append(offset + int(perm[pos]) * self.seq_len)
        return out

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's batch at `step` (does not move the counter)."""
        tokens, s = self.dataset.tokens, self.seq_len
        rows = np.stack([tokens[a:a + s + 1] for a in self.starts(step)]).astype(np.int64)
        chunk = torch.from_numpy(rows)  # (b, t+1)
        return chunk[:, :-1], chunk[:, 1:]

    @property
    def epoch(self) -> float:
        """Epochs completed so far, fractional."""
        return self.step * self.global_batch_size / self.windows_per_epoch


def eval_batches(dataset: TokenDataset, batch_size: int, seq_len: int, max_batches: int | None = None,
                 *, rank: int = 0, world_size: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic validation batches: windows [k*seq_len, (k+1)*seq_len) with their shifted targets,
    k = 0, 1, ... in order, non-overlapping, covering every predictable token but the last partial window.
    The last batch may be smaller. With world_size > 1, rank r gets batches r, r + world_size, ...
    (of the first max_batches)."""
    n_windows = (dataset.n_tokens - 1) // seq_len
    if n_windows == 0:
        raise DataError(f"split {dataset.split!r} has {dataset.n_tokens} tokens, "
                        f"fewer than seq_len + 1 = {seq_len + 1}")
    n_batches = -(-n_windows // batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    tokens = dataset.tokens
    for b in range(rank, n_batches, world_size):
        first, last = b * batch_size, min((b + 1) * batch_size, n_windows)
        span = np.asarray(tokens[first * seq_len: last * seq_len + 1], dtype=np.int64)
        x = torch.from_numpy(span[:-1].reshape(last - first, seq_len).copy())
        y = torch.from_numpy(span[1:].reshape(last - first, seq_len).copy())
        yield x, y
