"""The lab's limit rules: `bound` (a deterministic value, or a ratio of two, within closed limits) and `above` /
`below` (a trained metric past a threshold by more than the std over seeds) are one judge with two noise models.
Every such verdict stored in docs/lab_report is what the judge gives again from the report's own per-seed values."""
import json
from pathlib import Path

import pytest

from archlab.lab import suites
from archlab.lab.store import RunRecord
from archlab.lab.verdicts import HELD, INCONCLUSIVE, NOT_HELD, Rule, judge

REPORTS = Path(__file__).resolve().parents[2] / "docs" / "lab_report"
LIMIT_KINDS = ("above", "below", "bound")


def _stored() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(REPORTS.glob("*/verdicts.json")):
        for suite, verdicts in json.loads(path.read_text()).items():
            out += [(suite, v) for v in verdicts if v["kind"] in LIMIT_KINDS]
    return out


def _rows(sides: list[dict]) -> list[RunRecord]:
    """One row per side and seed, labelled side=<index>, carrying the stored value."""
    return [RunRecord(suite="s", variant=f"v{i}", seed=int(seed), status="done",
                      extra={"labels": {"side": str(i)}, "value": value})
            for i, side in enumerate(sides) for seed, value in side["values"].items()]


@pytest.mark.parametrize("suite, stored", _stored(), ids=lambda x: x if isinstance(x, str) else x["kind"])
def test_every_stored_limit_verdict_is_judged_the_same_from_its_stored_values(suite, stored):
    rule = next(r for r in suites.BUILTIN[suite].rules if r.statement == stored["statement"])
    sides = stored["sides"]
    again = Rule(kind=rule.kind, statement=rule.statement, metric="value", a={"side": "0"},
                 b={"side": "1"} if len(sides) == 2 else None, expected=rule.expected, at_least=rule.at_least,
                 at_most=rule.at_most)
    assert judge(again, _rows(sides)).verdict == stored["verdict"]


def test_the_reports_hold_limit_verdicts_of_every_kind():
    assert {v["kind"] for _, v in _stored()} == set(LIMIT_KINDS)


@pytest.mark.parametrize("kind, values, verdict", [
    ("bound", [0.5], HELD),                # a single measurement on a closed limit holds
    ("bound", [0.49], NOT_HELD),
    ("above", [0.5, 0.5], INCONCLUSIVE),   # seeds: on the threshold, within the std (0) either way
    ("above", [0.51, 0.51], HELD),
    ("below", [0.51, 0.51], NOT_HELD),
])
def test_a_bound_is_closed_and_a_threshold_wants_a_clear_side(kind, values, verdict):
    limits = {"at_least": 0.5} if kind == "bound" else {"expected": 0.5}
    rule = Rule(kind=kind, statement="s", metric="value", a={"side": "0"}, **limits)
    assert judge(rule, _rows([{"values": dict(enumerate(values))}])).verdict == verdict


def test_a_threshold_rule_judges_one_side():
    with pytest.raises(ValueError, match="bound"):
        Rule(kind="above", statement="s", a={"x": "a"}, b={"x": "b"}, expected=1.0)
