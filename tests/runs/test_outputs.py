"""One-shot outputs (runs.outputs) never replace an input or a folder a live writer holds."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import archlab
from archlab.cli import main
from archlab.runs.outputs import OutputConflictError, check_output, fresh_output

SRC = str(Path(archlab.__file__).parents[1])


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _holder(folder: Path) -> subprocess.Popen:
    """Another process holding RunLock(folder) until killed."""
    code = ("import sys, time\nfrom archlab.runs.lock import RunLock\n"
            "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": SRC})
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture()
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(4):
        (folder / f"doc{i}.txt").write_text(f"to be or not to be, number {i}. " * 20)
    return folder


@pytest.mark.parametrize("where", ["the folder", "a folder above it", "a folder inside it"])
def test_a_live_writers_folder_is_never_replaced(tmp_path, corpus, capsys, where):
    run = tmp_path / "runs" / "live"
    (run / "checkpoints" / "step_0000001").mkdir(parents=True)
    (run / "checkpoints" / "step_0000001" / "model.safetensors").write_bytes(b"weights")
    out = {"the folder": run, "a folder above it": tmp_path / "runs", "a folder inside it": run / "checkpoints"}[where]
    locked = run
    holder = _holder(locked)
    try:
        before = _snapshot(tmp_path / "runs")
        rc = main(["data", "prepare", "--corpus", str(corpus), "--tokenizer", "bytes", "--out", str(out),
                   "--overwrite", "--quiet", "--workers", "0"])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and f"pid {holder.pid}" in err and "is writing" in err
        assert _snapshot(tmp_path / "runs") == before
    finally:
        holder.kill()
        holder.wait()
    # the writer gone, the same command replaces the folder
    assert main(["data", "prepare", "--corpus", str(corpus), "--tokenizer", "bytes", "--out", str(out),
                 "--overwrite", "--quiet", "--workers", "0"]) == 0
    assert (out / "meta.json").is_file()


def test_a_writer_that_starts_meanwhile_keeps_its_folder(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    holder = None
    try:
        with pytest.raises(OutputConflictError, match="is writing"):
            with fresh_output(target, overwrite=True, inputs=()) as tmp:
                (tmp / "new.txt").write_text("new")
                holder = _holder(target)                 # a trainer locks the folder while this one works
        assert (target / "old.txt").read_text() == "old" and not (target / "new.txt").exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]     # the temporary folder is gone
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()


def test_this_processs_own_lock_does_not_block_its_outputs(tmp_path):
    """The lab driver holds its sweep folder and prepares data inside it."""
    from archlab.runs.lock import RunLock

    with RunLock(tmp_path / "sweep"):
        (tmp_path / "sweep" / "data").mkdir()
        (tmp_path / "sweep" / "data" / "x").write_text("x")
        check_output(tmp_path / "sweep" / "data", inputs=(), overwrite=True)


def test_inputs_are_compared_resolved(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real)
    with pytest.raises(OutputConflictError, match="is the input"):
        check_output(real, inputs=[tmp_path / "alias"], overwrite=True)
    with pytest.raises(OutputConflictError, match="holds the input"):
        check_output(tmp_path, inputs=[real / "file.txt", real], overwrite=True)
    check_output(tmp_path / "other", inputs=[real, "bytes", None])          # siblings and non-paths pass
