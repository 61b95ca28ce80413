"""Supervised fine-tuning data for decoders: chat examples (archlab.data.chat) in a folder, and the batches that
pack them into rows without attention across examples.

SFT folder layout (written by `write_sft_folder`, read by `SFTDataset`)::

    DATA_DIR/
      meta.json             "format": "archlab-sft", dtype, vocab_size, eot id, the loss mask and truncation
                            used, per-split example / token / scored counts, the corpus and its sha256
      train.ids.bin         every example's ids back to back (uint16 or uint32, raw little-endian)
      train.scored.bin      uint8 per token: 1 where the loss scores the token that follows it (labels[j] =
                            ids[j + 1]), as ChatExample.labels says; an example's last slot is never scored
      train.offsets.bin     int64 (n_examples + 1): where example i starts; the last entry = the token count
      val.ids.bin, val.scored.bin, val.offsets.bin
      tokenizer/            the tokenizer, with its chat template

A batch is (inputs, labels) with inputs = {"input_ids", "document_ids"} (b, t): with packing (the default), rows
of exactly seq_len slots, each holding whole examples (best-fit decreasing over the lengths, once) with
document ids 0, 1, ... per row and -1 on the padded tail, so positions restart at each example and no query
attends to another (archlab.nn.masks.document_positions); without packing, one example per row, padded to the
batch's longest. labels are -100 on unscored and padded slots. Batch `step` on `rank` is a pure function of
(seed, step, rank, global batch): each epoch visits every row once in a permutation drawn from (seed, epoch).
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from archlab.data.objectives import IGNORE
from archlab.data.prepare import _token_dtype, write_json
from archlab.data.tokenizer_adapter import load_tokenizer
from archlab.data.tokens import META_FILE, StepSampler, _mix_seed, load_meta
from archlab.errors import DataError

__all__ = ["SFT_FORMAT", "write_sft_folder", "SFTDataset", "SFTSampler", "sft_eval_batches",
           "pack_rows", "collate_examples", "real_token_share", "describe"]

SFT_FORMAT = "archlab-sft"
FORMAT_VERSION = 1
SPLITS = ("train", "val")
OFFSET_DTYPE = np.dtype("<i8")


# --------------------------------------------------------------------------- writing
def _write_split(folder: Path, split: str, examples: Sequence[Any], dtype: np.dtype) -> dict:
    """ids, scored flags and offsets of `examples` (ChatExample: input_ids, labels) as one split's files."""
    lengths = np.fromiter((len(e.input_ids) for e in examples), dtype=np.int64, count=len(examples))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(OFFSET_DTYPE)                 # (n + 1,)
    ids = np.fromiter((t for e in examples for t in e.input_ids), dtype=dtype, count=int(offsets[-1]))
    scored = np.fromiter((t != IGNORE for e in examples for t in e.labels), dtype=np.uint8, count=int(offsets[-1]))
    names = {"ids_file": f"{split}.ids.bin", "scored_file": f"{split}.scored.bin",
             "offsets_file": f"{split}.offsets.bin"}
    for key, array in (("ids_file", ids), ("scored_file", scored), ("offsets_file", offsets)):
        (folder / names[key]).write_bytes(array.tobytes())
    return {**names, "examples": len(examples), "tokens": int(offsets[-1]), "scored": int(scored.sum()),
            "longest": int(lengths.max()) if len(lengths) else 0}


def write_sft_folder(folder: str | os.PathLike, splits: dict[str, Sequence[Any]], tokenizer_dir: str | os.PathLike,
                     vocab_size: int, eot_id: int, **described: Any) -> dict:
    """Write the examples of each split (ChatExample lists under "train" and "val") and a copy of the tokenizer
    folder into `folder` (created; meta.json last, so its presence marks a complete folder).
    `described` (corpus, sha256, loss_mask, truncation, seed ...) goes into meta.json as it is."""
    folder = Path(folder)
    folder.mkdir(parents=True)
    dtype = _token_dtype(vocab_size)
    info = {split: _write_split(folder, split, splits.get(split, []), dtype) for split in SPLITS}
    shutil.copytree(tokenizer_dir, folder / "tokenizer")
    meta = {"format": SFT_FORMAT, "version": FORMAT_VERSION, **described, "dtype": dtype.name,
            "vocab_size": int(vocab_size), "eot_id": int(eot_id), "splits": info, "tokenizer": "tokenizer"}
    write_json(folder / META_FILE, meta)
    return meta


# --------------------------------------------------------------------------- reading
def _read(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    n = path.stat().st_size // dtype.itemsize if path.is_file() else -1
    if n != count:
        raise DataError(f"{path} holds {max(n, 0)} values but {META_FILE} says {count}; prepare the folder again")
    return np.fromfile(path, dtype=dtype) if n else np.zeros(0, dtype)


class SFTDataset:
    """One split of an SFT folder in memory: example i is (ids(i), scored(i))."""

    def __init__(self, data_dir: str | os.PathLike, split: str = "train") -> None:
        split = {"validation": "val", "valid": "val"}.get(split, split)
        self.data_dir = Path(data_dir)
        self.meta = load_meta(self.data_dir, expect=None)
        if self.meta.get("format") != SFT_FORMAT:
            raise DataError(f"{data_dir} is not an SFT data folder (format {self.meta.get('format')!r})")
        if split not in self.meta["splits"]:
            raise DataError(f"no split {split!r} in {data_dir} (has {sorted(self.meta['splits'])})")
        self.split = split
        info = self.meta["splits"][split]
        self.dtype = np.dtype(self.meta["dtype"])
        self.n_examples, self.n_tokens = int(info["examples"]), int(info["tokens"])
        self.ids = _read(self.data_dir / info["ids_file"], self.dtype, self.n_tokens)
        self.scored = _read(self.data_dir / info["scored_file"], np.dtype(np.uint8), self.n_tokens)
        self.offsets = _read(self.data_dir / info["offsets_file"], OFFSET_DTYPE, self.n_examples + 1)
        if self.n_examples and int(self.offsets[-1]) != self.n_tokens:
            raise DataError(f"{self.data_dir / info['offsets_file']} does not end at the token count; "
                            "prepare the folder again")
        self.vocab_size = int(self.meta["vocab_size"])
        self.eot_id = int(self.meta["eot_id"])
        self.bytes_per_token = float("nan")     # the loss scores answers, not the text: no bits per byte

    def __len__(self) -> int:
        return self.n_examples

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, labels) of example i as int64 arrays: labels[j] = ids[j + 1] where scored, else IGNORE."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        ids = self.ids[a:b].astype(np.int64)
        targets = np.append(ids[1:], IGNORE)
        return ids, np.where(self.scored[a:b].astype(bool), targets, IGNORE)

    def load_tokenizer(self) -> Any:
        return load_tokenizer(self.data_dir / self.meta.get("tokenizer", "tokenizer"))

    def __repr__(self) -> str:
        return f"SFTDataset({str(self.data_dir)!r}, {self.split!r}, n_examples={self.n_examples})"


# --------------------------------------------------------------------------- rows and batches
def pack_rows(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Example indices grouped into rows of at most seq_len tokens: best-fit decreasing (each example, longest
    first, into the fullest row it still fits, else a new row); within a row, in index order. Deterministic."""
    import bisect

    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []              # (room left, row) sorted: the fullest fitting row is found first
    for i in order:
        n = int(lengths[i])
        if n > seq_len:
            raise DataError(f"an example of {n} tokens does not fit in train.seq_len={seq_len}")
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            room, row = free.pop(k)
        else:
            room, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, row))
    return [sorted(row) for row in rows]


def collate_examples(dataset: SFTDataset, rows: Sequence[Sequence[int]], width: int | None = None,
                     pad_id: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Rows of examples as (inputs, labels): each row's examples back to back with document ids 0, 1, ..., right
    padded (document id -1, label IGNORE) to `width` (None: the longest row)."""
    parts = [[dataset.example(i) for i in row] for row in rows]
    sizes = [sum(len(ids) for ids, _ in row) for row in parts]
    t = width if width is not None else max(sizes)
    input_ids = np.full((len(rows), t), pad_id, dtype=np.int64)                  # (b, t)
    labels = np.full((len(rows), t), IGNORE, dtype=np.int64)                     # (b, t)
    documents = np.full((len(rows), t), -1, dtype=np.int64)                      # (b, t)
    for r, row in enumerate(parts):
        at = 0
        for d, (ids, lab) in enumerate(row):
            input_ids[r, at:at + len(ids)], labels[r, at:at + len(ids)] = ids, lab
            documents[r, at:at + len(ids)] = d
            at += len(ids)
    inputs = {"input_ids": torch.from_numpy(input_ids), "document_ids": torch.from_numpy(documents)}
    return inputs, torch.from_numpy(labels)


def _rows(dataset: SFTDataset, seq_len: int, packing: bool) -> list[list[int]]:
    lengths = dataset.lengths()
    if len(lengths) and int(lengths.max()) > seq_len:
        raise DataError(f"{int((lengths > seq_len).sum())} {dataset.split} examples of {dataset.data_dir} are longer "
                        f"than train.seq_len={seq_len} (longest {int(lengths.max())}): prepare them again with "
                        "this seq_len")
    return pack_rows(lengths, seq_len) if packing else [[i] for i in range(len(lengths))]


class SFTSampler(StepSampler):
    """Training batches of SFT rows (packed, or one padded example per row); the state is the step counter."""

    STATE_KEYS = ("seed", "seq_len", "global_batch_size", "packing")

    def __init__(self, dataset: SFTDataset, batch_size: int, seq_len: int, *, packing: bool = True, seed: int = 0,
                 rank: int = 0, world_size: int = 1) -> None:
        if batch_size < 1 or seq_len < 1:
            raise DataError(f"batch_size={batch_size} and seq_len={seq_len} must be positive")
        if len(dataset) == 0:
            raise DataError(f"split {dataset.split!r} of {dataset.data_dir} has no examples")
        self.dataset, self.batch_size, self.seq_len, self.packing = dataset, batch_size, seq_len, packing
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.global_batch_size = batch_size * world_size
        self.rows = _rows(dataset, seq_len, packing)
        self.step = 0
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(_mix_seed(self.seed, epoch))
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = torch.randperm(len(self.rows), generator=g)
        return self._perms[epoch]

    def batch(self, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        rows = [self.rows[int(self._perm(epoch)[pos])] for epoch, pos in self._rows(step, len(self.rows))]
        return collate_examples(self.dataset, rows, self.seq_len if self.packing else None,
                                pad_id=self.dataset.eot_id)

    @property
    def epoch(self) -> float:
        return self.step * self.global_batch_size / len(self.rows)


def sft_eval_batches(dataset: SFTDataset, batch_size: int, seq_len: int, max_batches: int | None = None, *,
                     packing: bool = True, rank: int = 0, world_size: int = 1
                     ) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """Deterministic validation batches: the split's rows in order, batch_size at a time (rank r of world_size
    takes batches r, r + world_size, ... of the first max_batches)."""
    if len(dataset) == 0:
        raise DataError(f"split {dataset.split!r} of {dataset.data_dir} has no examples")
    rows = _rows(dataset, seq_len, packing)
    n_batches = -(-len(rows) // batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for k in range(rank, n_batches, world_size):
        yield collate_examples(dataset, rows[k * batch_size:(k + 1) * batch_size], seq_len if packing else None,
                               pad_id=dataset.eot_id)


def real_token_share(dataset: SFTDataset, batch_size: int, seq_len: int, packing: bool) -> float:
    """Real tokens / slots over one epoch of training rows (packed rows of seq_len, or padded batches)."""
    sampler = SFTSampler(dataset, batch_size, seq_len, packing=packing)
    lengths = dataset.lengths()
    sizes = np.array([int(lengths[row].sum()) for row in sampler.rows])
    if packing:
        return float(sizes.sum() / (len(sizes) * seq_len))
    order = sampler._perm(0).numpy()
    slots = sum(int(sizes[order[k:k + batch_size]].max()) * len(order[k:k + batch_size])
                for k in range(0, len(order), batch_size))
    return float(sizes.sum() / slots)


def describe(meta: dict) -> str:
    """One line: examples, tokens and scored tokens per split."""
    return "; ".join(f"{s}: {v['examples']:,} examples, {v['tokens']:,} tokens ({v['scored']:,} scored)"
                     for s, v in meta["splits"].items())
