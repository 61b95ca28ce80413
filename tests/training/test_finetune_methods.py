"""`archlab finetune --method`: one command for every post-training method (training/methods). DPO gets a prepared
folder as SFT does (OUT/data: the lines and the tokenizer that encodes them) and trains exactly as
`archlab train --init-from BASE --set train.method=dpo` on the same file."""
from __future__ import annotations

import json
import math
import random

import pytest
import yaml

from archlab.cli import main
from archlab.data.preference_folder import PREFERENCE_FILE, is_preference_folder
from archlab.tokenizer import train as train_tokenizer
from archlab.tokenizer.chat_builtin import install_chat_template
from archlab.training.config import TrainConfig
from archlab.training.metrics import read_metrics
from archlab.training.trainer import fit_vocab, train

WORDS = ["red", "green", "blue", "cat", "dog", "bird", "one", "two", "yes", "no", "good", "bad"]
COMMON = ["--no-progress", "--set", "train.batch_size=4", "--set", "train.seq_len=32", "--set", "train.log_every=1",
          "--set", "train.warmup_steps=0", "--set", "train.sample_every=-1", "--set", "train.budget=2",
          "--set", "train.lr=1e-2", "--set", "train.memory_check=false"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A byte-level BPE tokenizer with the chatml template, a tiny decoder trained 2 steps (the base), preferences."""
    from test_checkpoint import tiny_model

    root = tmp_path_factory.mktemp("methods")
    rng = random.Random(0)
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"d{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(200)) + ": good bad\n")
    tok = train_tokenizer(corpus / "d0.txt", 280, ["<|endoftext|>"])
    tok.save(root / "tok")
    install_chat_template(root / "tok", "chatml")
    assert main(["data", "prepare", "--corpus", str(corpus), "--tokenizer", str(root / "tok"), "--out",
                 str(root / "data"), "--workers", "0", "--quiet"]) == 0
    train(fit_vocab(tiny_model(), root / "data"), TrainConfig(
        batch_size=4, seq_len=32, budget=2, lr=3e-3, warmup_steps=0, eval_batches=1, sample_every=-1),
        root / "data", root / "base", progress=False)
    lines = [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 4))) + ":", "chosen": " good",
              "rejected": " bad"} for _ in range(16)]
    (root / "prefs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return root


def _losses(run) -> list[dict]:
    keep = ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen")
    return [{k: r[k] for k in keep} for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def test_finetune_method_dpo_prepares_a_folder_and_trains_as_train_does(world, tmp_path):
    out, plain = tmp_path / "dpo", tmp_path / "plain"
    assert main(["finetune", str(world / "base"), "--method", "dpo", "--data", str(world / "prefs.jsonl"),
                 "--out", str(out), *COMMON]) == 0
    assert main(["train", "--init-from", str(world / "base"), "--data", str(world / "prefs.jsonl"), "--out",
                 str(plain), *COMMON, "--set", "train.objective=dpo"]) == 0       # the earlier key, renamed
    assert is_preference_folder(out / "data") and (out / "data" / PREFERENCE_FILE).is_file()
    assert (out / "data" / "tokenizer" / "tokenizer.json").is_file() and (out / "tokenizer").is_dir()
    ours, theirs = _losses(out), _losses(plain)
    assert abs(ours[0]["loss"] - math.log(2)) < 1e-6                # policy = reference at the first step
    assert ours == theirs                                           # the same pairs, batches and reference
    recorded = yaml.safe_load((out / "config.yaml").read_text())["train"]
    assert recorded["method"] == "dpo" and "dpo_beta" not in recorded and recorded["dpo"]["beta"] == 0.1
    # a resume checks the prepared folder's settings and continues
    assert main(["finetune", str(world / "base"), "--method", "dpo", "--data", str(world / "prefs.jsonl"),
                 "--out", str(out), *COMMON, "--set", "train.budget=3", "--resume"]) == 0
    assert [r["loss"] for r in _losses(out)][:2] == [r["loss"] for r in ours] and len(_losses(out)) == 3


@pytest.mark.parametrize("args, message", [
    (["--method", "nope"], "--method nope: choose one of sft, dpo"),
    (["--method", "dpo", "--val", "{prefs}"], "--method dpo holds out --val-fraction"),
    (["--method", "dpo", "--data", "{chat}"], "chat.jsonl:1 has no 'chosen'"),
    (["--method", "dpo", "--set", "train.dpo.beta=0"], "train.dpo.beta=0"),
])
def test_bad_method_input_is_one_line_and_writes_nothing(world, tmp_path, capsys, args, message):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": "hi", "completion": " yes"}) + "\n")
    args = [a.replace("{prefs}", str(world / "prefs.jsonl")).replace("{chat}", str(chat)) for a in args]
    data = [] if "--data" in args else ["--data", str(world / "prefs.jsonl")]
    out = tmp_path / "run"
    assert main(["finetune", str(world / "base"), *data, "--out", str(out), *COMMON, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err
    assert not out.exists()
