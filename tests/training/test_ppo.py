"""`archlab finetune --method ppo` (training/methods/ppo.py over training/ppo.py): the first rollout's figures as PPO's
math fixes them (policy = reference, value head at zero), TRL's log names, exact resume in the middle of a rollout, a
reward run as the reward, bad input as one line that writes nothing; and (slow) a reward raised from a fresh start."""
from __future__ import annotations

import json
import random

import pytest
import torch
from finetune_runs import COUNT_CALLS, WORDS, assert_runs_agree, single_and_two_processes

from archlab.cli import main
from archlab.training.config import TrainConfig
from archlab.training.finetune import finetune
from archlab.training.metrics import read_metrics

TRL_NAMES = ("objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
             "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg",
             "val/clipfrac_avg", "policy/entropy_avg", "val/ratio", "val/ratio_var", "val/num_eos_tokens", "episode")
REWARD = '''def letters(prompts, completions, completion_ids, **columns):
    """The share of completion tokens that are single lowercase letters (byte ids 97..122)."""
    return [sum(97 <= t <= 122 for t in ids) / max(len(ids), 1) for ids in completion_ids]
'''


@pytest.fixture(scope="module")
def world(chat_world, make_base, tmp_path_factory):
    """An untrained base with the chat tokenizer, 32 plain prompts, a reward function and a broken one."""
    root = tmp_path_factory.mktemp("ppo")
    base = make_base(root / "base")
    rng = random.Random(0)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Repeat {rng.choice(WORDS)}:"}) + "\n"
                                                for _ in range(32)))
    (root / "rewards.py").write_text(REWARD)
    (root / "broken.py").write_text("def one(prompts, completions, **columns):\n    return [1.0]\n")
    return {"root": root, "base": base, "prompts": root / "prompts.jsonl", "reward": f"{root / 'rewards.py'}:letters",
            "broken": f"{root / 'broken.py'}:one"}


def _cfg(world, **ppo) -> TrainConfig:
    return TrainConfig(lr=1e-2, batch_size=4, seq_len=32, budget=2, log_every=1, eval={"every": 0},
                       sample={"every": -1}, memory_check=False, schedule={"warmup_steps": 0},
                       ppo={"reward": world["reward"], "response_length": 6, "temperature": 1.0, **ppo})


def _records(run) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def test_the_first_rollout_has_no_kl_a_zero_policy_loss_and_trls_log_names(world, tmp_path):
    out = tmp_path / "run"
    finetune(world["base"], world["prompts"], out, train_cfg=_cfg(world, num_ppo_epochs=2, gamma=1.0, lam=0.9),
             method="ppo", progress=False)
    first, second = _records(out)
    assert set(TRL_NAMES) <= set(first)
    assert first["objective/kl"] == 0.0                    # the policy is the reference: the same log-probs
    assert first["objective/non_score_reward"] == 0.0
    assert first["objective/rlhf_reward"] == pytest.approx(first["objective/scores"])
    assert first["val/ratio"] == pytest.approx(1.0, abs=1e-5) and first["policy/clipfrac_avg"] == 0.0
    assert abs(first["loss/policy_avg"]) < 1e-6            # -mean(whitened advantages) over the whole rollout
    assert first["episode"] == 4.0 and "objective/kl" not in second     # one rollout, two PPO epochs
    assert second["val/ratio"] != pytest.approx(1.0, abs=1e-6)           # the policy moved
    recorded = json.loads(json.dumps(read_metrics(out / "metrics.jsonl")))
    assert recorded and (out / "data" / "prompts.jsonl").is_file() and (out / "tokenizer").is_dir()


def test_the_first_rollouts_returns_are_the_score_discounted_by_lambda(world):
    """Values start at zero and the KL at 0, so GAE's return at token t of an L-token completion is
    lambda^(L-1-t) * score (gamma = 1); the advantages are those whitened over the rollout's tokens."""
    from types import SimpleNamespace

    from archlab.runs.model_folder import load_run
    from archlab.training.init_from import read_init_source
    from archlab.training.methods.ppo import open_ppo
    from archlab.training.ppo import masked_whiten

    cfg = _cfg(world, lam=0.8)
    source = read_init_source(world["base"])
    info = SimpleNamespace(world_size=1, rank=0, is_main=True)
    run = open_ppo(source.model_config, cfg, world["prompts"], source, info)
    model, _ = load_run(world["base"])
    run.extend(model)
    run.start(model, world["root"], device=torch.device("cpu"))
    inputs, labels = run.batches.next(0, 0)
    r = run.batches.current
    mask = r["completion_mask"].bool()
    lengths = mask.sum(-1)
    t = torch.arange(mask.shape[1])
    expect = torch.where(mask, 0.8 ** (lengths[:, None] - 1 - t) * r["scores"][:, None], 0.0)
    assert torch.allclose(r["returns"], expect, atol=1e-6) and torch.count_nonzero(r["values"]) == 0
    assert torch.allclose(r["advantages"], torch.where(mask, masked_whiten(expect, mask), 0.0), atol=1e-5)
    rows = run.batches.rows_of(0, 0)
    assert torch.equal(labels, r["completion_ids"][rows]) and torch.equal(inputs["advantages"], r["advantages"][rows])


def test_a_resume_in_the_middle_of_a_rollout_equals_the_uninterrupted_run(world, tmp_path):
    cfg = TrainConfig.with_overrides(_cfg(world, num_ppo_epochs=2, num_mini_batches=2),   # 4 steps per rollout
                                     {"schedule.kind": "constant"})      # the LR does not depend on the budget
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    finetune(world["base"], world["prompts"], whole, train_cfg=TrainConfig.with_overrides(
        cfg, {"budget": "6", "checkpoint.every": "3"}), method="ppo", progress=False)
    finetune(world["base"], world["prompts"], parts, train_cfg=TrainConfig.with_overrides(
        cfg, {"budget": "3", "checkpoint.every": "3"}), method="ppo", progress=False)
    finetune(world["base"], world["prompts"], parts, train_cfg=TrainConfig.with_overrides(
        cfg, {"budget": "6", "checkpoint.every": "3"}), method="ppo", progress=False, resume=True)
    keep = ("step", "loss", "grad_norm", "objective/scores", "val/ratio", "loss/value_avg")
    a = [{k: r.get(k) for k in keep} for r in _records(whole)]
    b = [{k: r.get(k) for k in keep} for r in _records(parts)]
    assert a == b and len(a) == 6


def test_a_reward_run_scores_the_completions(world, tmp_path):
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": f"Repeat {w}:", "chosen": f" {w}", "rejected": " x"}) + "\n"
                             for w in WORDS))
    common = ["--no-progress", "--set", "train.batch_size=4", "--set", "train.seq_len=32", "--set", "train.budget=2",
              "--set", "train.sample.every=-1", "--set", "train.memory_check=false", "--set", "train.log_every=1"]
    assert main(["finetune", str(world["base"]), "--method", "reward", "--data", str(prefs), "--out",
                 str(tmp_path / "rm"), *common, "--set", "train.lr=1e-2"]) == 0
    assert main(["finetune", str(world["base"]), "--method", "ppo", "--data", str(world["prompts"]), "--out",
                 str(tmp_path / "ppo"), *common, "--reward", str(tmp_path / "rm"),
                 "--set", "train.ppo.response_length=4"]) == 0
    first = _records(tmp_path / "ppo")[0]
    assert first["objective/scores"] != 0.0 and first["objective/kl"] == 0.0
    # archlab train on the prompt file itself, encoded with BASE's tokenizer: the same first rollout
    assert main(["train", "--init-from", str(world["base"]), "--data", str(world["prompts"]), "--out",
                 str(tmp_path / "train"), *common, "--set", "train.method=ppo", "--set",
                 f"train.ppo.reward={tmp_path / 'rm'}", "--set", "train.ppo.response_length=4"]) == 0
    assert _records(tmp_path / "train")[0]["objective/scores"] == first["objective/scores"]


@pytest.mark.parametrize("args, message", [
    (["--set", "train.ppo.gamma=1.5"], "train.ppo.gamma=1.5 must be in [0, 1]"),
    (["--set", "train.ppo.lam=-0.1"], "train.ppo.lam=-0.1 must be in [0, 1]"),
    ([], "--method ppo needs a reward"),
    (["--data", "{bad}", "--reward", "{broken}"], "bad.jsonl:2 has 'question', not the fields of prompts"),
    (["--reward", "nowhere"], "reward 'nowhere'"),
    (["--reward", "{broken}"], "returned 1 values for 2 completions"),
    (["--reward", "{broken}", "--reward", "{broken}"], "--method ppo takes one --reward"),
    (["--set", "train.ppo.response_length=40"], "train.ppo.response_length=40 leaves no room for a prompt"),
])
def test_bad_ppo_input_is_one_line_and_writes_nothing(world, tmp_path, capsys, args, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "Repeat cat:"}) + "\n" + json.dumps({"question": "Repeat dog:"}) + "\n")
    args = [a.replace("{bad}", str(bad)).replace("{broken}", world["broken"]) for a in args]
    data = [] if "--data" in args else ["--data", str(world["prompts"])]
    out = tmp_path / "run"
    assert main(["finetune", str(world["base"]), "--method", "ppo", *data, "--out", str(out), "--no-progress",
                 "--set", "train.seq_len=32", "--set", "train.memory_check=false", "--set",
                 "train.ppo.response_length=8", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.slow
def test_ppo_raises_the_reward_from_a_fresh_start(world, tmp_path):
    """120 steps (30 rollouts of 16 prompts, 4 PPO epochs each) on an untrained model: the share of single-letter tokens
    the reward counts goes from ~0.1 (chance) to ~0.7 on this machine; the test asks for +0.3."""
    out = tmp_path / "run"
    cfg = TrainConfig.with_overrides(_cfg(world, num_ppo_epochs=4, response_length=4), {"budget": "120",
                                                                                         "batch_size": "16"})
    finetune(world["base"], world["prompts"], out, train_cfg=cfg, method="ppo", progress=False)
    scores = [r["objective/scores"] for r in _records(out) if "objective/scores" in r]
    assert len(scores) == 30
    before, after = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    assert after >= before + 0.3, (before, after, scores)


@pytest.mark.parametrize("info,message", [
    ({"world_size": 2, "rank": 0, "strategy": "fsdp"}, "runs data-parallel with dist.strategy=ddp, not fsdp"),
    ({"world_size": 3, "rank": 0, "strategy": "ddp"}, "must be divisible by the world size 3"),
])
def test_data_parallel_ppo_refuses_what_it_cannot_split(world, info, message):
    from types import SimpleNamespace

    from archlab.errors import UserError
    from archlab.training.init_from import read_init_source
    from archlab.training.methods.ppo import open_ppo

    source = read_init_source(world["base"])
    with pytest.raises(UserError, match=message):
        open_ppo(source.model_config, _cfg(world), world["prompts"], source, SimpleNamespace(**info))


COUNTED = REWARD.replace("    return", COUNT_CALLS + "    return")


@pytest.mark.slow      # two torchrun processes; ~30 s on 2 cores
def test_two_process_ppo_matches_single_process(world, tmp_path, monkeypatch):
    """PPO under torchrun (2 CPU processes, gloo, DDP): each rank samples, values, scores (the reward sees half the
    completions) and references every other prompt of a rollout; the shares gathered are the one-process rollout (each
    prompt's completion from its own seeded generator), whitened and GAE'd on every rank; each rank trains on its share
    of each micro-batch, its token-mean loss scaled by its share of the micro-batch's tokens; the step's figures are
    token-weighted over the ranks. Logged figures and final weights equal the single process's."""
    (tmp_path / "counted.py").write_text(COUNTED)
    args = ["finetune", str(world["base"]), "--method", "ppo", "--data", str(world["prompts"]), "--reward",
            f"{tmp_path / 'counted.py'}:letters", "--no-progress", "--set", "train.batch_size=4", "--set",
            "train.grad_accum=2", "--set", "train.seq_len=32", "--set", "train.budget=5", "--set", "train.lr=1e-2",
            "--set", "train.log_every=1", "--set", "train.sample.every=-1", "--set", "train.memory_check=false",
            "--set", "train.schedule.warmup_steps=0", "--set", "train.ppo.response_length=6", "--set",
            "train.ppo.temperature=1.0", "--set", "train.ppo.num_ppo_epochs=2", "--set", "train.ppo.num_mini_batches=2",
            "--set", "train.ppo.whiten_rewards=true", "--set", "train.ppo.kl_estimator=k3"]
    calls = single_and_two_processes(args, tmp_path, monkeypatch)
    # two rollouts of 16 prompts (4 steps each): 16 completions per rollout on one process, 8 on each rank
    assert calls == {"single": {0: [16, 16]}, "ddp": {0: [8, 8], 1: [8, 8]}}
    # weights atol 1e-4: Adam turns float noise in near-zero gradients into ~1e-5 moves
    assert_runs_agree(tmp_path / "single", tmp_path / "ddp", ("loss", "grad_norm", *TRL_NAMES), weights_atol=1e-4)
    kl = [r["objective/kl"] for r in _records(tmp_path / "single") if "objective/kl" in r]
    assert len(kl) == 2 and kl[-1] > 0                                   # the second rollout's policy had moved


def test_a_lora_ppo_policy_exports_without_its_value_head_and_is_a_base_for_another_method(world, tmp_path):
    """The value head stays in the run's checkpoint, leaves with neither an HF export nor a new method's start; a LoRA
    run read as a base has its adapters merged, as load_run merges them."""
    from safetensors.torch import load_file

    from archlab.runs.model_folder import load_run

    run = tmp_path / "ppo"
    assert main(["finetune", str(world["base"]), "--method", "ppo", "--data", str(world["prompts"]), "--out", str(run),
                 "--reward", world["reward"], "--lora-r", "4", "--no-progress", "--set", "train.batch_size=4",
                 "--set", "train.seq_len=32", "--set", "train.budget=2", "--set", "train.sample.every=-1",
                 "--set", "train.memory_check=false", "--set", "train.ppo.response_length=4"]) == 0
    from archlab.training.init_from import read_init_source

    model, _ = load_run(run)
    assert hasattr(model, "value_head")                       # the checkpoint keeps it (a resume needs it)
    source = read_init_source(run).state                      # a LoRA run as a base: its adapters folded in
    assert not any(".lora_" in k for k in source) and set(source) == set(model.state_dict())
    assert all(torch.equal(source[k], v) for k, v in model.state_dict().items())
    assert main(["convert", "--to-hf", str(run), "--out", str(tmp_path / "hf"), "--no-check"]) == 0
    assert not any(k.startswith("value_head") for k in load_file(tmp_path / "hf" / "model.safetensors"))
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"Repeat {w}:", "completion": f" {w}"}) + "\n" for w in WORDS))
    assert main(["finetune", str(run), "--data", str(sft), "--out", str(tmp_path / "sft"), "--no-progress",
                 "--set", "train.batch_size=4", "--set", "train.seq_len=32", "--set", "train.budget=1",
                 "--set", "train.sample.every=-1", "--set", "train.memory_check=false"]) == 0
    assert not hasattr(load_run(tmp_path / "sft")[0], "value_head")


def test_chat_prompts_end_at_the_templates_end_of_turn(world, tmp_path):
    from archlab.tokenizer.chat import ChatTokenizer

    prompts = tmp_path / "chat.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Repeat {w}"}]}) + "\n"
                               for w in WORDS))
    out = tmp_path / "run"
    finetune(world["base"], prompts, out, train_cfg=_cfg(world, response_length=8), method="ppo", progress=False)
    from types import SimpleNamespace

    from archlab.training.init_from import read_init_source
    from archlab.training.methods.ppo import open_ppo

    source = read_init_source(world["base"])
    run = open_ppo(source.model_config, _cfg(world), out / "data", source, SimpleNamespace(world_size=1))
    specials = ChatTokenizer.of(out / "tokenizer").tokenizer.special_to_id
    assert run.batches.end_ids == [specials["<|endoftext|>"], specials["<|im_end|>"]]
    assert {"objective/scores", "val/num_eos_tokens"} <= set(_records(out)[0])
