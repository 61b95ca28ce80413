"""Plain helpers of the fine-tuning tests (the fixtures are in conftest.py): fast `archlab finetune` arguments."""
from __future__ import annotations

from pathlib import Path

WORDS = ["cat", "dog", "bird", "fish", "tree", "rock", "star", "moon"]
VOCAB = 302          # the BPE's 300 + ChatML's two special tokens


def finetune_argv(base: Path, data: Path, out: Path, *extra: str, budget: int = 3, seq_len: int | None = 32
                  ) -> list[str]:
    """`archlab finetune` arguments for a fast CPU run (no eval, no samples, no memory check); seq_len None: not
    given (the command's default)."""
    rows = ["--set", f"train.seq_len={seq_len}"] if seq_len is not None else []
    return ["finetune", str(base), "--data", str(data), "--out", str(out), "--no-progress",
            "--set", f"train.budget={budget}", *rows, "--set", "train.batch_size=4",
            "--set", "train.lr=1e-2", "--set", "train.eval_every=0", "--set", "train.sample_every=-1",
            "--set", "train.memory_check=false", *extra]


COUNT_CALLS = ("    import os\n    with open(os.environ['REWARD_CALLS'], 'a') as f:\n"
               "        f.write(os.environ.get('RANK', '0') + ' ' + str(len(completions)) + chr(10))\n")
"""Lines a reward function's body can start with: each call appends `RANK n_completions` to $REWARD_CALLS."""


def reward_calls(path: Path) -> dict[int, list[int]]:
    """rank -> the completions a COUNT_CALLS reward scored per call, sorted (the 2-row probe before a run left out)."""
    calls: dict[int, list[int]] = {}
    for line in path.read_text().splitlines():
        rank, n = map(int, line.split())
        if n != 2:
            calls.setdefault(rank, []).append(n)
    return {rank: sorted(n) for rank, n in calls.items()}


def single_and_two_processes(args: list[str], tmp_path: Path, monkeypatch) -> dict[str, dict[int, list[int]]]:
    """`archlab *args` once in this process (--out tmp_path/single) and under torchrun with 2 CPU processes, gloo and
    DDP (--out tmp_path/ddp); each must succeed. Returns the reward calls each made ({"single": ..., "ddp": ...})."""
    import os
    import subprocess
    import sys

    from archlab.cli import main

    monkeypatch.setenv("REWARD_CALLS", str(tmp_path / "single_calls.txt"))
    assert main([*args, "--out", str(tmp_path / "single")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "REWARD_CALLS": str(tmp_path / "ddp_calls.txt")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "archlab", *args, "--out", str(tmp_path / "ddp"), "--set", "dist.strategy=ddp"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: reward_calls(tmp_path / f"{name}_calls.txt") if (tmp_path / f"{name}_calls.txt").exists() else {}
            for name in ("single", "ddp")}


def assert_runs_agree(single: Path, ddp: Path, keys, weights_atol: float = 1e-5) -> None:
    """The two run folders logged `keys` at the same steps with the same values (rel 1e-4), and their final weights
    agree (rel 1e-4, atol `weights_atol`)."""
    import pytest
    import torch

    from archlab.runs.checkpoint import latest_checkpoint, load_checkpoint
    from archlab.training.metrics import read_metrics

    theirs_rows, ours_rows = read_metrics(single / "metrics.jsonl"), read_metrics(ddp / "metrics.jsonl")
    for key in keys:
        ours = [(r["step"], r[key]) for r in ours_rows if key in r]
        reference = [(r["step"], r[key]) for r in theirs_rows if key in r]
        assert [s for s, _ in ours] == [s for s, _ in reference] and ours, key
        assert [v for _, v in ours] == pytest.approx([v for _, v in reference], rel=1e-4, abs=1e-5), key
    ours_w, theirs_w = (load_checkpoint(latest_checkpoint(run))[0] for run in (ddp, single))
    assert ours_w.keys() == theirs_w.keys()
    for name, value in theirs_w.items():
        torch.testing.assert_close(ours_w[name], value, rtol=1e-4, atol=weights_atol, msg=name)
