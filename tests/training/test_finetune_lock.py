"""Two `finetune --resume --out NEW` started together (what a restart-on-failure job script runs): the first to
lock the run folder writes it; the other is refused with one line, exit 2, before it writes anything, and
removes nothing it did not create. Finetune used to write OUT/data before taking the lock, and the refused
process removed the whole folder from under the winner.

The race is made deterministic: the other process appears at the moment this one takes the run folder's lock
(RunLock.acquire), locks the folder and writes what a fine-tune writes before its first checkpoint (config.yaml,
tokenizer/, data/); once this one has given up, it finishes (metrics.jsonl, checkpoints/) and lets go."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from finetune_runs import finetune_argv

import archlab
from archlab.cli import main
from archlab.runs.lock import RunLock

SRC = str(Path(archlab.__file__).parents[1])
WINNER = """import shutil, sys
from archlab.runs.lock import RunLock
LATER = ("metrics.jsonl", "checkpoints")
with RunLock(sys.argv[2]):
    shutil.copytree(sys.argv[1], sys.argv[2], dirs_exist_ok=True,
                    ignore=lambda d, names: [n for n in names if d == sys.argv[1] and n in LATER])
    print("held", flush=True)
    sys.stdin.readline()
    shutil.copytree(sys.argv[1], sys.argv[2], dirs_exist_ok=True,
                    ignore=lambda d, names: [n for n in names if d == sys.argv[1] and n not in LATER])
print("done", flush=True)
"""


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def test_the_refused_finetune_leaves_the_winners_run_intact(chat_world, make_base, tmp_path, monkeypatch, capsys):
    base = make_base(tmp_path / "base")
    assert main(finetune_argv(base, chat_world["data"], tmp_path / "finished", budget=2)) == 0
    out = tmp_path / "new"
    winner: list[subprocess.Popen] = []
    acquire = RunLock.acquire

    def the_other_process_locks_first(self):
        if self.folder == out and not winner:
            proc = subprocess.Popen([sys.executable, "-c", WINNER, str(tmp_path / "finished"), str(out)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                    env={**os.environ, "PYTHONPATH": SRC})
            winner.append(proc)
            assert proc.stdout.readline().strip() == "held"
        return acquire(self)

    monkeypatch.setattr(RunLock, "acquire", the_other_process_locks_first)
    try:
        capsys.readouterr()
        assert main(finetune_argv(base, chat_world["data"], out, "--resume", budget=4)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"pid {winner[0].pid}" in err, err
        winner[0].stdin.write("go on\n")
        winner[0].stdin.flush()
        assert winner[0].stdout.readline().strip() == "done"
    finally:
        for proc in winner:
            proc.kill()
            proc.wait()
    monkeypatch.undo()
    assert _snapshot(out) == _snapshot(tmp_path / "finished")            # the winner's run, whole
    assert main(["check", str(out)]) == 0


@pytest.mark.parametrize("resume", [False, True])
def test_a_refusal_removes_only_what_this_finetune_wrote(chat_world, make_base, tmp_path, resume):
    """A bad LoRA target is refused after the lock is taken: a folder this call made goes; a folder it found
    keeps everything it held."""
    base = make_base(tmp_path / "base")
    out = tmp_path / "out"
    argv = finetune_argv(base, chat_world["data"], out, "--lora-r", "2", "--lora-targets", "nope",
                         *(["--resume"] if resume else []))
    if resume:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    assert main(argv) == 2
    if resume:
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    else:
        assert not out.exists()
    shutil.rmtree(out, ignore_errors=True)
