"""Next-token selection from logits: greedy and filtered sampling.

The filters run in this order (the order transformers applies its processors and warpers):

    repetition penalty -> temperature -> top-k -> top-p -> min-p -> sample

  repetition penalty  CTRL (Keskar et al. 2019, arXiv 1909.05858): every token already in the row
                      (prompt included) has its logit divided by the penalty if positive, multiplied
                      if negative.
  temperature         logits / T; T = 0 means greedy (argmax after the repetition penalty).
  top-k               keep the k largest logits (Fan et al. 2018).
  top-p (nucleus)     keep the smallest set of most likely tokens whose mass reaches p
                      (Holtzman et al. 2019, arXiv 1904.09751); the most likely token always stays.
  min-p               keep tokens whose probability is at least min_p x the top probability
                      (Nguyen et al. 2024, arXiv 2407.01082).
Shapes: b batch (rows), v vocab.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def __post_init__(self):
        if not self.temperature >= 0 or math.isinf(self.temperature):   # NaN fails `>= 0`
            raise ValueError(f"temperature={self.temperature} must be a finite number >= 0 (0 means greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be >= 1 (or None for no top-k)")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if self.repetition_penalty is not None and not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits (b, v) float, seen (b, v) bool: tokens present in the row so far."""
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p, min-p: removed tokens get -inf. (b, v) -> (b, v) float."""
    logits = logits.float() / params.temperature
    neg_inf = float("-inf")
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]                  # (b, 1)
        logits = logits.masked_fill(logits < kth, neg_inf)
    if params.top_p is not None and params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs                                    # (b, v)
        drop_sorted = mass_before >= params.top_p     # the set already reached p without it
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, neg_inf)
    if params.min_p is not None and params.min_p > 0.0:
        probs = logits.softmax(-1)
        threshold = params.min_p * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, neg_inf)
    return logits


def next_token(logits: torch.Tensor, params: SamplingParams, *, seen: torch.Tensor | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row: logits (b, v) -> (b,) long."""
    if params.repetition_penalty is not None and params.repetition_penalty != 1.0 and seen is not None:
        logits = apply_repetition_penalty(logits.float(), seen, params.repetition_penalty)
    if params.greedy:
        return logits.argmax(-1)
    probs = filter_logits(logits, params).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
