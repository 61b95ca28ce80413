"""Token data: the folder format (written by data/prepare.py), reading it, and the batch samplers.

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

import copy
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from archlab.data.formats import META_FILE, load_meta  # a data folder's meta.json, read beside the formats it names
from archlab.data.tokenizer_adapter import TokenizerLike, load_tokenizer
from archlab.errors import DataError

__all__ = ["META_FILE", "FORMAT_VERSION", "SPLITS", "SENTENCES_SUFFIX", "load_meta", "TokenDataset",
           "Rows", "StepSampler", "BatchSampler", "eval_batches", "DataError"]

FORMAT_VERSION = 1
SPLITS = ("train", "val")
SENTENCES_SUFFIX = ".sentences.bin"

# --------------------------------------------------------------------------- reading
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
        self.chunk_starts: np.ndarray | None = None   # set by spread(): where its glued chunks start

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

    def head(self, n_tokens: int) -> TokenDataset:
        """This split cut to its first `n_tokens` tokens (a view: nothing is copied or written), for training on a
        fixed amount of unique data that the sampler then repeats (train.stream.unique_tokens). Bytes are counted
        pro rata, documents by the end-of-text ids inside the cut. A cut past the split is a DataError.
        Example: TokenDataset("data/shakespeare", "train").head(100_000).n_tokens -> 100000"""
        if not 0 < n_tokens <= self.n_tokens:
            raise DataError(f"train.stream.unique_tokens={n_tokens} must be in [1, {self.n_tokens}]: the "
                            f"{self.split!r} split of {self.data_dir} holds {self.n_tokens} tokens")
        cut = copy.copy(self)
        cut.tokens = self.tokens[:n_tokens]
        cut.n_tokens = int(n_tokens)
        cut.n_bytes = round(self.n_bytes * n_tokens / self.n_tokens)
        cut.n_documents = int(np.count_nonzero(np.asarray(cut.tokens) == self.eot_id))
        if self.sentence_starts is not None:
            cut.sentence_starts = self.sentence_starts[self.sentence_starts < n_tokens]
        return cut

    def spread(self, n_tokens: int, chunk: int) -> TokenDataset:
        """`n_tokens` of this split taken as k = max(1, n_tokens // chunk) chunks of near-equal length (each at
        least `chunk` tokens) evenly strided over the whole split, glued back to back in memory: a fixed amount
        of unique data that samples every part of the split, where head() samples its first works only
        (train.stream.unique_tokens with unique_spread). Chunk i holds tokens [a_i, a_i + len_i) of the split,
        len_i = (i+1)n//k - i*n//k and a_i = i*n//k + i*(N-n)//k (the unused N - n tokens spread as equal
        gaps); `chunk_starts` records where each chunk starts in the glued stream, so BatchSampler never draws a
        window across a seam. Bytes are counted pro rata, documents by the end-of-text ids inside.
        Example: TokenDataset("data/shakespeare", "train").spread(100_000, 2048).chunk_starts[:2] -> [0, 2083]"""
        if not 0 < n_tokens <= self.n_tokens:
            raise DataError(f"train.stream.unique_tokens={n_tokens} must be in [1, {self.n_tokens}]: the "
                            f"{self.split!r} split of {self.data_dir} holds {self.n_tokens} tokens")
        n, total = int(n_tokens), self.n_tokens
        k = max(1, n // chunk)
        i = np.arange(k + 1, dtype=np.int64)
        glued = i * n // k                                    # (k+1,) chunk bounds in the glued stream
        first = glued[:-1] + i[:-1] * (total - n) // k         # (k,) where each chunk starts in the split
        lengths = np.diff(glued)                               # (k,)
        cut = copy.copy(self)
        cut.tokens = np.concatenate([np.asarray(self.tokens[a:a + m]) for a, m in zip(first, lengths)])   # (n,)
        cut.n_tokens = n
        cut.n_bytes = round(self.n_bytes * n / total)
        cut.n_documents = int(np.count_nonzero(cut.tokens == self.eot_id))
        cut.chunk_starts = glued[:-1]
        if self.sentence_starts is not None:
            ss = np.asarray(self.sentence_starts)
            cut.sentence_starts = np.concatenate([ss[(ss >= a) & (ss < a + m)] - a + g
                                                  for a, m, g in zip(first, lengths, glued[:-1])])
        return cut

    def load_tokenizer(self) -> TokenizerLike:
        return load_tokenizer(self.data_dir / self.meta.get("tokenizer", "tokenizer"))

    def __repr__(self) -> str:
        return f"TokenDataset({str(self.data_dir)!r}, {self.split!r}, n_tokens={self.n_tokens})"


def _mix_seed(*parts: int) -> int:
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(int(p).to_bytes(8, "little", signed=True))
    return int.from_bytes(h.digest(), "little") & (2**63 - 1)


@dataclass(frozen=True)
class Rows:
    """What a sampler drew for one micro-step, before an objective (data/objectives.py) turns it into the model's
    inputs and labels: token rows `ids` (b, n); their next-token `targets` (b, n) where the rows are windows of a
    stream (None where they are not); and `inputs` that come with the rows (a sentence pair's attention_mask,
    token_type_ids and next_sentence_labels)."""

    ids: torch.Tensor
    targets: torch.Tensor | None = None
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


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

    @property
    def epoch(self) -> float:
        """Epochs completed so far, fractional."""
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
        self._bases = np.arange(self.windows_per_epoch, dtype=np.int64) * seq_len   # window k: offset + bases[k]
        if dataset.chunk_starts is not None:
            self._chunked(dataset.chunk_starts, n)
        self.step = 0
        self._epochs: dict[int, tuple[int, torch.Tensor]] = {}

    def _chunked(self, chunk_starts: np.ndarray, n: int) -> None:
        """Windows inside the chunks of a spread() subset only: a chunk of L tokens holds (L - seq_len) // seq_len
        windows at chunk start + offset + j * seq_len, which fit for every offset in [0, seq_len)."""
        s = self.seq_len
        bounds = np.append(np.asarray(chunk_starts, dtype=np.int64), n)
        per_chunk = (np.diff(bounds) - s) // s                 # (k,) windows per chunk
        if per_chunk.min() < 1:
            raise DataError(f"a chunk of {int(np.diff(bounds).min())} tokens holds no window of seq_len + offset "
                            f"< {2 * s} tokens: make train.stream.unique_tokens larger or the chunks longer")
        self._bases = np.concatenate([a + np.arange(w, dtype=np.int64) * s for a, w in zip(bounds[:-1], per_chunk)])
        self.windows_per_epoch, self._max_offset = len(self._bases), s - 1

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
            out.append(offset + int(self._bases[int(perm[pos])]))
        return out

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's batch at `step` (does not move the counter)."""
        tokens, s = self.dataset.tokens, self.seq_len
        rows = np.stack([tokens[a:a + s + 1] for a in self.starts(step)]).astype(np.int64)
        chunk = torch.from_numpy(rows)  # (b, t+1)
        return chunk[:, :-1], chunk[:, 1:]

    def next_rows(self, step: int, micro: int) -> Rows:
        """The next windows and their targets, as Rows (moves the counter). Windows follow the counter alone; the
        trainer's step and micro-step are what an objective turns them with."""
        x, y = next(self)
        return Rows(x, y)

    @property
    def epoch(self) -> float:
        """Epochs completed so far, fractional."""
        return self.step * self.global_batch_size / self.windows_per_epoch


def eval_batches(dataset: TokenDataset, batch_size: int, seq_len: int, max_batches: int | None = None,
                 *, rank: int = 0, world_size: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic validation batches of non-overlapping windows [k*seq_len, (k+1)*seq_len) with their shifted
    targets. All of them (k = 0, 1, ... in order, every predictable token but the last partial window), or, when
    max_batches holds fewer windows than the split, that many spread evenly over the whole split: the first ones
    alone would score its first documents only (a lab sweep's 8 batches of 16 x 256 bytes were 2 of the Python
    standard library's 41 validation modules). The last batch may be smaller. With world_size > 1, rank r gets
    batches r, r + world_size, ... Example: next(eval_batches(val, 4, 32, max_batches=1))[0].shape -> (4, 32)"""
    n_windows = (dataset.n_tokens - 1) // seq_len
    if n_windows == 0:
        raise DataError(f"split {dataset.split!r} has {dataset.n_tokens} tokens, "
                        f"fewer than seq_len + 1 = {seq_len + 1}")
    n_batches = -(-n_windows // batch_size)
    windows = np.arange(n_windows)
    if max_batches is not None and max_batches < n_batches:
        n_batches = max_batches
        windows = np.arange(n_batches * batch_size) * n_windows // (n_batches * batch_size)   # evenly spaced
    tokens = dataset.tokens
    for b in range(rank, n_batches, world_size):
        chosen = windows[b * batch_size:(b + 1) * batch_size]
        span = np.stack([np.asarray(tokens[k * seq_len:(k + 1) * seq_len + 1], dtype=np.int64) for k in chosen])
        x = torch.from_numpy(span[:, :-1].copy())                                    # (b, seq_len)
        y = torch.from_numpy(span[:, 1:].copy())
        yield x, y
