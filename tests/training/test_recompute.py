"""Activation checkpointing: the same losses and gradients, a fraction of the saved activations."""
from __future__ import annotations

import torch

from archlab.config import ModelConfig
from archlab.data.prepare import prepare
from archlab.models.decoder import TransformerLM
from archlab.training.recompute import checkpoint_blocks
from archlab.training.trainer import TrainConfig, read_metrics, train


def _cfg(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=97, d_model=48, n_layers=3, max_seq_len=64, attention={"n_heads": 4},
                       mlp={"activation": "swiglu", "d_ff": 128}, block={"residual_dropout": 0.1}, **kw)


def _saved_bytes(model, ids) -> tuple[int, list[torch.Tensor]]:
    """Bytes autograd keeps for backward during one forward, and the gradients after backward."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.manual_seed(0)                                  # dropout masks: the same draws
        out = model.loss(ids[:, :-1], ids[:, 1:])
    out.total.backward()
    return sum(saved), [p.grad.clone() for p in model.parameters()]


def test_checkpointed_blocks_give_the_same_gradients_and_keep_far_less():
    ids = torch.randint(0, 97, (4, 65), generator=torch.Generator().manual_seed(0))
    plain, ckpt = TransformerLM(_cfg()), TransformerLM(_cfg())
    names = [n for n, _ in ckpt.named_parameters()]
    checkpoint_blocks(ckpt)
    assert [n for n, _ in ckpt.named_parameters()] == names            # checkpoints keep their keys
    kept_plain, grads_plain = _saved_bytes(plain, ids)
    kept_ckpt, grads_ckpt = _saved_bytes(ckpt, ids)
    for a, b in zip(grads_plain, grads_ckpt):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert kept_ckpt < kept_plain / 3, (kept_ckpt, kept_plain)


def test_training_with_activation_checkpointing_logs_the_same_losses(tmp_path):
    prepare(["all the world's a stage, and all the men and women merely players " * 30] * 10, "bytes",
            tmp_path / "data", num_workers=0, progress=False)
    cfg = _cfg().with_overrides({"vocab_size": 257})
    losses = []
    for flag in (False, True):
        run = TrainConfig(batch_size=2, seq_len=32, budget=4, warmup_steps=1, eval_every=0, eval_batches=1,
                          log_every=1, sample_every=-1, activation_checkpointing=flag)
        result = train(cfg, run, tmp_path / "data", tmp_path / f"run{flag}", progress=False)
        losses.append([r["loss"] for r in read_metrics(result.metrics_path) if "loss" in r])
    assert len(losses[0]) == 4
    assert all(abs(a - b) < 1e-5 for a, b in zip(*losses)), losses
