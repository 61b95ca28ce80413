"""Scoring the k-shot mapping task (archlab.eval.incontext) and prefix matching (induction heads), on hand-made
models whose answers are known."""
from __future__ import annotations

import math

import pytest
import torch

from archlab.data.incontext import line, value_slots
from archlab.data.tokenizer_adapter import ByteTokenizer
from archlab.eval import diagnostics
from archlab.eval.incontext import score_mapping

V, L = 257, 5.0


class Copier(torch.nn.Module):
    """At a value slot (after `key>`), predicts the value last written after the same key, else `fallback`; logit L
    on the prediction and 0 elsewhere, so p(prediction) = e^L / (e^L + V - 1)."""

    def __init__(self, fallback: str = "a", copy: bool = True):
        super().__init__()
        self.fallback, self.copy = ord(fallback), copy

    def forward(self, ids: torch.Tensor) -> torch.Tensor:              # (b, t) -> (b, t, V)
        out = torch.zeros(*ids.shape, V)
        for r, row in enumerate(ids.tolist()):
            for i in range(1, len(row)):
                if row[i] != ord(">"):
                    continue
                earlier = [row[j + 2] for j in range(i - 1) if row[j] == row[i - 1] and row[j + 1] == ord(">")
                           and j + 2 < i]
                out[r, i, earlier[-1] if earlier and self.copy else self.fallback] = L
        return out


EPISODES = [[("q", "m"), ("f", "a"), ("q", "m"), ("f", "a")],
            [("x", "a"), ("y", "b"), ("y", "b"), ("x", "a")]]


def test_a_perfect_copier_scores_one_on_every_shot_and_chance_only_at_zero_shots():
    result = score_mapping(Copier(), ByteTokenizer(), EPISODES)
    # 0-shot values: m, a, a, b against the fallback `a`: 2 of 4 right; every 1-shot value is copied right
    assert result["icl_accuracy_per_shot"] == [0.5, 1.0]
    assert result["icl_accuracy"] == 1.0 and result["icl_shots"] == 1
    assert result["icl_nll"] == pytest.approx(-math.log(math.exp(L) / (math.exp(L) + V - 1)))


def test_a_model_that_ignores_the_context_scores_the_values_that_happen_to_match():
    result = score_mapping(Copier(copy=False), ByteTokenizer(), EPISODES)
    # it always says `a`: 0-shot m, a, a, b -> 2/4; 1-shot m, a, b, a -> 2/4
    assert result["icl_accuracy_per_shot"] == [0.5, 0.5] and result["icl_accuracy"] == 0.5
    wrong, right = -math.log(1 / (math.exp(L) + V - 1)), -math.log(math.exp(L) / (math.exp(L) + V - 1))
    assert result["icl_nll"] == pytest.approx((wrong + right + wrong + right) / 4)


def test_slots_read_the_logits_one_position_before_the_value():
    pairs = EPISODES[0]
    text = "\n" + line(pairs)
    assert [text[o] for o, _ in value_slots(pairs)] == ["m", "a", "m", "a"]


def test_prefix_matching_of_hand_made_attention():
    half = 3
    probs = torch.zeros(1, 2, 6, 6)                                   # (b, h, t, s)
    for i, target in zip(range(3, 6), range(1, 4)):                  # queries 3, 4, 5 -> keys 1, 2, 3
        probs[0, 0, i, target] = 1.0                                 # head 0: a perfect induction head
        probs[0, 1, i, 0] = 1.0                                      # head 1: a sink
    probs[0, 1, 4, 0], probs[0, 1, 4, 2] = 0.5, 0.5                  # ... half of one query on its target
    assert diagnostics.prefix_matching(probs, half).tolist() == pytest.approx([1.0, 0.5 / 3])


def test_uniform_attention_scores_the_mean_of_one_over_the_keys_seen():
    from test_diagnostics import _frozen_stream_model

    model = _frozen_stream_model(q_bias=0.0)                         # zero queries: uniform causal attention
    half = 8
    scores = diagnostics.prefix_matching_scores(model, range(3, 8), half, rows=2)
    expected = sum(1 / (i + 1) for i in range(half, 2 * half)) / half
    assert len(scores) == 3 and all(s == pytest.approx([expected, expected], abs=1e-6) for s in scores)
    with pytest.raises(ValueError, match="max_seq_len"):
        diagnostics.prefix_matching_scores(model, range(3, 8), 17)


def test_diagnose_reports_the_strongest_induction_head():
    from test_diagnostics import _frozen_stream_model, _ids

    result = diagnostics.diagnose(_frozen_stream_model(q_bias=0.0), _ids())
    rows = [layer["prefix_matching"] for layer in result["layers"]]
    best = max(max(r) for r in rows)
    assert result["summary"]["max_prefix_matching"] == pytest.approx(best)
    layer, head = result["summary"]["max_prefix_matching_at"]
    assert rows[layer][head] == best
