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
