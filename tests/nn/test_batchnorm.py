"""norm.kind=batchnorm: equal to torch's BatchNorm1d over every (row, position) of the batch, running averages
included; and its trouble in a language model, shown against LayerNorm: while training, right padding (which a
causal model's real tokens never attend to) changes the real tokens' outputs through the batch statistics,
and so does a later token; at evaluation (running averages) neither does."""
from __future__ import annotations

import pytest
import torch

from archlab.config import ModelConfig
from archlab.models.accounting import param_count
from archlab.models.decoder import TransformerLM
from archlab.nn.norms import BatchNorm


@pytest.mark.parametrize("bias", [False, True])
def test_batchnorm_equals_torch_batchnorm1d_over_rows_and_positions(bias):
    torch.manual_seed(0)
    ours, ref = BatchNorm(6, eps=1e-5, bias=bias), torch.nn.BatchNorm1d(6, eps=1e-5, momentum=0.1)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(6))
        ref.weight.copy_(ours.weight)
        if bias:
            ours.bias.copy_(torch.randn(6))
        ref.bias.copy_(ours.bias if bias else torch.zeros(6))
    for _ in range(3):                                     # training: batch statistics, running averages move
        x = torch.randn(4, 5, 6) * 3 + 1                   # (b, t, d)
        want = ref(x.reshape(-1, 6)).reshape(4, 5, 6)      # BatchNorm1d: (N, C) samples
        assert torch.allclose(ours(x), want, atol=1e-5)
    assert torch.allclose(ours.running_mean, ref.running_mean) and torch.allclose(ours.running_var, ref.running_var)
    ours.eval()
    ref.eval()
    x = torch.randn(2, 3, 6)
    assert torch.allclose(ours(x), ref(x.reshape(-1, 6)).reshape(2, 3, 6), atol=1e-5)


def model(kind: str) -> TransformerLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=2, max_seq_len=32, attention={"n_heads": 4},
                      norm={"kind": kind}, init={"std": 0.2})
    m = TransformerLM(cfg)
    assert param_count(cfg) == sum(p.numel() for p in m.parameters())
    return m


@torch.no_grad()
def test_padding_changes_real_tokens_under_batchnorm_while_training():
    real = torch.randint(1, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    padded = torch.cat((real, torch.zeros(2, 4, dtype=torch.long)), dim=1)    # 4 pad tokens (id 0) at the end
    for kind in ("layernorm", "batchnorm"):
        m = model(kind)
        for training in (True, False):
            m.train(training)
            state = {k: v.clone() for k, v in m.state_dict().items()}
            gap = float((m(real) - m(padded)[:, :6]).abs().max())
            m.load_state_dict(state)                                          # undo the running-average update
            if kind == "batchnorm" and training:
                assert gap > 1e-2, "padded slots should move the batch statistics"
            else:
                assert gap < 1e-5, f"{kind}, training={training}: {gap}"


@torch.no_grad()
def test_batchnorm_training_forward_sees_later_tokens():
    ids = torch.randint(1, 32, (2, 8), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[:, -1] = (ids[:, -1] + 1) % 32
    m = model("batchnorm").train()
    assert float((m(ids)[:, 0] - m(changed)[:, 0]).abs().max()) > 1e-4        # position 0 depends on position 7
    m.eval()
    assert float((m(ids)[:, :-1] - m(changed)[:, :-1]).abs().max()) < 1e-6
