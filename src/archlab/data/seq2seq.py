"""Paired data for encoder-decoders (translation, summarization): a .jsonl corpus of source/target pairs
tokenized into memmap files, and the batch samplers that read them.

Pairs folder layout (written by `prepare_seq2seq`, read by `Seq2SeqDataset`)::

    DATA_DIR/
      meta.json             "format": "archlab-pairs", dtype, vocab_size, eot id, fields, per-split pair /
                            token / byte counts and longest source and target, corpus, seed
      train.source.bin      every training source's ids followed by the end-of-text id, back to back; raw
      train.target.bin      little-endian uint16 (vocab_size <= 65536) or uint32, as archlab.data.tokens writes
      train.offsets.bin     int64 (n_pairs + 1, 2), raw little-endian: row i = where pair i's source and
                            target start; the last row = the two files' token counts
      val.source.bin, val.target.bin, val.offsets.bin
      tokenizer/            a copy of the tokenizer

Both sides end with the end-of-text id (T5 ends source and target with </s>); lengths count it. The split is
by pair, archlab.data.tokens's seeded hash of the pair's bytes (the source's byte count, the source, the target), so
it depends on the seed and the text alone, not on read order; with two or more pairs both splits hold one.

Sampling has archlab.data.tokens.BatchSampler's contract: batch `step` on `rank` is a pure function of
(seed, step, rank, global batch). Each epoch visits every pair once in a permutation drawn from
(seed, epoch); global sample i of step s is s * global_batch + i; rank r of world_size takes rows
[r*B, (r+1)*B). A batch is `(inputs, labels)`: inputs = {"input_ids": (b, s), "attention_mask": (b, s) 1 =
real}, right padded with pad_id to the batch's longest source; labels (b, t), right padded with -100 (not
scored) to its longest target: what archlab.EncoderDecoderLM.forward(**inputs, targets=labels) takes.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from archlab.data import corpora
from archlab.data.objectives import IGNORE
from archlab.data.prepare import (
    SplitWriter,
    checked_output,
    default_workers,
    doc_score,
    encoded,
    input_paths,
    write_json,
)
from archlab.data.tokenizer_adapter import EOT_TOKEN, TokenizerLike, load_tokenizer
from archlab.data.tokens import META_FILE, StepSampler, _mix_seed, load_meta
from archlab.errors import DataError
from archlab.faults import fault_point
from archlab.runs.outputs import fresh_output

__all__ = ["SEQ2SEQ_FORMAT", "prepare_seq2seq", "Seq2SeqDataset", "Seq2SeqSampler",
           "seq2seq_eval_batches", "collate_pairs", "check_lengths", "DataError"]

SEQ2SEQ_FORMAT = "archlab-pairs"          # the meta.json value folders already prepared hold
FORMAT_VERSION = 1
SPLITS = ("train", "val")
OFFSET_DTYPE = np.dtype("<i8")


# --------------------------------------------------------------------------- reading the .jsonl
def _read_pairs(path: Path, source_field: str, target_field: str) -> Iterator[tuple[str, str]]:
    """(source, target) per non-blank line; a bad line is a DataError naming the file and line."""
    for lineno, record in corpora.jsonl_records(path):
        where = f"line {lineno} of {path}"
        if not isinstance(record, dict):
            raise DataError(f"{where} is a JSON {type(record).__name__}, not an object with "
                            f"{source_field!r} and {target_field!r} fields")
        texts = []
        for side, field in (("source", source_field), ("target", target_field)):
            if field not in record:
                raise DataError(f"{where} has no {field!r} field (it has {', '.join(map(repr, record)) or 'none'}; "
                                f"set --{side}-field)")
            if not isinstance(record[field], str):
                raise DataError(f"{where}: field {field!r} is {type(record[field]).__name__}, not a string")
            texts.append(record[field])
        yield texts[0], texts[1]


def _pair_bytes(source: str, target: str) -> tuple[bytes, bytes]:
    return source.encode("utf-8", errors="surrogatepass"), target.encode("utf-8", errors="surrogatepass")


def _splits(path: Path, fields: tuple[str, str], seed: int, val_fraction: float) -> bytearray:
    """First pass, before any tokenizing: check every line and decide each pair's split (1 = val).
    With two or more pairs neither split is empty: the pair nearest the threshold moves over."""
    is_val = bytearray()
    lowest_train: tuple[float, int] | None = None   # (score, index) of the pair to move if val is empty
    highest_val: tuple[float, int] | None = None    # ... and if train is empty
    for i, (source, target) in enumerate(_read_pairs(path, *fields)):
        src, tgt = _pair_bytes(source, target)
        score = doc_score(len(src).to_bytes(8, "little") + src + tgt, seed)
        val = score < val_fraction
        is_val.append(val)
        if val and (highest_val is None or score > highest_val[0]):
            highest_val = (score, i)
        if not val and (lowest_train is None or score < lowest_train[0]):
            lowest_train = (score, i)
    if not is_val:
        raise DataError(f"{path} holds no pairs (an empty file)")
    n_val = sum(is_val)
    if n_val == len(is_val) and highest_val is not None:   # a lone pair trains; 2+: keep one for val
        is_val[highest_val[1]] = 0
    elif n_val == 0 and len(is_val) >= 2 and val_fraction > 0 and lowest_train is not None:
        is_val[lowest_train[1]] = 1
    return is_val


# --------------------------------------------------------------------------- prepare
class _Seq2SeqWriter:
    """One split: source and target token files (ids + eot each) and the offsets of every pair."""

    def __init__(self, tmp: Path, split: str, eot: np.ndarray) -> None:
        self.source = SplitWriter(tmp / f"{split}.source.bin", eot)
        self.target = SplitWriter(tmp / f"{split}.target.bin", eot)
        self.offsets_path = tmp / f"{split}.offsets.bin"
        self.offsets = open(self.offsets_path, "wb")
        self.longest = [0, 0]   # source, target, in tokens with the eot

    def _row(self) -> None:
        self.offsets.write(np.array([self.source.tokens, self.target.tokens], OFFSET_DTYPE).tobytes())

    def write(self, src: tuple[np.ndarray, int], tgt: tuple[np.ndarray, int]) -> None:
        self._row()
        for side, (ids, n_bytes) in enumerate((src, tgt)):
            start, end = (self.source, self.target)[side].write(ids, n_bytes)
            self.longest[side] = max(self.longest[side], end - start)

    def close(self) -> None:
        self._row()   # the end row: pair i spans offsets[i] to offsets[i + 1]
        for f in (self.source, self.target, self.offsets):
            f.close()

    def info(self) -> dict:
        return {"source_file": self.source.path.name, "target_file": self.target.path.name,
                "offsets_file": self.offsets_path.name, "pairs": self.source.documents,
                "source_tokens": self.source.tokens, "target_tokens": self.target.tokens,
                "source_bytes": self.source.bytes, "target_bytes": self.target.bytes,
                "max_source_len": self.longest[0], "max_target_len": self.longest[1]}


def prepare_seq2seq(
    corpus_jsonl: str | os.PathLike,
    tokenizer: Any,
    out_dir: str | os.PathLike,
    *,
    source_field: str = "source",
    target_field: str = "target",
    val_fraction: float = 0.05,
    seed: int = 0,
    eot_token: str = EOT_TOKEN,
    num_workers: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Tokenize a .jsonl file of {source_field: str, target_field: str} lines into `out_dir` and return the meta.

    The file is read twice: once to check every line and decide the splits (a bad line costs no tokenizing),
    once to tokenize. num_workers: tokenizing processes (None: the usable CPUs, at most 8; 0 or 1: this one).
    Built beside out_dir under a temporary name and renamed into place; an existing out_dir is an error
    unless overwrite.
    """
    path = Path(corpus_jsonl).expanduser()
    if path.suffix.lower() != ".jsonl":
        raise DataError(f"a pairs corpus is one .jsonl file of {{{source_field!r}: ..., {target_field!r}: ...}} "
                        f"lines; {str(corpus_jsonl)!r} is not a .jsonl path")
    if not path.is_file():
        raise DataError(f"pairs corpus {str(corpus_jsonl)!r} does not exist")
    inputs = input_paths(path, tokenizer)
    out, tok, vocab_size, eot_id, dtype = checked_output(out_dir, tokenizer, eot_token, val_fraction, overwrite,
                                                          inputs)
    fields = (source_field, target_field)
    is_val = _splits(path, fields, seed, val_fraction)
    workers = default_workers() if num_workers is None else max(0, int(num_workers))

    with fresh_output(out, overwrite=overwrite, inputs=inputs) as tmp:
        splits = _write_pairs(path, fields, is_val, tok, tmp, dtype=dtype, eot_id=eot_id, seed=seed,
                              workers=workers, progress=progress)
        fault_point("prepare:split")
        meta = {"format": SEQ2SEQ_FORMAT, "version": FORMAT_VERSION, "corpus": os.fspath(corpus_jsonl),
                "dtype": dtype.name, "vocab_size": vocab_size, "eot_token": eot_token, "eot_id": eot_id,
                "seed": seed, "val_fraction": val_fraction, "source_field": source_field,
                "target_field": target_field, "splits": splits, "tokenizer": "tokenizer"}
        (tmp / "tokenizer").mkdir()
        tok.save(tmp / "tokenizer")
        write_json(tmp / META_FILE, meta)  # written last: its presence marks completeness
    return load_meta(out, expect=SEQ2SEQ_FORMAT)


def _write_pairs(path: Path, fields: tuple[str, str], is_val: bytearray, tok: Any, tmp: Path, *,
                 dtype: np.dtype, eot_id: int, seed: int, workers: int, progress: bool) -> dict:
    from archlab.progress import progress_bar

    eot = np.array([eot_id], dtype=dtype)
    writers = {s: _Seq2SeqWriter(tmp, s, eot) for s in SPLITS}
    # sources and targets interleaved through archlab.data.tokens's tokenizing pool, paired up again in order
    texts = (text for pair in _read_pairs(path, *fields) for text in pair)
    # each encoded document is (ids, split score, byte count, ...): the score is the pair's, from _splits
    sides = ((doc[0], doc[2]) for batch in encoded(texts, tok, seed, dtype, workers) for doc in batch)
    bar = progress_bar(desc="tokenizing", unit=" pairs", total=len(is_val), disable=not progress, file=sys.stderr)
    try:
        for i, (src, tgt) in enumerate(zip(sides, sides)):
            writers[SPLITS[is_val[i]]].write(src, tgt)
            bar.update()
    finally:
        bar.close()
        for w in writers.values():
            w.close()
    return {s: w.info() for s, w in writers.items()}


# --------------------------------------------------------------------------- reading
def _memmap(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    n = path.stat().st_size // dtype.itemsize
    if n != count:
        raise DataError(f"{path} holds {n} values but {META_FILE} says {count}; prepare the folder again")
    # np.memmap cannot map an empty file
    return np.memmap(path, dtype=dtype, mode="r") if n else np.zeros(0, dtype)


class Seq2SeqDataset:
    """A read-only memmap view of one split of a pairs folder: pair i is (source(i), target(i))."""

    def __init__(self, data_dir: str | os.PathLike, split: str = "train") -> None:
        split = {"validation": "val", "valid": "val"}.get(split, split)
        self.data_dir = Path(data_dir)
        self.meta = load_meta(self.data_dir, expect=SEQ2SEQ_FORMAT)
        if split not in self.meta["splits"]:
            raise DataError(f"no split {split!r} in {data_dir} (has {sorted(self.meta['splits'])})")
        self.split = split
        info = self.meta["splits"][split]
        self.dtype = np.dtype(self.meta["dtype"])
        self.n_pairs = int(info["pairs"])
        self.sources = _memmap(self.data_dir / info["source_file"], self.dtype, info["source_tokens"])
        self.targets = _memmap(self.data_dir / info["target_file"], self.dtype, info["target_tokens"])
        offsets = _memmap(self.data_dir / info["offsets_file"], OFFSET_DTYPE, 2 * (self.n_pairs + 1))
        self.offsets = offsets.reshape(self.n_pairs + 1, 2)  # (pairs + 1, [source start, target start])
        if tuple(self.offsets[-1]) != (info["source_tokens"], info["target_tokens"]):
            raise DataError(f"{self.data_dir / info['offsets_file']} does not end at the token counts in "
                            f"{META_FILE}; prepare the folder again")
        self.max_source_len = int(info["max_source_len"])
        self.max_target_len = int(info["max_target_len"])
        self.n_source_tokens, self.n_target_tokens = int(info["source_tokens"]), int(info["target_tokens"])
        self.n_tokens = self.n_source_tokens + self.n_target_tokens       # what a pass over the split reads
        self.n_target_bytes = int(info["target_bytes"])
        self.vocab_size = int(self.meta["vocab_size"])
        self.eot_id = int(self.meta["eot_id"])

    @property
    def bytes_per_token(self) -> float:
        """UTF-8 bytes per target token (end-of-text counted, as archlab.data.tokens.TokenDataset counts it): the
        scored side, so bits per target byte = (mean loss in nats) / ln 2 / bytes_per_token."""
        return self.n_target_bytes / self.n_target_tokens if self.n_target_tokens else 0.0

    def __len__(self) -> int:
        return self.n_pairs

    def source(self, i: int) -> np.ndarray:
        """Pair i's source ids, ending with the end-of-text id."""
        return self.sources[self.offsets[i, 0]:self.offsets[i + 1, 0]]

    def target(self, i: int) -> np.ndarray:
        return self.targets[self.offsets[i, 1]:self.offsets[i + 1, 1]]

    def lengths(self) -> np.ndarray:
        """(n_pairs, 2) int64: every pair's source and target length, from the offsets alone."""
        return np.diff(np.asarray(self.offsets), axis=0)

    def load_tokenizer(self) -> TokenizerLike:
        return load_tokenizer(self.data_dir / self.meta.get("tokenizer", "tokenizer"))

    def __repr__(self) -> str:
        return f"Seq2SeqDataset({str(self.data_dir)!r}, {self.split!r}, n_pairs={self.n_pairs})"


def check_lengths(dataset: Seq2SeqDataset, max_source_len: int | None, max_target_len: int | None, *,
                  setting: str | None = None) -> None:
    """A DataError naming how many of the split's sources (targets) are longer than the limit, and the longest;
    `setting` names where the limit comes from (e.g. "train.seq_len")."""
    lengths = dataset.lengths()
    for side, limit in enumerate((max_source_len, max_target_len)):
        if limit is None:
            continue
        name = ("source", "target")[side]
        if limit < 1:
            raise DataError(f"max_{name}_len={limit} must be positive")
        over = int((lengths[:, side] > limit).sum())
        if over:
            raise DataError(f"{over:,} of {len(dataset):,} {dataset.split} {name}s are longer than "
                            f"{setting or f'max_{name}_len'}={limit} (longest {int(lengths[:, side].max()):,} "
                            f"tokens, end-of-text included): raise {setting or 'the limit'} or filter the pairs")


def collate_pairs(dataset: Seq2SeqDataset, indices: Sequence[int], pad_id: int = 0,
                  ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Pairs `indices` as (inputs, labels), right padded to the longest source (s) and target (t) among them."""
    sources = [dataset.source(i) for i in indices]
    targets = [dataset.target(i) for i in indices]
    b, s, t = len(indices), max(map(len, sources)), max(map(len, targets))
    input_ids = np.full((b, s), pad_id, dtype=np.int64)
    attention_mask = np.zeros((b, s), dtype=np.int64)
    labels = np.full((b, t), IGNORE, dtype=np.int64)
    for row, (src, tgt) in enumerate(zip(sources, targets)):
        input_ids[row, :len(src)] = src
        attention_mask[row, :len(src)] = 1
        labels[row, :len(tgt)] = tgt
    inputs = {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(attention_mask)}
    return inputs, torch.from_numpy(labels)


class Seq2SeqSampler(StepSampler):
    """Training batches (inputs, labels) of pairs, every pair once per epoch in a permutation drawn from
    (seed, epoch). Batch `step` on `rank` is a pure function of (seed, step, rank, batch_size * world_size):
    the state is the step counter (iteration, state_dict and load_state_dict: archlab.data.tokens.StepSampler).
    Pairs longer than the limits are an error here, before any training."""

    def __init__(self, dataset: Seq2SeqDataset, batch_size: int, *, max_source_len: int, max_target_len: int,
                 seed: int = 0, rank: int = 0, world_size: int = 1, pad_id: int = 0, setting: str | None = None
                 ) -> None:
        if batch_size < 1:
            raise DataError(f"batch_size={batch_size} must be positive")
        if not 0 <= rank < world_size:
            raise DataError(f"rank={rank} must be in [0, world_size={world_size})")
        if len(dataset) == 0:
            raise DataError(f"split {dataset.split!r} of {dataset.data_dir} has no pairs")
        check_lengths(dataset, max_source_len, max_target_len, setting=setting)
        self.dataset, self.batch_size, self.pad_id = dataset, batch_size, pad_id
        self.max_source_len, self.max_target_len = max_source_len, max_target_len
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.global_batch_size = batch_size * world_size
        self.pairs_per_epoch = len(dataset)
        self.step = 0
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(_mix_seed(self.seed, epoch))
            if len(self._perms) >= 2:  # a batch spans two epochs, unless it is larger than one
                self._perms.pop(min(self._perms))
            self._perms[epoch] = torch.randperm(self.pairs_per_epoch, generator=g)
        return self._perms[epoch]

    def indices(self, step: int) -> list[int]:
        """Pair indices of this rank's rows at `step`."""
        return [int(self._perm(epoch)[pos]) for epoch, pos in self._rows(step, self.pairs_per_epoch)]

    def batch(self, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """This rank's batch at `step` (does not move the counter)."""
        return collate_pairs(self.dataset, self.indices(step), self.pad_id)

    @property
    def epoch(self) -> float:
        """Epochs completed so far, fractional."""
        return self.step * self.global_batch_size / self.pairs_per_epoch


def seq2seq_eval_batches(dataset: Seq2SeqDataset, batch_size: int, max_batches: int | None = None, *, rank: int = 0,
                      world_size: int = 1, pad_id: int = 0, max_source_len: int | None = None,
                      max_target_len: int | None = None, setting: str | None = None,
                      ) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """Deterministic validation batches: pairs [k*batch_size, (k+1)*batch_size) in file order, k = 0, 1, ...;
    the last batch may be smaller. With world_size > 1, rank r gets batches r, r + world_size, ... (of the
    first max_batches). Length limits, when given, are checked as Seq2SeqSampler checks them."""
    if len(dataset) == 0:
        raise DataError(f"split {dataset.split!r} of {dataset.data_dir} has no pairs")
    check_lengths(dataset, max_source_len, max_target_len, setting=setting)
    n_batches = -(-len(dataset) // batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for k in range(rank, n_batches, world_size):
        yield collate_pairs(dataset, range(k * batch_size, min((k + 1) * batch_size, len(dataset))), pad_id)
