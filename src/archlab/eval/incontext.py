"""Score a model on k-shot random mappings (archlab.data.incontext) from one teacher-forced forward per batch:

  icl_accuracy           the share of values predicted right (argmax) whose key was shown earlier in the line
                         (1 to SHOTS shots): only in-context learning can get these right
  icl_accuracy_per_shot  the same per number of earlier occurrences, 0-shot first (0-shot: chance, ~1/26)
  icl_nll                the mean negative log-likelihood (nats) of the 1+-shot values: the smooth metric

Teacher forcing is exact here: a value's prediction reads only the line before it, which holds the true values.
"""
from __future__ import annotations

from typing import Any

import torch

from archlab.data.incontext import line, value_slots
from archlab.errors import UserError


def encode_episodes(tokenizer: Any, episodes: list[list[tuple[str, str]]]) -> tuple[torch.Tensor, list]:
    """(rows of "\\n" + episode ids (n, t), each row's value slots): one token per character, as bytes give."""
    rows, slots = [], []
    for pairs in episodes:
        text = "\n" + line(pairs)
        ids = list(tokenizer.encode(text))
        if len(ids) != len(text):
            raise UserError(f"the tokenizer writes {text[:20]!r}... in {len(ids)} tokens for {len(text)} characters: "
                            "score the mapping task with a byte-level tokenizer (--tokenizer bytes)")
        rows.append(ids)
        slots.append(value_slots(pairs))
    if len({len(r) for r in rows}) != 1:
        raise UserError("mapping episodes of different lengths: score episodes of one shape at a time")
    return torch.tensor(rows, dtype=torch.long), slots


def tally(logp: torch.Tensor, rows: torch.Tensor, slots: list, shots: int) -> tuple[list[list[int]], list[float]]:
    """Per shot count: [right, total] over the value slots, and the NLLs of the 1+-shot values.
    logp (b, t - 1, v) are the log-probabilities of rows[:, 1:] (b, t), read at each slot's position."""
    counts = [[0, 0] for _ in range(shots + 1)]
    nll: list[float] = []
    for r, row_slots in enumerate(slots):
        for offset, k in row_slots:
            target = int(rows[r, offset])
            counts[k][0] += int(int(logp[r, offset - 1].argmax()) == target)
            counts[k][1] += 1
            if k > 0:
                nll.append(-float(logp[r, offset - 1, target]))
    return counts, nll


@torch.no_grad()
def score_mapping(model: torch.nn.Module, tokenizer: Any, episodes: list[list[tuple[str, str]]],
                  batch_size: int = 128) -> dict[str, Any]:
    """icl_accuracy, icl_accuracy_per_shot, icl_nll of `model` on `episodes` (see the module docstring).
    Example: score_mapping(model, ByteTokenizer(), incontext.episodes(64))["icl_accuracy_per_shot"] -> [0.04, ...]"""
    x, slots = encode_episodes(tokenizer, episodes)                    # (n, t)
    shots = max(k for row in slots for _, k in row)
    counts = [[0, 0] for _ in range(shots + 1)]
    nll: list[float] = []
    for start in range(0, len(x), batch_size):
        rows = x[start:start + batch_size]
        logp = torch.log_softmax(model(rows[:, :-1]).float(), -1)       # (b, t-1, v): position i predicts i + 1
        part, part_nll = tally(logp, rows, slots[start:start + batch_size], shots)
        counts = [[a + c, b + d] for (a, b), (c, d) in zip(counts, part)]
        nll += part_nll
    per_shot = [right / total if total else float("nan") for right, total in counts]
    later = [sum(c[0] for c in counts[1:]), sum(c[1] for c in counts[1:])]
    return {"icl_accuracy": later[0] / later[1], "icl_accuracy_per_shot": per_shot,
            "icl_nll": sum(nll) / len(nll), "icl_shots": shots}
