"""A run's metrics: metrics.jsonl (one JSON object a line, train and eval lines), its TensorBoard
mirror, and loss_curve.png drawn from it."""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

__all__ = ["append_jsonl", "truncate_metrics", "read_metrics", "plot_loss_curve", "TensorBoardLogger"]


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def truncate_metrics(path: Path, step: int) -> None:
    """Keep only lines up to `step`: a killed run may have logged past its last checkpoint."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except ValueError:  # a line cut short by the kill
            continue
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def truncate_samples(path: Path, step: int) -> None:
    """Keep only the samples.txt entries of steps up to `step`, so a resume writes each step's once."""
    if not path.is_file():
        return
    kept, keep = [], True
    for line in path.read_text().splitlines(keepends=True):
        match = _SAMPLE_HEADER.match(line)
        if match:
            keep = int(match.group(1)) <= step
        if keep:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


_SAMPLE_HEADER = re.compile(r"^=== step (\d+) ")


def read_metrics(path: str | os.PathLike) -> list[dict]:
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out


def plot_loss_curve(run_dir: str | os.PathLike) -> Path | None:
    """loss_curve.png: train loss (and validation loss) against tokens seen (matplotlib, Agg)."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    rows = read_metrics(metrics)
    train_rows = [r for r in rows if "loss" in r]
    val_rows = [r for r in rows if "val_loss" in r]
    if not train_rows and not val_rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train_rows:
        ax.plot([r["tokens"] for r in train_rows], [r["loss"] for r in train_rows], lw=1, label="train")
    if val_rows:
        ax.plot([r["tokens"] for r in val_rows], [r["val_loss"] for r in val_rows], "o-", ms=3, label="val")
    ax.set_xlabel("tokens")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = run_dir / "loss_curve.png"
    fig.savefig(out)
    plt.close(fig)
    return out


class TensorBoardLogger:
    """Scalars to RUN_DIR/tb when tensorboard is installed; silently nothing otherwise."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.writer = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.writer = SummaryWriter(str(run_dir / "tb"))
            except Exception:
                self.writer = None

    def log(self, record: dict) -> None:
        if self.writer is None:
            return
        for key, value in record.items():
            if key not in ("step", "tokens") and isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
