"""archlab.data.seq2seq: paired source/target data for encoder-decoders, prepared from .jsonl and sampled."""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from archlab.data.batches import tokens_processed
from archlab.data.formats import detect
from archlab.data.prepare import prepare
from archlab.data.seq2seq import Seq2SeqDataset, Seq2SeqSampler, prepare_seq2seq, seq2seq_eval_batches
from archlab.data.tokenizer_adapter import ByteTokenizer
from archlab.data.tokens import TokenDataset
from archlab.errors import DataError, UserError
from archlab.faults import FAULT_EXIT
from archlab.runs.outputs import OutputExistsError
from archlab.runs.provenance import data_fingerprint

EOT = ByteTokenizer.eot_id


def make_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """n distinct pairs of varied lengths, some non-ASCII, one empty target."""
    rng = random.Random(seed)
    words = ["der", "Hund", "läuft", "schnell", "über", "die", "Straße", "日本", "ok"]
    out = []
    for i in range(n):
        source = f"{i} " + " ".join(rng.choice(words) for _ in range(rng.randint(0, 8)))
        target = "" if i == 3 else f"#{i} " + " ".join(rng.choice(words) for _ in range(rng.randint(0, 5)))
        out.append((source, target))
    return out


def write_jsonl(path, pairs, source="source", target="target"):
    path.write_text("".join(json.dumps({source: s, target: t}, ensure_ascii=False) + "\n" for s, t in pairs))
    return path


def expected_ids(text: str) -> tuple[int, ...]:
    return (*ByteTokenizer().encode(text), EOT)


def split_contents(data_dir) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    out = {}
    for split in ("train", "val"):
        ds = Seq2SeqDataset(data_dir, split)
        out[split] = [(tuple(ds.source(i).tolist()), tuple(ds.target(i).tolist())) for i in range(len(ds))]
    return out


@pytest.fixture(scope="module")
def pairs_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pairs")
    pairs = make_pairs(40)
    write_jsonl(tmp / "pairs.jsonl", pairs)
    prepare_seq2seq(tmp / "pairs.jsonl", "bytes", tmp / "data", val_fraction=0.2, num_workers=0, progress=False)
    return tmp / "data", pairs


# --------------------------------------------------------------------------- prepare
def test_prepared_ids_are_the_tokenizer_encoding_plus_eot_in_file_order(pairs_dir):
    data_dir, pairs = pairs_dir
    index = {(expected_ids(s), expected_ids(t)): i for i, (s, t) in enumerate(pairs)}
    seen = []
    for split, rows in split_contents(data_dir).items():
        lines = [index[row] for row in rows]   # KeyError: a pair that is not some line's encoding
        assert lines == sorted(lines), f"{split} pairs are not in file order"
        seen += lines
    assert sorted(seen) == list(range(len(pairs)))
    meta = json.loads((data_dir / "meta.json").read_text())
    assert meta["format"] == "archlab-pairs" and meta["eot_id"] == EOT and meta["dtype"] == "uint16"
    for split, info in meta["splits"].items():
        offsets = np.fromfile(data_dir / f"{split}.offsets.bin", dtype="<i8").reshape(-1, 2)
        sources = np.fromfile(data_dir / f"{split}.source.bin", dtype="<u2")
        assert offsets.shape == (info["pairs"] + 1, 2) and offsets[0].tolist() == [0, 0]
        assert offsets[-1].tolist() == [info["source_tokens"], info["target_tokens"]] == [
            sources.size, (data_dir / f"{split}.target.bin").stat().st_size // 2]
        assert (sources[offsets[1:, 0] - 1] == EOT).all()   # every source ends with the end-of-text id
        lengths = np.diff(offsets, axis=0)
        assert [info["max_source_len"], info["max_target_len"]] == lengths.max(axis=0).tolist()
        texts = [pairs[index[row]] for row in split_contents(data_dir)[split]]
        assert info["source_bytes"] == sum(len(s.encode()) for s, _ in texts)
    assert meta["splits"]["train"]["pairs"] > meta["splits"]["val"]["pairs"] > 0
    train = Seq2SeqDataset(data_dir)
    assert train.load_tokenizer() == ByteTokenizer()
    targets = [pairs[index[row]][1] for row in split_contents(data_dir)["train"]]
    assert train.n_tokens == train.sources.size + train.targets.size
    assert train.bytes_per_token == sum(len(t.encode()) for t in targets) / sum(len(t.encode()) + 1 for t in targets)


def test_fingerprint_covers_every_file_of_a_pairs_folder(tmp_path, pairs_dir):
    shutil.copytree(pairs_dir[0], tmp_path / "d")
    before = data_fingerprint(tmp_path / "d")
    for name in ("val.target.bin", "train.offsets.bin"):
        path = tmp_path / "d" / name
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
        assert data_fingerprint(tmp_path / "d") != before, name
        before = data_fingerprint(tmp_path / "d")


def test_split_depends_on_seed_and_pairs_not_on_file_order(tmp_path):
    pairs = make_pairs(60)
    shuffled = list(pairs)
    random.Random(1).shuffle(shuffled)
    runs = {}
    for name, rows, seed in (("a", pairs, 0), ("b", shuffled, 0), ("c", pairs, 1)):
        write_jsonl(tmp_path / f"{name}.jsonl", rows)
        prepare_seq2seq(tmp_path / f"{name}.jsonl", "bytes", tmp_path / name, val_fraction=0.3, seed=seed,
                      num_workers=0, progress=False)
        runs[name] = {split: sorted(rows) for split, rows in split_contents(tmp_path / name).items()}
    assert runs["a"] == runs["b"]
    assert runs["a"]["val"] != runs["c"]["val"]


def test_tokenizing_processes_write_the_same_files(tmp_path, pairs_dir):
    data_dir, pairs = pairs_dir
    write_jsonl(tmp_path / "pairs.jsonl", pairs)
    prepare_seq2seq(tmp_path / "pairs.jsonl", "bytes", tmp_path / "data", val_fraction=0.2, num_workers=2,
                  progress=False)
    for path in sorted(data_dir.glob("*.bin")):
        assert (tmp_path / "data" / path.name).read_bytes() == path.read_bytes(), path.name


@pytest.mark.parametrize("n, expect", [(1, (1, 0)), (2, (1, 1))])
def test_two_or_more_pairs_keep_one_for_each_split(tmp_path, n, expect):
    write_jsonl(tmp_path / "p.jsonl", make_pairs(n))
    meta = prepare_seq2seq(tmp_path / "p.jsonl", "bytes", tmp_path / "d", val_fraction=0.01, num_workers=0,
                         progress=False)
    assert (meta["splits"]["train"]["pairs"], meta["splits"]["val"]["pairs"]) == expect


def test_custom_fields_and_an_existing_folder(tmp_path):
    write_jsonl(tmp_path / "p.jsonl", [("hallo", "hello"), ("Welt", "world")], source="de", target="en")
    prepare_seq2seq(tmp_path / "p.jsonl", "bytes", tmp_path / "d", source_field="de", target_field="en",
                  num_workers=0, progress=False)
    rows = sorted(sum(split_contents(tmp_path / "d").values(), []))
    assert rows == sorted([(expected_ids("hallo"), expected_ids("hello")),
                           (expected_ids("Welt"), expected_ids("world"))])
    with pytest.raises(OutputExistsError, match="--overwrite"):
        prepare_seq2seq(tmp_path / "p.jsonl", "bytes", tmp_path / "d", source_field="de", target_field="en",
                      progress=False)
    write_jsonl(tmp_path / "p.jsonl", [("a", "b")], source="de", target="en")
    prepare_seq2seq(tmp_path / "p.jsonl", "bytes", tmp_path / "d", source_field="de", target_field="en",
                  num_workers=0, overwrite=True, progress=False)
    assert len(Seq2SeqDataset(tmp_path / "d")) == 1


BAD_LINES = {
    "not json": ('{"source": "a", "target": "b"}\n{"source": "a", target}\n', r"pairs\.jsonl:2: not valid JSON"),
    "no target": ('{"source": "a", "target": "b"}\n\n{"source": "a", "tgt": "b"}\n',
                  r"line 3 of \S*pairs\.jsonl has no 'target' field \(it has 'source', 'tgt'"),
    "no source": ('{"target": "b"}\n', r"line 1 of \S*pairs\.jsonl has no 'source' field"),
    "not a string": ('{"source": "a", "target": ["b"]}\n', r"line 1 of \S*pairs\.jsonl: field 'target' is list"),
    "null": ('{"source": null, "target": "b"}\n', r"line 1 of \S*pairs\.jsonl: field 'source' is NoneType"),
    "not an object": ('["a", "b"]\n', r"line 1 of \S*pairs\.jsonl is a JSON list, not an object"),
    "empty file": ("\n\n", r"pairs\.jsonl holds no pairs"),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_bad_input_is_one_line_naming_file_and_line(tmp_path, case):
    text, message = BAD_LINES[case]
    (tmp_path / "pairs.jsonl").write_text(text)
    with pytest.raises(UserError, match=message) as err:   # DataError, or corpora's CorpusError for bad JSON
        prepare_seq2seq(tmp_path / "pairs.jsonl", "bytes", tmp_path / "d", num_workers=0, progress=False)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "d").exists() and list(tmp_path.iterdir()) == [tmp_path / "pairs.jsonl"]


def test_a_leading_bom_is_dropped_as_in_corpora(tmp_path):
    pairs = make_pairs(6)
    plain = write_jsonl(tmp_path / "plain.jsonl", pairs)
    marked = tmp_path / "bom.jsonl"
    marked.write_bytes("\ufeff".encode() + plain.read_bytes())
    for path in (plain, marked):
        prepare_seq2seq(path, "bytes", tmp_path / path.stem, val_fraction=0.2, num_workers=0, progress=False)
    assert split_contents(tmp_path / "bom") == split_contents(tmp_path / "plain")


def test_a_pairs_corpus_is_one_jsonl_file(tmp_path):
    (tmp_path / "pairs.txt").write_text("a\tb\n")
    with pytest.raises(DataError, match="not a .jsonl path"):
        prepare_seq2seq(tmp_path / "pairs.txt", "bytes", tmp_path / "d", progress=False)
    with pytest.raises(DataError, match="does not exist"):
        prepare_seq2seq(tmp_path / "missing.jsonl", "bytes", tmp_path / "d", progress=False)


# --------------------------------------------------------------------------- folder kinds
def test_each_folder_kind_refuses_the_other_reader(tmp_path, pairs_dir):
    data_dir, _ = pairs_dir
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("some text for a token stream")
    prepare(tmp_path / "texts", "bytes", tmp_path / "tokens", num_workers=0, progress=False)
    with pytest.raises(DataError, match="is a source/target pairs folder, not a token-stream folder: "
                       "read it with archlab.data.seq2seq.Seq2SeqDataset"):
        TokenDataset(data_dir)
    with pytest.raises(DataError, match="is a token-stream folder, not a source/target pairs folder: "
                       "read it with archlab.data.tokens.TokenDataset"):
        Seq2SeqDataset(tmp_path / "tokens")
    assert detect(data_dir).format == "seq2seq_pairs" and detect(tmp_path / "tokens").format == "token_stream"


# --------------------------------------------------------------------------- sampling
def test_batch_rows_are_padded_pairs_with_mask_and_ignored_labels(pairs_dir):
    ds = Seq2SeqDataset(pairs_dir[0])
    sampler = Seq2SeqSampler(ds, 6, max_source_len=ds.max_source_len, max_target_len=ds.max_target_len, pad_id=7)
    inputs, labels = sampler.batch(3)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    sources = [ds.source(i) for i in sampler.indices(3)]
    targets = [ds.target(i) for i in sampler.indices(3)]
    assert ids.dtype == mask.dtype == labels.dtype == torch.int64
    assert ids.shape == mask.shape == (6, max(map(len, sources)))
    assert labels.shape == (6, max(map(len, targets)))
    for row, (src, tgt) in enumerate(zip(sources, targets)):
        assert ids[row, :len(src)].tolist() == src.tolist() and set(ids[row, len(src):].tolist()) <= {7}
        assert mask[row].tolist() == [1] * len(src) + [0] * (ids.shape[1] - len(src))
        assert labels[row, :len(tgt)].tolist() == tgt.tolist()
        assert set(labels[row, len(tgt):].tolist()) <= {-100}
    assert tokens_processed(inputs, labels, "encoder_decoder") == sum(map(len, sources + targets))


def test_batch_is_a_pure_function_of_step_and_resumes_from_state(pairs_dir):
    ds = Seq2SeqDataset(pairs_dir[0])
    limits = dict(max_source_len=ds.max_source_len, max_target_len=ds.max_target_len)
    straight = Seq2SeqSampler(ds, 4, seed=3, **limits)
    batches = [next(straight) for _ in range(20)]  # 80 samples: past two epochs of 30-odd pairs
    fresh = Seq2SeqSampler(ds, 4, seed=3, **limits)
    for step in (7, 0, 19, 7):
        assert_same(fresh.batch(step), batches[step])
    first = Seq2SeqSampler(ds, 4, seed=3, **limits)
    for _ in range(9):
        next(first)
    resumed = Seq2SeqSampler(ds, 4, seed=3, **limits)
    resumed.load_state_dict(first.state_dict())
    for step in range(9, 20):
        assert_same(next(resumed), batches[step])
    assert resumed.step == 20 and resumed.epoch == pytest.approx(80 / len(ds))
    with pytest.raises(DataError, match="seed=3"):
        Seq2SeqSampler(ds, 4, seed=4, **limits).load_state_dict(first.state_dict())
    with pytest.raises(DataError, match="global_batch_size=4"):
        Seq2SeqSampler(ds, 2, seed=3, **limits).load_state_dict(first.state_dict())


def assert_same(a, b):
    assert a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
    assert torch.equal(a[1], b[1])


def test_ranks_split_the_global_batch(pairs_dir):
    ds = Seq2SeqDataset(pairs_dir[0])
    limits = dict(max_source_len=ds.max_source_len, max_target_len=ds.max_target_len)
    whole = Seq2SeqSampler(ds, 6, seed=1, **limits)
    ranks = [Seq2SeqSampler(ds, 3, seed=1, rank=r, world_size=2, **limits) for r in range(2)]
    for step in range(12):
        assert whole.indices(step) == ranks[0].indices(step) + ranks[1].indices(step)
    resumed = Seq2SeqSampler(ds, 2, seed=1, rank=1, world_size=3, **limits)   # same global batch, 3 ranks
    resumed.load_state_dict(whole.state_dict())
    assert resumed.indices(5) == whole.indices(5)[2:4]


def test_every_pair_once_per_epoch(pairs_dir):
    ds = Seq2SeqDataset(pairs_dir[0])
    sampler = Seq2SeqSampler(ds, 5, seed=2, max_source_len=ds.max_source_len, max_target_len=ds.max_target_len)
    n = len(ds)
    seen = [i for step in range(-(-3 * n // 5)) for i in sampler.indices(step)]
    epochs = [seen[e * n:(e + 1) * n] for e in range(3)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert epochs[0] != epochs[1]


def test_too_long_pairs_are_named_at_construction(pairs_dir):
    ds = Seq2SeqDataset(pairs_dir[0])
    lengths = np.array([[len(ds.source(i)), len(ds.target(i))] for i in range(len(ds))])
    limit = int(np.median(lengths[:, 0]))
    over = int((lengths[:, 0] > limit).sum())
    message = (f"{over} of {len(ds)} train sources are longer than max_source_len={limit} "
               f"(longest {lengths[:, 0].max()} tokens")
    with pytest.raises(DataError, match=message.replace("(", r"\(")):
        Seq2SeqSampler(ds, 2, max_source_len=limit, max_target_len=100)
    with pytest.raises(DataError, match="train targets are longer than max_target_len=1 "):
        Seq2SeqSampler(ds, 2, max_source_len=100, max_target_len=1)
    Seq2SeqSampler(ds, 2, max_source_len=int(lengths[:, 0].max()), max_target_len=int(lengths[:, 1].max()))


def test_eval_batches_cover_the_split_in_order(pairs_dir):
    ds = Seq2SeqDataset(pairs_dir[0], "train")
    batches = list(seq2seq_eval_batches(ds, 8, pad_id=0))
    assert [b[1].shape[0] for b in batches[:-1]] == [8] * (len(batches) - 1)
    assert sum(b[1].shape[0] for b in batches) == len(ds)
    targets = [row[row != -100].tolist() for _, labels in batches for row in labels]
    assert targets == [ds.target(i).tolist() for i in range(len(ds))]
    assert len(list(seq2seq_eval_batches(ds, 8, max_batches=2))) == 2
    shards = [list(seq2seq_eval_batches(ds, 8, rank=r, world_size=2)) for r in range(2)]
    assert_same(shards[1][0], batches[1])
    assert [len(s) for s in shards] == [len(batches[0::2]), len(batches[1::2])]
    with pytest.raises(DataError, match="train targets are longer than max_target_len=2 "):
        next(seq2seq_eval_batches(ds, 8, max_target_len=2))


# --------------------------------------------------------------------------- command line
def test_cli_prepares_pairs_and_reports_bad_input_as_status_2(tmp_path, capsys):
    from archlab.cli import main

    write_jsonl(tmp_path / "p.jsonl", make_pairs(10), source="de", target="en")
    args = ["data", "prepare", "--seq2seq", "--corpus", str(tmp_path / "p.jsonl"), "--tokenizer", "bytes",
            "--workers", "0", "--quiet", "--source-field", "de", "--target-field", "en"]
    assert main([*args, "--out", str(tmp_path / "d")]) == 0
    assert "pairs" in capsys.readouterr().out and len(Seq2SeqDataset(tmp_path / "d")) > 0
    old = [("--pairs" if a == "--seq2seq" else a) for a in args]       # the flag's earlier name still works
    assert main([*old, "--out", str(tmp_path / "d2")]) == 0 and len(Seq2SeqDataset(tmp_path / "d2")) > 0
    assert "--pairs is deprecated: it is --seq2seq now" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"de": "a", "en": "b"}\n{"de": "a"}\n')
    args[args.index(str(tmp_path / "p.jsonl"))] = str(tmp_path / "bad.jsonl")
    assert main([*args, "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert "line 2 of" in err and "has no 'en' field" in err and "Traceback" not in err
    assert main([*args[:3], "--corpus", str(tmp_path), *args[5:], "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert "not a .jsonl path" in err and "Traceback" not in err and not (tmp_path / "e").exists()


def test_a_killed_prepare_leaves_no_folder_and_a_rerun_completes(tmp_path):
    write_jsonl(tmp_path / "p.jsonl", make_pairs(10))
    code = ("from archlab.data.seq2seq import prepare_seq2seq\n"
            f"prepare_seq2seq({str(tmp_path / 'p.jsonl')!r}, 'bytes', {str(tmp_path / 'd')!r}, num_workers=0)\n")
    env = {**os.environ, "ARCHLAB_FAULT": "prepare:split"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == FAULT_EXIT, proc.stderr
    assert not (tmp_path / "d").exists() and list(tmp_path.glob(".d.partial-*"))
    prepare_seq2seq(tmp_path / "p.jsonl", "bytes", tmp_path / "d", num_workers=0, progress=False)
    assert len(Seq2SeqDataset(tmp_path / "d")) + len(Seq2SeqDataset(tmp_path / "d", "val")) == 10
    assert not list(tmp_path.glob(".d.partial-*"))
