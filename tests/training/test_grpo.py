"""`archlab finetune --method grpo` (training/methods/grpo.py, training/grpo.py): prompts in, groups of sampled
completions scored by rewards (built-ins, the user's FILE.py:FUNC from the command line, a reward run), TRL's
GRPO loss and log names; bad input refused in one line before anything is written."""
from __future__ import annotations

import json
import random

import pytest
import torch
from finetune_runs import COUNT_CALLS, assert_runs_agree, single_and_two_processes

from archlab.cli import main
from archlab.training.grpo import group_advantages
from archlab.training.metrics import read_metrics

WORDS = ["red", "green", "blue", "cat", "dog", "bird", "one", "two", "yes", "no"]
COMMON = ["--no-progress", "--set", "train.batch_size=8", "--set", "train.log_every=1", "--set",
          "train.warmup_steps=0", "--set", "train.sample_every=-1", "--set", "train.budget=2", "--set", "train.lr=1e-3",
          "--set", "train.memory_check=false", "--set", "train.eval_every=0", "--set", "train.grpo.num_generations=4",
          "--set", "train.grpo.max_completion_length=6"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A byte-level BPE tokenizer, a tiny decoder trained 2 steps (the base), prompt lines with answers."""
    from test_checkpoint import tiny_model

    from archlab.tokenizer import train as train_tokenizer
    from archlab.training.config import TrainConfig
    from archlab.training.trainer import fit_vocab, train

    root = tmp_path_factory.mktemp("grpo")
    rng = random.Random(0)
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(2):
        (corpus / f"d{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(200)) + "\n")
    tok = train_tokenizer(corpus / "d0.txt", 280, ["<|endoftext|>"])
    tok.save(root / "tok")
    assert main(["data", "prepare", "--corpus", str(corpus), "--tokenizer", str(root / "tok"), "--out",
                 str(root / "data"), "--workers", "0", "--quiet"]) == 0
    train(fit_vocab(tiny_model(), root / "data"), TrainConfig(
        batch_size=4, seq_len=32, budget=2, lr=3e-3, warmup_steps=0, eval_batches=1, sample_every=-1),
        root / "data", root / "base", progress=False)
    lines = [{"prompt": " ".join(rng.choice(WORDS) for _ in range(3)) + ":", "answer": rng.choice(WORDS)}
             for _ in range(12)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (root / "my_rewards.py").write_text(
        "def has_e(prompts, completions, answer, **kw):\n    return [float('e' in c) for c in completions]\n"
        "def boom(prompts, completions, **kw):\n    raise RuntimeError('no reward today')\n"
        "def short(prompts, completions, **kw):\n    return [1.0]\n"
        "def words(prompts, completions, **kw):\n    return ['good' for _ in completions]\n"
        "def slow_has_e(prompts, completions, **kw):\n    import time\n    time.sleep(0.05)\n"
        "    return [float('e' in c) for c in completions]\n"
        "def counted_has_e(prompts, completions, **kw):\n" + COUNT_CALLS +
        "    return [float('e' in c) for c in completions]\n")
    return root


def _rows(run):
    return [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def test_grpo_trains_with_a_builtin_and_a_users_reward_and_logs_trls_names(world, tmp_path):
    out = tmp_path / "run"
    assert main(["finetune", str(world / "base"), "--method", "grpo", "--data", str(world / "prompts.jsonl"),
                 "--out", str(out), "--reward", "exact_match", "--reward", f"{world / 'my_rewards.py'}:has_e",
                 "--set", "train.grpo.beta=0.04", "--val-fraction", "0.25", *COMMON]) == 0
    rows = _rows(out)
    val = [r for r in read_metrics(out / "metrics.jsonl") if "val_reward" in r]
    assert len(val) == 1 and {"val_loss", "val_reward_std", "val_rewards/has_e/mean"} <= set(val[0])
    assert val[0]["val_loss"] == -val[0]["val_reward"]
    from types import SimpleNamespace

    from archlab.runs.model_folder import read_run_config
    from archlab.training.config import TrainConfig
    from archlab.training.methods.grpo import open_grpo

    cfg = TrainConfig.from_dict(read_run_config(out)["train"])
    session = open_grpo(SimpleNamespace(arch="decoder", max_seq_len=64, vocab_size=280), cfg, out / "data", None,
                        SimpleNamespace(world_size=1, rank=0))
    trained = {i for step in range(8) for i in session._prompt_indices(step)}     # two passes over the lines
    assert session.val and not trained & set(session.val) and trained | set(session.val) == set(range(12))
    assert len(rows) == 2
    names = {"loss", "grad_norm", "reward", "reward_std", "frac_reward_zero_std", "rewards/exact_match/mean",
             "rewards/has_e/mean", "rewards/has_e/std", "completions/mean_length", "completions/clipped_ratio",
             "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_max", "clip_ratio/region_mean"}
    assert names <= set(rows[0]), names - set(rows[0])
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)          # policy = reference at the first step
    assert rows[0]["clip_ratio/region_mean"] == 0.0               # on-policy: the ratio is 1
    assert 1 <= rows[0]["completions/mean_length"] <= 6
    assert (out / "data" / "prompts.jsonl").is_file() and (out / "tokenizer" / "tokenizer.json").is_file()


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 3.0, 1.0])
    adv, zero = group_advantages(r, 2)
    a, b = 0.5 / (0.5 ** 0.5 + 1e-4), 1.0 / (2 ** 0.5 + 1e-4)      # (r - mean) / (unbiased std + 1e-4) per group
    torch.testing.assert_close(adv, torch.tensor([a, -a, 0.0, 0.0, b, -b]))
    assert zero.tolist() == [False, False, True, True, False, False]
    adv, _ = group_advantages(r, 3, "none")
    torch.testing.assert_close(adv, r - torch.tensor([2 / 3] * 3 + [5 / 3] * 3))


@pytest.mark.parametrize("args, message", [
    (["--reward", "{root}/missing.py:f"], "missing.py:f: no such file"),
    (["--reward", "{root}/my_rewards.py:nope"], "my_rewards.py has no function nope"),
    (["--reward", "{root}/my_rewards.py:boom"], "raised RuntimeError: no reward today"),
    (["--reward", "{root}/my_rewards.py:short"], "returned 1 values for 2 completions"),
    (["--reward", "{root}/my_rewards.py:words"], "returned 'good': every reward must be a finite number"),
    (["--data", "{root}/no_prompt.jsonl"], "no_prompt.jsonl:1 has 'question', 'answer', not the fields of prompts"),
    (["--data", "{root}/prefs.jsonl"], "prefs.jsonl is a file of preference pairs; --method grpo reads prompts"),
    (["--data", "{root}/no_answer.jsonl"], "the exact_match reward compares with an 'answer'"),
    (["--set", "train.grpo.num_generations=1"], "train.grpo.num_generations=1 must be at least 2"),
    (["--set", "train.grpo.beta=-0.1"], "train.grpo.beta=-0.1 must be >= 0"),
    (["--set", "train.batch_size=6"], "must be a multiple of train.grpo.num_generations=4"),
    (["--reward", "{root}/other_rm"], "was trained with another tokenizer than the policy's"),
    (["--reward", "nonsense"], "reward 'nonsense': neither a built-in"),
])
def test_bad_grpo_input_is_one_line_exit_2_and_writes_nothing(world, tmp_path, capsys, args, message):
    root = world
    (root / "no_prompt.jsonl").write_text(json.dumps({"question": "hi", "answer": "x"}) + "\n")
    (root / "no_answer.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    (root / "prefs.jsonl").write_text(json.dumps({"prompt": "a", "chosen": " b", "rejected": " c"}) + "\n")
    other = root / "other_rm" / "tokenizer"
    if not other.is_dir():                  # a reward run folder whose tokenizer is another one
        from archlab.tokenizer import train as train_tokenizer

        other.parent.mkdir(exist_ok=True)
        (other.parent / "c.txt").write_text("zz yy xx ww " * 50)
        train_tokenizer(other.parent / "c.txt", 270, ["<|endoftext|>"]).save(other)
    args = [a.replace("{root}", str(root)) for a in args]
    data = [] if "--data" in args else ["--data", str(root / "prompts.jsonl")]
    out = tmp_path / "run"
    assert main(["finetune", str(root / "base"), "--method", "grpo", *data, "--out", str(out), *COMMON, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err, err
    assert not out.exists()


def test_reward_is_for_grpo_only(world, tmp_path, capsys):
    assert main(["finetune", str(world / "base"), "--data", str(world / "prompts.jsonl"), "--out", str(tmp_path / "r"),
                 "--reward", "exact_match"]) == 2
    assert "--reward is for --method grpo or ppo, not --method sft" in capsys.readouterr().err


def test_grpo_resumed_after_an_interruption_equals_the_uninterrupted_run(world, tmp_path):
    """A rollout is a function of the weights and (seed, step): stopped after step 2 and resumed, the run logs what
    the uninterrupted one did, β > 0 (the reference rebuilt from --init-from's weights) and grad_accum 2 included."""
    import shutil

    argv = ["finetune", str(world / "base"), "--method", "grpo", "--data", str(world / "prompts.jsonl"), *COMMON,
            "--reward", "exact_match", "--reward", f"{world / 'my_rewards.py'}:has_e", "--set", "train.grpo.beta=0.1",
            "--set", "train.grad_accum=2", "--set", "train.batch_size=4", "--set", "train.checkpoint_every=2",
            "--set", "train.keep_last=2", "--set", "train.budget=4"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert main([*argv, "--out", str(whole)]) == 0
    shutil.copytree(whole, parts)
    shutil.rmtree(parts / "checkpoints" / "step_0000004")     # interrupted after step 2's checkpoint
    assert main([*argv, "--out", str(parts), "--resume"]) == 0
    keep = ("loss", "grad_norm", "reward", "kl", "entropy", "completions/mean_length")
    a, b = ([{k: r[k] for k in keep} for r in _rows(run)] for run in (whole, parts))
    assert len(a) == 4 and a == b
    assert a[-1]["kl"] > 0                                   # the policy moved away from the reference


@pytest.mark.slow
def test_grpo_teaches_a_small_model_to_repeat_a_letter(tmp_path):
    """A verifiable task from nothing: a tiny decoder pretrained on lines `km` of letters a-d, m drawn at random
    (nothing links it to k), follows a letter with one of the four, right 1 time in 4 when the task is to repeat k;
    GRPO with the exact_match reward (the answer is the prompt's letter) teaches it to repeat k on most samples
    (from 1 in 4 to nearly always in 90 steps, ~25 s on a shared 2-core CPU)."""
    from test_checkpoint import tiny_model

    from archlab.tokenizer import train as train_tokenizer
    from archlab.training.config import TrainConfig
    from archlab.training.trainer import fit_vocab, train

    rng = random.Random(0)
    letters = "abcd"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"d{i}.txt").write_text("".join(f"{rng.choice(letters)}{rng.choice(letters)}\n" for _ in range(2000)))
    train_tokenizer(corpus / "d0.txt", 257, ["<|endoftext|>"]).save(tmp_path / "tok")
    assert main(["data", "prepare", "--corpus", str(corpus), "--tokenizer", str(tmp_path / "tok"), "--out",
                 str(tmp_path / "data"), "--workers", "0", "--quiet"]) == 0
    train(fit_vocab(tiny_model(), tmp_path / "data"), TrainConfig(
        batch_size=16, seq_len=32, budget=100, lr=1e-2, warmup_steps=0, eval_batches=1, sample_every=-1),
        tmp_path / "data", tmp_path / "base", progress=False)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"\n{k}", "answer": k}) + "\n"
                                                    for k in letters))
    out = tmp_path / "grpo"
    assert main(["finetune", str(tmp_path / "base"), "--method", "grpo", "--data", str(tmp_path / "prompts.jsonl"),
                 "--out", str(out), "--reward", "exact_match", "--no-progress", "--set", "train.batch_size=64",
                 "--set", "train.budget=90", "--set", "train.lr=1e-2", "--set", "train.warmup_steps=0",
                 "--set", "train.log_every=1", "--set", "train.eval_every=0", "--set", "train.sample_every=-1",
                 "--set", "train.memory_check=false", "--set", "train.grpo.max_completion_length=1"]) == 0
    rewards = [r["reward"] for r in _rows(out)]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    print(f"reward: first 3 steps {first:.3f}, last 5 steps {last:.3f}")
    # measured (a 2-core Xeon): 0.25 -> 1.00; with train.seed 1 and 4, 0.10 -> 0.66 and 0.19 -> 1.00 (at 60 steps
    # seed 1 reached 0.49 only: 90 leave room for another CPU's float path)
    assert first < 0.45 and last > 0.6


@pytest.mark.slow
def test_grpo_killed_mid_rollout_and_resumed_equals_the_uninterrupted_run(world, tmp_path):
    """SIGKILL while a step's completions are being scored (the reward sleeps, so that is where the time goes), then
    --resume: the metrics and the final weights equal the uninterrupted run's, step for step."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from archlab.runs.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint

    argv = [sys.executable, "-m", "archlab", "finetune", str(world / "base"), "--method", "grpo", "--data",
            str(world / "prompts.jsonl"), *COMMON, "--reward", "exact_match",
            "--reward", f"{world / 'my_rewards.py'}:slow_has_e", "--set", "train.grpo.beta=0.1",
            "--set", "train.grad_accum=2", "--set", "train.batch_size=4", "--set", "train.checkpoint_every=2",
            "--set", "train.keep_last=2", "--set", "train.budget=6"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(out, *extra):
        return subprocess.Popen([*argv, "--out", str(out), *extra], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    assert main([*argv[3:], "--out", str(tmp_path / "full")]) == 0     # uninterrupted, in this process
    victim = run(tmp_path / "killed")
    deadline = time.time() + 300
    while time.time() < deadline and victim.poll() is None:
        found = list_checkpoints(tmp_path / "killed" / "checkpoints")
        if found and found[-1].name >= "step_0000002":
            time.sleep(0.03)                                   # into step 3's rollout (its rewards sleep 0.05 s)
            victim.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    victim.communicate(timeout=60)
    assert victim.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert latest_checkpoint(tmp_path / "killed").name < "step_0000006"
    resumed = run(tmp_path / "killed", "--resume")
    err = resumed.communicate(timeout=300)[1]
    assert resumed.returncode == 0, err
    keep = ("loss", "grad_norm", "reward", "kl", "entropy")
    a, b = ([{k: r[k] for k in keep} for r in _rows(run_dir)] for run_dir in (tmp_path / "full", tmp_path / "killed"))
    assert len(a) == 6 and a == b
    x, _ = load_checkpoint(latest_checkpoint(tmp_path / "full"))
    y, _ = load_checkpoint(latest_checkpoint(tmp_path / "killed"))
    assert all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("info,message", [
    ({"world_size": 2, "rank": 0, "strategy": "fsdp"}, "run it with dist.strategy=ddp, not fsdp"),
    ({"world_size": 3, "rank": 0, "strategy": "ddp"}, "must be divisible by the world size 3"),
])
def test_data_parallel_grpo_refuses_what_it_cannot_split(world, tmp_path, info, message):
    from types import SimpleNamespace

    from archlab.errors import UserError
    from archlab.training.config import TrainConfig
    from archlab.training.methods.grpo import open_grpo

    with pytest.raises(UserError, match=message):
        open_grpo(SimpleNamespace(arch="decoder", max_seq_len=64, vocab_size=280), TrainConfig(batch_size=8),
                  tmp_path, None, SimpleNamespace(**info))


@pytest.mark.slow      # two torchrun processes; ~30 s on 2 cores
@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])   # the two with a token count across ranks
def test_two_process_grpo_matches_single_process(world, tmp_path, loss_type, monkeypatch):
    """GRPO under torchrun (2 CPU processes, gloo, DDP): each rank samples and scores every other prompt of the step
    (the reward function sees half the completions: the rollout is split), the shares gathered are the one-process
    generation batch (each prompt's group drawn from its own seeded generator), each rank takes its share of each
    micro-batch and scales its loss so that DDP's mean gradient is the one-process gradient; the loss's figures are
    reduced over the ranks. The logged loss, gradient norm, rewards, KL, entropy, clip ratios and held-out reward, and
    the final weights, are the single process's."""
    args = ["finetune", str(world / "base"), "--method", "grpo", "--data", str(world / "prompts.jsonl"), *COMMON,
            "--reward", "exact_match", "--reward", f"{world / 'my_rewards.py'}:counted_has_e", "--set",
            "train.grpo.beta=0.04", "--set", f"train.grpo.loss_type={loss_type}", "--set", "train.grad_accum=2",
            "--set", "train.budget=3", "--set", "train.lr=1e-2", "--set", "train.eval_every=2", "--val-fraction",
            "0.25"]
    calls = single_and_two_processes(args, tmp_path, monkeypatch)
    # 3 steps of 4 prompts x 4 completions, 2 evaluations of the one held-out prompt: 16 and 4 rows on one process;
    # under DDP rank 0 samples each step's prompt slots 0 and 2 (8 rows) and the held-out prompt, rank 1 slots 1 and 3
    assert calls == {"single": {0: [4, 4, 16, 16, 16]}, "ddp": {0: [4, 4, 8, 8, 8], 1: [8, 8, 8]}}
    assert_runs_agree(tmp_path / "single", tmp_path / "ddp", (
        "loss", "grad_norm", "reward", "reward_std", "rewards/counted_has_e/mean", "kl", "entropy",
        "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_max", "completions/mean_length", "val_reward"))
    assert _rows(tmp_path / "single")[-1]["kl"] > 0              # the policy moved: the weights say something


def test_held_out_prompts_are_whole_lines_and_never_in_the_training_pool(world):
    """train.grpo.val_fraction holds out the prompts of a seeded hash of lines (data.prepare.held_out_indices, as DPO's
    pairs); the pool the steps draw from is every other prompt."""
    from archlab.data.prepare import held_out_indices
    from archlab.data.prompts import load_prompts
    from archlab.training.config import TrainConfig
    from archlab.training.methods.grpo import GRPORun

    data = load_prompts(world / "prompts.jsonl", world / "tok")
    run = GRPORun(data, TrainConfig(seed=3, grpo={"val_fraction": 0.25}), [], None)
    assert run.val == held_out_indices(data.path, data.prompts, 3, 0.25) and 0 < len(run.val) < len(data.prompts)
    assert sorted(run.val + run.pool) == list(range(len(data.prompts)))
    assert GRPORun(data, TrainConfig(seed=3), [], None).val == []
