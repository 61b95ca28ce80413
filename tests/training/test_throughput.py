"""What MFU is measured against: the matmul peak, and the ceiling a model's own matmul shapes set."""
from __future__ import annotations

import pytest
import torch

from archlab.models import presets
from archlab.models.accounting import _matmul_params_per_token
from archlab.models.decoder import TransformerLM
from archlab.training.throughput import matmul_ceiling, matmul_peak_flops, matmul_weight_shapes

CPU = torch.device("cpu")
DENSE = ["gpt2", "llama2-7b", "gemma2-9b", "qwen3-8b", "falcon-7b", "command-a"]   # tied and untied heads


@pytest.mark.parametrize("name", DENSE)
def test_weight_shapes_are_the_matmuls_the_flop_count_counts(name):
    cfg = presets.tiny(name)
    shapes = matmul_weight_shapes(TransformerLM(cfg))
    assert sum(n_out * n_in for n_out, n_in in shapes) == _matmul_params_per_token(cfg)
    assert (cfg.vocab_size, cfg.d_model) in shapes                # the LM head, tied or not


def test_ceiling_counts_three_matmuls_per_weight_and_times_them():
    shapes = [(48, 32), (48, 32), (32, 96)]
    flops, seconds = matmul_ceiling(shapes, 64, CPU, repeats=2)
    assert flops == 3 * 2 * 64 * (2 * 48 * 32 + 32 * 96)         # forward, input grad, weight grad
    assert seconds > 0


def test_peak_is_a_plausible_rate_and_cached():
    peak = matmul_peak_flops(CPU, "float32", n=128)
    assert 1e8 < peak < 1e15
    assert matmul_peak_flops(CPU, "float32", n=128) == peak
