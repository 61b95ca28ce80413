"""The one output check (runs.outputs.check_output) in every command that writes: an --out that is, holds or sits
inside one of the command's inputs, or a live writer's folder, is one line and exit 2 before anything is written
or locked. Each case is a reproduction of a way a run was lost: `convert --to-peft RUN --out RUN --overwrite`
deleted the run, `--out` its parent deleted every sibling, and `train --init-from B --data D --out D` trained
into its own data folder."""
from __future__ import annotations

import inspect
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

import archlab
from archlab.cli import main
from archlab.data.prepare import prepare
from archlab.nn.lora import LoRAConfig
from archlab.runs.outputs import check_output, fresh_output
from archlab.training.trainer import TrainConfig, fit_vocab, train

SRC = Path(archlab.__file__).parents[1]
WORDS = "the quick brown fox jumps over a lazy dog".split()


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """runs/data (tokens), runs/lora (a one-step LoRA run), runs/sibling (another run's files)."""
    root = tmp_path_factory.mktemp("runs")
    rng = random.Random(0)
    prepare([" ".join(rng.choice(WORDS) for _ in range(200)) for _ in range(20)], "bytes", root / "data",
            num_workers=0, progress=False)
    cfg = fit_vocab(archlab.presets.tiny("llama3-8b", d_model=32), root / "data")
    train(cfg, TrainConfig(budget=1, batch_size=2, seq_len=16, eval_every=0, sample_every=-1, lora=LoRAConfig(r=2),
                           memory_check=False), root / "data", root / "lora", progress=False)
    (root / "sibling").mkdir()
    (root / "sibling" / "metrics.jsonl").write_text('{"step": 1}\n')
    return root


def _refused(capsys, argv: list[str], *, match: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(match, err), err


@pytest.mark.parametrize("out", ["lora", "."], ids=["the run itself", "the run's parent"])
def test_convert_to_peft_never_replaces_its_run_or_the_runs_beside_it(runs, capsys, out):
    before = _snapshot(runs)
    _refused(capsys, ["convert", "--to-peft", str(runs / "lora"), "--out", str(runs / out), "--overwrite"],
             match=r"^archlab convert: error: --out .* (is|holds) the input .*lora")
    assert _snapshot(runs) == before


def test_train_never_writes_into_its_data_folder(runs, capsys):
    before = _snapshot(runs)
    _refused(capsys, ["train", "--init-from", str(runs / "lora"), "--data", str(runs / "data"), "--out",
                      str(runs / "data"), "--set", "train.budget=1", "--no-progress"],
             match=r"--out .*data is the input .*data")
    _refused(capsys, ["train", "--init-from", str(runs / "lora"), "--data", str(runs / "data"), "--out",
                      str(runs / "lora" / "more"), "--set", "train.budget=1", "--no-progress"],
             match=r"--out .*more sits inside the input .*lora")
    assert _snapshot(runs) == before


def test_finetune_never_writes_into_its_base(runs, capsys, tmp_path):
    (tmp_path / "sft.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    before = _snapshot(runs)
    _refused(capsys, ["finetune", str(runs / "lora"), "--data", str(tmp_path / "sft.jsonl"), "--out",
                      str(runs), "--resume"], match=r"--out .* holds the input .*lora")
    assert _snapshot(runs) == before


def test_a_run_is_never_written_over_a_live_writers_folder(runs, capsys):
    code = ("import sys, time\nfrom archlab.runs.lock import RunLock\n"
            "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(runs / "sibling")], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(SRC)})
    try:
        assert holder.stdout.readline().strip() == "held"
        before = _snapshot(runs)
        _refused(capsys, ["train", "--preset", "tiny:llama3-8b", "--data", str(runs / "data"), "--out",
                          str(runs), "--set", "train.budget=1", "--no-progress"],
                 match=rf"holds the folder .*sibling, which pid {holder.pid} .* is writing")
        _refused(capsys, ["convert", "--to-hf", str(runs / "lora"), "--out", str(runs / "sibling" / "hf")],
                 match=rf"sits inside the folder .*sibling, which pid {holder.pid} .* is writing")
        assert _snapshot(runs) == before and not (runs / "sibling" / "hf").exists()
    finally:
        holder.kill()
        holder.wait()


def test_no_writer_can_skip_the_inputs():
    """The check's parts are private and `inputs` has no default: each caller names what it reads."""
    for fn in (check_output, fresh_output):
        assert inspect.signature(fn).parameters["inputs"].default is inspect.Parameter.empty
    for path in (SRC / "archlab").rglob("*.py"):
        if path.name != "outputs.py":
            assert not re.search(r"\b_?refuse_(existing|overlap|live_writers)\(", path.read_text()), path
