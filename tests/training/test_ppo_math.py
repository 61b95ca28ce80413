"""PPO's math (training/ppo.py) on fixed small rollouts, against values computed by hand in the comments, and GAE
against its closed form A_t = sum_l (gamma lam)^l delta_{t+l} (a different computation from the recursion)."""
from __future__ import annotations

import math

import pytest
import torch

from archlab.training.ppo import (
    entropy_from_logits,
    gae,
    kl_estimate,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    token_rewards,
    value_loss,
)

T, F = True, False


def test_gae_equals_the_hand_computed_advantages_and_ignores_what_lies_past_the_end():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, 2.0, 7.0]])
    values = torch.tensor([[0.5, 0.2, 0.4], [1.0, 1.0, 9.0]])
    mask = torch.tensor([[T, T, T], [T, T, F]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: d2 = 1 - 0.4 = 0.6; d1 = 0.9 * 0.4 - 0.2 = 0.16, A1 = 0.16 + 0.72 * 0.6 = 0.592;
    #        d0 = 0.9 * 0.2 - 0.5 = -0.32, A0 = -0.32 + 0.72 * 0.592 = 0.10624
    # row 1 (the 7 and the 9 lie past the end): d1 = 2 - 1 = 1 = A1; d0 = 0.5 + 0.9 - 1 = 0.4, A0 = 0.4 + 0.72 = 1.12
    assert torch.allclose(advantages, torch.tensor([[0.10624, 0.592, 0.6], [1.12, 1.0, 0.0]]))
    assert torch.allclose(returns, torch.tensor([[0.60624, 0.792, 1.0], [2.12, 2.0, 0.0]]))


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.7, 0.0), (0.0, 0.5)])
def test_gae_equals_its_closed_form_sum_of_discounted_td_errors(gamma, lam):
    torch.manual_seed(0)
    rewards, values = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    lengths = [6, 4, 1, 3]
    mask = torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    for row, n in enumerate(lengths):
        v = [float(values[row, t]) for t in range(n)] + [0.0]                 # the end's value is 0
        delta = [float(rewards[row, t]) + gamma * v[t + 1] - v[t] for t in range(n)]
        for t in range(6):
            expect = sum((gamma * lam) ** k * delta[t + k] for k in range(n - t)) if t < n else 0.0
            assert advantages[row, t].item() == pytest.approx(expect, abs=1e-12)
            assert returns[row, t].item() == pytest.approx(expect + (v[t] if t < n else 0.0), abs=1e-12)


def test_with_gamma_and_lambda_one_the_advantage_is_the_reward_to_go_minus_the_value():
    rewards = torch.tensor([[0.1, -0.2, 0.3, 1.0]])
    values = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    advantages, returns = gae(rewards, values, torch.ones(1, 4, dtype=torch.bool), 1.0, 1.0)
    to_go = torch.tensor([[1.2, 1.1, 1.3, 1.0]])
    assert torch.allclose(returns, to_go) and torch.allclose(advantages, to_go - values)


def test_the_score_lands_on_the_last_real_token_and_the_kl_penalty_on_every_real_token():
    kl = torch.tensor([[0.2, -0.4, 0.6], [1.0, 3.0, 5.0]])
    mask = torch.tensor([[T, T, T], [T, F, F]])
    rewards, non_score = token_rewards(torch.tensor([2.0, -1.0]), kl, mask, kl_coef=0.5)
    assert torch.allclose(non_score, torch.tensor([[-0.1, 0.2, -0.3], [-0.5, 0.0, 0.0]]))
    assert torch.allclose(rewards, torch.tensor([[-0.1, 0.2, 1.7], [-1.5, 0.0, 0.0]]))


def test_k1_and_k3_estimators_by_hand():
    logprobs, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-2.0, -1.0, -0.5])
    assert torch.allclose(kl_estimate(logprobs, ref, "k1"), torch.tensor([1.0, -1.0, 0.0]))
    # k3 = (r - 1) - log r, r = p_ref / p: r = e^-1 -> e^-1 - 1 + 1 = 0.3679; r = e -> e - 2 = 0.7183
    assert torch.allclose(kl_estimate(logprobs, ref, "k3"), torch.tensor([math.exp(-1), math.e - 2, 0.0]))
    with pytest.raises(ValueError, match="k2"):
        kl_estimate(logprobs, ref, "k2")                         # type: ignore[arg-type]


def test_k3_is_an_unbiased_estimate_of_the_kl_between_two_categoricals():
    torch.manual_seed(0)
    p, q = torch.softmax(torch.randn(5), 0), torch.softmax(torch.randn(5), 0)
    draws = torch.multinomial(p, 400_000, replacement=True, generator=torch.Generator().manual_seed(1))
    exact = float((p * (p / q).log()).sum())
    for estimator in ("k1", "k3"):
        estimate = kl_estimate(p.log()[draws], q.log()[draws], estimator).mean()
        assert float(estimate) == pytest.approx(exact, abs=0.01)


def test_whitening_over_the_real_tokens_with_bessels_correction():
    values = torch.tensor([[1.0, 2.0], [3.0, 100.0]])
    mask = torch.tensor([[T, T], [T, F]])
    assert masked_mean(values, mask).item() == pytest.approx(2.0)
    assert masked_var(values, mask).item() == pytest.approx(1.0)                 # (1 + 0 + 1) / (3 - 1)
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(2 / 3)
    scale = 1 / math.sqrt(1 + 1e-8)
    assert torch.allclose(masked_whiten(values, mask), torch.tensor([[-1.0, 0.0], [1.0, 98.0]]) * scale)
    assert torch.allclose(masked_whiten(values, mask, shift_mean=False), (values - 2) * scale + 2)
    with pytest.raises(ValueError, match="at least 2 real tokens"):
        masked_var(values, torch.tensor([[T, F], [F, F]]))


def test_the_clipped_policy_loss_by_hand():
    old = torch.zeros(1, 4)
    new = torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.1), 3.0]])
    advantages = torch.tensor([[1.0, 1.0, -2.0, 9.0]])
    mask = torch.tensor([[T, T, T, F]])
    out = policy_loss(new, old, advantages, mask, cliprange=0.2)
    # ratio 1.5, A 1: max(-1.5, -1.2) = -1.2 (clipped); ratio 0.5, A 1: max(-0.5, -0.8) = -0.5; ratio 1.1, A -2: 2.2
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 2.2) / 3)
    assert out.clipfrac.item() == pytest.approx(1 / 3)
    logs = [math.log(1.5), math.log(0.5), math.log(1.1), 0.0]                    # the padded slot counts as 0
    assert out.approxkl.item() == pytest.approx(0.5 * sum(x * x for x in logs) / 4)
    assert out.ratio.item() == pytest.approx((1.5 + 0.5 + 1.1) / 3)


def test_at_the_first_update_the_policy_loss_is_minus_the_mean_advantage_and_its_gradient_the_policy_gradient():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, requires_grad=True)
    tokens = torch.randint(0, 5, (2, 3))
    logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    advantages, mask = torch.randn(2, 3), torch.tensor([[T, T, T], [T, T, F]])
    out = policy_loss(logprobs, logprobs.detach(), advantages, mask, 0.2)
    assert out.loss.item() == pytest.approx(-masked_mean(advantages, mask).item(), abs=1e-6)
    (grad,) = torch.autograd.grad(out.loss, logits, retain_graph=True)
    (reinforce,) = torch.autograd.grad(-masked_mean(advantages * logprobs, mask), logits)
    assert torch.allclose(grad, reinforce, atol=1e-6) and out.clipfrac.item() == 0.0


def test_the_clipped_value_loss_by_hand():
    old, returns = torch.zeros(1, 3), torch.ones(1, 3)
    new = torch.tensor([[0.5, -0.1, 4.0]])
    out = value_loss(new, old, returns, torch.tensor([[T, T, F]]), cliprange_value=0.2)
    # 0.5 clips to 0.2: max((0.5-1)^2, (0.2-1)^2) = 0.64 (clipped larger); -0.1 is inside: 1.21
    assert out.loss.item() == pytest.approx(0.5 * (0.64 + 1.21) / 2)
    assert out.clipfrac.item() == pytest.approx(0.5)


def test_entropy_from_logits_equals_torch_distributions():
    logits = torch.randn(2, 3, 7)
    expect = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(entropy_from_logits(logits), expect, atol=1e-6)
