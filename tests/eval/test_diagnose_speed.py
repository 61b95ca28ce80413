"""diagnose's effective ranks on one thread (LAPACK's threaded SVD stalled on a loaded CPU), equal to float64
SVDs; and a progress bar over the layers on the command line."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from archlab.eval import diagnostics

FIXTURE = Path(__file__).parents[1] / "fixtures" / "run_v1"


@pytest.mark.parametrize("shape", [(256, 576), (64, 32), (5, 5)])
def test_singular_values_equal_numpys_float64_svd_with_a_massive_activation(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    x[0, shape[1] // 2] = 2e4                               # one value ~10^4 the rest, as at SmolLM2's token 0
    expected = np.linalg.svd(x.double().numpy(), compute_uv=False)
    got = diagnostics.singular_values(x)
    assert got.dtype == torch.float64 and got.shape == (min(shape),)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-10, atol=1e-9)
    p = expected / expected.sum()
    assert diagnostics.effective_rank(x) == pytest.approx(float(np.exp(-(p * np.log(p)).sum())), rel=1e-10)


def test_the_svd_runs_on_one_thread_and_the_threads_come_back(monkeypatch):
    seen = []
    real = torch.linalg.svdvals
    monkeypatch.setattr(torch.linalg, "svdvals", lambda x: seen.append(torch.get_num_threads()) or real(x))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        diagnostics.effective_rank(torch.randn(8, 16))
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_command_shows_a_bar_over_the_layers(tmp_path, capsys):
    from archlab.cli import main

    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    assert main(["diagnose", str(FIXTURE), "--text", str(text), "--max-tokens", "24",
                 "--out", str(tmp_path / "diag")]) == 0
    assert "measuring layers" in capsys.readouterr().err
