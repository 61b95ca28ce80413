"""`archlab finetune --method`: one command for every post-training method (training/methods). DPO gets a prepared
folder as SFT does (OUT/data: the lines and the tokenizer that encodes them) and trains exactly as
`archlab train --init-from BASE --set train.method=dpo` on the same file."""
from __future__ import annotations

import json
import math
import random

import pytest
import yaml
from finetune_runs import assert_runs_agree, single_and_two_processes

from archlab.cli import main
from archlab.data.formats import Found, detect
from archlab.data.preference_folder import PREFERENCE_FILE
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
    assert detect(out / "data") == Found("preference_pairs", folder=True) and (out / "data" / PREFERENCE_FILE).is_file()
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
    (["--method", "dpo", "--data", "{chat}"], "chat.jsonl is a file of chat examples; --method dpo reads"),
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


# ---- reward models (--method reward) --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reward_run(world, tmp_path_factory):
    """A reward run: 3 steps on the preferences, a margin on every line, TRL's centring term on."""
    rng = random.Random(2)
    lines = [json.loads(line) for line in (world / "prefs.jsonl").read_text().splitlines()]
    data = tmp_path_factory.mktemp("rm") / "prefs_margin.jsonl"
    data.write_text("".join(json.dumps({**line, "margin": round(rng.uniform(0, 1), 3)}) + "\n" for line in lines))
    out = data.parent / "rm"
    assert main(["finetune", str(world / "base"), "--method", "reward", "--data", str(data), "--out", str(out),
                 *COMMON, "--set", "train.budget=3", "--set", "train.reward.center_rewards_coefficient=0.01",
                 "--set", "train.reward.val_fraction=0.25", "--set", "train.eval_every=3"]) == 0
    return out, data


def test_reward_first_loss_is_ln2_with_trls_log_names_and_held_out_accuracy(reward_run):
    import torch

    from archlab.training.methods.reward import reward_loss

    zero = torch.zeros(4)
    assert float(reward_loss(zero, zero)) == pytest.approx(math.log(2), abs=1e-7)   # without margins: ln 2
    run, data = reward_run
    rows = read_metrics(run / "metrics.jsonl")
    steps = [r for r in rows if "loss" in r]
    # the head starts at zero: every reward 0, so the first loss is mean(softplus(margin)) over the first batch
    ours = _reward_run_of(run)
    margins = ours.margins[ours.batches.indices(0)]
    assert steps[0]["loss"] == pytest.approx(float(torch.nn.functional.softplus(margins).mean()), abs=1e-6)
    assert steps[0]["accuracy"] == 0.0 and steps[0]["margin"] == 0.0 and steps[0]["max_reward"] == 0.0
    assert {"accuracy", "margin", "min_reward", "mean_reward", "max_reward"} <= set(steps[-1])
    assert steps[-1]["max_reward"] != 0.0                       # the head has learned something
    val = [r for r in rows if "val_accuracy" in r][-1]
    assert 0.0 <= val["val_accuracy"] <= 1.0 and "val_loss" in val and "val_margin" in val


def test_reward_loss_and_logs_equal_trls_on_one_batch(reward_run):
    """Our loss and logged figures of one batch equal TRL's RewardTrainer.compute_loss given the same rewards; the
    rewards are the score head on the hidden state of each side's last token, computed here row by row."""
    from types import SimpleNamespace

    import torch

    trl = pytest.importorskip("trl")
    from archlab.nn.heads import SCORE_HEAD
    from archlab.runs.model_folder import load_run

    run, _ = reward_run
    model, _ = load_run(run)
    ours = _reward_run_of(run)
    inputs, labels = ours.batches.next(0, 0)
    with torch.no_grad():
        loss = ours.loss(model, inputs, labels).total
    logged = ours.log_fields()
    # the rewards by hand: head . hidden at the last real token of each unpadded row
    lengths = inputs["attention_mask"].sum(-1)
    head = getattr(model, SCORE_HEAD).weight[0]
    with torch.no_grad():
        rewards = torch.stack([model(input_ids=inputs["input_ids"][i:i + 1, :n], return_hidden=True)[0, -1] @ head
                               for i, n in enumerate(lengths.tolist())])                        # (2b,)
    # TRL's compute_loss on those rewards, its accelerator and logging stubbed to one process
    metrics: dict = {"train": {}}
    fake = SimpleNamespace(model=SimpleNamespace(training=True), args=SimpleNamespace(center_rewards_coefficient=0.01),
                           accelerator=SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x),
                           _total_train_tokens=0, _tp_size=1,
                           _metrics={"train": __import__("collections").defaultdict(list)})
    margin = ours.margins[inputs["pair_index"]]
    theirs = trl.RewardTrainer.compute_loss(
        fake, lambda **kw: SimpleNamespace(logits=rewards[:, None]),
        {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"], "margin": margin})
    metrics = {k: v[0] for k, v in fake._metrics["train"].items() if k != "num_tokens"}
    assert float(loss) == pytest.approx(float(theirs), abs=1e-5)
    assert set(metrics) == set(logged)
    for name, value in metrics.items():
        assert logged[name] == pytest.approx(value, abs=1e-5), name


def test_score_prints_each_sides_reward_and_the_accuracy(reward_run, tmp_path, capsys):
    import torch

    from archlab.runs.model_folder import load_run
    from archlab.training.methods.reward import sequence_rewards

    run, data = reward_run
    capsys.readouterr()
    assert main(["score", str(run), "--data", str(data)]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 16 and "accuracy" in err
    model, _ = load_run(run)
    first = open_first_pair(run)
    with torch.no_grad():
        expected = sequence_rewards(model, torch.tensor([first.chosen[0]]), torch.tensor([len(first.chosen[0])]))
    assert rows[0]["chosen"] == pytest.approx(float(expected[0]), abs=1e-5)
    share = sum(r["chosen"] > r["rejected"] for r in rows) / len(rows)
    assert f"accuracy {share:.4f}" in err
    assert main(["score", str(run), "--data", str(data), "--batch-size", "0"]) == 2


def test_score_refuses_a_run_without_a_score_head(world, capsys):
    assert main(["score", str(world / "base"), "--data", str(world / "prefs.jsonl")]) == 2
    assert "is not a reward run" in capsys.readouterr().err


def test_score_names_a_folder_given_as_data_as_a_folder(reward_run, capsys):
    run, data = reward_run
    assert main(["score", str(run), "--data", str(data.parent)]) == 2
    assert f"{data.parent}: a folder, not a file (preference data is a .jsonl file)" in capsys.readouterr().err


def open_first_pair(run):
    from archlab.data.preference_folder import open_preference_folder

    return open_preference_folder(run / "data", max_tokens=None, truncation="refuse", progress=False).pairs[0]


def _reward_run_of(run):
    """The RewardRun a reward run folder trained with (its config, its prepared folder), one process."""
    from types import SimpleNamespace

    from archlab.data.preference_folder import open_preference_folder
    from archlab.training.methods.reward import RewardRun, _margins

    cfg = TrainConfig.from_yaml((run / "config.yaml").read_text())
    data = open_preference_folder(run / "data", max_tokens=cfg.seq_len, truncation="refuse", progress=False)
    return RewardRun(data, cfg, SimpleNamespace(rank=0, world_size=1, is_main=True), _margins(data))


def test_orpo_first_loss_equals_the_formula_from_the_stored_logps(world, tmp_path):
    """--method dpo with train.dpo.loss=orpo: at the first step the policy is the base, whose log-probs the run
    stored, so the logged loss is ORPO's from them (training/dpo.py LOSSES)."""
    import torch
    from safetensors.torch import load_file

    from archlab.data.preference_folder import open_preference_folder
    from archlab.training.dpo import REFERENCE_FILE, DPOBatches, held_out, preference_loss

    out = tmp_path / "orpo"
    assert main(["finetune", str(world / "base"), "--method", "dpo", "--data", str(world / "prefs.jsonl"),
                 "--out", str(out), *COMMON, "--set", "train.budget=1", "--set", "train.dpo.loss=orpo"]) == 0
    cfg = TrainConfig.from_yaml((out / "config.yaml").read_text())
    data = open_preference_folder(out / "data", max_tokens=cfg.seq_len, truncation="refuse", progress=False)
    index = DPOBatches(data, cfg, val=held_out(data, cfg)).sampler.indices(0)
    stored = load_file(str(out / REFERENCE_FILE))
    count = torch.tensor([[sum(t != -100 for t in side[1]) for side in (data.pairs[i].chosen, data.pairs[i].rejected)]
                          for i in index], dtype=torch.float32)                               # (b, 2)
    c, r = stored["chosen"][index], stored["rejected"][index]
    expected = preference_loss("orpo", c, r, c, r, count[:, 0], count[:, 1], beta=cfg.dpo.beta)
    assert _losses(out)[0]["loss"] == pytest.approx(float(expected), abs=1e-5)


def test_reward_refuses_fsdp_before_reading_anything(tmp_path):
    from types import SimpleNamespace

    from archlab.errors import UserError
    from archlab.training.methods.reward import open_reward

    with pytest.raises(UserError, match="train.method=reward runs data-parallel with dist.strategy=ddp, not fsdp"):
        open_reward(None, TrainConfig(method="reward"), tmp_path / "nothing.jsonl", None,
                    SimpleNamespace(world_size=2, rank=0, is_main=True, strategy="fsdp"))


@pytest.mark.slow      # two torchrun processes; ~30 s on 2 cores
def test_two_process_reward_run_matches_single_process(world, reward_run, tmp_path, monkeypatch):
    """A reward run under torchrun (2 CPU processes, gloo, DDP; the base's LM head untied, so frozen: a reward model
    never reads it): each rank's share of each batch, the loss a mean over pairs, the logged figures reduced over the
    ranks, the held-out pairs scored on every rank. The logged loss, gradient norm, TRL's figures, held-out figures
    and the final weights are the single process's."""
    import torch

    from archlab.runs.checkpoint import latest_checkpoint, load_checkpoint

    _, data = reward_run
    args = ["finetune", str(world / "base"), "--method", "reward", "--data", str(data), *COMMON, "--set",
            "train.budget=3", "--set", "train.grad_accum=2", "--set", "train.reward.center_rewards_coefficient=0.01",
            "--set", "train.reward.val_fraction=0.25", "--set", "train.eval_every=2"]
    single_and_two_processes(args, tmp_path, monkeypatch)
    # weights atol 1e-4: Adam turns float noise in near-zero gradients into ~1e-5 moves
    assert_runs_agree(tmp_path / "single", tmp_path / "ddp", (
        "loss", "grad_norm", "accuracy", "margin", "min_reward", "mean_reward", "max_reward", "val_loss",
        "val_accuracy", "val_min_reward"), weights_atol=1e-4)
    last = [r for r in read_metrics(tmp_path / "single" / "metrics.jsonl") if "max_reward" in r][-1]
    assert last["max_reward"] != last["min_reward"]                         # the head has learned something
    trained, base = (load_checkpoint(latest_checkpoint(run))[0] for run in (tmp_path / "single", world / "base"))
    assert torch.equal(trained["lm_head.weight"], base["lm_head.weight"])   # frozen: never read
    assert max(float((trained[k] - base[k]).abs().max()) for k in base) > 5e-3     # 3 steps at lr <= 1e-2 moved them
