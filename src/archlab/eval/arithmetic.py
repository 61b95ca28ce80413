"""Score a model on addition problems (archlab.data.arithmetic) three ways, from one teacher-forced forward:

  exact_match     every answer digit right: the sharp, all-or-nothing metric. All argmaxes right under
                  teacher forcing is exactly what greedy decoding would write, so no decode loop is needed.
  digit_accuracy  the share of answer digits whose argmax is right (given the true digits before it)
  answer_nll      the answer tokens' mean negative log-likelihood (nats): the smooth, continuous one
  digit_accuracy_per_position  the sub-tasks: units digit, tens digit with its carry, ..., the carry out

Schaeffer et al. 2023 (arXiv 2304.15004): abilities that look emergent under exact match grow smoothly
under per-token metrics; with independent digits, exact match ~ digit_accuracy ** digits.
"""
from __future__ import annotations

from typing import Any

import torch

from archlab.errors import UserError


def encode_problems(tokenizer: Any, problems: list[tuple[str, str]]) -> tuple[torch.Tensor, int]:
    """(rows of prompt + answer ids, answer length): each answer character must be one token."""
    rows, width = [], None
    for text, ans in problems:
        ids = list(tokenizer.encode(text))
        for ch in ans:
            one = list(tokenizer.encode(ch))
            if len(one) != 1:
                raise UserError(f"the tokenizer splits the digit {ch!r} into {len(one)} tokens: score addition "
                                "with a byte-level tokenizer (--tokenizer bytes)")
            ids += one
        if width is not None and len(ids) != width:
            raise UserError("addition problems encode to different lengths: use a byte-level tokenizer")
        width = len(ids)
        rows.append(ids)
    return torch.tensor(rows, dtype=torch.long), len(problems[0][1])


@torch.no_grad()
def score_addition(model: torch.nn.Module, tokenizer: Any, problems: list[tuple[str, str]],
                   batch_size: int = 128) -> dict[str, Any]:
    """exact_match, digit_accuracy, answer_nll and digit_accuracy_per_position of `model` on `problems`
    (see the module docstring), and answer_digits (the answer's length)."""
    x, k = encode_problems(tokenizer, problems)                       # (n, t), answers are the last k ids
    right, nll = [], []
    for start in range(0, len(x), batch_size):
        rows = x[start:start + batch_size]
        logits = model(rows[:, :-1])                                   # (b, t-1, v)
        logp = torch.log_softmax(logits[:, -k:].float(), -1)           # (b, k, v): the answer positions
        target = rows[:, -k:]                                          # (b, k)
        right.append(logp.argmax(-1) == target)                        # (b, k)
        nll.append(-logp.gather(-1, target[..., None])[..., 0].mean(-1))
    hits = torch.cat(right).float()                                    # (n, k)
    return {"exact_match": float(hits.min(-1).values.mean()), "digit_accuracy": float(hits.mean()),
            "answer_nll": float(torch.cat(nll).mean()), "answer_digits": k,
            "digit_accuracy_per_position": hits.mean(0).tolist()}     # least significant digit first
