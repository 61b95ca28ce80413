"""held_out_indices, the one line-based validation split of DPO, KTO, reward and GRPO runs: it holds out exactly the
examples whose line split_by_line holds out, every example of such a line together, and reads no file at 0."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from archlab.data.prepare import held_out_indices, split_by_line


def test_every_example_of_a_held_out_line_goes_with_it(tmp_path):
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(f'{{"prompt": "p{i}", "chosen": "a", "rejected": "b"}}\n' for i in range(40)))
    pairs = [SimpleNamespace(line=n) for n in range(1, 41)]
    sides = pairs + [SimpleNamespace(line=n) for n in range(1, 41)]       # KTO's completions: two a line
    val = held_out_indices(path, pairs, 3, 0.25)
    assert [pairs[i] for i in val] == split_by_line(path, pairs, 3, 0.25)[1] and 0 < len(val) < 40
    assert held_out_indices(path, sides, 3, 0.25) == val + [i + 40 for i in val]
    assert held_out_indices(path, pairs, 4, 0.25) != val


def test_no_fraction_holds_nothing_out_and_reads_nothing():
    assert held_out_indices(Path("/nonexistent/prefs.jsonl"), [SimpleNamespace(line=1)] * 3, 0, 0.0) == []
