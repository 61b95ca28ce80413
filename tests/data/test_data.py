"""Token data: prepare (split, eot, dtype, meta, atomicity), TokenDataset, BatchSampler, eval_batches."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from archlab.data import prepare as preparing
from archlab.data.prepare import prepare
from archlab.data.tokenizer_adapter import ByteTokenizer, load_tokenizer
from archlab.data.tokens import BatchSampler, TokenDataset, eval_batches, load_meta
from archlab.errors import DataError

EOT = "<|endoftext|>"


class FakeTokenizer:
    """ids = UTF-8 bytes + offset, eot = vocab_size - 1: the tokenizer protocol without archlab.tokenizer."""

    def __init__(self, vocab_size: int = 300, offset: int = 0, fail_on: str | None = None):
        self.vocab_size, self.offset, self.fail_on = vocab_size, offset, fail_on

    def encode(self, text: str) -> list[int]:
        if self.fail_on is not None and self.fail_on in text:
            raise RuntimeError("tokenizer crashed")
        return [b + self.offset for b in text.encode("utf-8")]

    def token_to_id(self, token: str) -> int | None:
        return self.vocab_size - 1 if token == EOT else None

    def save(self, directory) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "fake.json").write_text(json.dumps({"vocab_size": self.vocab_size}))


def _docs(n: int) -> list[str]:
    return [f"document {i}: " + "abc\u00e9\u6f22 " * (i % 7 + 1) for i in range(n)]


def _read_docs(data_dir: Path, split: str, offset: int = 0) -> list[str]:
    """The documents of a split, cut at the eot ids and decoded back to text."""
    ds = TokenDataset(data_dir, split)
    ids = np.asarray(ds.tokens, dtype=np.int64)
    assert ids.size == 0 or ids[-1] == ds.eot_id, "every document, the last included, ends with eot"
    cuts = np.flatnonzero(ids == ds.eot_id)
    docs, start = [], 0
    for cut in cuts:
        docs.append(bytes((ids[start:cut] - offset).tolist()).decode("utf-8"))
        start = cut + 1
    return docs


def _prepare(docs, out, **kw):
    kw.setdefault("num_workers", 0)
    kw.setdefault("progress", False)
    tokenizer = kw.pop("tokenizer", "bytes")
    return prepare(docs, tokenizer, out, **kw)


# --------------------------------------------------------------------------- prepare: split
def test_split_is_by_whole_document_and_covers_the_corpus(tmp_path):
    docs = _docs(60)
    meta = _prepare(docs, tmp_path / "d", val_fraction=0.25)
    train, val = _read_docs(tmp_path / "d", "train"), _read_docs(tmp_path / "d", "val")
    assert sorted(train + val) == sorted(docs)  # each document whole, in exactly one split
    assert train == [d for d in docs if d in set(train)]  # corpus order kept within a split
    assert 5 <= len(val) <= 25
    assert meta["splits"]["val"]["documents"] == len(val) and meta["splits"]["train"]["documents"] == len(train)


def test_split_is_deterministic_and_independent_of_workers_and_order(tmp_path, monkeypatch):
    docs = _docs(60)
    _prepare(docs, tmp_path / "a", val_fraction=0.2, seed=3)
    monkeypatch.setattr(preparing, "BATCH_DOCS", 3)  # 20 batches over 2 processes: order must still hold
    _prepare(docs, tmp_path / "b", val_fraction=0.2, seed=3, num_workers=2)
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    _prepare(docs[::-1], tmp_path / "r", val_fraction=0.2, seed=3)
    assert set(_read_docs(tmp_path / "r", "val")) == set(_read_docs(tmp_path / "a", "val"))
    _prepare(docs, tmp_path / "s", val_fraction=0.2, seed=4)
    assert set(_read_docs(tmp_path / "s", "val")) != set(_read_docs(tmp_path / "a", "val"))


def test_tokenizing_streams_with_a_bounded_read_ahead(monkeypatch):
    monkeypatch.setattr(preparing, "BATCH_DOCS", 1)
    pulled = 0

    def endless():
        nonlocal pulled
        while True:
            pulled += 1
            yield f"document {pulled}"
    stream = preparing.encoded(endless(), ByteTokenizer(), 0, np.dtype(np.uint16), num_workers=2)
    first = [next(stream) for _ in range(3)]
    assert bytes(first[2][0][0].tolist()) == b"document 3"
    assert pulled <= 3 + 2 * 2  # what was consumed plus at most 2 * workers batches in flight
    stream.close()


def test_a_stream_closed_early_lets_its_workers_finish_rather_than_killing_them(monkeypatch):
    """Pool.terminate can kill a worker holding the result queue's lock and then wait on it forever (it hung CI
    for 15 minutes); an early close waits for the batches in flight and closes the pool instead."""
    import multiprocessing.pool

    def refuse(self):
        raise AssertionError("terminate called")
    monkeypatch.setattr(multiprocessing.pool.Pool, "terminate", refuse)
    monkeypatch.setattr(preparing, "BATCH_DOCS", 1)
    stream = preparing.encoded((f"document {i}" for i in range(100)), ByteTokenizer(), 0, np.dtype(np.uint16),
                               num_workers=2)
    assert bytes(next(stream)[0][0].tolist()) == b"document 0"
    stream.close()


def test_two_documents_always_give_one_to_each_split(tmp_path):
    for seed in range(4):
        for fraction in (0.0001, 0.5, 0.9999):
            meta = _prepare(["first doc", "second doc"], tmp_path / f"d{seed}{fraction}",
                            val_fraction=fraction, seed=seed)
            assert [meta["splits"][s]["documents"] for s in ("train", "val")] == [1, 1]
    meta = _prepare(["only doc"], tmp_path / "one", val_fraction=0.9)
    assert meta["splits"]["train"]["documents"] == 1 and meta["splits"]["val"]["tokens"] == 0


def test_moving_a_document_into_val_keeps_both_files_consistent(tmp_path):
    docs = _docs(30)
    _prepare(docs, tmp_path / "d", val_fraction=1e-9)  # no document scores below: one is moved
    train, val = _read_docs(tmp_path / "d", "train"), _read_docs(tmp_path / "d", "val")
    assert len(val) == 1 and sorted(train + val) == sorted(docs)
    meta = load_meta(tmp_path / "d")
    assert meta["splits"]["val"]["bytes"] == len(val[0].encode())
    assert meta["splits"]["val"]["tokens"] == len(val[0].encode()) + 1


# --------------------------------------------------------------------------- prepare: tokens + meta
def test_eot_follows_every_document_and_empty_documents_are_dropped(tmp_path):
    _prepare(["ab", "", "c", "", "def"], tmp_path / "d", val_fraction=0.0)
    ids = TokenDataset(tmp_path / "d", "train").tokens
    assert ids.tolist() == [97, 98, 256, 99, 256, 100, 101, 102, 256]


@pytest.mark.parametrize("vocab_size,offset,dtype", [(300, 0, "uint16"), (65536, 65000, "uint16"),
                                                     (70000, 65000, "uint32")])
def test_dtype_is_uint16_up_to_65536_tokens_else_uint32(tmp_path, vocab_size, offset, dtype):
    tok = FakeTokenizer(vocab_size, offset)
    meta = _prepare(["hello \u00e9", "world"], tmp_path / "d", tokenizer=tok)
    assert meta["dtype"] == dtype and meta["eot_id"] == vocab_size - 1
    ds = TokenDataset(tmp_path / "d", "train")
    assert ds.tokens.dtype == np.dtype(dtype) and int(ds.tokens.max()) == vocab_size - 1
    assert sorted(_read_docs(tmp_path / "d", "train", offset) + _read_docs(tmp_path / "d", "val", offset)) == \
        ["hello \u00e9", "world"]


def test_meta_counts_tokens_and_utf8_bytes_per_split(tmp_path):
    docs = ["caf\u00e9", "\u6f22\u5b57 text", "emoji \U0001f600", "plain ascii", "more"]
    tok = FakeTokenizer(400)
    meta = _prepare(docs, tmp_path / "d", tokenizer=tok, val_fraction=0.3, corpus_name="unit")
    assert meta["corpus"] == "unit" and meta["vocab_size"] == 400 and meta["eot_token"] == EOT
    assert meta["format"] == "archlab-tokens" and meta["seed"] == 0 and meta["val_fraction"] == 0.3
    for split in ("train", "val"):
        texts = _read_docs(tmp_path / "d", split)
        info = meta["splits"][split]
        assert info["bytes"] == sum(len(t.encode("utf-8")) for t in texts)
        assert info["tokens"] == sum(len(tok.encode(t)) + 1 for t in texts)
        ds = TokenDataset(tmp_path / "d", split)
        assert ds.n_tokens == info["tokens"] and ds.bytes_per_token == pytest.approx(info["bytes"] / info["tokens"])
    assert json.loads((tmp_path / "d" / "tokenizer" / "fake.json").read_text()) == {"vocab_size": 400}


def test_data_folder_carries_its_byte_tokenizer(tmp_path):
    _prepare(["x", "y"], tmp_path / "d")
    tok = TokenDataset(tmp_path / "d").load_tokenizer()
    assert isinstance(tok, ByteTokenizer) and tok.decode(tok.encode("h\u00e9")) == "h\u00e9"
    assert load_tokenizer(tmp_path / "d" / "tokenizer") == ByteTokenizer()


def test_prepare_reads_a_corpus_path(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i, text in enumerate(["one", "two", "three"]):
        (folder / f"{i}.txt").write_text(text)
    meta = _prepare(folder, tmp_path / "d")
    assert meta["corpus"] == str(folder)
    assert sorted(_read_docs(tmp_path / "d", "train") + _read_docs(tmp_path / "d", "val")) == ["one", "three", "two"]


def test_tokenizer_without_the_eot_token_is_an_error(tmp_path):
    with pytest.raises(DataError, match="no '<\\|end_of_doc\\|>' token"):
        _prepare(["a"], tmp_path / "d", eot_token="<|end_of_doc|>")
    assert not (tmp_path / "d").exists()


def test_unknown_tokenizer_spec_is_an_error(tmp_path):
    with pytest.raises(DataError, match="neither 'bytes' nor"):
        _prepare(["a"], tmp_path / "d", tokenizer=str(tmp_path / "nope"))


def test_crash_mid_prepare_leaves_no_data_folder(tmp_path):
    docs = _docs(20) + ["boom"] + _docs(5)
    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        _prepare(docs, tmp_path / "d", tokenizer=FakeTokenizer(fail_on="boom"))
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its temporary build


def test_existing_folder_is_kept_unless_overwrite(tmp_path):
    _prepare(["first", "run"], tmp_path / "d")
    with pytest.raises(FileExistsError, match="overwrite"):
        _prepare(["second", "run"], tmp_path / "d")
    assert "first" in _read_docs(tmp_path / "d", "train") + _read_docs(tmp_path / "d", "val")
    _prepare(["second", "run"], tmp_path / "d", overwrite=True)
    assert sorted(_read_docs(tmp_path / "d", "train") + _read_docs(tmp_path / "d", "val")) == ["run", "second"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_dataset_on_an_unprepared_folder_is_an_error(tmp_path):
    with pytest.raises(DataError, match="not a prepared data folder"):
        TokenDataset(tmp_path, "train")


# --------------------------------------------------------------------------- sampling
@pytest.fixture
def counting_dir(tmp_path) -> Path:
    """A data folder whose train tokens are 0, 1, 2, ...: a window's first token is its start."""
    n = 5000
    out = tmp_path / "counting"
    out.mkdir()
    np.arange(n, dtype=np.uint16).tofile(out / "train.bin")
    np.arange(n // 10, dtype=np.uint16).tofile(out / "val.bin")
    meta = {"dtype": "uint16", "vocab_size": n, "eot_id": n - 1, "splits": {
        "train": {"file": "train.bin", "tokens": n, "bytes": 2 * n, "documents": 1},
        "val": {"file": "val.bin", "tokens": n // 10, "bytes": n // 10, "documents": 1}}}
    (out / "meta.json").write_text(json.dumps(meta))
    return out


def test_batches_are_int64_windows_with_targets_shifted_by_one(counting_dir):
    x, y = next(BatchSampler(TokenDataset(counting_dir), batch_size=4, seq_len=16, seed=0))
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)
    assert torch.equal(x, x[:, :1] + torch.arange(16))  # contiguous windows


def test_sampler_is_deterministic_per_seed(counting_dir):
    ds = TokenDataset(counting_dir)
    a = [next(BatchSampler(ds, 4, 16, seed=1))[0] for _ in range(2)]
    assert torch.equal(a[0], a[1])
    b = next(BatchSampler(ds, 4, 16, seed=2))[0]
    assert not torch.equal(a[0], b)


def test_resumed_sampler_continues_exactly(counting_dir):
    ds = TokenDataset(counting_dir)
    run = BatchSampler(ds, 8, 32, seed=5)
    for _ in range(40):  # past an epoch boundary (155 windows / 8 per step)
        next(run)
    state = json.loads(json.dumps(run.state_dict()))  # survives a checkpoint file
    expected = [next(run) for _ in range(5)]
    resumed = BatchSampler(ds, 8, 32, seed=5)
    resumed.load_state_dict(state)
    for (x, y), (ex, ey) in zip((next(resumed) for _ in range(5)), expected):
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_ranks_split_the_single_process_global_batch(counting_dir):
    ds = TokenDataset(counting_dir)
    single = BatchSampler(ds, batch_size=6, seq_len=32, seed=7)
    ranks = [BatchSampler(ds, batch_size=3, seq_len=32, seed=7, rank=r, world_size=2) for r in range(2)]
    for _ in range(60):  # crosses several epochs
        x, y = next(single)
        parts = [next(r) for r in ranks]
        assert torch.equal(x, torch.cat([p[0] for p in parts])) and torch.equal(y, torch.cat([p[1] for p in parts]))
        assert not torch.equal(parts[0][0], parts[1][0])


def test_resume_onto_a_different_world_size_with_the_same_global_batch(counting_dir):
    ds = TokenDataset(counting_dir)
    single = BatchSampler(ds, 4, 32, seed=0)
    for _ in range(7):
        next(single)
    rank1 = BatchSampler(ds, 2, 32, seed=0, rank=1, world_size=2)
    rank1.load_state_dict(single.state_dict())
    assert torch.equal(next(rank1)[0], next(single)[0][2:])
    with pytest.raises(DataError, match="global_batch_size"):
        BatchSampler(ds, 3, 32, seed=0).load_state_dict(single.state_dict())


def test_an_epoch_visits_disjoint_windows_once_and_epochs_differ(counting_dir):
    ds = TokenDataset(counting_dir)
    sampler = BatchSampler(ds, batch_size=5, seq_len=32, seed=0, rank=0, world_size=1)
    n = sampler.windows_per_epoch
    assert n == (5000 - 1) // 32 - 1
    epochs = [[s for i in range(k * n, (k + 1) * n) for s in [_start_of(sampler, i)]] for k in range(2)]
    for starts in epochs:
        assert len(set(starts)) == n
        ordered = sorted(starts)
        assert all(b - a == 32 for a, b in zip(ordered, ordered[1:]))  # non-overlapping, no gaps
        assert ordered[-1] + 33 <= 5000
    assert epochs[0] != epochs[1]


def _start_of(sampler: BatchSampler, sample: int) -> int:
    epoch, pos = divmod(sample, sampler.windows_per_epoch)
    offset, perm = sampler._epoch(epoch)
    return offset + int(perm[pos]) * sampler.seq_len


def test_sampler_rejects_a_split_shorter_than_a_window(tmp_path):
    _prepare(["ab", "cd"], tmp_path / "d")
    with pytest.raises(DataError, match="fewer than seq_len"):
        BatchSampler(TokenDataset(tmp_path / "d", "val"), 2, 8)


# --------------------------------------------------------------------------- evaluation batches
def test_eval_batches_are_contiguous_non_overlapping_and_cover_the_split(counting_dir):
    ds = TokenDataset(counting_dir, "validation")  # 500 tokens -> 15 windows of 32 (+1 target)
    batches = list(eval_batches(ds, batch_size=4, seq_len=32))
    assert [b[0].shape[0] for b in batches] == [4, 4, 4, 3]
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    assert torch.equal(x.flatten(), torch.arange(15 * 32)) and torch.equal(y, x + 1)
    shards = [list(eval_batches(ds, 4, 32, rank=r, world_size=2)) for r in range(2)]
    assert [len(s) for s in shards] == [2, 2] and torch.equal(shards[1][0][0], batches[1][0])


def test_fewer_eval_batches_than_the_split_holds_spread_over_all_of_it(counting_dir):
    """The first windows alone would score the split's first documents only."""
    ds = TokenDataset(counting_dir, "validation")  # 15 windows of 32
    again = list(eval_batches(ds, batch_size=4, seq_len=32, max_batches=2))
    x, y = torch.cat([b[0] for b in again]), torch.cat([b[1] for b in again])
    assert [b[0].shape[0] for b in again] == [4, 4]
    assert x[:, 0].tolist() == [32 * k for k in (0, 1, 3, 5, 7, 9, 11, 13)]      # k = i * 15 // 8: evenly spread
    assert torch.equal(x, x[:, :1] + torch.arange(32)) and torch.equal(y, x + 1)  # whole windows, their targets
    shards = [list(eval_batches(ds, 4, 32, max_batches=2, rank=r, world_size=2)) for r in range(2)]
    assert torch.equal(torch.cat([shards[0][0][0], shards[1][0][0]]), x)        # ranks split the same windows


# --------------------------------------------------------------------------- command line
def test_cli_prepare_writes_a_data_folder(tmp_path, capsys):
    from archlab.cli import main

    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(4):
        (folder / f"{i}.txt").write_text(f"text number {i}")
    out = tmp_path / "data"
    rc = main(["data", "prepare", "--corpus", str(folder), "--tokenizer", "bytes", "--out", str(out),
               "--workers", "0", "--quiet", "--val-fraction", "0.3"])
    assert rc == 0 and "train" in capsys.readouterr().out
    assert TokenDataset(out).n_tokens + TokenDataset(out, "val").n_tokens == sum(len(f"text number {i}") + 1
                                                                                   for i in range(4))
    rc = main(["data", "prepare", "--corpus", str(tmp_path / "missing"), "--tokenizer", "bytes",
               "--out", str(tmp_path / "x"), "--quiet"])
    assert rc == 2 and "missing" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------- repeated data (train.stream.unique_tokens)
def test_unique_tokens_trains_on_the_splits_head_repeated_epoch_after_epoch(counting_dir):
    from archlab.config import ModelConfig
    from archlab.data.batches import TrainBatches
    from archlab.training.config import TrainConfig

    cfg = TrainConfig().with_overrides({"batch_size": "4", "seq_len": "16", "stream.unique_tokens": "1e3",
                                        "stream.unique_spread": "false"})
    assert cfg.stream.unique_tokens == 1000
    batches = TrainBatches(ModelConfig(vocab_size=5000), cfg, TokenDataset(counting_dir))
    per_epoch = (1000 - 1) // 16 - 1                      # 61 windows of 17 tokens fit in the first 1000
    assert batches.sampler.windows_per_epoch == per_epoch
    seen = []
    for step in range(per_epoch):                         # 4 windows a step: exactly 4 epochs
        inputs, labels = batches.next(step, 0)
        seen.append(inputs["input_ids"])
        assert int(labels.max()) <= 999                   # the last target is token 999 at most: never past the head
    assert batches.epoch == pytest.approx(4.0)
    starts = torch.cat(seen)[:, 0].tolist()
    for k in range(4):                                    # each epoch visits its own 61 disjoint windows once
        epoch = sorted(starts[k * per_epoch:(k + 1) * per_epoch])
        assert all(b - a == 16 for a, b in zip(epoch, epoch[1:]))


def test_unique_tokens_spread_takes_equal_chunks_strided_over_the_split_and_every_epoch_repeats_exactly_them(
        counting_dir):
    from archlab.config import ModelConfig
    from archlab.data.batches import TrainBatches
    from archlab.training.config import TrainConfig

    cfg = TrainConfig().with_overrides({"batch_size": "7", "seq_len": "16", "stream.unique_tokens": "1000",
                                        "stream.unique_chunk_windows": "8"})
    assert cfg.stream.unique_spread                       # the default
    batches = TrainBatches(ModelConfig(vocab_size=5000), cfg, TokenDataset(counting_dir))
    # by hand: chunks of >= 8 * 16 = 128 tokens -> k = 1000 // 128 = 7; lengths i*1000//7 apart: 142, then 6 x 143;
    # the 4000 unused tokens as gaps of i*4000//7: chunk i starts at i*1000//7 + i*4000//7 of the 5000
    firsts = [0, 713, 1427, 2142, 2856, 3571, 4285]
    lengths = [142, 143, 143, 143, 143, 143, 143]
    subset = np.concatenate([np.arange(a, a + m) for a, m in zip(firsts, lengths)])
    data = batches.sampler.dataset
    assert data.n_tokens == 1000 and np.array_equal(np.asarray(data.tokens), subset)
    assert data.chunk_starts.tolist() == [0, 142, 285, 428, 571, 714, 857]
    per_epoch = 7 * ((142 - 16) // 16)                    # 7 windows a chunk, whatever the epoch's offset
    assert batches.sampler.windows_per_epoch == per_epoch == 49
    chunk_of = {int(t): c for c, (a, m) in enumerate(zip(firsts, lengths)) for t in range(a, a + m)}
    epochs = []
    for epoch in range(4):
        seen = set()
        for step in range(7 * epoch, 7 * epoch + 7):     # 7 steps of 7 windows: one epoch
            inputs, labels = batches.next(step, 0)
            for x, y in zip(inputs["input_ids"], labels):
                span = [int(t) for t in x] + [int(y[-1])]
                assert span == list(range(span[0], span[0] + 17))       # contiguous in the split: no seam crossed
                assert {chunk_of.get(t) for t in span} == {chunk_of[span[0]]}   # inside one chunk
                seen.add(span[0])
        starts = sorted(seen)
        assert len(starts) == 49                                         # each window once an epoch
        offsets = {s - firsts[chunk_of[s]] for s in starts}
        assert len({o % 16 for o in offsets}) == 1                       # one offset an epoch, in every chunk
        assert sorted({chunk_of[s] for s in starts}) == list(range(7))   # every chunk, every epoch
        epochs.append(starts)
    assert batches.epoch == pytest.approx(4.0)
    assert len({tuple(e) for e in epochs}) > 1                           # the offset moves between epochs


def test_a_spread_subset_keeps_sentence_starts_and_refuses_a_bad_size(counting_dir):
    from archlab.config import ConfigError
    from archlab.training.config import TrainConfig

    train = TokenDataset(counting_dir)
    train.sentence_starts = np.array([0, 50, 140, 150, 700, 720, 4999])
    part = train.spread(1000, 128)                        # chunks [0, 142), [713, 856), ... glued at 0, 142, ...
    assert part.sentence_starts.tolist() == [0, 50, 140, 142 + 720 - 713]
    assert part.n_bytes == round(train.n_bytes * 1000 / 5000) and train.n_tokens == 5000
    assert np.array_equal(np.asarray(train.spread(5000, 128).tokens), np.arange(5000))  # all of it: the split
    with pytest.raises(DataError, match="unique_tokens"):
        train.spread(5001, 128)
    with pytest.raises(ConfigError, match="unique_chunk_windows"):
        TrainConfig(stream={"unique_chunk_windows": 4})


def test_a_splits_head_counts_its_tokens_bytes_and_documents_and_refuses_a_cut_past_the_end(tmp_path):
    docs = _docs(40)
    _prepare(docs, tmp_path / "d", val_fraction=0.1)
    train = TokenDataset(tmp_path / "d", "train")
    ids = np.asarray(train.tokens, dtype=np.int64)
    cut = int(np.flatnonzero(ids == train.eot_id)[4]) + 1          # five whole documents
    head = train.head(cut)
    assert head.n_tokens == len(head) == cut and np.array_equal(np.asarray(head.tokens), ids[:cut])
    assert head.n_documents == 5 and train.n_tokens == len(ids)      # the original is untouched
    assert head.n_bytes == round(train.n_bytes * cut / train.n_tokens)
    with pytest.raises(DataError, match="unique_tokens"):
        train.head(train.n_tokens + 1)


def test_unique_tokens_must_be_a_whole_positive_number():
    from archlab.config import ConfigError
    from archlab.training.config import TrainConfig

    for bad in (0, -5, 2.5, True):
        with pytest.raises(ConfigError, match="unique_tokens"):
            TrainConfig(stream={"unique_tokens": bad})
    assert TrainConfig().with_overrides({"train.stream.unique_tokens": "none"}).stream.unique_tokens is None
