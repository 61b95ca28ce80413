"""The fused AdamW the trainer builds (training/optim.py) writes parameters without bumping their version counters;
the decode session's packed weights (nn/fused.py) are rebuilt only on a version change. Generation in the training
process (samples, RL rollouts) must see the updated weights: greedy tokens after a step equal the unpacked path's."""
from __future__ import annotations

import torch

import archlab
from archlab.config import ModelConfig
from archlab.models import build_model
from archlab.training.config import TrainConfig
from archlab.training.optim import build_optimizer


def test_generation_after_an_optimizer_step_uses_the_new_weights():
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=64, d_model=32, n_layers=1, max_seq_len=32, attention={"n_heads": 4}))
    optimizer = build_optimizer(model, TrainConfig(lr=0.5), torch.device("cpu"), "ddp")
    ids = torch.tensor([[1, 2, 3]])
    model.eval()
    before = archlab.generate(model, ids, 6)                         # packs the weights for decoding
    versions = [p._version for p in model.parameters()]
    model(ids).sum().backward()
    optimizer.step()
    assert all(p._version > v for p, v in zip(model.parameters(), versions))
    after = archlab.generate(model, ids, 6)
    assert torch.equal(after, archlab.generate(model, ids, 6, fast_decode=False))
    assert not torch.equal(after, before)
