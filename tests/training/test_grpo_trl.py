"""GRPO against TRL's GRPOTrainer on a frozen batch: the same tiny Llama (an archlab model exported with save_hf and
read back by transformers), the same prompts and completions (TRL's generation replaced by the frozen one), the same
rewards. TRL's advantages, reward logs and reference log-probs, then its loss per loss type, each token's loss
alone (TRL's tool_mask picks one token into the loss without changing the forward), kl, entropy and clip ratios
equal ours to 1e-5."""
from __future__ import annotations

import pytest
import torch

from archlab.training.grpo import group_advantages, grpo_loss
from archlab.training.methods import rewards as reward_fns
from archlab.training.methods.rollout import completion_logps

GROUP, BETA = 4, 0.04
PROMPTS = [[5, 9, 13], [7, 11]]
COMPLETIONS = [[20, 21, 0], [22, 23, 24, 25, 26, 27], [30, 0], [31, 32, 33, 0],       # eos = 0; some truncated
               [40, 41, 42, 43, 44, 45], [46, 0], [47, 48, 0], [0]]


def has_seven(prompts, completions, **kwargs):
    return [float("7" in c) for c in completions]


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """(our model, TRL's GRPOTrainer over its transformers copy, the frozen batch's text, the HF tokenizer)."""
    trl = pytest.importorskip("trl")
    transformers = pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    import archlab
    from archlab.interop import save_hf
    from archlab.tokenizer import train as train_tokenizer

    root = tmp_path_factory.mktemp("grpo_trl")
    (root / "c.txt").write_text("a b c 7 d e 77 f g h " * 40)
    train_tokenizer(root / "c.txt", 260, ["<|endoftext|>"]).save(root / "tok")
    torch.manual_seed(0)
    ours = archlab.TransformerLM(archlab.presets.tiny("llama2-7b").with_overrides({"vocab_size": 260})).eval()
    save_hf(ours, root / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(root / "tok" / "tokenizer.json"),
                                               eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    assert tok.eos_token_id == 0
    answers = [tok.decode(COMPLETIONS[0][:-1]), "nothing"]
    rows = [{"prompt": tok.decode(p), "answer": a} for p, a in zip(PROMPTS, answers) for _ in range(GROUP)]
    exact_match = reward_fns.BUILTINS.get("exact_match")()
    args = trl.GRPOConfig(output_dir=str(root / "out"), per_device_train_batch_size=8, num_generations=GROUP,
                          max_completion_length=6, beta=BETA, epsilon=0.2, epsilon_high=0.28, report_to=[],
                          use_cpu=True, bf16=False, reward_weights=[1.0, 0.5], temperature=0.9)
    trainer = trl.GRPOTrainer(model=hf, reward_funcs=[exact_match, has_seven], args=args,
                              train_dataset=datasets.Dataset.from_list(rows), processing_class=tok)
    return ours, trainer, rows, tok


def _frozen_generate(tok):
    prompt_ids = [p for p in PROMPTS for _ in range(GROUP)]
    texts = [tok.decode(c, skip_special_tokens=True) for c in COMPLETIONS]
    return lambda prompts: (prompt_ids, COMPLETIONS, None, texts, None, {}, None, None)


def test_grpo_loss_logs_and_per_token_loss_equal_trls_on_a_frozen_batch(both):
    ours, trainer, rows, tok = both
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer._generate = _frozen_generate(tok)
    theirs = trainer._generate_and_score_completions(rows)
    logs = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    # the rewards, the advantages and their logs
    texts = [tok.decode(c, skip_special_tokens=True) for c in COMPLETIONS]
    columns = {"answer": [r["answer"] for r in rows]}
    funcs = [reward_fns.RewardFunc("exact_match", reward_fns.BUILTINS.get("exact_match")(), "exact_match"),
             reward_fns.RewardFunc("has_seven", has_seven, "has_seven")]
    per_func = torch.tensor([reward_fns.call(f, [r["prompt"] for r in rows], texts, COMPLETIONS, columns)
                             for f in funcs]).T                                              # (8, 2)
    rewards = per_func @ torch.tensor([1.0, 0.5])
    advantages, zero_std = group_advantages(rewards, GROUP)
    torch.testing.assert_close(advantages, theirs["advantages"], atol=1e-5, rtol=0)
    assert float(rewards.std()) > 0 and 0 < float(zero_std.float().mean()) < 1        # the batch tests something
    expected = {"reward": rewards.mean(), "reward_std": rewards.std(), "frac_reward_zero_std": zero_std.float().mean(),
                "rewards/exact_match/mean": per_func[:, 0].mean(), "rewards/has_seven/std": per_func[:, 1].std()}
    for name, value in expected.items():
        assert logs[name] == pytest.approx(float(value), abs=1e-5), name

    # the same batch through our forward: reference log-probs (the starting weights) and the policy's
    pids, pmask = theirs["prompt_ids"], theirs["prompt_mask"]
    cids, cmask = theirs["completion_ids"], theirs["completion_mask"]
    with torch.no_grad():
        ref, _ = completion_logps(ours, pids, pmask, cids, temperature=0.9, completion_mask=cmask, entropy=False)
    torch.testing.assert_close(ref * cmask, theirs["ref_per_token_logps"] * cmask, atol=1e-5, rtol=0)
    # off-policy old log-probs, so the clipping on both sides has work to do; a reference apart from the policy, so
    # the KL term has a value and a gradient
    old = ref + torch.linspace(-0.4, 0.4, ref.numel()).view_as(ref)
    ref = ref - torch.linspace(0.0, 0.5, ref.numel()).view_as(ref)
    theirs["old_per_token_logps"], theirs["ref_per_token_logps"] = old, ref
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        trainer.loss_type = loss_type
        trl_loss = trainer._compute_loss(trainer.model, theirs)
        logs = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        logps, entropy = completion_logps(ours, pids, pmask, cids, temperature=0.9, completion_mask=cmask)
        out = grpo_loss(logps, old, advantages, cmask, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28,
                        beta=BETA, ref_logps=ref, max_completion_length=6, num_items=theirs["num_items_in_batch"],
                        entropy=entropy.detach())
        assert float(out.loss.detach()) == pytest.approx(float(trl_loss), abs=1e-5), loss_type
        for name in ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean",
                     "clip_ratio/high_max", "clip_ratio/region_mean"):
            assert out.figures[name] == pytest.approx(logs[name], abs=1e-5), (loss_type, name)
    assert out.figures["clip_ratio/region_mean"] > 0 and out.figures["kl"] > 0.01   # clipping and KL took part
    # each token's loss alone: bnpo over a one-token mask is that token's loss
    trainer.loss_type = "bnpo"
    for i, j in cmask.nonzero().tolist():
        one = torch.zeros_like(cmask)
        one[i, j] = 1
        trl_token = trainer._compute_loss(trainer.model, {**theirs, "tool_mask": one})
        assert float(out.per_token[i, j].detach()) == pytest.approx(float(trl_token), abs=1e-5), (i, j)

