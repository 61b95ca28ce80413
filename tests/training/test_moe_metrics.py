"""A model with MoE layers logs its experts' load on every training line of metrics.jsonl; a dense one none."""
from __future__ import annotations

import pytest

from archlab.config import ModelConfig
from archlab.data.prepare import prepare
from archlab.training.trainer import TrainConfig, read_metrics, train


@pytest.mark.parametrize("moe", [None, {"n_experts": 4, "top_k": 2}])
def test_training_lines_carry_the_expert_load(tmp_path, moe):
    prepare(["to be or not to be, that is the question " * 40] * 12, "bytes", tmp_path / "data",
            num_workers=0, progress=False)
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
