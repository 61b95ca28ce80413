"""Training settings known to learn a generated task, shared by the demo that shows them and the lab suites that
vary them: `reverse_words` is the model and the three stages (pretraining, SFT, DPO) of the post-training demo
(archlab.demo.post_training) on the reverse-a-word task (archlab.data.reverse_words), and the base of the lab's
`finetune` suites (archlab.lab.suites: lora_rank, norm_transfer).

What was measured while choosing them (2-core CPU): the words have one length and each document or packed example
starts at position 0, so with learned absolute positions (GPT-2's) reversing is a fixed map from answer slot to
word slot. A base pretrained on lines of plain words instead stayed at 0-1% after 300 SFT steps (its attention
had learned to look locally); from a fresh init SFT found the map after a plateau whose length varied by seed
(100%, 100%, 45% at 200 steps); with RoPE the plateau outlasted 300 steps. DPO's learning rate is 1e-4: at 1e-3 the
loss reached 1e-4 within 60 steps while both answers' likelihoods fell, and held-out exact match dropped from 100%
to 18% (the likelihood displacement DPO is known for).
"""
from __future__ import annotations

from typing import Any

from archlab.config import ModelConfig
from archlab.data.reverse_words import SIZES
from archlab.training.config import DPOConfig, TrainConfig

__all__ = ["reverse_words"]


def reverse_words(*, quick: bool, seed: int = 0) -> dict[str, Any]:
    """The model ("model"), the three stages' TrainConfigs ("base", "sft", "dpo") and the data sizes
    (data.reverse_words.SIZES: "sft_examples", "dpo_pairs", "test_words", "base_documents"); `quick` shrinks the
    steps to seconds (for tests); `seed` drives the model's init and every stage's data order (the task's words
    stay the same). Example: reverse_words(quick=False)["sft"].budget -> 200"""
    model = ModelConfig(name="demo-post-training", vocab_size=260, d_model=96 if quick else 128, n_layers=2,
                        max_seq_len=128, attention={"n_heads": 4},
                        mlp={"activation": "swiglu", "d_ff": 256 if quick else 512},
                        norm={"kind": "rmsnorm"}, position={"kind": "learned"}, seed=seed)
    common = dict(seed=seed, weight_decay=0.0, eval_batches=4, checkpoint_every=100_000, keep_last=1,
                  sample_every=-1, device="cpu", dtype="float32", budget_unit="steps")
    steps = {"base": 8, "sft": 12, "dpo": 6} if quick else {"base": 200, "sft": 200, "dpo": 40}
    return {
        "model": model,
        "base": TrainConfig(lr=3e-3, warmup_steps=min(10, steps["base"]), batch_size=32, seq_len=64,
                            budget=steps["base"], document_masks=True,
                            eval_every=max(4, steps["base"] // 3), log_every=max(2, steps["base"] // 30), **common),
        "sft": TrainConfig(lr=3e-3, warmup_steps=min(20, steps["sft"]), batch_size=32, seq_len=128,
                           budget=steps["sft"],
                           eval_every=max(4, steps["sft"] // 6), log_every=max(2, steps["sft"] // 60), **common),
        "dpo": TrainConfig(lr=1e-4, warmup_steps=5, batch_size=16, seq_len=64, budget=steps["dpo"],
                           eval_every=max(3, steps["dpo"] // 4), log_every=max(1, steps["dpo"] // 30),
                           method="dpo", dpo=DPOConfig(beta=0.1), **common),
        **SIZES["quick" if quick else "full"],
    }
