"""GRPO's math as pure functions (Shao et al. 2024, DeepSeekMath §4.1; the loss types of TRL's GRPOTrainer: grpo,
bnpo, Dr. GRPO (Liu et al. 2025), DAPO (Yu et al. 2025) with its decoupled clip ε_high). Tensors are (b, c) over the
completion tokens, `mask` 1 on a token that counts; nothing here reads a model.

    advantages, zero_std = group_advantages(rewards, group=8, scale="group")   # (r - mean_g) / (std_g + 1e-4)
    out = grpo_loss(logps, old_logps, advantages, mask, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28,
                    beta=0.04, ref_logps=ref_logps, max_completion_length=512, num_items=mask.sum())
    out.loss.backward(); out.figures        # kl, clip_ratio/low_mean, ... under TRL's names

Per token, with ratio ρ = exp(log π - log π_old) (1 on-policy, where its gradient is the policy gradient):

    loss_t = -min(ρ A, clip(ρ, 1 - ε, 1 + ε_high) A) + β ρ k3_t,   k3 = exp(log π_ref - log π) - (log π_ref - log π) - 1

(the ρ on the KL term is TRL's default use_bias_correction_kl: 1 in value on-policy, but it carries a gradient)

then averaged per loss type: grpo, each sequence's mean then the batch's; bnpo, over the batch's tokens; dr_grpo,
the sum over b * max_completion_length; dapo, the sum over `num_items` (the tokens of the whole generation batch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from archlab.training.ppo import kl_estimate

__all__ = ["LOSS_TYPES", "group_advantages", "GRPOLoss", "grpo_loss"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
STD_EPS = 1e-4      # TRL's: advantages / (std + 1e-4), so an all-equal group's advantages are 0, not NaN


def group_advantages(rewards: torch.Tensor, group: int, scale: Literal["group", "batch", "none"] = "group"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages (n,), zero_std (n,) bool) of rewards (n,) whose consecutive runs of `group` are one prompt's
    completions: each reward minus its group's mean, divided by the group's std (scale="group", unbiased), the whole
    batch's std ("batch"), or not at all ("none"); zero_std marks rows whose std (the one scaled by, or the group's
    for "none") is 0, as TRL's frac_reward_zero_std counts them.
    Example: group_advantages(torch.tensor([1., 0., 1., 1.]), 2)[0] -> [0.7070, -0.7070, 0, 0]"""
    grouped = rewards.view(-1, group)                                                    # (n / g, g)
    mean = grouped.mean(-1).repeat_interleave(group)                                     # (n,)
    if scale == "batch":
        std = rewards.std().expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        std = grouped.std(-1).repeat_interleave(group)                                   # (n,)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + STD_EPS)
    return advantages, torch.isclose(std, torch.zeros_like(std))


@dataclass
class GRPOLoss:
    """The loss of one micro-batch (what backward takes), the per-token loss (b, c) before averaging, and the figures
    TRL logs of it (floats: kl, entropy when given, clip_ratio/low_mean, low_min, high_mean, high_max, region_mean)."""

    loss: torch.Tensor
    per_token: torch.Tensor
    figures: dict[str, float] = field(default_factory=dict)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp(min=1.0))


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor, *,
              loss_type: str = "dapo", epsilon_low: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
              ref_logps: torch.Tensor | None = None, max_completion_length: int | None = None,
              num_items: torch.Tensor | float | None = None, entropy: torch.Tensor | None = None,
              bias_correction_kl: bool = True) -> GRPOLoss:
    """GRPO's loss over logps (b, c) (differentiable), old_logps (b, c) (the sampling policy's; None: on-policy,
    logps detached), advantages (b,), mask (b, c); beta > 0 needs ref_logps (b, c). max_completion_length: dr_grpo's
    constant; num_items: dapo's token count (default: this batch's); bias_correction_kl: the KL term times the ratio ρ
    (TRL's use_bias_correction_kl, its default: the unbiased reverse-KL gradient of DeepSeek-V3.2). Equals TRL's
    GRPOTrainer._compute_loss with one accumulation step (tested on a frozen batch).
    Example: grpo_loss(logps, None, torch.tensor([1., -1.]), mask, loss_type="bnpo").loss"""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type!r}: one of {', '.join(LOSS_TYPES)}")
    mask = mask.to(logps.dtype)
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)                                                        # (b, c)
    adv = advantages[:, None]                                                             # (b, 1)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv)
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probs (ref_logps)")
        kl = kl_estimate(logps, ref_logps, "k3")                                          # (b, c)
        if bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + beta * kl
    total = (per_token * mask).sum()
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = total / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("dr_grpo divides by max_completion_length: give it")
        loss = total / (per_token.shape[0] * max_completion_length)
    else:                                                                                 # dapo
        items = mask.sum() if num_items is None else torch.as_tensor(num_items, dtype=logps.dtype)
        loss = total / items.clamp(min=1.0)
    with torch.no_grad():
        low = ((ratio < 1 - epsilon_low) & (adv < 0)).float()
        high = ((ratio > 1 + epsilon_high) & (adv > 0)).float()
        per_seq = mask.sum(-1)
        figures = {"clip_ratio/low_mean": _masked_mean(low, mask),
                   "clip_ratio/low_min": float(((low * mask).sum(-1) / per_seq).nan_to_num(float("inf")).min()),
                   "clip_ratio/high_mean": _masked_mean(high, mask),
                   "clip_ratio/high_max": float(((high * mask).sum(-1) / per_seq).nan_to_num(float("-inf")).max()),
                   "clip_ratio/region_mean": _masked_mean(((low + high) > 0).float(), mask)}
        if kl is not None:
            figures["kl"] = _masked_mean(kl, mask)
        if entropy is not None:
            figures["entropy"] = _masked_mean(entropy, mask)
    return GRPOLoss(loss, per_token, figures)
