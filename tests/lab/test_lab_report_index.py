"""docs/lab_report/report.md, the combined report, links every suite's own report folder beside it, and each link's
row states the verdicts that folder's verdicts.json holds."""
import json
import re
from pathlib import Path
from types import SimpleNamespace

from archlab.lab.verdicts import HELD, INCONCLUSIVE, NOT_HELD, overall

REPORTS = Path(__file__).resolve().parents[2] / "docs" / "lab_report"
ROW = re.compile(r"^\| \[(?P<folder>[^\]]+)/\]\((?P=folder)/report\.md\) \| (?P<suite>\w+) "
                 r"\| \*\*(?P<overall>[^*]+)\*\* \| (?P<held>\d+) \| (?P<not_held>\d+) \| (?P<inconclusive>\d+) \|",
                 re.M)


def _folders() -> list[str]:
    return sorted(p.name for p in REPORTS.iterdir() if (p / "report.md").is_file())


def test_every_report_folder_is_linked_from_the_combined_report():
    text = (REPORTS / "report.md").read_text()
    assert len(_folders()) >= 19
    assert [f for f in _folders() if f"]({f}/report.md)" not in text] == []


def test_each_linked_row_states_the_verdicts_its_folder_holds():
    rows = {(m["folder"], m["suite"]): m for m in ROW.finditer((REPORTS / "report.md").read_text())}
    stored = {(f, suite): verdicts for f in _folders()
              for suite, verdicts in json.loads((REPORTS / f / "verdicts.json").read_text()).items()}
    assert set(rows) == set(stored)
    for key, verdicts in stored.items():
        words = [v["verdict"] for v in verdicts]
        row = rows[key]
        assert row["overall"] == overall([SimpleNamespace(verdict=w) for w in words]), key   # reads .verdict only
        assert (int(row["held"]), int(row["not_held"]), int(row["inconclusive"])) == (
            words.count(HELD), words.count(NOT_HELD), words.count(INCONCLUSIVE)), key
