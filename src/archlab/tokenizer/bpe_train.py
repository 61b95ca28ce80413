"""Byte-level BPE training as GPT-2 defines it (Sennrich et al. 2016; Radford et al. 2019).

    vocab = special tokens, then the 256 bytes, then one token per merge (ids 0..vocab_size-1, no gaps)

1. Pre-tokenization: files are read in chunks cut at safe points (special tokens, or whitespace
   boundaries; see pretokenize.py) and counted in parallel worker processes. Memory grows with the
   number of distinct pre-tokens, not with the size of the input.
2. Merge loop: pair counts over all distinct pre-tokens weighted by their frequency; repeatedly merge
   the most frequent pair (ties: the lexicographically greater pair of byte strings), updating only
   the counts of pairs next to each merged occurrence. A compiled C loop (_bpe_merge.c, built with gcc
   on first use into the archlab cache and loaded with ctypes) and a pure-Python fallback implement the
   same algorithm and give identical merges; ARCHLAB_BPE_BACKEND=python|c|auto picks one.
"""
from __future__ import annotations

import ctypes
import hashlib
import heapq
import multiprocessing
import os
import subprocess
import sys
import sysconfig
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from archlab.paths import cache_dir
from archlab.tokenizer.pretokenize import count_pretokens, iter_text_chunks, resolve_inputs

__all__ = ["train_bpe", "count_file_pretokens", "merge_loop", "c_backend_available"]

_C_SOURCE = Path(__file__).with_name("_bpe_merge.c")
_lib = None
_lib_error: str | None = None


# --------------------------------------------------------------------------- pre-token counting
def _count_job(args: tuple[list[str], tuple[str, ...]]) -> Counter:
    texts, special_tokens = args
    return count_pretokens(texts, special_tokens)


def _jobs(chunks: Iterable[str], job_chars: int, special: tuple[str, ...]):
    job: list[str] = []
    size = 0
    for chunk in chunks:
        job.append(chunk)
        size += len(chunk)
        if size >= job_chars:
            yield job, special
            job, size = [], 0
    if job:
        yield job, special


def count_file_pretokens(input_path, special_tokens: Iterable[str] = (), *, num_workers: int | None = None,
                         chunk_chars: int = 1 << 21, max_job_chars: int = 1 << 24) -> Counter:
    """Counter of pre-token byte strings over one or more files (or folders).

    Files are read in chunks of ~chunk_chars characters; chunks are grouped into jobs of up to
    max_job_chars for the worker processes, each of which counts distinct segments over its job
    before running the pre-tokenization regex once per distinct segment.
    """
    special = tuple(special_tokens)
    files = resolve_inputs(input_path)
    total_chars = sum(f.stat().st_size for f in files)
    if num_workers is None:
        num_workers = os.cpu_count() or 1
    num_workers = max(1, min(num_workers, total_chars // chunk_chars + 1))
    job_chars = max(chunk_chars, min(max_job_chars, total_chars // num_workers + 1))
    jobs = _jobs(iter_text_chunks(files, special, chunk_chars), job_chars, special)
    counts: Counter = Counter()
    if num_workers == 1:
        for part in map(_count_job, jobs):
            counts.update(part)
    else:
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        with multiprocessing.get_context(method).Pool(num_workers) as pool:
            for part in pool.imap_unordered(_count_job, jobs):
                counts.update(part)
            pool.close()  # workers exit by themselves: terminate (the with's exit) can deadlock on a busy queue
            pool.join()
    return Counter({tok.encode("utf-8"): n for tok, n in counts.items()})


# --------------------------------------------------------------------------- compiled merge loop
def _load_c_library():
    """Compile _bpe_merge.c once per source hash into the archlab cache (gcc, no Python headers)."""
    global _lib, _lib_error
    if _lib is not None or _lib_error is not None:
        return _lib
    try:
        source = _C_SOURCE.read_bytes()
        tag = hashlib.sha256(source + sys.platform.encode()).hexdigest()[:16]
        suffix = sysconfig.get_config_var("SHLIB_SUFFIX") or ".so"
        target = cache_dir() / "ext" / f"bpe_merge_{tag}{suffix}"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            cc = os.environ.get("CC", "gcc")
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                out = Path(tmp) / target.name
                subprocess.run([cc, "-O3", "-shared", "-fPIC", "-o", str(out), str(_C_SOURCE)],
                               check=True, capture_output=True)
                os.replace(out, target)  # atomic: concurrent builders never see a half-written file
        lib = ctypes.CDLL(str(target))
        lib.bpe_merge.restype = ctypes.c_int64
        lib.bpe_merge.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p]
        _lib = lib
    except (OSError, subprocess.SubprocessError) as e:
        # OSError: no compiler on PATH, a read-only cache, a library the loader refuses;
        # SubprocessError: the compiler ran and failed. Either way the Python loop takes over.
        _lib_error = f"{type(e).__name__}: {e}"
    return _lib


def c_backend_available() -> bool:
    return _load_c_library() is not None


_PROGRESS = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int32)


def _merge_loop_c(words: list[bytes], counts: list[int], n_merges: int,
                  progress: Callable[[int], None] | None) -> list[tuple[int, int]]:
    lib = _load_c_library()
    lengths = np.fromiter((len(w) for w in words), dtype=np.int64, count=len(words))
    offsets = np.zeros(len(words) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    symbols = np.frombuffer(b"".join(words), dtype=np.uint8).astype(np.int32)
    weights = np.asarray(counts, dtype=np.int64)
    out = np.zeros(2 * max(n_merges, 1), dtype=np.int32)
    callback = _PROGRESS(lambda done: (progress(done), 0)[1]) if progress else ctypes.cast(None, _PROGRESS)
    made = lib.bpe_merge(len(words), offsets.ctypes.data, symbols.ctypes.data if len(symbols) else None,
                         weights.ctypes.data, n_merges, out.ctypes.data, callback)
    if made < 0:
        raise MemoryError("bpe_merge ran out of memory")
    return [(int(out[2 * k]), int(out[2 * k + 1])) for k in range(made)]


# --------------------------------------------------------------------------- pure-Python merge loop
_INVERT = bytes(range(255, -1, -1))


def _desc_key(token: bytes) -> str:
    """A string that sorts ascending exactly when `token` sorts descending (prefix-free: the terminator
    U+0100 is above every inverted byte), so a min-heap pops the lexicographically greatest pair."""
    return token.translate(_INVERT).decode("latin-1") + "\u0100"


def merge_pair(pair: tuple[int, int], new_id: int, seqs: list[list[int]], counts: list[int],
               pair_counts: dict[tuple[int, int], int], where: dict[tuple[int, int], set[int]]
               ) -> tuple[set[tuple[int, int]], int]:
    """Replace every occurrence of `pair` in the words that hold it by `new_id` (left to right, as BPE and
    WordPiece merge), keeping `pair_counts` (pair -> occurrences weighted by word count) and `where` (pair ->
    words holding it) up to date. Returns (the pairs whose count changed, the merged occurrences weighted by
    word count). The one pair-merge step of both trainers.
    Example: changed, n = merge_pair((a, b), c, seqs, counts, pair_counts, where)"""
    a, b = pair
    changed: set[tuple[int, int]] = set()
    merged_weight = 0
    for wi in sorted(where.pop(pair, ())):
        seq, n = seqs[wi], counts[wi]
        out: list[int] = []
        i = 0
        while i < len(seq):
            if i + 1 < len(seq) and seq[i] == a and seq[i + 1] == b:
                out.append(new_id)
                merged_weight += n
                i += 2
            else:
                out.append(seq[i])
                i += 1
        if len(out) == len(seq):
            continue
        for p in zip(seq, seq[1:]):
            pair_counts[p] -= n
            changed.add(p)
        for p in zip(out, out[1:]):
            pair_counts[p] = pair_counts.get(p, 0) + n
            where.setdefault(p, set()).add(wi)
            changed.add(p)
        seqs[wi] = out
    return changed, merged_weight


def _merge_loop_python(words: list[bytes], counts: list[int], n_merges: int,
                       progress: Callable[[int], None] | None) -> list[tuple[int, int]]:
    token_bytes: list[bytes] = [bytes([i]) for i in range(256)]
    keys: list[str] = [_desc_key(t) for t in token_bytes]
    seqs: list[list[int]] = [list(w) for w in words]
    pair_counts: dict[tuple[int, int], int] = {}
    where: dict[tuple[int, int], set[int]] = {}
    for wi, seq in enumerate(seqs):
        n = counts[wi]
        for pair in zip(seq, seq[1:]):
            pair_counts[pair] = pair_counts.get(pair, 0) + n
            where.setdefault(pair, set()).add(wi)
    heap = [(-c, keys[a] + keys[b], a, b) for (a, b), c in pair_counts.items()]
    heapq.heapify(heap)
    merges: list[tuple[int, int]] = []
    while len(merges) < n_merges and heap:
        neg, _, a, b = heapq.heappop(heap)
        if pair_counts.get((a, b), 0) != -neg or neg == 0:
            continue  # stale entry
        c = 256 + len(merges)
        merges.append((a, b))
        token_bytes.append(token_bytes[a] + token_bytes[b])
        keys.append(_desc_key(token_bytes[c]))
        changed, _ = merge_pair((a, b), c, seqs, counts, pair_counts, where)
        pair_counts.pop((a, b), None)
        changed.discard((a, b))
        for pair in changed:
            cnt = pair_counts[pair]
            if cnt > 0:
                heapq.heappush(heap, (-cnt, keys[pair[0]] + keys[pair[1]], pair[0], pair[1]))
            else:
                del pair_counts[pair]
        if progress and len(merges) % 256 == 0:
            progress(len(merges))
    return merges


def merge_loop(word_counts: dict[bytes, int], n_merges: int, *, backend: str | None = None,
               progress: Callable[[int], None] | None = None) -> list[tuple[int, int]]:
    """Merges as (left id, right id) pairs with ids 0..255 = bytes and 256+k = the k-th merge.

    backend: "c", "python" or "auto" (default: $ARCHLAB_BPE_BACKEND, else "auto" = C when it builds)."""
    backend = backend or os.environ.get("ARCHLAB_BPE_BACKEND", "auto")
    if backend not in ("auto", "c", "python"):
        raise ValueError(f"backend={backend!r} must be 'auto', 'c' or 'python'")
    items = [(w, n) for w, n in word_counts.items() if len(w) > 1 and n > 0]
    words = [w for w, _ in items]
    counts = [n for _, n in items]
    if backend == "c" and not c_backend_available():
        raise RuntimeError(f"the compiled BPE merge loop is unavailable: {_lib_error}")
    if backend != "python" and c_backend_available():
        return _merge_loop_c(words, counts, n_merges, progress)
    return _merge_loop_python(words, counts, n_merges, progress)


def train_bpe(input_path, vocab_size: int, special_tokens: Iterable[str] = (), *,
              num_workers: int | None = None, backend: str | None = None,
              progress: Callable[[int], None] | None = None
              ) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Train a byte-level BPE tokenizer on a file, a folder, or a list of them.

    Returns (vocab, merges): vocab maps ids 0..vocab_size-1 to bytes (special tokens first, then the 256
    bytes, then merges in order); merges lists (left bytes, right bytes) in merge order. Fewer merges are
    made (and the vocabulary is smaller) only when no pair is left to merge.
    `progress(n)` is called every 256 merges.
    """
    special = list(dict.fromkeys(special_tokens))
    n_merges = vocab_size - 256 - len(special)
    if n_merges < 0:
        raise ValueError(f"vocab_size={vocab_size} is below 256 bytes + {len(special)} special tokens")
    word_counts = count_file_pretokens(input_path, special, num_workers=num_workers)
    return bpe_from_counts(word_counts, vocab_size, special, backend=backend, progress=progress)


def bpe_from_counts(word_counts: dict[bytes, int], vocab_size: int, special_tokens: Iterable[str] = (), *,
                    backend: str | None = None, progress: Callable[[int], None] | None = None
                    ) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """train_bpe from already counted pre-tokens (bytes -> count)."""
    special = list(dict.fromkeys(special_tokens))
    n_merges = vocab_size - 256 - len(special)
    if n_merges < 0:
        raise ValueError(f"vocab_size={vocab_size} is below 256 bytes + {len(special)} special tokens")
    id_merges = merge_loop(word_counts, n_merges, backend=backend, progress=progress)
    tokens: list[bytes] = [bytes([i]) for i in range(256)]
    merges: list[tuple[bytes, bytes]] = []
    for a, b in id_merges:
        merges.append((tokens[a], tokens[b]))
        tokens.append(tokens[a] + tokens[b])
    vocab: dict[int, bytes] = {i: s.encode("utf-8") for i, s in enumerate(special)}
    for t in tokens:
        vocab[len(vocab)] = t
    return vocab, merges
