"""Training settings known to learn a generated task, shared by the demo that shows them and the lab suites that
vary them: `reverse_words` is the model and the four stages (pretraining, SFT, DPO, GRPO) of the post-training demo
(archlab.demo.post_training) on the reverse-a-word task (archlab.data.reverse_words), and the base of the lab's
`finetune` suites (archlab.lab.suites: lora_rank, norm_transfer).

What was measured while choosing them (2-core CPU): the words have one length and each document or packed example
starts at position 0, so with learned absolute positions (GPT-2's) reversing is a fixed map from answer slot to
word slot. A base pretrained on lines of plain words instead stayed at 0-1% after 300 SFT steps (its attention
had learned to look locally); from a fresh init SFT found the map after a plateau whose length varied by seed
(100%, 100%, 45% at 200 steps); with RoPE the plateau outlasted 300 steps. SFT's 300 steps with a 60-step warmup
come from seeds 0-7: at 200 steps with a 20-step warmup seed 4 stayed at 3% (validation loss 0.66 = ln 26 / 5: it
reversed letters 2-5 and left the first, the word's last letter, to chance; 400 steps kept it there), and so it did at
lr 1e-3, 2e-3 or 5e-3 (2-3%) and with a 100-step warmup (5%). With a 60-step warmup over 300 steps every seed reached
100%: seed 4 by step 231 (26% at 200 steps of a 200-step schedule), seeds 0, 5 and 6 by step 99, seed 7 by 132. The
first answer letter comes 13 tokens after the word's last letter in the chat turn but right after it in the
pretraining text, and from position 31, beyond the 20 a pretraining document fills: SFT learns that one lookup from
scratch, and the plateau before it varies by seed. DPO's learning rate is 5e-5: at 1e-3 the
loss reached 1e-4 within 60 steps while both answers' likelihoods fell, and held-out exact match dropped from 100%
to 18% (the likelihood displacement DPO is known for); at 1e-4 seed 1 still lost 18% of its answers (82%), at 1e-4
for 20 steps 11%; at 5e-5 for 40 steps seeds 0 and 1 kept 100% and 93%, all in lowercase. From the 300-step SFT
models 40 steps left seed 3 at 89.5% in lowercase (its SFT had left 30%), under the 90% target; 60 steps took seeds
0-4 to 100%, all right.

GRPO starts from the SFT model, as DPO does, with an exact-match reward against the lowercase reversal: SFT leaves
the case to chance, so about half of each group of 8 samples is right and nearly every group has a reward to learn
from (frac_reward_zero_std near 0 at the start).
At lr 1e-3 (4 prompts a step, 20 steps) the reward swung between 0.5 and 1 and seed 1 lost 13% of its reversals;
at 3e-4 with 8 prompts a step it rose steadily to ~0.97 within 60 steps (14 CPU seconds) on seeds 0 and 1.
"""
from __future__ import annotations

from typing import Any

from archlab.config import ModelConfig
from archlab.data.reverse_words import SIZES
from archlab.training.config import DPOConfig, GRPOConfig, TrainConfig

__all__ = ["reverse_words"]


def reverse_words(*, quick: bool, seed: int = 0) -> dict[str, Any]:
    """The model ("model"), the four stages' TrainConfigs ("base", "sft", "dpo", "grpo") and the data sizes
    (data.reverse_words.SIZES: "sft_examples", "dpo_pairs", "grpo_prompts", "test_words", "base_documents");
    `quick` shrinks the steps to seconds (for tests); `seed` drives the model's init and every stage's data order
    (the task's words stay the same). Example: reverse_words(quick=False)["sft"].budget -> 300"""
    model = ModelConfig(name="demo-post-training", vocab_size=260, d_model=96 if quick else 128, n_layers=2,
                        max_seq_len=128, attention={"n_heads": 4},
                        mlp={"activation": "swiglu", "d_ff": 256 if quick else 512},
                        norm={"kind": "rmsnorm"}, position={"kind": "learned"}, seed=seed)
    common = dict(seed=seed, weight_decay=0.0, eval_batches=4, checkpoint_every=100_000, keep_last=1,
                  sample_every=-1, device="cpu", dtype="float32", budget_unit="steps")
    steps = {"base": 8, "sft": 12, "dpo": 6, "grpo": 2} if quick else {"base": 200, "sft": 300, "dpo": 60, "grpo": 60}
    return {
        "model": model,
        "base": TrainConfig(lr=3e-3, warmup_steps=min(10, steps["base"]), batch_size=32, seq_len=64,
                            budget=steps["base"], document_masks=True,
                            eval_every=max(4, steps["base"] // 3), log_every=max(2, steps["base"] // 30), **common),
        "sft": TrainConfig(lr=3e-3, warmup_steps=min(60, steps["sft"]), batch_size=32, seq_len=128,
                           budget=steps["sft"],
                           eval_every=max(4, steps["sft"] // 6), log_every=max(2, steps["sft"] // 60), **common),
        "dpo": TrainConfig(lr=5e-5, warmup_steps=5, batch_size=16, seq_len=64, budget=steps["dpo"],
                           eval_every=max(3, steps["dpo"] // 4), log_every=max(1, steps["dpo"] // 30),
                           method="dpo", dpo=DPOConfig(beta=0.1), **common),
        # 8 prompts x 8 completions a step; beta 0: no reference model (TRL's default); 8 new tokens hold a
        # five-letter answer and its end of turn
        "grpo": TrainConfig(lr=3e-4, warmup_steps=0, batch_size=64, seq_len=64, budget=steps["grpo"],
                            eval_every=100_000, log_every=1, method="grpo",
                            grpo=GRPOConfig(num_generations=8, max_completion_length=8, beta=0.0), **common),
        **SIZES["quick" if quick else "full"],
    }
