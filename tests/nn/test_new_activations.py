"""ELU, SELU, the original sigmoid GLU and the bilinear layer: each MLP against values computed by hand on a
d_model = 1, d_ff = 1 layer with unit weights, so y = act(x) (plain) or gate_fn(a x) * (b x) (gated)."""
from __future__ import annotations

import math

import pytest
import torch

from archlab.config import GATED_ACTIVATIONS, ModelConfig
from archlab.lab import suites
from archlab.nn.mlp import DenseMLP

LAMBDA, ALPHA = 1.0507009873554805, 1.6732632423543772      # Klambauer et al. 2017, eq. (2)
X = [-2.0, -0.5, 0.0, 0.7, 3.0]


def mlp(kind: str, gate: float = 1.0, up: float = 1.0) -> DenseMLP:
    layer = DenseMLP(1, 1, kind, bias=False)
    with torch.no_grad():
        layer.up_proj.weight.fill_(up)
        layer.down_proj.weight.fill_(1.0)
        if layer.gate_proj is not None:
            layer.gate_proj.weight.fill_(gate)
    return layer


@pytest.mark.parametrize("kind, by_hand", [
    ("elu", lambda x: x if x > 0 else math.exp(x) - 1),
    ("selu", lambda x: LAMBDA * (x if x > 0 else ALPHA * (math.exp(x) - 1))),
    ("glu", lambda x: 1 / (1 + math.exp(-2 * x)) * (3 * x)),       # sigmoid(2x) * 3x
    ("bilinear", lambda x: (2 * x) * (3 * x)),                      # 2x * 3x: no gate function
])
def test_activation_by_hand(kind, by_hand):
    layer = mlp(kind, gate=2.0, up=3.0) if kind in GATED_ACTIVATIONS else mlp(kind)
    got = layer(torch.tensor(X).reshape(1, -1, 1)).flatten().tolist()
    assert got == pytest.approx([by_hand(x) for x in X], rel=1e-6, abs=1e-7)


def test_selu_keeps_unit_variance_and_the_gated_kinds_have_a_gate():
    """SELU's fixed point (Klambauer et al. 2017): N(0, 1) inputs give outputs of mean ~0 and variance ~1."""
    y = torch.nn.functional.selu(torch.randn(200_000, generator=torch.Generator().manual_seed(0)))
    assert abs(float(y.mean())) < 0.01 and abs(float(y.var()) - 1) < 0.01
    assert {"glu", "bilinear"} <= set(GATED_ACTIVATIONS) and not {"elu", "selu"} & set(GATED_ACTIVATIONS)
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=1, attention={"n_heads": 4},
                      mlp={"activation": "bilinear", "d_ff": 48})
    from archlab.models.accounting import param_count
    from archlab.models.decoder import TransformerLM
    assert param_count(cfg) == sum(p.numel() for p in TransformerLM(cfg).parameters())


def test_activation_suite_lists_the_four():
    values = suites.load("activation").axes[0]["values"]
    assert {"elu", "selu", "glu", "bilinear"} <= set(values)
