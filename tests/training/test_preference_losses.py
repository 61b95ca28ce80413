"""The DPO family's losses against TRL's own functions: ORPO (reference-free odds ratio plus the chosen tokens' NLL,
TRL's ORPOTrainer.odds_ratio_loss and its cross-entropy)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from archlab.data.objectives import IGNORE
from archlab.training.dpo import log1mexp, preference_loss, sequence_logps


def _batch(seed: int, b: int = 3, t: int = 7, v: int = 11):
    """Logits (2b, t, v) and labels (2b, t) scoring a different tail of each row (b chosen, then b rejected)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(2 * b, t, v, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, v, (2 * b, t), generator=gen)
    for row, start in enumerate(torch.randint(1, t - 1, (2 * b,), generator=gen).tolist()):
        labels[row, :start] = IGNORE
    return logits, labels


def test_log1mexp_equals_trls():
    orpo = pytest.importorskip("trl.experimental.orpo.orpo_trainer")
    x = -torch.logspace(-8, 2, 50, dtype=torch.float64)
    torch.testing.assert_close(log1mexp(x), orpo.log1mexp(x))
    torch.testing.assert_close(log1mexp(x), torch.log(1 - torch.exp(x)), rtol=1e-6, atol=1e-15)   # naive: fine here


@pytest.mark.parametrize("seed", [0, 1])
def test_orpo_loss_equals_trls_odds_ratio_loss_and_nll(seed):
    trainer = pytest.importorskip("trl.experimental.orpo.orpo_trainer").ORPOTrainer
    logits, labels = _batch(seed)
    logps, counts = sequence_logps(logits, labels)                                  # (2b,) each
    logp_c, logp_r = logps.chunk(2)
    n_c, n_r = counts.chunk(2)
    ours = preference_loss("orpo", logp_c, logp_r, logp_c * 0, logp_r * 0, n_c, n_r, beta=0.25)
    # TRL: the NLL over every chosen token of the batch, minus the mean of beta * log sigmoid(log odds ratio) of the
    # per-token mean log-probs (get_batch_logps(average_log_prob=True))
    b = logp_c.shape[0]
    nll = F.cross_entropy(logits[:b].flatten(0, 1), labels[:b].flatten(), ignore_index=IGNORE)
    fake = SimpleNamespace(beta=0.25, accelerator=SimpleNamespace(device=torch.device("cpu")))
    losses, *_ = trainer.odds_ratio_loss(fake, logp_c / n_c, logp_r / n_r)
    torch.testing.assert_close(ours, (nll - losses.mean()).to(ours.dtype), rtol=1e-6, atol=1e-9)
