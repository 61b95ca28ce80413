"""PPO's math for language models as pure functions over one fixed rollout (Schulman et al. 2017; the RLHF form of
Ziegler et al. 2019 and Ouyang et al. 2022, as TRL's experimental PPOTrainer computes it). Every tensor is (b, t) over
the response tokens, `mask` True on a real response token; nothing here reads a model.

    kl = kl_estimate(logprobs, ref_logprobs, "k1")                 # per token, Schulman's k1 or k3 estimator
    rewards, non_score = token_rewards(scores, kl, mask, kl_coef)  # -kl_coef * kl, the score on the last real token
    advantages, returns = gae(rewards, values, mask, gamma, lam)   # Generalized Advantage Estimation (Schulman 2016)
    advantages = masked_whiten(advantages, mask)                   # zero mean, unit variance over the real tokens
    policy = policy_loss(new_logprobs, logprobs, advantages, mask, cliprange)     # the clipped surrogate
    value = value_loss(new_values, values, returns, mask, cliprange_value)        # the clipped value loss

One deliberate difference from TRL: the score goes on the last real token (the action that ended the response) and
values are fitted over the real tokens only. TRL puts it one slot past the end (on the first pad, whose value it
also fits), so λ discounts the score once before it reaches the last action; on a response that fills the whole
length the two agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["KL_ESTIMATORS", "masked_mean", "masked_var", "masked_whiten", "kl_estimate", "token_rewards", "gae",
           "PolicyLoss", "policy_loss", "ValueLoss", "value_loss", "entropy_from_logits", "last_token_index"]

KL_ESTIMATORS = ("k1", "k3")      # http://joschu.net/blog/kl-approx.html; k2 is not an option in TRL either


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The mean of `values` where `mask` is True (over `dim`, or all of it). Example:
    masked_mean(torch.tensor([1., 5.]), torch.tensor([True, False])) -> 1.0"""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum()
    return (values * mask).sum(dim) / mask.sum(dim)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """The variance of `values` where `mask` is True; unbiased: Bessel's n / (n - 1), which needs two tokens.
    Example: masked_var(torch.tensor([1., 3., 9.]), torch.tensor([True, True, False])) -> 2.0"""
    centered = values - masked_mean(values, mask)
    variance = masked_mean(centered ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count < 2:
            raise ValueError(f"a whitened quantity needs at least 2 real tokens, got {int(count)} (a larger rollout "
                             "or longer responses)")
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) over the real tokens, the mean added back unless shift_mean (TRL whitens
    advantages with shift_mean=True and rewards with False). Positions outside `mask` are whitened too: the caller
    zeroes them. Example: masked_whiten(torch.tensor([1., 3.]), torch.tensor([True, True])) -> [-0.7071, 0.7071]"""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: Literal["k1", "k3"] = "k1"
                ) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs (b, t) each: k1 = log p - log
    p_ref (unbiased, can be negative), k3 = (r - 1) - log r with r = p_ref / p (unbiased, never negative).
    Example: kl_estimate(torch.tensor([-1.]), torch.tensor([-1.]), "k3") -> 0"""
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"kl estimator {estimator!r}: one of {', '.join(KL_ESTIMATORS)}")


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Each row's last real token (b,) of a mask (b, t) whose real tokens come first; a row with none gives 0."""
    return (mask.long().sum(-1) - 1).clamp(min=0)


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards, non_score_reward), both (b, t): the KL penalty -kl_coef * kl on every real token, plus each row's
    score (b,) on its last real token (where the episode ends). Zero past the end.
    Example: token_rewards(torch.tensor([1.]), torch.zeros(1, 3), torch.tensor([[True, True, False]]), 0.05)[0]
    -> [[0, 1, 0]]"""
    non_score = torch.where(mask, -kl_coef * kl, torch.zeros_like(kl))
    rewards = non_score.clone()
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last_token_index(mask)] += scores.to(rewards.dtype)
    return rewards, non_score


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016) over rewards and values (b, t):

        delta_t = r_t + gamma * V_{t+1} - V_t          (V past the last real token is 0: the episode has ended)
        A_t     = delta_t + gamma * lam * A_{t+1}      returns_t = A_t + V_t

    Returns (advantages, returns), zero past each row's end. gamma = lam = 1 makes A_t the sum of the rewards from t
    on minus V_t; lam = 0 the one-step TD error. Example: gae(torch.tensor([[0., 1.]]), torch.zeros(1, 2),
    torch.ones(1, 2, dtype=torch.bool), 1.0, 1.0) -> ([[1, 1]], [[1, 1]])"""
    rewards = torch.where(mask, rewards, torch.zeros_like(rewards))
    values = torch.where(mask, values, torch.zeros_like(values))
    width = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])                                       # (b,) A_{t+1}
    for t in reversed(range(width)):
        next_values = values[:, t + 1] if t < width - 1 else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last = delta + gamma * lam * last
        advantages[:, t] = last
    advantages = torch.where(mask, advantages, torch.zeros_like(advantages))
    return advantages, advantages + values


@dataclass
class PolicyLoss:
    """The clipped surrogate and what TRL logs of it: clipfrac (share of real tokens where the clipped term won),
    approxkl (0.5 * mean squared log-ratio, over every slot as TRL's), ratio (mean new/old probability ratio)."""

    loss: torch.Tensor
    clipfrac: torch.Tensor
    approxkl: torch.Tensor
    ratio: torch.Tensor


def policy_loss(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, cliprange: float) -> PolicyLoss:
    """PPO's clipped surrogate, a masked mean over the real tokens (b, t):
    max(-A * ratio, -A * clamp(ratio, 1 - eps, 1 + eps)), ratio = exp(new - old).
    Example: policy_loss(lp, lp, adv, mask, 0.2).loss == -masked_mean(adv, mask) (ratio 1 at the first update)"""
    log_ratio = torch.where(mask, new_logprobs - old_logprobs, torch.zeros_like(new_logprobs))
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(unclipped, clipped), mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).float(), mask)
        approxkl = 0.5 * (log_ratio ** 2).mean()
        mean_ratio = masked_mean(ratio, mask)
    return PolicyLoss(loss, clipfrac, approxkl, mean_ratio)


@dataclass
class ValueLoss:
    """The clipped value loss and clipfrac (share of real tokens where the clipped error was the larger)."""

    loss: torch.Tensor
    clipfrac: torch.Tensor


def value_loss(new_values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float) -> ValueLoss:
    """0.5 * masked mean of max((V - R)^2, (clamp(V, V_old - c, V_old + c) - R)^2) over the real tokens (b, t).
    Example: value_loss(v, v, v + 1, mask, 0.2).loss -> 0.5"""
    clipped = torch.clamp(new_values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped_error = (new_values - returns) ** 2
    clipped_error = (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped_error, clipped_error), mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped_error > unclipped_error).float(), mask)
    return ValueLoss(loss, clipfrac)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """The entropy of each slot's next-token distribution (b, t, v) -> (b, t): logsumexp(z) - sum softmax(z) * z."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)
