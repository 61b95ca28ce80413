"""The post-training demo: its mechanics at quick size (four run folders that chain, answers scored on held-out
words only, DPO's logs read back, the curves drawn, the command) and, as a slow test, its targets at full size."""
import json

import pytest

from archlab.data import reverse_words as rw
from archlab.demo import post_training as pt
from archlab.eval.reverse_words import score_reversal
from archlab.training import recipes


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("post") / "demo"
    lines = []
    return pt.run_post_training_demo(out, quick=True, progress=False, log=lines.append), lines


def test_the_four_stages_chain_and_report(quick_demo):
    result, lines = quick_demo
    out = result.run_dir
    for stage in ("base", "sft", "dpo", "grpo"):
        assert (out / stage / "metrics.jsonl").exists()
    dpo_config = (out / "dpo" / "config.yaml").read_text()
    assert "method: dpo" in dpo_config
    dpo_rows = [json.loads(x) for x in (out / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert any("rewards/accuracies" in r for r in dpo_rows)
    assert result.dpo_reward_accuracy == [r for r in dpo_rows if "rewards/accuracies" in r][-1]["rewards/accuracies"]
    for value in (result.exact_base_plain, result.exact_base, result.exact_sft, result.exact_dpo, result.preferred_sft,
                  result.preferred_dpo):
        assert 0.0 <= value <= 1.0
    assert result.preferred_dpo <= result.exact_dpo      # an answer in the preferred case is a right answer
    grpo_config = (out / "grpo" / "config.yaml").read_text()
    assert "method: grpo" in grpo_config
    grpo_rows = [json.loads(x) for x in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in grpo_rows if "rewards/exact_match/mean" in r] == [1, 2]
    for passes in (result.pass_sft, result.pass_grpo):
        assert set(passes) == {"pass@1", "pass@8"} and 0.0 <= passes["pass@1"] <= passes["pass@8"] <= 1.0
    assert 0.0 <= result.exact_grpo <= 1.0
    assert set(result.stage_cpu_seconds) == {"base", "sft", "dpo", "grpo"} and result.cpu_seconds > 0
    assert (out / "post_training.png").stat().st_size > 10_000
    assert any(line.startswith("[4/5] RL with a verifiable reward") for line in lines)
    assert any(line.startswith("[5/5]") and "CPU" in line for line in lines)


def test_scoring_counts_exact_and_preferred_answers(quick_demo, monkeypatch):
    """score_reversal's counting against answers written by hand: a model replaced by one that reads the word
    from the prompt and answers right (lowercase), right (capitals) or wrong by a rule."""
    import torch

    result, _ = quick_demo
    words = rw.reverse_problems(12)
    folder = result.run_dir / "sft"
    from archlab.runs import model_folder
    from archlab.tokenizer.chat import ChatTokenizer, apply_chat_template

    chat = ChatTokenizer.of(folder / "tokenizer")
    real_model, tokenizer = model_folder.load_model_and_tokenizer(folder)
    end = chat.tokenizer.token_to_id("<|im_end|>")
    width = len(apply_chat_template(chat, rw.user_turn(words[0]), add_generation_prompt=True))
    kinds = {w: ("lower", "upper", "wrong")[i % 3] for i, w in enumerate(words)}

    def fake_generate(model, ids, max_new_tokens, eos_token_id):
        rows = []
        for row in ids.tolist():
            word = tokenizer.decode(row).split(rw.INSTRUCTION)[1][:rw.WORD_LENGTH]
            answer = {"lower": word[::-1], "upper": word[::-1].upper(), "wrong": word}[kinds[word]]
            rows.append(row + tokenizer.encode(answer) + [end])
        return torch.tensor(rows)

    monkeypatch.setattr("archlab.generation.decode.generate", fake_generate)
    scores = score_reversal(folder, words)
    assert width > rw.WORD_LENGTH
    assert scores == {"exact": 8 / 12, "preferred": 4 / 12}


def test_the_demo_command_runs_the_four_stages(tmp_path, capsys):
    from archlab.cli import main

    assert main(["demo", "--post-training", "--quick", "--no-progress", "--out", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "[2/5] instruction tuning" in out and "[3/5] preference tuning (DPO" in out and "[4/5] RL" in out
    assert (tmp_path / "d" / "dpo" / "config.yaml").exists() and (tmp_path / "d" / "grpo" / "config.yaml").exists()


def test_the_seed_drives_init_and_data_order_of_every_stage_and_0_is_the_default():
    cfg = recipes.reverse_words(quick=True, seed=3)
    assert cfg["model"].seed == 3 and all(cfg[stage].seed == 3 for stage in ("base", "sft", "dpo", "grpo"))
    assert recipes.reverse_words(quick=True) == recipes.reverse_words(quick=True, seed=0)
    assert recipes.reverse_words(quick=True, seed=3)["sft_examples"] == cfg["sft_examples"]   # the same task


def test_the_demo_command_passes_its_seed_to_the_stages(tmp_path, monkeypatch):
    from archlab.cli import main

    seen = {}
    monkeypatch.setattr(pt, "run_post_training_demo", lambda out, **kw: seen.update(kw, out=out))
    assert main(["demo", "--post-training", "--seed", "2", "--out", str(tmp_path / "d")]) == 0
    assert seen["seed"] == 2 and seen["out"] == str(tmp_path / "d")
    assert main(["demo", "--post-training", "--out", str(tmp_path / "e")]) == 0 and seen["seed"] == 0


@pytest.mark.slow
def test_the_full_demo_meets_its_targets(tmp_path):
    """Held-out exact match from ~0% (the base through the chat template) to >= 90% after SFT; DPO raising the
    share of answers in the preferred case to >= 90% without losing the task; GRPO raising greedy exact match of the
    lowercase answer and sampled pass@1 by >= 20 points each. This runs seed 4, the seed with the least margin: at
    200 SFT steps with a 20-step warmup it stayed at 3% right; at the recipe's 300 steps with a 60-step warmup its SFT
    loss leaves the plateau last on both float paths, near step 210-225 of 300 (the other seeds by step 72-175). Seeds
    0-4 met every target on a 2-core AVX-512 Xeon and seeds 0-7 on its AVX2 float path (emulated: ATen, MKL and
    oneDNN held to AVX2 by environment variables), seed 4 there with one and with two threads (docs/benchmarks.md)."""
    result = pt.run_post_training_demo(tmp_path / "demo", seed=4, progress=False, log=lambda line: None)
    assert result.exact_base_plain >= 0.9          # the base can do the task in its pretraining format
    assert result.exact_base <= 0.05               # ... but not as a chat
    assert result.exact_sft >= 0.9
    assert result.preferred_dpo >= result.preferred_sft + 0.2 and result.preferred_dpo >= 0.9
    assert result.exact_dpo >= 0.9
    assert result.exact_grpo >= result.preferred_sft + 0.2          # greedy, exactly the lowercase reversal
    assert result.pass_grpo["pass@1"] >= result.pass_sft["pass@1"] + 0.2
    assert result.pass_grpo["pass@8"] >= result.pass_sft["pass@8"] - 0.05   # sharpened, not narrowed


def test_pass_at_k_is_the_unbiased_estimator_computed_by_hand():
    from archlab.eval.reverse_words import pass_at_k

    rows = [[True, False, False, False], [False] * 4, [True] * 4]
    assert pass_at_k(rows, 1) == pytest.approx((1 / 4 + 0 + 1) / 3)
    assert pass_at_k(rows, 2) == pytest.approx((1 - 3 / 6 + 0 + 1) / 3)     # 1 - C(3,2)/C(4,2) for the first
    assert pass_at_k(rows, 4) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        pass_at_k(rows, 5)


def test_grpo_prompts_answer_with_the_lowercase_reversal_of_training_words(tmp_path):
    path = rw.write_grpo_prompts(tmp_path, 50)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    held_out = set(rw.reverse_problems(200))
    assert len(lines) == 50
    for line in lines:
        word = line["prompt"][0]["content"][len(rw.INSTRUCTION):]
        assert line["answer"] == word[::-1] and line["prompt"] == rw.user_turn(word) and word not in held_out
