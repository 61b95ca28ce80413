"""The README serves the first hour: within its first 120 lines it says what archlab is (at most 5 lines), gives
the two first commands (set up + the demo, set up + the tests: scripts/test.sh and .ci/run rely on them), a
command table with a row for every registered command, and the map of the house naming every room under
src/archlab; measured figures, with their dates, live further down and in docs/benchmarks.md."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from archlab.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "archlab"
FIRST = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:120]
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def registered_commands() -> set[str]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return set(sub.choices)


def table_commands(lines: list[str]) -> set[str]:
    """Commands of the rows that start `| \\`archlab NAME`."""
    return {m.group(1) for line in lines if (m := re.match(r"\| `archlab ([\w-]+)", line))}


def map_rooms(lines: list[str]) -> set[str]:
    """Rooms named at the start of a line of a code block under the heading `The map of the house`."""
    start = next(i for i, line in enumerate(lines) if line.startswith("## The map of the house"))
    rooms, in_block = set(), False
    for line in lines[start:]:
        if line.startswith("```"):
            if in_block:
                break
            in_block = True
        elif in_block and (m := re.match(r"\s+(\w+)/\s", line)):
            rooms.add(m.group(1))
    return rooms


def test_the_command_table_has_a_row_for_every_registered_command():
    commands = registered_commands()
    assert len(commands) >= 19                       # the parser was really read
    assert table_commands(FIRST) == commands, "README's command table (first 120 lines) vs archlab --help"


def test_the_map_names_every_room_under_src_archlab():
    rooms = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert len(rooms) >= 13
    assert map_rooms(FIRST) == rooms, "README's map of the house (first 120 lines) vs the rooms under src/archlab"


def test_what_it_is_and_the_two_first_commands_open_the_readme():
    heading = next(i for i, line in enumerate(FIRST) if line.startswith("## "))
    assert len([line for line in FIRST[1:heading] if line.strip()]) <= 5
    first_block = FIRST[heading:heading + 6]
    assert any(line.startswith("bash scripts/setup.sh && .venv/bin/archlab demo ") for line in first_block)
    assert any(line.startswith("bash scripts/test.sh ") for line in first_block)
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()       # CI runs the README's command


def quick_start_commands(lines: list[str]) -> tuple[list[str], list[str]]:
    """(the commands of the code block under `## Quick starts`, continuation lines joined; the prose after it)."""
    start = next(i for i, line in enumerate(lines) if line.startswith("## Quick starts"))
    opening = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
    closing = next(i for i in range(opening + 1, len(lines)) if lines[i].startswith("```"))
    text = "\n".join(lines[opening + 1:closing]).replace("\\\n", " ")
    after = lines[closing + 1:next(i for i in range(closing + 1, len(lines)) if lines[i].startswith("## "))]
    return [line.strip() for line in text.splitlines() if line.strip().startswith("archlab ")], after


def test_the_three_quick_starts_say_how_long_their_training_runs():
    """A newcomer who copies any of the quick starts' `train` lines gets a budget, and the text after the block
    says what a `train` without one runs (TrainConfig's default: 1,000 steps, hours on 2 cores)."""
    from archlab.training.config import TrainConfig

    commands, after = quick_start_commands(FIRST)
    assert len([line for line in FIRST if re.match(r"# [123]\. ", line)]) == 3
    trains = [c for c in commands if c.startswith("archlab train ")]
    assert len(trains) >= 2 and all("train.budget=" in c for c in trains), trains
    default = TrainConfig()
    assert f"{default.budget:,.0f} {default.budget_unit}" in " ".join(after), "the default budget, said as it is"


def test_dates_stay_out_of_the_first_150_lines():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:150]
    assert len(DATE.findall("\n".join(lines))) <= 3


def test_the_parsers_catch_a_missing_row_and_a_missing_room():
    lines = ["| `archlab demo` | ... |", "| `archlab fill-mask` | ... |", "## The map of the house", "```",
             "src/archlab/", "  cli/         one module", "  nn/          norms", "```", "  lab/  after the block"]
    assert table_commands(lines) == {"demo", "fill-mask"}
    assert map_rooms(lines) == {"cli", "nn"}
    block = ["## Quick starts", "```bash", "# 1. yours", "archlab train --preset x \\", "    --set train.budget=5",
             "archlab report y", "```", "A train runs 1,000 steps.", "## Next"]
    assert quick_start_commands(block) == (["archlab train --preset x      --set train.budget=5", "archlab report y"],
                                           ["A train runs 1,000 steps."])
