"""Perplexity of a model on a token sequence, in consecutive windows (each scored on its own: no context carried
across a window's start), and the largest logit difference between two models on the same windows. What `archlab
quantize` prints and the real-model lab suites (lab/real_model.py) measure.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["windows", "perplexity", "compare_logits"]


def windows(ids: torch.Tensor, seq_len: int, max_tokens: int | None = None) -> Iterator[torch.Tensor]:
    """Consecutive (1, seq_len + 1) slices of ids (n,), the last one shorter, within the first max_tokens + 1."""
    n = ids.numel() if max_tokens is None else min(ids.numel(), max_tokens + 1)
    for start in range(0, n - 1, seq_len):
        yield ids[start: min(start + seq_len + 1, n)][None]                 # (1, <= seq_len + 1)


@torch.no_grad()
def perplexity(model: nn.Module, ids: torch.Tensor, seq_len: int, max_tokens: int | None = None,
               logits_of: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None) -> float:
    """exp(mean next-token cross-entropy) of `model` over ids (n,) in windows of seq_len (`windows`).
    logits_of(model, x): the forward to score (default model(x)), e.g. one with an activation zeroed.
    Example: perplexity(model, torch.tensor(tok.encode(text)), 256)"""
    model.eval()
    nats, count = 0.0, 0
    for w in windows(ids, seq_len, max_tokens):
        x, y = w[:, :-1], w[:, 1:]
        nats += _nats(model(x) if logits_of is None else logits_of(model, x), y)    # logits (1, t, v)
        count += y.numel()
    if count == 0:
        raise ValueError("perplexity needs at least 2 tokens")
    return math.exp(nats / count)


def _nats(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Summed next-token cross-entropy of logits (1, t, v) against targets (1, t)."""
    return float(F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum"))


@torch.no_grad()
def compare_logits(a: nn.Module, b: nn.Module, ids: torch.Tensor, seq_len: int, max_tokens: int | None = None
                   ) -> dict[str, float]:
    """{max_abs, max_rel (max|a - b| / max|a|), top1_agreement, ppl_a, ppl_b} of two models' logits on the same
    windows: each model runs once per window (the perplexities are `perplexity`'s, from the same logits).
    Example: d = compare_logits(model, quantize_int8(copy.deepcopy(model)), ids, 256); d["ppl_b"] / d["ppl_a"]"""
    worst, scale, agree, count, nats_a, nats_b = 0.0, 0.0, 0, 0, 0.0, 0.0
    for w in windows(ids, seq_len, max_tokens):
        la, lb = a(w[:, :-1]).float(), b(w[:, :-1]).float()                  # (1, t, v) each
        worst = max(worst, float((la - lb).abs().max()))
        scale = max(scale, float(la.abs().max()))
        agree += int((la.argmax(-1) == lb.argmax(-1)).sum())
        nats_a, nats_b = nats_a + _nats(la, w[:, 1:]), nats_b + _nats(lb, w[:, 1:])
        count += la.shape[1]
    if count == 0:
        raise ValueError("compare_logits needs at least 2 tokens")
    return {"max_abs": worst, "max_rel": worst / scale if scale else float("nan"),
            "top1_agreement": agree / count, "ppl_a": math.exp(nats_a / count), "ppl_b": math.exp(nats_b / count)}
