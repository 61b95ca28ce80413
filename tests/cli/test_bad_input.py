"""Bad input over every subcommand: exit status 2, exactly one stderr line that names the problem, no
traceback, and nothing on disk changed (issue: "what new users hit").

Each case is (id, argv with {placeholders}, expected text in the message[, setup]). Placeholders:
{data} a prepared data folder, {run} a trained run folder, {tok} a BPE tokenizer folder, {hf} an HF export,
{corpus} a text folder, {new} a path that does not exist yet, {tmp} this case's own folder, {bad} a file
the case's setup writes. The CLI runs in-process (archlab.cli.main), so the whole suite takes seconds."""
from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import yaml
from test_checkpoint import make_data, tiny_model

from archlab.cli import main
from archlab.training.trainer import TrainConfig, train


# ---- shared fixtures: built once, snapshot-checked after every case ----------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(f"to be or not to be, that is question number {i}. " * 30)
    data = make_data(root / "data", n_docs=12, words=120)
    cfg = TrainConfig(batch_size=4, seq_len=16, budget=2, warmup_steps=1, eval_batches=1, sample_every=-1)
    train(tiny_model(), cfg, data, root / "run", progress=False)
    assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "300", "--no-progress",
                 "--out", str(root / "tok")]) == 0
    bpe_data = root / "bpe_data"
    assert main(["data", "prepare", "--corpus", str(corpus), "--tokenizer", str(root / "tok"), "--out",
                 str(bpe_data), "--workers", "0", "--quiet"]) == 0
    train(tiny_model().with_overrides({"vocab_size": 300}), cfg, bpe_data, root / "bpe_run", progress=False)
    assert main(["convert", "--to-hf", str(root / "bpe_run"), "--out", str(root / "hf")]) == 0
    assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "300", "--no-progress",
                 "--special-tokens", "<|endoftext|>", "[MASK]", "--out", str(root / "mask_tok")]) == 0
    assert main(["data", "prepare", "--corpus", str(corpus), "--tokenizer", str(root / "mask_tok"), "--out",
                 str(root / "mlm_data"), "--workers", "0", "--quiet"]) == 0
    encoder = tiny_model().with_overrides({"arch": "encoder", "vocab_size": 300, "position.kind": "rope"})
    train(encoder, cfg, root / "mlm_data", root / "enc_run", progress=False)
    (root / "prompt.txt").write_text("to be or not to be " * 5)
    (root / "suite.yaml").write_text(yaml.safe_dump({"name": "mini", "claim": "c", "seeds": 1, "axes": [
        {"name": "norm", "key": "norm.kind", "values": ["layernorm", "rmsnorm"]}]}))
    return {"data": root / "data", "run": root / "run", "tok": root / "tok", "hf": root / "hf",
            "corpus": corpus, "bpe_run": root / "bpe_run", "enc_run": root / "enc_run", "prompt": root / "prompt.txt",
            "suite": root / "suite.yaml", "root": root}


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- setups that make a broken file in the case's own folder ----------------------------------------
def write(name: str, content: str | bytes):
    def setup(tmp: Path, w: dict) -> None:
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return setup


def copy_of(what: str, then=None):
    """A copy of a shared folder as {tmp}/copy, optionally damaged by `then(copy)`."""
    def setup(tmp: Path, w: dict) -> None:
        shutil.copytree(w[what], tmp / "copy")
        if then is not None:
            then(tmp / "copy")
    return setup


def truncate(rel: str):
    def damage(folder: Path) -> None:
        path = next(folder.glob(rel))
        path.write_bytes(path.read_bytes()[:64])
    return damage


def flip_byte(rel: str):
    """One byte of the tensor data changed: same size, a readable file, other weights."""
    def damage(folder: Path) -> None:
        path = next(folder.glob(rel))
        data = bytearray(path.read_bytes())
        data[-9] ^= 0x40
        path.write_bytes(bytes(data))
    return damage


def foreign_link(rel: str):
    """The weights file replaced by a link to a file outside the folder (here a copy of the same bytes, so only
    the link gives it away)."""
    def damage(folder: Path) -> None:
        path = next(folder.glob(rel))
        foreign = folder.parent / "foreign.safetensors"
        shutil.move(path, foreign)
        path.symlink_to(foreign)
    return damage


def edit_json(rel: str, change):
    def damage(folder: Path) -> None:
        path = next(folder.glob(rel))
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))
    return damage


def shard_index(names):
    """An HF folder whose model.safetensors.index.json names `names` as the shard of every tensor."""
    def damage(folder: Path) -> None:
        from safetensors import safe_open
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            keys = list(f.keys())
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: names for k in keys}}))
    return damage


def replace_text(rel: str, text: str):
    def damage(folder: Path) -> None:
        next(folder.glob(rel)).write_text(text)
    return damage


def other_model_config(folder: Path) -> None:
    cfg = yaml.safe_load((folder / "config.yaml").read_text())
    cfg["model"]["d_model"] = 64
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))


def hf_field(key: str, value):
    def damage(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, key: value}))
    return damage


def model_field(key: str, value):
    def damage(folder: Path) -> None:
        cfg = yaml.safe_load((folder / "config.yaml").read_text())
        cfg["model"][key] = value
        (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    return damage


def nan_in(rel: str):
    def damage(folder: Path) -> None:
        from safetensors.torch import load_file, save_file
        path = next(folder.glob(rel))
        tensors = load_file(path)
        name = sorted(tensors)[-1]
        tensors[name].view(-1)[0] = float("nan")
        save_file(tensors, path, metadata={"format": "pt"})
    return damage


def nan_in_checkpoint(name: str):
    """NaN in three values of weight `name` of the run's checkpoint, meta.json's size and sha256 rewritten to
    match: a checkpoint that verifies but holds weights of a run that diverged."""
    def damage(folder: Path) -> None:
        from safetensors import safe_open
        from safetensors.torch import save_file

        from archlab.runs.checkpoint import sha256_file
        path = next(folder.glob(CKPT))
        with safe_open(str(path), "pt") as f:
            tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        tensors[name].view(-1)[:3] = float("nan")
        save_file(tensors, path, metadata=metadata)

        def rehash(meta: dict) -> None:
            meta["files"][path.name], meta["sha256"][path.name] = path.stat().st_size, sha256_file(path)
        edit_json("checkpoints/step_*/meta.json", rehash)(folder)
    return damage


def nonempty_dir(tmp: Path, w: dict) -> None:
    (tmp / "out").mkdir()
    (tmp / "out" / "keep.txt").write_text("mine")


def live_lock(folder: Path) -> None:
    """A lock held by pid 1 on this host: a process that is always alive."""
    import socket
    import time
    (folder / ".lock").write_text(json.dumps({"pid": 1, "host": socket.gethostname(), "since": time.time(),
                                              "heartbeat": time.time()}))


def combine(*setups):
    def setup(tmp: Path, w: dict) -> None:
        for s in setups:
            s(tmp, w)
    return setup


def seq2seq_run(tmp: Path, w: dict) -> None:
    """{tmp}/s2s: a run folder holding a tiny encoder-decoder with learned positions (max_seq_len 8) and the
    BPE run's tokenizer."""
    from archlab.config import ModelConfig
    from archlab.models import build_model
    from archlab.runs.checkpoint import save_checkpoint

    cfg = ModelConfig.from_dict(dict(arch="encoder_decoder", vocab_size=300, d_model=32, n_layers=1, max_seq_len=8,
                                     position=dict(kind="learned"), attention=dict(n_heads=2)))
    folder = tmp / "s2s"
    folder.mkdir()
    (folder / "config.yaml").write_text(yaml.safe_dump({"model": cfg.to_dict()}))
    save_checkpoint(folder / "checkpoints", 1, build_model(cfg).state_dict(), {})
    shutil.copytree(w["bpe_run"] / "tokenizer", folder / "tokenizer")


def pairs_data(tmp: Path, w: dict) -> None:
    """{tmp}/pairs: a prepared source/target folder (byte tokenizer)."""
    from archlab.data.seq2seq import prepare_seq2seq
    rows = [{"source": f"to be {i}", "target": f"{i} be to"} for i in range(20)]
    (tmp / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare_seq2seq(tmp / "pairs.jsonl", "bytes", tmp / "pairs", progress=False)


T = ["train", "--data", "{data}", "--out", "{new}", "--no-progress"]
BERT = T + ["--preset", "tiny:bert-base", "--set", "vocab_size=257", "--set", "train.seq_len=16"]
TP = T + ["--preset", "tiny:llama2-7b"]
G = ["generate", "{run}", "--prompt", "to be"]
FM = ["fill-mask", "{enc_run}"]
CKPT = "checkpoints/step_*/model.safetensors"
FT = ["finetune", "{bpe_run}", "--out", "{new}", "--no-progress", "--set", "train.memory_check=false"]
PC = '{"prompt": "to be or ", "completion": "not to be"}\n'
CHAT = '{"messages": [{"role": "user", "content": "to be"}, {"role": "assistant", "content": "or not"}]}\n'
LONG = '{"prompt": "to be or not to be", "completion": "' + "be " * 20 + '"}\n'
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
DPO = ["train", "--init-from", "{bpe_run}", "--data", "{bad}", "--out", "{new}", "--no-progress", "--set",
       "train.seq_len=16", "--set", "train.objective=dpo"]
PREF = '{"prompt": "to be", "chosen": " or not", "rejected": " that is"}\n'

CASES = [
    # ---- top level and argparse ---------------------------------------------------------------
    ("unknown command", ["nosuch"], "invalid choice"),
    ("train without --out", ["train", "--data", "{data}"], "required: --out"),
    ("generate without --prompt", ["generate", "{run}"], "give --prompt TEXT"),
    ("eval bad int", ["eval", "{run}", "--batches", "two"], "invalid int value"),
    ("eval bad split", ["eval", "{run}", "--split", "test"], "invalid choice"),
    ("eval bad device", ["eval", "{run}", "--device", "tpu"], "invalid choice"),
    ("tokenizer bad kind", ["tokenizer", "train", "--input", "{corpus}", "--vocab-size", "300", "--kind", "sp",
                            "--out", "{new}"], "invalid choice"),
    ("convert both directions", ["convert", "--from-hf", "{hf}", "--to-hf", "{run}", "--out", "{new}"],
     "not allowed with"),
    ("convert bad dtype", ["convert", "--from-hf", "{hf}", "--out", "{new}", "--dtype", "int8"], "invalid choice"),
    ("inspect bad int", ["inspect", "llama2-7b", "--seq-len", "1k"], "invalid int value"),
    ("demo bad float", ["demo", "--minutes", "soon"], "invalid float value"),
    # ---- train ---------------------------------------------------------------------------------
    ("train no model", T, "no model"),
    ("train unknown preset", T + ["--preset", "llama9-1t"], "llama9-1t"),
    ("train init-from missing", T + ["--init-from", "{tmp}/nomodel"], "nomodel"),
    ("train init-from not a model", T + ["--init-from", "{corpus}"], "neither a run folder"),
    ("train init-from and preset", TP + ["--init-from", "{run}"], "--init-from gives the model"),
    ("train init-from changes a shape", T + ["--init-from", "{run}", "--set", "n_layers=3"],
     "keep every weight's shape"),
    ("train init-from other tokenizer", T + ["--init-from", "{bpe_run}"], "different tokenizer"),
    ("train init-from damaged weights", T + ["--init-from", "{tmp}/copy"], "model.safetensors",
     copy_of("run", truncate(CKPT))),
    ("train resume imported weights", ["train", "--resume", "--config", "{tmp}/copy/config.yaml", "--data", "{data}",
                                       "--out", "{tmp}/copy", "--no-progress"], "--init-from",
     lambda tmp, w: main(["convert", "--from-hf", str(w["hf"]), "--out", str(tmp / "copy")])),
    ("train set without =", TP + ["--set", "n_layers"], "key=value"),
    # ---- train.objective=dpo on preference .jsonl ----------------------------------------------
    ("dpo malformed line", DPO, "bad.jsonl:2: not valid JSON", write("bad.jsonl", PREF + '{"prompt": broken\n')),
    ("dpo missing field", DPO, "bad.jsonl:2 has no 'rejected'", write("bad.jsonl", PREF + '{"prompt": "a", '
                                                                      '"chosen": "b"}\n')),
    ("dpo chosen equals rejected", DPO, "bad.jsonl:1: chosen equals rejected",
     write("bad.jsonl", '{"prompt": "to be", "chosen": " or", "rejected": " or"}\n')),
    ("dpo side too long", DPO, "more than the limit of 16: choose a policy with train.dpo.truncation",
     write("bad.jsonl", PREF + json.dumps({"prompt": "to be or not to be " * 9, "chosen": " yes",
                                           "rejected": " no"}) + "\n")),
    ("dpo chosen not the assistant's", DPO, "bad.jsonl:1: chosen must hold assistant messages only",
     write("bad.jsonl", json.dumps({"prompt": [{"role": "user", "content": "hi"}], "chosen": [
         {"role": "user", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]}) + "\n")),
    ("dpo unknown role", DPO, "bad.jsonl:1: prompt[0] has unknown role 'boss'",
     write("bad.jsonl", json.dumps({"prompt": [{"role": "boss", "content": "hi"}], "chosen": [
         {"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]}) + "\n")),
    ("dpo on a token folder", DPO[:4] + ["{data}"] + DPO[5:], "token stream; train.method=dpo reads preference pairs"),
    ("dpo without init-from", ["train", "--preset", "tiny:llama2-7b"] + DPO[3:], "--init-from BASE",
     write("bad.jsonl", PREF)),
    ("jsonl without method dpo", DPO[:-2], "preference pairs; train.method=pretrain reads", write("bad.jsonl", PREF)),
    ("dpo beta zero", DPO + ["--set", "train.dpo.beta=0"], "train.dpo.beta=0", write("bad.jsonl", PREF)),
    ("dpo unknown loss", DPO + ["--set", "train.dpo.loss=nope"], "train.dpo.loss='nope' is not one of",
     write("bad.jsonl", PREF)),
    ("train unknown key", TP + ["--set", "n_layerz=2"], "n_layerz"),
    ("train unknown train key", TP + ["--set", "train.lrr=1"], "lrr"),
    ("train unknown objective", TP + ["--set", "train.objective=denoise"], "denoise"),
    ("train objective for another kind", TP + ["--set", "train.objective=mlm"], "train.objective=mlm trains encoder"),
    ("train span corruption without sentinels", T + ["--preset", "tiny:t5-11b", "--set", "vocab_size=257"],
     "span corruption needs sentinel ids"),
    ("train next sentence without the head", BERT + ["--set", "train.objective=next_sentence"], "nsp_head=true"),
    ("train document masks with masked LM", BERT + ["--set", "train.document_masks=true"],
     "train.document_masks keeps next-token documents apart: not with train.objective=mlm"),
    ("train next sentence without sentences",
     BERT + ["--set", "nsp_head=true", "--set", "train.objective=next_sentence"], "--sentences"),
    ("train pairs on a decoder", ["train", "--data", "{tmp}/pairs", "--out", "{new}", "--no-progress", "--preset",
                                  "tiny:llama2-7b", "--set", "vocab_size=257"],
     "paired source/target data trains encoder-decoders", pairs_data),
    ("train pairs longer than seq_len", ["train", "--data", "{tmp}/pairs", "--out", "{new}", "--no-progress",
                                         "--preset", "tiny:t5-11b", "--set", "vocab_size=257", "--set",
                                         "train.seq_len=4"], "longer than train.seq_len=4", pairs_data),
    ("train unique tokens past the split", TP + ["--set", "train.stream.unique_tokens=99999999"],
     "train.stream.unique_tokens=99999999 must be in [1, "),
    ("train unique tokens zero", TP + ["--set", "train.stream.unique_tokens=0"], "train.stream.unique_tokens=0"),
    ("train zero layers", TP + ["--set", "n_layers=0"], "n_layers"),
    ("train non-numeric", TP + ["--set", "n_layers=abc"], "n_layers"),
    ("train bad heads", TP + ["--set", "attention.n_kv_heads=3"], "n_kv_heads"),
    ("train bad norm", TP + ["--set", "norm.kind=groupnorm"], "groupnorm"),
    ("train negative lr", TP + ["--set", "train.lr=-1"], "train.lr"),
    ("train zero batch", TP + ["--set", "train.batch_size=0"], "train.batch_size"),
    ("train infinite budget", TP + ["--set", "train.budget=inf"], "train.budget"),
    ("train nan budget", TP + ["--set", "train.budget=nan"], "train.budget"),
    ("train bad dtype", TP + ["--set", "train.dtype=float16"], "float16"),
    ("train bad device", TP + ["--set", "train.device=tpu"], "tpu"),
    ("train bad unit", TP + ["--set", "train.budget_unit=hours"], "hours"),
    ("train bad schedule", TP + ["--set", "train.schedule=linear"], "linear"),
    ("train bad betas", TP + ["--set", "train.betas=[0.9, 1.5]"], "betas"),
    ("train bad min_lr_ratio", TP + ["--set", "train.min_lr_ratio=2"], "min_lr_ratio"),
    ("train bad nan policy", TP + ["--set", "train.nan_policy=ignore"], "ignore"),
    ("train bad no_decay", TP + ["--set", "train.no_decay=weights"], "weights"),
    ("train seq past learned positions", TP + ["--set", "position.kind=learned", "--set", "max_seq_len=8",
                                               "--set", "train.seq_len=16"], "max_seq_len"),
    ("train batch not divisible", TP + ["--set", "train.grad_accum=0"], "grad_accum"),
    ("train missing config", T + ["--config", "{tmp}/nope.yaml"], "nope.yaml"),
    ("train malformed config", T + ["--config", "{bad}"], "bad.yaml", write("bad.yaml", "model: [unclosed\n")),
    ("train config is a list", T + ["--config", "{bad}"], "mapping", write("bad.yaml", "- a\n- b\n")),
    ("train config wrong types", T + ["--config", "{bad}"], "d_model",
     write("bad.yaml", "model: {vocab_size: 257, d_model: wide, n_layers: 2, attention: {n_heads: 2}}\n")),
    ("train config unknown field", T + ["--config", "{bad}"], "colour",
     write("bad.yaml", "model: {vocab_size: 257, d_model: 32, n_layers: 2, colour: red, attention: {n_heads: 2}}\n")),
    ("train preset and config model", TP + ["--config", "{bad}"], "both --preset",
     write("bad.yaml", "model: {vocab_size: 257, d_model: 32, n_layers: 2, attention: {n_heads: 2}}\n")),
    ("train missing data", ["train", "--data", "{tmp}/nodata", "--out", "{new}", "--preset", "tiny:llama2-7b"],
     "nodata"),
    ("train data is empty dir", ["train", "--data", "{tmp}/empty", "--out", "{new}", "--preset", "tiny:llama2-7b"],
     "empty", lambda tmp, w: (tmp / "empty").mkdir()),
    ("train data corrupt meta", ["train", "--data", "{tmp}/copy", "--out", "{new}", "--preset", "tiny:llama2-7b"],
     "meta.json", copy_of("data", replace_text("meta.json", "{not json"))),
    ("train into existing run", ["train", "--data", "{data}", "--out", "{run}", "--preset", "tiny:llama2-7b",
                                 "--no-progress"], "already holds a run"),
    ("train resume other model", ["train", "--data", "{data}", "--out", "{tmp}/copy", "--resume", "--preset",
                                  "tiny:llama2-7b", "--set", "vocab_size=257", "--no-progress"],
     "different model config", copy_of("run")),
    ("train resume other data", ["train", "--data", "{tmp}/d2", "--out", "{tmp}/copy", "--resume", "--config",
                                 "{tmp}/copy/config.yaml", "--no-progress"], "--allow-new-data",
     combine(copy_of("run"), lambda tmp, w: make_data(tmp / "d2", n_docs=9, words=80))),
    ("train resume damaged", ["train", "--data", "{data}", "--out", "{tmp}/copy", "--resume", "--config",
                              "{tmp}/copy/config.yaml", "--no-progress"], "verifies", copy_of("run", truncate(CKPT))),
    ("train cannot fit", T + ["--preset", "llama2-7b", "--set", "train.seq_len=4096"], "needs about"),
    ("train seed past every generator", TP + ["--set", "train.seed=1e100"], "train.seed=1e+100 must be in"),
    ("train negative seed", TP + ["--set", "train.seed=-1"], "train.seed=-1 must be in"),
    # ---- eval ----------------------------------------------------------------------------------
    ("eval missing run", ["eval", "{tmp}/norun"], "norun"),
    ("eval not a run", ["eval", "{corpus}"], "not a run folder"),
    ("eval zero batches", ["eval", "{run}", "--batches", "0"], "--batches 0"),
    ("eval zero batch size", ["eval", "{run}", "--batch-size", "0"], "--batch-size 0"),
    ("eval zero seq len", ["eval", "{run}", "--seq-len", "0"], "--seq-len 0"),
    ("eval negative seq len", ["eval", "{run}", "--seq-len", "-4"], "--seq-len -4"),
    ("eval split too short", ["eval", "{run}", "--seq-len", "100000"], "nothing to evaluate"),
    ("eval missing data", ["eval", "{run}", "--data", "{tmp}/nodata"], "nodata"),
    ("eval corrupt config", ["eval", "{tmp}/copy"], "config.yaml", copy_of("run", replace_text("config.yaml",
                                                                                             "model: [x\n"))),
    ("eval mismatched checkpoint", ["eval", "{tmp}/copy"], "does not match", copy_of("run", other_model_config)),
    ("eval truncated weights", ["eval", "{tmp}/copy"], "model.safetensors", copy_of("run", truncate(CKPT))),
    ("eval missing checkpoint", ["eval", "{run}", "--checkpoint", "{tmp}/nockpt"], "nockpt"),
    ("eval vocab mismatch", ["eval", "{run}", "--data", "{root}/bpe_data"], "vocab_size"),
    # ---- generate ------------------------------------------------------------------------------
    ("generate nan temperature", G + ["--temperature", "nan"], "--temperature nan"),
    ("generate negative temperature", G + ["--temperature", "-1"], "--temperature -1"),
    ("generate inf temperature", G + ["--temperature", "inf"], "--temperature inf"),
    ("generate zero top-k", G + ["--top-k", "0"], "--top-k 0"),
    ("generate zero top-p", G + ["--top-p", "0"], "--top-p 0"),
    ("generate big top-p", G + ["--top-p", "1.5"], "--top-p 1.5"),
    ("generate nan top-p", G + ["--top-p", "nan"], "--top-p nan"),
    ("generate big min-p", G + ["--min-p", "2"], "--min-p 2"),
    ("generate zero repetition penalty", G + ["--repetition-penalty", "0"], "--repetition-penalty 0"),
    ("generate nan repetition penalty", G + ["--repetition-penalty", "nan"], "--repetition-penalty nan"),
    ("generate zero beams", G + ["--num-beams", "0"], "--num-beams 0"),
    ("generate negative beams", G + ["--num-beams", "-2"], "--num-beams -2"),
    ("generate zero new tokens", G + ["--max-new-tokens", "0"], "--max-new-tokens 0"),
    ("generate nan length penalty", G + ["--num-beams", "2", "--length-penalty", "nan"], "--length-penalty nan"),
    ("generate zero sink window", G + ["--sink-window", "0"], "--sink-window 0"),
    ("generate negative sink tokens", G + ["--sink-window", "8", "--sink-tokens", "-1"], "--sink-tokens -1"),
    ("generate sink past context", G + ["--sink-window", "64"], "must fit the model's context"),
    ("generate unknown device", G + ["--device", "tpu"], "--device tpu"),
    # ---- chat (every case fails before stdin is read) -------------------------------------------
    ("chat without a chat template", ["chat", "{run}"], "add one with `archlab tokenizer chat-template"),
    ("chat on an encoder", ["chat", "{enc_run}"], "archlab chat needs a decoder-only LM"),
    ("chat on a folder that is not a model", ["chat", "{tmp}"], "neither a run folder"),
    ("chat nan temperature", ["chat", "{run}", "--temperature", "nan"], "--temperature nan"),
    ("chat zero new tokens", ["chat", "{run}", "--max-new-tokens", "0"], "--max-new-tokens 0"),
    ("chat unknown device", ["chat", "{run}", "--device", "tpu"], "--device tpu"),
    ("generate cuda missing", G + ["--device", "cuda"], "CUDA is not available"),
    ("generate missing path", ["generate", "{tmp}/nothing", "--prompt", "x"], "nothing"),
    ("generate malformed hub id", ["generate", "hf:a/b/c", "--prompt", "x"], "expected hf:ORG/NAME"),
    ("generate not a model", ["generate", "{corpus}", "--prompt", "x"], "neither a run folder"),
    ("generate empty prompt", ["generate", "{run}", "--prompt", ""], "--prompt encodes to no tokens"),
    ("generate --source on a decoder", ["generate", "{run}", "--source", "x"], "--source is for encoder-decoders"),
    ("generate encoder-decoder without --source", ["generate", "{tmp}/s2s", "--prompt", "x"], "give --source",
     seq2seq_run),
    ("generate source past the encoder", ["generate", "{tmp}/s2s", "--source", "to be " * 20],
     "longer than the encoder takes", seq2seq_run),
    ("generate prompt past context", ["generate", "{run}", "--prompt", "x" * 200], "context"),
    ("generate model past memory", ["generate", "{tmp}/copy", "--prompt", "x"], "GiB free",
     copy_of("run", model_field("d_model", 10**11))),
    ("generate tokenizer model not an object", ["generate", "{tmp}/copy", "--prompt", "x"],
     '"model" is a JSON int, not an object',
     copy_of("bpe_run", replace_text("tokenizer/tokenizer.json", '{"model": 5}'))),
    ("generate mismatched checkpoint", ["generate", "{tmp}/copy", "--prompt", "x"], "does not match",
     copy_of("run", other_model_config)),
    ("generate truncated weights", ["generate", "{tmp}/copy", "--prompt", "x"], "model.safetensors",
     copy_of("run", truncate(CKPT))),
    ("generate flipped byte", ["generate", "{tmp}/copy", "--prompt", "x"], "its sha256 differs",
     copy_of("run", flip_byte(CKPT))),
    ("generate foreign weights link", ["generate", "{tmp}/copy", "--prompt", "x"], "outside",
     copy_of("run", foreign_link(CKPT))),
    ("generate meta names a file outside", ["generate", "{tmp}/copy", "--prompt", "x"], "not a file inside",
     copy_of("run", edit_json("checkpoints/step_*/meta.json",
                              lambda m: m["files"].update({"../../config.yaml": 1})))),
    ("generate hf index climbs out", ["generate", "{tmp}/copy", "--prompt", "x"], "not a file inside",
     copy_of("hf", shard_index("../hf/model.safetensors"))),
    ("generate hf index absolute", ["generate", "{tmp}/copy", "--prompt", "x"], "not a file inside",
     copy_of("hf", shard_index("/etc/hostname"))),
    ("generate no tokenizer", ["generate", "{tmp}/copy", "--prompt", "x"], "no tokenizer",
     copy_of("run", lambda f: shutil.rmtree(f / "tokenizer"))),
    ("generate corrupt tokenizer", ["generate", "{tmp}/copy", "--prompt", "x"], "tokenizer",
     copy_of("bpe_run", replace_text("tokenizer/tokenizer.json", "{broken"))),
    ("generate hf without tokenizer", ["generate", "{tmp}/copy", "--prompt", "x"], "no tokenizer.json",
     copy_of("hf", lambda f: (f / "tokenizer.json").unlink())),
    ("generate hf damaged weights", ["generate", "{tmp}/copy", "--prompt", "x"], "model.safetensors",
     copy_of("hf", truncate("model.safetensors"))),
    ("generate hf corrupt config", ["generate", "{tmp}/copy", "--prompt", "x"], "config.json",
     copy_of("hf", replace_text("config.json", "{oops"))),
    ("generate hf unknown family", ["generate", "{tmp}/copy", "--prompt", "x"], "model_type",
     copy_of("hf", lambda f: (f / "config.json").write_text(json.dumps({
         **json.loads((f / "config.json").read_text()), "model_type": "transformer_xl"})))),
    # ---- fill-mask -----------------------------------------------------------------------------
    ("fill-mask without text", ["fill-mask", "{enc_run}"], "required: TEXT"),
    ("fill-mask bad top-k", FM + ["to be [MASK]", "--top-k", "five"], "invalid int value"),
    ("fill-mask zero top-k", FM + ["to be [MASK]", "--top-k", "0"], "--top-k 0"),
    ("fill-mask bad device", FM + ["to be [MASK]", "--device", "tpu"], "--device tpu"),
    ("fill-mask decoder run", ["fill-mask", "{bpe_run}", "to be [MASK]"],
     "is a decoder-only model; fill-mask needs an encoder (arch=encoder)"),
    ("fill-mask decoder hf folder", ["fill-mask", "{hf}", "to be [MASK]"], "is a decoder-only model"),
    ("fill-mask missing folder", ["fill-mask", "{tmp}/nomodel", "to be [MASK]"], "nomodel"),
    ("fill-mask not a model", ["fill-mask", "{corpus}", "to be [MASK]"], "neither a run folder"),
    ("fill-mask no mask in text", FM + ["to be or not to be"], "holds no mask token"),
    ("fill-mask other mask spelling", FM + ["to be or <mask> to be"], "<mask> is not this tokenizer's mask token"),
    ("fill-mask text past positions", FM + ["[MASK] " + "to be or not " * 40], "max_seq_len=64"),
    ("fill-mask tokenizer without mask", ["fill-mask", "{tmp}/copy", "to be [MASK]"], "no mask token",
     combine(copy_of("enc_run"), lambda tmp, w: shutil.copy(w["tok"] / "tokenizer.json", tmp / "copy" / "tokenizer"))),
    ("fill-mask no tokenizer", ["fill-mask", "{tmp}/copy", "to be [MASK]"], "no tokenizer",
     copy_of("enc_run", lambda f: shutil.rmtree(f / "tokenizer"))),
    ("fill-mask damaged weights", ["fill-mask", "{tmp}/copy", "to be [MASK]"], "model.safetensors",
     copy_of("enc_run", truncate(CKPT))),
    # ---- convert and verify --------------------------------------------------------------------
    ("convert from missing", ["convert", "--from-hf", "{tmp}/nohf", "--out", "{new}"], "nohf"),
    ("convert from not hf", ["convert", "--from-hf", "{corpus}", "--out", "{new}"], "config.json"),
    ("convert from corrupt config", ["convert", "--from-hf", "{tmp}/copy", "--out", "{new}"], "config.json",
     copy_of("hf", replace_text("config.json", "[1, 2"))),
    ("convert from damaged weights", ["convert", "--from-hf", "{tmp}/copy", "--out", "{new}"], "model.safetensors",
     copy_of("hf", truncate("model.safetensors"))),
    ("convert from no weights", ["convert", "--from-hf", "{tmp}/copy", "--out", "{new}"], "safetensors",
     copy_of("hf", lambda f: (f / "model.safetensors").unlink())),
    ("convert from heads not a number", ["convert", "--from-hf", "{tmp}/copy", "--out", "{new}"],
     "num_attention_heads='four' must be a whole number", copy_of("hf", hf_field("num_attention_heads", "four"))),
    ("convert from eps not a number", ["convert", "--from-hf", "{tmp}/copy", "--out", "{new}"],
     "rms_norm_eps='small' must be a number", copy_of("hf", hf_field("rms_norm_eps", "small"))),
    ("convert from nan weights", ["convert", "--from-hf", "{tmp}/copy", "--out", "{new}"], "holds NaN (1 of",
     copy_of("hf", nan_in("model.safetensors"))),
    ("generate hf nan weights", ["generate", "{tmp}/copy", "--prompt", "x"], "holds NaN (1 of",
     copy_of("hf", nan_in("model.safetensors"))),
    ("generate sampled from nan weights", ["generate", "{tmp}/copy", "--prompt", "x", "--temperature", "0.8",
                                           "--max-new-tokens", "8"],
     "weight blocks.0.attn.q_proj.weight holds NaN (3 of 1,024 values): the run diverged",
     copy_of("run", nan_in_checkpoint("blocks.0.attn.q_proj.weight"))),
    ("convert to from nan weights", ["convert", "--to-hf", "{tmp}/copy", "--out", "{new}"],
     "weight blocks.0.attn.q_proj.weight holds NaN (3 of 1,024 values): the run diverged",
     copy_of("run", nan_in_checkpoint("blocks.0.attn.q_proj.weight"))),
    ("train resume from nan weights", ["train", "--data", "{data}", "--out", "{tmp}/copy", "--resume", "--config",
                                       "{tmp}/copy/config.yaml", "--no-progress"],
     "holds NaN (3 of 1,024 values): the run diverged; resume from an earlier checkpoint; --resume takes the newest",
     copy_of("run", nan_in_checkpoint("blocks.0.attn.q_proj.weight"))),
    ("convert from into run", ["convert", "--from-hf", "{hf}", "--out", "{run}"], "--overwrite"),
    ("convert from into nonempty", ["convert", "--from-hf", "{hf}", "--out", "{tmp}/out"], "--overwrite",
     nonempty_dir),
    ("convert to into nonempty", ["convert", "--to-hf", "{run}", "--out", "{tmp}/out"], "--overwrite", nonempty_dir),
    ("convert to into itself", ["convert", "--to-hf", "{tmp}/copy", "--out", "{tmp}/copy", "--overwrite"],
     "is the input", copy_of("run")),
    ("convert to into its parent", ["convert", "--to-hf", "{tmp}/copy", "--out", "{tmp}", "--overwrite"],
     "holds the input", copy_of("run")),
    ("convert to inside its run", ["convert", "--to-hf", "{run}", "--out", "{run}/hf"], "sits inside the input"),
    ("convert to over a live run", ["convert", "--to-hf", "{run}", "--out", "{tmp}/copy", "--overwrite"],
     "pid 1 on", copy_of("run", live_lock)),
    ("convert from into itself", ["convert", "--from-hf", "{tmp}/copy", "--out", "{tmp}/copy", "--overwrite"],
     "is the input", copy_of("hf")),
    ("convert from through a symlink", ["convert", "--from-hf", "{tmp}/link", "--out", "{tmp}/copy", "--overwrite"],
     "is the input", combine(copy_of("hf"), lambda tmp, w: (tmp / "link").symlink_to(tmp / "copy"))),
    ("convert from over parent of a live run", ["convert", "--from-hf", "{hf}", "--out", "{tmp}", "--overwrite"],
     "is writing", copy_of("run", live_lock)),
    ("convert to from missing", ["convert", "--to-hf", "{tmp}/norun", "--out", "{new}"], "norun"),
    ("convert to not a run", ["convert", "--to-hf", "{corpus}", "--out", "{new}"], "not a run folder"),
    ("convert to unknown family", ["convert", "--to-hf", "{run}", "--out", "{new}", "--family", "bert2"], "bert2"),
    ("convert to damaged run", ["convert", "--to-hf", "{tmp}/copy", "--out", "{new}"], "model.safetensors",
     copy_of("run", truncate(CKPT))),
    ("convert to flipped byte", ["convert", "--to-hf", "{tmp}/copy", "--out", "{new}"], "its sha256 differs",
     copy_of("run", flip_byte(CKPT))),
    ("convert to foreign weights link", ["convert", "--to-hf", "{tmp}/copy", "--out", "{new}"], "outside",
     copy_of("run", foreign_link(CKPT))),
    ("convert from index climbs out", ["convert", "--from-hf", "{tmp}/copy", "--out", "{new}"], "not a file inside",
     copy_of("hf", shard_index("../../x.safetensors"))),
    ("convert to peft without adapters", ["convert", "--to-peft", "{run}", "--out", "{new}"], "holds no LoRA adapters"),
    ("convert to peft into nonempty", ["convert", "--to-peft", "{run}", "--out", "{tmp}/out"], "--overwrite",
     nonempty_dir),
    ("train lora rank zero", TP + ["--set", "train.lora.r=0"], "lora.r=0 must be an integer >= 1"),
    ("train lora target matches nothing", TP + ["--set", "train.lora.r=4", "--set", "train.lora.targets=q,qkv"],
     "lora target 'qkv' matches no Linear"),
    ("verify missing", ["verify", "{tmp}/nohf"], "nohf"),
    ("verify not hf", ["verify", "{corpus}"], "config.json"),
    ("verify damaged", ["verify", "{tmp}/copy"], "model.safetensors", copy_of("hf", truncate("model.safetensors"))),
    ("verify zero seq len", ["verify", "{hf}", "--seq-len", "0"], "--seq-len 0"),
    ("verify zero batch", ["verify", "{hf}", "--batch", "0"], "--batch 0"),
    # ---- tokenizer -----------------------------------------------------------------------------
    ("tokenizer missing input", ["tokenizer", "train", "--input", "{tmp}/nofile", "--vocab-size", "300", "--out",
                                 "{new}"], "nofile"),
    ("tokenizer empty input dir", ["tokenizer", "train", "--input", "{tmp}/empty", "--vocab-size", "300", "--out",
                                   "{new}"], "no input files", lambda tmp, w: (tmp / "empty").mkdir()),
    ("tokenizer zero vocab", ["tokenizer", "train", "--input", "{corpus}", "--vocab-size", "0", "--out", "{new}"],
     "--vocab-size 0"),
    ("tokenizer negative vocab", ["tokenizer", "train", "--input", "{corpus}", "--vocab-size", "-5", "--out",
                                  "{new}"], "--vocab-size -5"),
    ("tokenizer vocab below bytes", ["tokenizer", "train", "--input", "{corpus}", "--vocab-size", "100", "--out",
                                     "{new}", "--no-progress"], "100"),
    ("tokenizer wordpiece vocab too small", ["tokenizer", "train", "--input", "{corpus}", "--vocab-size", "300",
                                             "--kind", "wordpiece", "--out", "{new}", "--no-progress"], "300"),
    ("tokenizer empty special", ["tokenizer", "train", "--input", "{corpus}", "--vocab-size", "300",
                                 "--special-tokens", "", "--out", "{new}"], "empty string"),
    ("tokenizer on token ids", ["tokenizer", "train", "--input", "{data}", "--vocab-size", "300", "--out", "{new}"],
     "train.bin is binary"),
    ("tokenizer unknown corpus name", ["tokenizer", "train", "--input", "shakespear", "--vocab-size", "300", "--out",
                                       "{new}"], "nor a built-in corpus (shakespeare,"),
    ("tokenizer out exists", ["tokenizer", "train", "--input", "{corpus}", "--vocab-size", "300", "--out",
                              "{tok}"], "--overwrite"),
    ("tokenizer train into its input", ["tokenizer", "train", "--input", "{tmp}/copy", "--vocab-size", "300",
                                        "--out", "{tmp}/copy", "--overwrite", "--no-progress"], "is the input",
     copy_of("corpus")),
    ("tokenizer train over its input's folder", ["tokenizer", "train", "--input", "{tmp}/copy/doc0.txt",
                                                 "--vocab-size", "300", "--out", "{tmp}/copy", "--overwrite",
                                                 "--no-progress"], "holds the input", copy_of("corpus")),
    ("stats missing tokenizer", ["tokenizer", "stats", "{tmp}/notok", "--input", "{corpus}"], "notok"),
    ("stats corrupt tokenizer", ["tokenizer", "stats", "{tmp}/copy", "--input", "{corpus}"], "tokenizer",
     copy_of("tok", replace_text("tokenizer.json", "{nope"))),
    ("stats missing input", ["tokenizer", "stats", "{tok}", "--input", "{tmp}/nofile"], "nofile"),
    ("stats zero top", ["tokenizer", "stats", "{tok}", "--input", "{corpus}", "--top", "-1"], "--top -1"),
    # ---- data prepare --------------------------------------------------------------------------
    ("prepare missing corpus", ["data", "prepare", "--corpus", "{tmp}/nocorpus", "--tokenizer", "bytes", "--out",
                                "{new}", "--quiet"], "nocorpus"),
    ("prepare unknown corpus name", ["data", "prepare", "--corpus", "wikipedia-2031", "--tokenizer", "bytes",
                                     "--out", "{new}", "--quiet"], "wikipedia-2031"),
    ("prepare missing tokenizer", ["data", "prepare", "--corpus", "{corpus}", "--tokenizer", "{tmp}/notok",
                                   "--out", "{new}", "--quiet"], "notok"),
    ("prepare corrupt tokenizer", ["data", "prepare", "--corpus", "{corpus}", "--tokenizer", "{tmp}/copy",
                                   "--out", "{new}", "--quiet"], "tokenizer",
     copy_of("tok", replace_text("tokenizer.json", "{nope"))),
    ("prepare out exists", ["data", "prepare", "--corpus", "{corpus}", "--tokenizer", "bytes", "--out", "{data}",
                            "--quiet"], "--overwrite"),
    ("prepare into its corpus", ["data", "prepare", "--corpus", "{tmp}/copy", "--tokenizer", "bytes", "--out",
                                 "{tmp}/copy", "--overwrite", "--quiet"], "is the input", copy_of("corpus")),
    ("prepare inside its corpus", ["data", "prepare", "--corpus", "{corpus}", "--tokenizer", "bytes", "--out",
                                   "{corpus}/data", "--quiet"], "sits inside the input"),
    ("prepare over its tokenizer", ["data", "prepare", "--corpus", "{corpus}", "--tokenizer", "{tmp}/copy", "--out",
                                    "{tmp}/copy", "--overwrite", "--quiet"], "is the input", copy_of("tok")),
    ("prepare pairs into its corpus", ["data", "prepare", "--seq2seq", "--corpus", "{bad}", "--tokenizer", "bytes",
                                       "--out", "{bad}", "--overwrite", "--quiet"], "is the input",
     write("bad.jsonl", '{"source": "a", "target": "b"}\n')),
    ("prepare over a live run", ["data", "prepare", "--corpus", "{corpus}", "--tokenizer", "bytes", "--out",
                                 "{tmp}/copy", "--overwrite", "--quiet"], "is writing", copy_of("run", live_lock)),
    ("prepare val fraction high", ["data", "prepare", "--corpus", "{corpus}", "--tokenizer", "bytes", "--out",
                                   "{new}", "--val-fraction", "1.5", "--quiet"], "val_fraction"),
    ("prepare val fraction negative", ["data", "prepare", "--corpus", "{corpus}", "--tokenizer", "bytes", "--out",
                                       "{new}", "--val-fraction", "-0.1", "--quiet"], "val_fraction"),
    ("prepare negative workers", ["data", "prepare", "--corpus", "{corpus}", "--tokenizer", "bytes", "--out",
                                  "{new}", "--workers", "-1", "--quiet"], "--workers -1"),
    ("prepare malformed jsonl", ["data", "prepare", "--corpus", "{bad}", "--tokenizer", "bytes", "--out",
                                 "{new}", "--quiet", "--workers", "0"], "not valid JSON",
     write("bad.jsonl", '{"text": "ok"}\n{"text": broken\n')),
    ("prepare jsonl without field", ["data", "prepare", "--corpus", "{bad}", "--tokenizer", "bytes", "--out",
                                     "{new}", "--quiet", "--workers", "0"], "'text'",
     write("bad.jsonl", '{"body": "no text field"}\n')),
    ("prepare jsonl field not text", ["data", "prepare", "--corpus", "{bad}", "--tokenizer", "bytes", "--out",
                                      "{new}", "--quiet", "--workers", "0"], "not a string",
     write("bad.jsonl", '{"text": 42}\n')),
    ("prepare jsonl nested deep", ["data", "prepare", "--corpus", "{bad}", "--tokenizer", "bytes", "--out",
                                   "{new}", "--quiet", "--workers", "0"], "nested too deeply",
     write("bad.jsonl", "[" * 50_000 + "]" * 50_000 + "\n")),
    ("prepare pairs nested deep", ["data", "prepare", "--seq2seq", "--corpus", "{bad}", "--tokenizer", "bytes",
                                   "--out", "{new}", "--quiet", "--workers", "0"],
     "bad.jsonl:2: JSON nested too deeply",
     write("bad.jsonl", '{"source": "a", "target": "b"}\n' + '{"source": ' * 50_000 + "1" + "}" * 50_000 + "\n")),
    ("prepare unknown eot", ["data", "prepare", "--corpus", "{corpus}", "--tokenizer", "{tok}", "--out", "{new}",
                             "--eot-token", "<eos>", "--quiet", "--workers", "0"], "<eos>"),
    # ---- lab -----------------------------------------------------------------------------------
    ("ablate no suite", ["ablate"], "SUITE"),
    ("ablate unknown suite", ["ablate", "nosuchsuite", "--out", "{new}"], "nosuchsuite"),
    ("ablate malformed yaml", ["ablate", "{bad}", "--out", "{new}"], "bad.yaml", write("bad.yaml", "name: [x\n")),
    ("ablate wrong seeds type", ["ablate", "{bad}", "--out", "{new}"], "seeds",
     write("bad.yaml", "name: s\nclaim: c\nseeds: many\naxes: [{name: n, key: norm.kind, values: [rmsnorm]}]\n")),
    ("ablate axes not a list", ["ablate", "{bad}", "--out", "{new}"], "axes",
     write("bad.yaml", "name: s\nclaim: c\nseeds: 1\naxes: norm\n")),
    ("ablate unknown axis key", ["ablate", "{bad}", "--out", "{new}"], "norm.kindd",
     write("bad.yaml", "name: s\nclaim: c\nseeds: 1\naxes: [{name: n, key: norm.kindd, values: [rmsnorm]}]\n")),
    ("ablate unknown scale", ["ablate", "{suite}", "--scale", "huge", "--out", "{new}"], "huge"),
    ("ablate into its data", ["ablate", "{suite}", "--data", "{tmp}/copy", "--out", "{tmp}/copy", "--budget", "1"],
     "is the input", copy_of("data")),
    ("ablate inside its data", ["ablate", "{suite}", "--data", "{data}", "--out", "{data}/sweep", "--budget", "1"],
     "sits inside the input"),
    ("ablate over its data's parent", ["ablate", "{suite}", "--data", "{tmp}/copy/prepared", "--out", "{tmp}/copy",
                                       "--budget", "1"], "holds the input",
     lambda tmp, w: shutil.copytree(w["data"], tmp / "copy" / "prepared")),
    ("ablate bad set", ["ablate", "{suite}", "--set", "lr", "--out", "{new}"], "KEY=VALUE"),
    ("ablate unknown train key", ["ablate", "{suite}", "--set", "train.lrr=1", "--out", "{new}"], "lrr"),
    ("ablate unknown executor", ["ablate", "{suite}", "--executor", "slurm", "--out", "{new}"], "slurm"),
    ("ablate zero workers", ["ablate", "{suite}", "--executor", "local", "--workers", "0", "--out", "{new}"],
     "--workers must be at least 1"),
    ("ablate workers serial", ["ablate", "{suite}", "--workers", "2", "--out", "{new}"], "--executor local or ray"),
    ("ablate address not ray", ["ablate", "{suite}", "--executor", "local", "--address", "h:1", "--out", "{new}"],
     "--executor ray"),
    ("report out exists", ["report", "{corpus}", "--out", "{data}"], "pass --overwrite"),
    ("report missing", ["report", "{tmp}/nosweep"], "nosweep"),
    ("report no results", ["report", "{corpus}"], "results"),
    ("report corrupt db", ["report", "{tmp}/sweep"], "not a readable archlab results table",
     write("sweep/results.sqlite", b"garbage" * 200)),
    # ---- finetune: chat data, templates, LoRA ---------------------------------------------------
    ("finetune malformed line", FT + ["--data", "{bad}"], "bad.jsonl:2: not valid JSON",
     write("bad.jsonl", PC + "{not json\n")),
    ("finetune message without role", FT + ["--data", "{bad}"], "bad.jsonl:2: messages[0] has no 'role'",
     write("bad.jsonl", PC + '{"messages": [{"content": "hi"}]}\n')),
    ("finetune unknown role", FT + ["--data", "{bad}"], "bad.jsonl:2: messages[0] has unknown role 'wizard'",
     write("bad.jsonl", PC + '{"messages": [{"role": "wizard", "content": "hi"}]}\n')),
    ("finetune example past seq_len", FT + ["--data", "{bad}", "--set", "train.seq_len=8"], "bad.jsonl:2: ",
     write("bad.jsonl", PC + LONG)),
    ("finetune example past seq_len names the limit", FT + ["--data", "{bad}", "--set", "train.seq_len=8"],
     "more than the limit of 8", write("bad.jsonl", PC + LONG)),
    ("finetune lora target matches nothing", FT + ["--data", "{bad}", "--lora-r", "2", "--lora-targets", "qkv"],
     "lora target 'qkv' matches no Linear", write("bad.jsonl", PC)),
    ("finetune template loops", FT + ["--data", "{bad}", "--chat-template", "{tmp}/loop.jinja"],
     "bad.jsonl:1: the chat template", combine(write("bad.jsonl", CHAT), write("loop.jinja", LOOP))),
    ("finetune unknown template", FT + ["--data", "{bad}", "--chat-template", "chatml2"], "chatml2",
     write("bad.jsonl", PC)),
    ("finetune unknown loss mask", FT + ["--data", "{bad}", "--set", "train.sft.loss_mask=answers"], "answers",
     write("bad.jsonl", PC)),
    ("finetune not jsonl", FT + ["--data", "{prompt}"], "is a .jsonl file"),
    ("finetune out not empty", ["finetune", "{bpe_run}", "--data", "{bad}", "--out", "{tmp}/full"],
     "exists and is not empty", combine(write("bad.jsonl", PC), write("full/x.txt", "x"))),
    # ---- diagnose, inspect, check, demo ---------------------------------------------------------
    ("diagnose out exists", ["diagnose", "{run}", "--text", "{prompt}", "--out", "{corpus}"], "pass --overwrite"),
    ("diagnose missing model", ["diagnose", "{tmp}/nomodel", "--text", "{prompt}"], "nomodel"),
    ("diagnose missing text", ["diagnose", "{run}", "--text", "{tmp}/notext"], "notext: no such file"),
    ("diagnose text a folder", ["diagnose", "{run}", "--text", "{tmp}"], "a folder, not a file"),
    ("diagnose short text", ["diagnose", "{run}", "--text", "{bad}", "--out", "{new}"], "need at least 2",
     write("bad.txt", "x")),
    ("diagnose zero tokens", ["diagnose", "{run}", "--text", "{prompt}", "--max-tokens", "0"], "--max-tokens 0"),
    ("diagnose zero top-k", ["diagnose", "{run}", "--text", "{prompt}", "--top-k", "0"], "--top-k 0"),
    ("diagnose not a model", ["diagnose", "{corpus}", "--text", "{prompt}"], "run folder"),
    ("inspect unknown preset", ["inspect", "llama9-1t"], "llama9-1t"),
    ("inspect unknown vs", ["inspect", "llama2-7b", "--vs", "gpt-9"], "gpt-9"),
    ("inspect zero seq len", ["inspect", "llama2-7b", "--seq-len", "0"], "--seq-len 0"),
    ("inspect zero batch", ["inspect", "llama2-7b", "--batch", "0"], "--batch 0"),
    ("inspect bad set", ["inspect", "llama2-7b", "--set", "attention.n_kv_heads=5"], "n_kv_heads"),
    ("inspect zero moe capacity", ["inspect", "mixtral-8x7b", "--set", "mlp.moe.capacity_factor=0"],
     "mlp.moe.capacity_factor=0.0 must be positive"),
    ("inspect unknown moe balance", ["inspect", "mixtral-8x7b", "--set", "mlp.moe.balance=none"],
     "mlp.moe.balance='none' is not one of 'loss', 'bias'"),
    ("inspect zero moe bias rate", ["inspect", "mixtral-8x7b", "--set", "mlp.moe.balance=bias",
                                    "--set", "mlp.moe.bias_update_rate=0"],
     "mlp.moe.bias_update_rate=0.0 must be positive"),
    ("inspect bad dtype", ["inspect", "llama2-7b", "--dtype", "float12"], "float12"),
    ("check missing", ["check", "{tmp}/norun"], "norun"),
    ("serve missing folder", ["serve", "{tmp}/nomodel"], "nomodel"),
    ("serve not a model", ["serve", "{corpus}"], "neither a run folder"),
    ("serve bad port", ["serve", "{run}", "--port", "70000"], "--port 70000"),
    ("serve bad device", ["serve", "{run}", "--device", "tpu"], "--device tpu"),
    ("serve no request size", ["serve", "{run}", "--max-request-mb", "0"], "--max-request-mb 0"),
    ("serve infinite request size", ["serve", "{run}", "--max-request-mb", "inf"], "--max-request-mb inf"),
    ("serve negative shutdown timeout", ["serve", "{run}", "--shutdown-timeout", "-1"], "--shutdown-timeout -1"),
    ("serve nan shutdown timeout", ["serve", "{run}", "--shutdown-timeout", "nan"], "--shutdown-timeout nan"),
    ("check not a run", ["check", "{corpus}"], "not a run folder"),
    ("ngram missing data", ["ngram", "{tmp}/nodata"], "nodata"),
    ("ngram not a data folder", ["ngram", "{run}"], "not a prepared data folder"),
    ("ngram order zero", ["ngram", "{data}", "--order", "0"], "--order 0"),
    ("ngram bad orders", ["ngram", "{data}", "--orders", "8-1"], "--orders '8-1'"),
    ("demo zero minutes", ["demo", "--minutes", "0", "--out", "{new}"], "--minutes 0"),
    ("demo nan minutes", ["demo", "--minutes", "nan", "--out", "{new}"], "--minutes nan"),
    ("demo unknown arch", ["demo", "--arch", "t5", "--out", "{new}"], "invalid choice"),
    ("demo encoder prompt without mask", ["demo", "--arch", "encoder", "--quick", "--prompt", "ROMEO:", "--out",
                                          "{new}"], "holds no [MASK]"),
    ("demo unknown corpus", ["demo", "--quick", "--corpus", "{tmp}/nocorpus", "--out", "{new}"], "nocorpus"),
    ("demo post-training with an arch", ["demo", "--post-training", "--arch", "encoder", "--out", "{new}"],
     "drop --arch"),
    ("demo seed without post-training", ["demo", "--seed", "1", "--out", "{new}"], "--seed applies to --post-training"),
    ("demo negative seed", ["demo", "--post-training", "--seed", "-1", "--out", "{new}"], "--seed=-1 must be in"),
]


def _fill(argv: list[str], w: dict, tmp: Path) -> list[str]:
    names = {**{k: str(v) for k, v in w.items()}, "new": str(tmp / "new"), "tmp": str(tmp)}
    bad = next((p for p in sorted(tmp.iterdir()) if p.name.startswith("bad")), None) if tmp.exists() else None
    names["bad"] = str(bad) if bad is not None else str(tmp / "bad")
    return [a.format(**names) for a in argv]


def _run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:          # argparse
        rc = exc.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(world, tmp_path, capsys, monkeypatch, case):
    name, argv, expected, *setup = case
    monkeypatch.delenv("ARCHLAB_DEBUG", raising=False)
    if setup:
        setup[0](tmp_path, world)
    argv = _fill(argv, world, tmp_path)
    shared, own = _snapshot(world["root"]), _snapshot(tmp_path)
    capsys.readouterr()
    rc, err = _run(argv, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, f"exit {rc}: {err}"
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert lines[0].startswith("archlab") and "error:" in lines[0], lines[0]
    assert expected in lines[0], lines[0]
    assert _snapshot(world["root"]) == shared
    assert _snapshot(tmp_path) == own
    assert not (tmp_path / "new").exists()


# ---- the environment: full disks and read-only folders (root ignores permissions, so simulated) -----
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
@pytest.mark.parametrize("command", [
    ["tokenizer", "train", "--input", "{corpus}", "--vocab-size", "300", "--no-progress", "--out", "{new}"],
    ["data", "prepare", "--corpus", "{corpus}", "--tokenizer", "bytes", "--out", "{new}", "--quiet", "--workers", "0"],
    ["convert", "--to-hf", "{run}", "--out", "{new}"],
    ["convert", "--from-hf", "{hf}", "--out", "{new}"],
])
def test_a_full_or_read_only_output_folder_is_one_line(world, tmp_path, capsys, monkeypatch, code, command):
    import os
    real_mkdir = os.mkdir

    def failing_mkdir(path, *args, **kwargs):
        if str(tmp_path) in os.fspath(path):
            raise OSError(code, os.strerror(code), os.fspath(path))
        return real_mkdir(path, *args, **kwargs)
    monkeypatch.setattr(os, "mkdir", failing_mkdir)
    shared = _snapshot(world["root"])
    rc, err = _run(_fill(command, world, tmp_path), capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert os.strerror(code) in lines[0]
    assert _snapshot(world["root"]) == shared and not (tmp_path / "new").exists()


def test_a_checkpoint_past_the_file_size_limit_is_one_line_and_keeps_the_older_ones(world, tmp_path, capsys,
                                                                                     monkeypatch):
    """safetensors reports EFBIG (a `ulimit -f`) as its own error, "... (os error 27)": the third save fails
    the way it does under that limit; the run stops with one line and the saved checkpoints stay whole."""
    import safetensors.torch
    from safetensors import SafetensorError

    from archlab.runs.checkpoint import list_checkpoints, verify_checkpoint

    real, calls, before = safetensors.torch.save_file, [], []

    def limited(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            before.extend(list_checkpoints(tmp_path / "run" / "checkpoints"))
            raise SafetensorError("Error while serializing: I/O error: File too large (os error 27)")
        return real(*args, **kwargs)
    monkeypatch.setattr(safetensors.torch, "save_file", limited)
    monkeypatch.delenv("ARCHLAB_DEBUG", raising=False)
    out = tmp_path / "run"
    rc, err = _run(["train", "--data", str(world["data"]), "--out", str(out), "--no-progress", "--preset",
                    "tiny:llama2-7b", "--set", "vocab_size=257", "--set", "train.budget=6", "--set",
                    "train.checkpoint_every=2", "--set", "train.seq_len=16", "--set", "train.batch_size=2", "--set",
                    "train.eval_batches=1", "--set", "train.sample_every=-1"], capsys)
    lines = [line for line in err.splitlines() if line.strip() and "error" in line]
    assert rc == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and "File too large (a file-size limit" in lines[0], err
    kept = list_checkpoints(out / "checkpoints")
    assert kept and kept == before
    for ckpt in kept:
        verify_checkpoint(ckpt, full=True)
    assert not list((out / "checkpoints").glob(".tmp-*"))


def test_the_suite_is_large():
    assert len(CASES) + 3 * 4 >= 150
