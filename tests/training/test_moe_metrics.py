"""A model with MoE layers logs its experts' load on every training line of metrics.jsonl; a dense one none.
With balance=bias (DeepSeek-V3) the expert bias moves every optimizer step and a resumed run continues it exactly."""
from __future__ import annotations

import pytest
import torch
from run_checks import assert_resume_is_exact

from archlab.config import ModelConfig
from archlab.data.prepare import prepare
from archlab.runs.checkpoint import latest_checkpoint, load_checkpoint
from archlab.training.trainer import TrainConfig, read_metrics, train


def _data(folder):
    prepare(["to be or not to be, that is the question " * 40] * 12, "bytes", folder, num_workers=0, progress=False)


@pytest.mark.parametrize("moe", [None, {"n_experts": 4, "top_k": 2}])
def test_training_lines_carry_the_expert_load(tmp_path, moe):
    _data(tmp_path / "data")
    cfg = ModelConfig(vocab_size=257, d_model=16, n_layers=2, max_seq_len=16, attention={"n_heads": 2},
                      mlp={"d_ff": 16, "moe": moe})
    run = TrainConfig(batch_size=2, seq_len=16, budget=2, warmup_steps=1, eval_every=0, log_every=1,
                      sample_every=-1)
    result = train(cfg, run, tmp_path / "data", tmp_path / "run", progress=False)
    lines = [r for r in read_metrics(result.metrics_path) if "loss" in r]
    assert len(lines) == 2
    for line in lines:
        if moe is None:
            assert not any(k.startswith("moe/") for k in line)
            continue
        table = line["moe/expert_fraction"]
        assert len(table) == 2 and all(len(row) == 4 and abs(sum(row) - 1) < 1e-3 for row in table)
        assert line["moe/max_expert_fraction"] == max(max(row) for row in table) >= 0.25


def test_expert_bias_moves_each_step_and_resumes_exactly(tmp_path):
    _data(tmp_path / "data")
    cfg = ModelConfig(vocab_size=257, d_model=16, n_layers=2, max_seq_len=16, attention={"n_heads": 2},
                      mlp={"d_ff": 16, "moe": {"n_experts": 4, "top_k": 2, "balance": "bias",
                                               "bias_update_rate": 0.01}})
    run = TrainConfig(batch_size=2, seq_len=16, grad_accum=2, budget=3, warmup_steps=1, eval_every=0,
                      log_every=1, sample_every=-1, checkpoint_every=2)
    assert_resume_is_exact(cfg, run, tmp_path / "data", tmp_path)     # every tensor of the last checkpoint equal
    weights, _ = load_checkpoint(latest_checkpoint(tmp_path / "full"))
    biases = [weights[k] for k in sorted(weights) if k.endswith("expert_bias")]
    assert len(biases) == 2
    for bias in biases:      # 3 steps of +-0.01 (0 only at exactly the mean load): odd multiples of 0.01 mostly
        steps = bias / 0.01
        torch.testing.assert_close(steps, steps.round(), atol=1e-4, rtol=0)
        assert steps.abs().max() <= 3 + 1e-4 and bool(bias.ne(0).any())
