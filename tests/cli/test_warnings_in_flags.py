"""Warnings raised under generate / chat name the flags the user typed, not generation's Python arguments."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from archlab.cli.generate import _in_flags

FIXTURE = Path(__file__).parents[1] / "fixtures" / "run_v1"


def test_a_warning_under_generate_names_compile_as_its_flag():
    # StreamingLLM stays eager under --compile, with a warning (nothing is compiled: fast)
    proc = subprocess.run([sys.executable, "-m", "archlab", "generate", str(FIXTURE), "--prompt", "ab",
                           "--max-new-tokens", "2", "--compile", "--sink-window", "16"],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "archlab generate: warning: --compile: decoding eagerly" in proc.stderr, proc.stderr
    assert "compile=True" not in proc.stderr


def test_the_python_names_of_generations_warnings_become_flags():
    assert _in_flags("compile=True with a draft: the forwards ...") == "--compile with a draft: the forwards ..."
    assert _in_flags("draft_tokens=9 is longer") == "--draft-tokens 9 is longer"
    assert _in_flags("recompile=True") == "recompile=True"                   # whole names only
