"""With tensorboard installed, a run writes its scalars to RUN_DIR/tb (the `tb` extra)."""
from __future__ import annotations

import pytest

from archlab.config import ModelConfig
from archlab.data.prepare import prepare
from archlab.training.trainer import TrainConfig, read_metrics, train

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def test_tensorboard_scalars_equal_metrics_jsonl(tmp_path):
    prepare(["to be or not to be, that is the question " * 40] * 12, "bytes", tmp_path / "data",
            num_workers=0, progress=False)
    cfg = ModelConfig(vocab_size=257, d_model=32, n_layers=1, max_seq_len=32, attention={"n_heads": 2})
    run = TrainConfig(batch_size=2, seq_len=16, budget=4, warmup_steps=1, eval_every=2, eval_batches=1,
                      log_every=1, sample_every=-1)
    result = train(cfg, run, tmp_path / "data", tmp_path / "run", progress=False)
    acc = event_accumulator.EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    assert {"loss", "lr", "val_loss"} <= set(acc.Tags()["scalars"])
    logged = {r["step"]: r["loss"] for r in read_metrics(result.metrics_path) if "loss" in r}
    written = {e.step: e.value for e in acc.Scalars("loss")}
    assert written.keys() == logged.keys() and len(written) == result.steps
    assert all(abs(written[s] - logged[s]) < 1e-5 for s in logged)
