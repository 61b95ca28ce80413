"""eval.expert_load: each MoE layer's first-choice and routed-slot shares per expert, by the layer's own routing (the
expert bias included), on hand-computed routings."""
from __future__ import annotations

import torch
from torch import nn

from archlab.config import MLPConfig, MoEConfig
from archlab.eval.expert_load import busiest_share, expert_load
from archlab.nn.mlp import MoEMLP

# router = identity: a token [s, 0] prefers expert 0, [0, s] expert 1 (the routed_layer of tests/nn/test_moe.py)
X = torch.tensor([[[2.0, 0.0], [3.0, 0.0], [1.0, 0.0], [4.0, 0.0], [0.0, 2.0]]])           # (1, 5, 2)


def layer(top_k: int, **moe) -> MoEMLP:
    torch.manual_seed(0)
    out = MoEMLP(2, 3, MLPConfig(activation="silu", moe=MoEConfig(n_experts=2, top_k=top_k, **moe)), bias=False)
    with torch.no_grad():
        out.router.weight.copy_(torch.eye(2))
    return out


def test_first_choices_and_routed_slots_per_layer():
    m = nn.Sequential(layer(2))                      # one layer: first choices 4 x expert 0, 1 x expert 1
    load = expert_load(m, [X, X[:, :2]])                # 7 tokens: first choices 6 x expert 0, 1 x expert 1
    torch.testing.assert_close(torch.tensor(load["first_choice"]), torch.tensor([[6 / 7, 1 / 7]]))
    torch.testing.assert_close(torch.tensor(load["routed"]), torch.tensor([[0.5, 0.5]]))   # top 2 of 2: both, always
    assert m.training                                   # restored (Sequential starts in training mode)


def test_the_expert_bias_chooses_in_the_measurement_too():
    m = nn.Sequential(layer(1, balance="bias"))
    with torch.no_grad():
        m[0].expert_bias.copy_(torch.tensor([-0.8, 0.0]))   # tokens 0, 2, 4 go to expert 1 (see tests/nn/test_moe.py)
    load = expert_load(m, [X])
    torch.testing.assert_close(torch.tensor(load["first_choice"]), torch.tensor([[0.4, 0.6]]))
    assert m[0].take_routed() is None                   # measured in eval mode: the bias update counted nothing


def test_every_layer_is_measured_and_the_busiest_share_averages_layers():
    load = expert_load(nn.Sequential(layer(1), layer(1)), [X])
    assert len(load["first_choice"]) == 2 and all(abs(sum(r) - 1) < 1e-9 for r in load["first_choice"])
    assert busiest_share([[0.5, 0.3, 0.2], [0.4, 0.4, 0.2]]) == 0.45
    assert expert_load(nn.Linear(2, 2), [X]) == {}
