"""The scalar heads (nn/heads.py): a reward model's ScoreHead at the last real token and a PPO policy's value head (the
same class read at every token) agree, start at zero, and a checkpoint holding either loads back onto its model."""
from __future__ import annotations

import torch

from archlab.config import ModelConfig
from archlab.models import build_model
from archlab.nn.heads import SCORE_HEAD, VALUE_HEAD, attach_score_head


def _model():
    return build_model(ModelConfig(vocab_size=64, d_model=16, n_layers=1, max_seq_len=16, attention={"n_heads": 2}))


def test_the_value_at_every_token_equals_the_score_at_each_length():
    model = _model()
    head = attach_score_head(model, VALUE_HEAD)
    assert attach_score_head(model, VALUE_HEAD) is head and not hasattr(model, SCORE_HEAD)
    assert torch.count_nonzero(head.values(torch.randn(2, 5, 16))) == 0          # zeros at the start
    torch.nn.init.normal_(head.weight)
    hidden = model(torch.randint(0, 64, (2, 5)), return_hidden=True)              # (b, t, d)
    values = head.values(hidden)                                                   # (b, t)
    for n in range(1, 6):
        assert torch.allclose(values[:, n - 1], head(hidden, torch.tensor([n, n])), atol=1e-6)


def test_a_checkpoint_with_a_value_head_loads_back_with_it(tmp_path):
    from archlab.runs.model_folder import model_with_weights

    model = _model()
    torch.nn.init.normal_(attach_score_head(model, VALUE_HEAD).weight)
    state = model.state_dict()
    loaded = model_with_weights(model.config, state, tmp_path / "model.safetensors")
    assert torch.equal(getattr(loaded, VALUE_HEAD).weight, state[f"{VALUE_HEAD}.weight"])
    assert not hasattr(loaded, SCORE_HEAD)
