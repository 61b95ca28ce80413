"""The emergence suite's pieces: the generated addition corpus, the three scores from one teacher-forced
forward (checked against hand-built models), the `sharper` verdict and the report section."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from archlab.data import arithmetic
from archlab.data.tokenizer_adapter import ByteTokenizer
from archlab.eval.arithmetic import encode_problems, score_addition
from archlab.lab.verdicts import HELD, INCONCLUSIVE, NOT_HELD, Rule, judge, sharpness


def test_answers_are_reversed_fixed_width_sums_and_held_out_pairs_stay_out():
    assert arithmetic.answer(57, 68, 2) == "521"        # 125 reversed
    assert arithmetic.answer(57, 68, 3) == "5210"       # 0125 reversed
    assert arithmetic.answer(99, 99, 2) == "891"        # 198
    assert arithmetic.prompt(7, 42, 2) == "\n07+42="
    assert [arithmetic.digits_of(c) for c in ("addition", "addition-4", "addition-x", "shakespeare")] == [2, 4, None,
                                                                                                          None]
    lines = [ln for doc in arithmetic.documents(3, n_docs=3, per_doc=200) for ln in doc.splitlines()]
    assert len(lines) == 600 and all(len(ln) == 12 for ln in lines)
    for ln in lines:
        a, rest = ln.split("+")
        b, s = rest.split("=")
        assert s == arithmetic.answer(int(a), int(b), 3) and not arithmetic.held_out(int(a), int(b))
    probs = arithmetic.problems(3, 50)
    assert probs == arithmetic.problems(3, 50)          # the same problems for every run
    assert all(arithmetic.held_out(int(p[1:4]), int(p[5:8])) and len(s) == 4 for p, s in probs)


class Oracle(torch.nn.Module):
    """Puts its mass on the true next byte of `rows`, except at the answer digits listed in `wrong`."""

    def __init__(self, rows: torch.Tensor, k: int, wrong: tuple[int, ...] = (), vocab: int = 257):
        super().__init__()
        self.rows, self.k, self.wrong, self.vocab, self.seen = rows, k, wrong, vocab, 0

    def forward(self, x):
        b, t = x.shape
        full = self.rows[self.seen:self.seen + b]
        self.seen += b
        logits = torch.zeros(b, t, self.vocab)
        nxt = full[:, 1:].clone()                                           # (b, t): the true next tokens
        for k in self.wrong:                                                # answer digit k predicted wrong
            nxt[:, t - self.k + k] = (nxt[:, t - self.k + k] + 1) % self.vocab
        logits.scatter_(-1, nxt[..., None], math.log(9.0))                  # p(argmax) = 9 / (9 + 256)
        return logits


def test_scores_from_hand_built_models():
    tok, probs = ByteTokenizer(), arithmetic.problems(3, 10)
    rows, k = encode_problems(tok, probs)
    assert rows.shape == (10, 13) and k == 4
    assert bytes(rows[0, -4:].tolist()).decode() == probs[0][1]
    right = score_addition(Oracle(rows, k), tok, probs, batch_size=4)
    p = 9 / (9 + 256)
    assert right.pop("digit_accuracy_per_position") == [1.0] * 4
    assert right == pytest.approx({"exact_match": 1.0, "digit_accuracy": 1.0, "answer_nll": -math.log(p),
                                   "answer_digits": 4})
    last_wrong = score_addition(Oracle(rows, k, wrong=(3,)), tok, probs)
    assert last_wrong["exact_match"] == 0.0 and last_wrong["digit_accuracy"] == pytest.approx(0.75)
    assert last_wrong["digit_accuracy_per_position"] == [1.0, 1.0, 1.0, 0.0]
    # three digits at p, one at 1 / 265 (the wrong token took the mass)
    assert last_wrong["answer_nll"] == pytest.approx((-3 * math.log(p) + math.log(265)) / 4)


def test_a_tokenizer_that_merges_digits_is_a_one_line_error():
    from archlab.errors import UserError

    class Merging(ByteTokenizer):
        def encode(self, text):
            return [1] if len(text) == 1 else super().encode(text)

    class Pairs(ByteTokenizer):
        def encode(self, text):
            return [7, 7] if text.isdigit() and len(text) == 1 else super().encode(text)

    encode_problems(Merging(), arithmetic.problems(2, 2))
    with pytest.raises(UserError, match="byte-level tokenizer"):
        encode_problems(Pairs(), arithmetic.problems(2, 2))


def test_sharpness_by_hand():
    assert sharpness([0.0, 0.1, 0.2, 1.0]) == pytest.approx(0.8)
    assert sharpness([0.0, 0.25, 0.5, 0.75, 1.0]) == pytest.approx(0.25)
    assert math.isnan(sharpness([0.3, 0.3, 0.3]))


def _rows(digit_acc: list[float], exact: list[float], seeds=(0, 1), jitter=0.01):
    from archlab.lab.store import RunRecord
    rng = np.random.default_rng(0)
    rows = []
    for i, (d, e) in enumerate(zip(digit_acc, exact)):
        for seed in seeds:
            extra = {"labels": {"size": f"s{i}"}, "digit_accuracy": d + jitter * rng.standard_normal(),
                     "exact_match": max(0.0, e + jitter * rng.standard_normal()), "answer_nll": 2.0 - 2 * d,
                     "answer_digits": 4, "digit_accuracy_per_position": [min(1.0, d + 0.05), d, d, d - 0.05]}
            rows.append(RunRecord(suite="emergence", variant=f"size=s{i}", seed=seed, status="done",
                                  params=40_000 * 2 ** i, tokens_seen=2_000_000, extra=extra))
    return rows


RULE = Rule(kind="sharper", metric="exact_match", versus="digit_accuracy", tol=0.15, statement="s")
SMOOTH = [0.30, 0.46, 0.62, 0.78, 0.94]


def test_sharper_verdict_held_when_exact_match_is_the_digit_accuracy_to_the_fourth():
    v = judge(RULE, _rows(SMOOTH, [d ** 4 for d in SMOOTH]))        # Schaeffer's picture
    assert v.verdict == HELD, v.reason
    assert v.numbers["sharpness"]["exact_match"] > 0.4 > 0.3 > v.numbers["sharpness"]["digit_accuracy"]


def test_sharper_verdict_refuses_an_even_rise_and_a_metric_that_never_moves():
    assert judge(RULE, _rows(SMOOTH, [0.1, 0.3, 0.5, 0.7, 0.9])).verdict == NOT_HELD
    never = judge(RULE, _rows(SMOOTH, [0.0] * 5, jitter=0.0))
    assert never.verdict == INCONCLUSIVE and "barely moved" in never.reason
    assert judge(RULE, _rows(SMOOTH[:2], [0.0, 0.5])).verdict == INCONCLUSIVE


def test_emergence_suite_and_report_from_a_synthetic_table(tmp_path):
    from archlab.lab import suites
    from archlab.lab.plan import plan
    from archlab.lab.report import build_report
    from archlab.lab.store import ResultStore
    from archlab.models.accounting import param_count

    suite = suites.BUILTIN["emergence"]
    planned = plan(suite, tmp_path, vocab_size=257)
    assert len(planned) == 18 and {p.train.budget_unit for p in planned} == {"tokens"}
    sizes = [param_count(p.model) for p in planned if p.seed == 0]
    assert sizes == sorted(sizes) and 3e4 < sizes[0] and sizes[-1] < 4e5          # a ladder, smallest first
    assert suite.corpus == "addition-2+icl" and suite.scale("large")["corpus"] == "addition-4+icl"
    rows = _rows(SMOOTH, [d ** 4 for d in SMOOTH])
    for r in rows:                                        # the mapping task's scores and the induction score
        i = int(r.variant[len("size=s"):])
        r.extra.update(icl_accuracy=0.1 + 0.2 * i, icl_accuracy_per_shot=[0.04, 0.1 * i, 0.2 * i, 0.3 * i],
                       icl_nll=3.0 - 0.5 * i, prefix_matching_max=0.1 * i + 0.05 * r.seed)
    with ResultStore(tmp_path / "sweep") as store:
        store.set_meta("suite:emergence", suite.to_dict())
        for row in rows:
            store.put(row)
    paths = build_report(tmp_path / "sweep")
    assert json.loads(paths["json"].read_text())["emergence"][0]["verdict"] == HELD
    md = paths["md"].read_text()
    assert "digit accuracy ^ 4" in md and "Emergence: the sharp metric beside the smooth ones" in md
    assert "| 40,000 | 4.8e+11 | " in md and "0.35 / 0.30 / 0.30 / 0.25" in md    # per position, units first
    for axis in ("params", "compute"):
        assert (paths["md"].parent / "img" / f"emergence_vs_{axis}.png").stat().st_size > 5000
    assert "In-context learning: k-shot lookups of fresh random mappings" in md
    # size s2 (160,000 parameters): accuracy 0.5 on both seeds; prefix matching 0.2 and 0.25
    assert "| 160,000 | 0.500 ± 0.000 | 2.000 ± 0.000 | 0.225 ± 0.035 | 0.04 / 0.20 / 0.40 / 0.60 |" in md
    assert (paths["md"].parent / "img" / "emergence_icl.png").stat().st_size > 5000


def test_a_sweep_generates_the_addition_corpus(tmp_path):
    from archlab.data.tokens import load_meta
    from archlab.lab.runner import ensure_data

    data = ensure_data(tmp_path, corpus="addition-2", progress=False)
    meta = load_meta(data)
    assert meta["corpus"] == "addition-2" and meta["vocab_size"] == 257
    total = meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"]
    assert total == 400 * (1000 * 10 + 1)             # 1,000 lines of 9 bytes and a line break, + end-of-text


def test_every_analysis_a_suite_can_name_has_a_report_section():
    from archlab.lab import report, suites

    assert set(suites.ANALYSES) == set(report.ANALYSES)
    assert {s.analysis for s in suites.BUILTIN.values()} - {None} == set(suites.ANALYSES)


def test_a_sweep_on_addition_with_icl_mixes_mapping_episodes_into_the_addition_lines(tmp_path, monkeypatch):
    from archlab.data import arithmetic
    from archlab.data.tokens import TokenDataset
    from archlab.lab.runner import ensure_data

    full = arithmetic.documents
    monkeypatch.setattr(arithmetic, "documents", lambda digits: full(digits, n_docs=20, per_doc=100))
    data = ensure_data(tmp_path, corpus="addition-2+icl", progress=False)
    text = bytes(int(i) for i in TokenDataset(data, "train").tokens if i < 256).decode()
    lines = text.splitlines()
    episodes = [x for x in lines if ">" in x]
    assert 0.1 < len(episodes) / len(lines) < 0.3 and all(x.count(">") == 12 for x in episodes)
    assert all("+" in x for x in lines if ">" not in x)
