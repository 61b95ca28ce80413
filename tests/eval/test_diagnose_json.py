"""archlab diagnose --json prints the summary that summary.json holds, as one line and nothing else."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

FIXTURE = Path(__file__).parents[1] / "fixtures" / "run_v1"


def test_diagnose_json_prints_the_summary_alone(tmp_path):
    from archlab.cli import main

    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["diagnose", str(FIXTURE), "--text", str(text), "--max-tokens", "24", "--json",
                     "--out", str(tmp_path / "diag")]) == 0
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    saved = json.loads((tmp_path / "diag" / "summary.json").read_text())["summary"]
    assert json.loads(lines[0]) == saved and saved["n_tokens"] == 24
