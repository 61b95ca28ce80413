"""DPO's stored reference log-probs (reference_logps.safetensors) are the run's own on --resume: the file records
the sha256 of the weights that scored it and of its values, so a resume with another --init-from, a file scored by
another model (swapped in from another run) or values edited since is one line, exit 2, the run as it was; a
resume with the run's own reference continues. Before, each of these was used silently (loss 4.33 at step 10
instead of ~0.35)."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from finetune_runs import WORDS

from archlab.cli import main
from archlab.training.dpo import REFERENCE_FILE

COMMON = ["--no-progress", "--set", "train.method=dpo", "--set", "train.batch_size=4", "--set", "train.seq_len=32",
          "--set", "train.warmup_steps=0", "--set", "train.sample_every=-1", "--set", "train.eval_every=0",
          "--set", "train.memory_check=false", "--set", "train.checkpoint_every=2"]


@pytest.fixture(scope="module")
def prefs(tmp_path_factory) -> Path:
    rng = random.Random(1)
    rows = [{"prompt": " ".join(rng.choice(WORDS) for _ in range(3)) + ":", "chosen": " good", "rejected": " bad"}
            for _ in range(16)]
    path = tmp_path_factory.mktemp("prefs") / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _dpo(base: Path, prefs: Path, out: Path, budget: int, *extra: str) -> int:
    return main(["train", "--init-from", str(base), "--data", str(prefs), "--out", str(out), *COMMON,
                 "--set", f"train.budget={budget}", *extra])


def _files(run: Path) -> dict[str, bytes]:
    return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def two_runs(chat_world, make_base, prefs, tmp_path_factory) -> dict:
    """Two 2-step DPO runs on the same pairs from two bases with other weights."""
    root = tmp_path_factory.mktemp("dpo")
    bases = [make_base(root / f"base{seed}", seed=seed) for seed in (0, 1)]
    for i, base in enumerate(bases):
        assert _dpo(base, prefs, root / f"run{i}", 2) == 0
    return {"bases": bases, "runs": [root / "run0", root / "run1"]}


def _refused(capsys, run: Path, argv_run: tuple, match: str) -> None:
    before = _files(run)
    capsys.readouterr()
    assert _dpo(*argv_run, 4, "--resume") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err
    assert _files(run) == before


def test_resume_with_another_init_from_is_refused(two_runs, prefs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(two_runs["runs"][0], run)
    _refused(capsys, run, (two_runs["bases"][1], prefs, run),
             f"its reference log-probs were scored by the weights of {two_runs['bases'][0]}, and --init-from "
             f"{two_runs['bases'][1]} holds other weights")


def test_a_reference_file_scored_by_another_model_is_refused(two_runs, prefs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(two_runs["runs"][0], run)
    shutil.copy2(two_runs["runs"][1] / REFERENCE_FILE, run / REFERENCE_FILE)       # the other base's scores
    _refused(capsys, run, (two_runs["bases"][0], prefs, run), "were scored by the weights of")


def test_edited_reference_values_are_refused(two_runs, prefs, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import save_file

    run = tmp_path / "run"
    shutil.copytree(two_runs["runs"][0], run)
    with safe_open(str(run / REFERENCE_FILE), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["chosen"] = tensors["chosen"] + 3.0                                     # metadata kept as it was
    save_file(tensors, str(run / REFERENCE_FILE), metadata=meta)
    _refused(capsys, run, (two_runs["bases"][0], prefs, run), "does not hold the values it was written with")


def test_the_runs_own_reference_resumes(two_runs, prefs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(two_runs["runs"][0], run)
    assert _dpo(two_runs["bases"][0], prefs, run, 4, "--resume") == 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert max(steps) == 4 and torch.isfinite(torch.tensor(steps, dtype=torch.float)).all()
