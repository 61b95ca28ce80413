"""The n-gram line of every suite's report: modified Kneser-Ney of order BASELINE_ORDER on the sweep's data folder,
counted on its train split and scored on every validation token, beside the runs' own validation bits/byte.

Counted once per data folder: the result is kept in SWEEP_DIR/ngram_baseline.json under a key made of the data
folder's meta.json and its token files' sizes and modification times, so a re-prepared folder is counted again.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
from pathlib import Path

__all__ = ["BASELINE_ORDER", "CACHE_FILE", "data_folder", "ngram_bpb", "ngram_line"]

BASELINE_ORDER = 5
CACHE_FILE = "ngram_baseline.json"


def data_folder(recorded: str | None, sweep_dir: Path) -> Path | None:
    """The prepared data folder a sweep recorded (a relative path read from the working directory, else from the
    sweep folder), or SWEEP_DIR/data; None when none of them is prepared."""
    candidates = [Path(recorded), sweep_dir / recorded] if recorded else []
    candidates.append(sweep_dir / "data")
    return next((p for p in candidates if (p / "meta.json").is_file()), None)


def _fingerprint(data: Path, order: int) -> str:
    digest = hashlib.sha256((data / "meta.json").read_bytes())
    for split in sorted(data.glob("*.bin")):
        stat = split.stat()
        digest.update(f"{split.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return f"order{order}:{digest.hexdigest()[:32]}"


def ngram_bpb(data: Path, sweep_dir: Path, order: int = BASELINE_ORDER) -> float:
    """Validation bits/byte of the order-`order` Kneser-Ney model of `data`, from the sweep's cache or counted now
    (and cached; a sweep folder that cannot be written to only loses the cache)."""
    cache_path = sweep_dir / CACHE_FILE
    key = _fingerprint(data, order)
    try:
        cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return float(cache[key]["bpb"])
    from archlab.eval.ngram import evaluate_ngram

    result = evaluate_ngram(data, [order])[0]
    cache[key] = {"data": str(data), "order": order, "bpb": result.bpb, "tokens": result.tokens,
                  "n_bytes": result.n_bytes}
    try:
        tmp = cache_path.with_name(cache_path.name + ".tmp")
        tmp.write_text(json.dumps(cache, indent=1) + "\n")
        os.replace(tmp, cache_path)
    except OSError:
        pass
    return result.bpb


def ngram_line(rows: list, recorded_data: str | None, sweep_dir: Path, order: int = BASELINE_ORDER) -> str:
    """One paragraph: the n-gram's bits/byte and the runs' (final validation loss per token / ln 2 / the
    validation split's bytes per token), best and worst variant."""
    from archlab.data.tokens import TokenDataset
    from archlab.errors import UserError

    data = data_folder(recorded_data, Path(sweep_dir))
    name = f"{order}-gram (modified KN)"
    if data is None:
        return f"**Baseline.** {name}: not computed, the sweep's data folder ({recorded_data or 'none recorded'}) " \
               "is not prepared here."
    try:
        bpb = ngram_bpb(data, Path(sweep_dir), order)
        bytes_per_token = TokenDataset(data, "val").bytes_per_token
    except UserError as exc:                   # e.g. a folder of source/target pairs: no single token stream
        return f"**Baseline.** {name}: not computed ({exc})."
    by_variant: dict[str, list[float]] = {}
    for r in rows:
        if r.status == "done" and r.final_val_loss is not None and math.isfinite(r.final_val_loss):
            by_variant.setdefault(r.variant, []).append(r.final_val_loss / math.log(2) / bytes_per_token)
    text = f"**Baseline.** {name} on the same validation bytes: {bpb:.4f} bits/byte"
    if by_variant:
        means = {v: statistics.fmean(x) for v, x in by_variant.items()}
        best, worst = min(means, key=means.__getitem__), max(means, key=means.__getitem__)
        text += (f"; the runs' final validation loss: best {means[best]:.4f} bits/byte ({best}), worst "
                 f"{means[worst]:.4f} ({worst}), mean over seeds")
    return text + "."
