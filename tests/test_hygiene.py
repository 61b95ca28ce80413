"""Code a reviewer can hold in their head: no function in src/archlab over 120 lines."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "archlab"


def test_no_function_is_longer_than_120_lines():
    long = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 120:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, long


def test_each_builtin_suite_is_its_own_registered_function():
    from archlab.lab import suites
    assert len(suites.BUILTIN) == 13
    names = [build.__name__.lstrip("_") for build in suites._BUILTIN_FUNCTIONS]
    assert names == list(suites.BUILTIN)
