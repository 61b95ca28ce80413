"""The README and docs describe the software as it is: each figure by its CPU, command and date, never by the
project's development history (sessions, issues, "the commit before", what the code "once had")."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CODE = [p for folder in ("src", "tests", "benchmarks") for p in sorted((ROOT / folder).rglob("*.py"))
        if p.name != Path(__file__).name]
HISTORY = [
    r"\b[Ss]essions? \d",              # "session 2", "Sessions 1-3"
    r"\b[Ii]ssues? #?\d",              # "issue 14", "issues #3"
    r"\(#\d+\)",                       # "(#16)"
    r"\bas issue\b",
    r"\bthe commit before\b",
    r"\bonce had\b",
    r"\bin this session\b",
    r"\bnot (?:written|built) yet\b",
]


@pytest.mark.parametrize("path", DOCS + CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_and_code_hold_no_development_history(path):
    text = path.read_text(encoding="utf-8")
    found = [(m.group(0), text.count("\n", 0, m.start()) + 1) for pattern in HISTORY
             for m in re.finditer(pattern, text)]
    assert not found, f"{path.name}: history wording {found}"


def test_the_patterns_catch_history_and_spare_the_api():
    history = "Timed as issue 14 asks; sessions 1-3 ran on Intel; (#16); as issue 3 says"
    api = "one DecodeSession per generate call; a decode session; the issue tracker"
    assert all(re.search(p, history) for p in HISTORY[:4])
    assert not any(re.search(p, api) for p in HISTORY)
