"""A reward run's held-out accuracy said before a PPO or GRPO run against it takes its first step (printed, and
logged on the run's first line as reward_model/<name>/val_accuracy): the figure the reward run recorded for its
final weights, or, when it recorded none there, computed on its held-out pairs (the same split, the same value)."""
from __future__ import annotations

import json
import shutil

import pytest
from finetune_runs import WORDS

from archlab.cli import main
from archlab.runs.model_folder import load_run
from archlab.training.methods.reward import held_out_accuracy
from archlab.training.metrics import read_metrics

COMMON = ["--no-progress", "--set", "train.batch_size=4", "--set", "train.seq_len=32", "--set", "train.budget=2",
          "--set", "train.sample.every=-1", "--set", "train.memory_check=false", "--set", "train.log_every=1",
          "--set", "train.schedule.warmup_steps=0"]


@pytest.fixture(scope="module")
def world(chat_world, make_base, tmp_path_factory):
    """An untrained base, plain prompts, and a reward run on 16 pairs with a quarter of them held out."""
    root = tmp_path_factory.mktemp("rm_accuracy")
    base = make_base(root / "base")
    prefs = root / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": f"Say {w}{i}:", "chosen": f" {w}", "rejected": " x"}) + "\n"
                             for i in range(2) for w in WORDS))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Say {w}:"}) + "\n" for w in WORDS))
    assert main(["finetune", str(base), "--method", "reward", "--data", str(prefs), "--out", str(root / "rm"),
                 "--val-fraction", "0.25", *COMMON, "--set", "train.lr=1e-2"]) == 0
    recorded = [r for r in read_metrics(root / "rm" / "metrics.jsonl") if "val_accuracy" in r][-1]
    return {"root": root, "base": base, "rm": root / "rm", "prompts": root / "prompts.jsonl", "recorded": recorded}


def _said(err: str) -> str:
    (line,) = [x for x in err.splitlines() if "held-out accuracy" in x]
    return line


@pytest.mark.parametrize("method, extra", [
    ("ppo", ["--set", "train.ppo.response_length=4"]),
    ("grpo", ["--set", "train.grpo.num_generations=4", "--set", "train.grpo.max_completion_length=4"]),
])
def test_the_reward_runs_held_out_accuracy_is_said_before_the_first_step_and_logged(world, tmp_path, capsys, method,
                                                                                    extra):
    out = tmp_path / method
    capsys.readouterr()
    assert main(["finetune", str(world["base"]), "--method", method, "--data", str(world["prompts"]), "--out",
                 str(out), *COMMON, "--reward", str(world["rm"]), *extra]) == 0
    err = capsys.readouterr().err
    recorded = world["recorded"]
    line = _said(err)
    assert f"held-out accuracy {recorded['val_accuracy']:.4f}" in line
    assert f"recorded by the reward run at step {recorded['step']}" in line
    assert err.index("held-out accuracy") < err.index("step 1/")          # said before the first step
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert rows[0]["reward_model/rm/val_accuracy"] == recorded["val_accuracy"]
    assert all("reward_model/rm/val_accuracy" not in r for r in rows[1:])


def test_without_a_recorded_figure_it_is_computed_on_the_same_held_out_pairs(world, tmp_path):
    rm = tmp_path / "rm"
    shutil.copytree(world["rm"], rm)
    lines = [r for r in read_metrics(rm / "metrics.jsonl") if "val_accuracy" not in r]
    (rm / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    model, _ = load_run(rm)
    found = held_out_accuracy(rm, model)
    assert "computed now on its" in found.source and "held-out pairs" in found.source
    assert found.accuracy == pytest.approx(world["recorded"]["val_accuracy"], abs=1e-9)


def test_a_reward_run_that_held_nothing_out_says_so(world, tmp_path):
    rm = tmp_path / "rm"
    assert main(["finetune", str(world["base"]), "--method", "reward", "--data", str(world["root"] / "prefs.jsonl"),
                 "--out", str(rm), "--val-fraction", "0", *COMMON]) == 0
    model, _ = load_run(rm)
    found = held_out_accuracy(rm, model)
    assert found.accuracy is None and "held no pairs out" in found.source


def test_score_refuses_unpaired_lines_in_one_line(world, tmp_path, capsys):
    data = tmp_path / "kto.jsonl"
    data.write_text(json.dumps({"prompt": "Say cat:", "completion": " cat", "label": True}) + "\n")
    assert main(["score", str(world["rm"]), "--data", str(data)]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds unpaired preferences (prompt, completion, label): archlab score compares" in err and "\n" not in err
