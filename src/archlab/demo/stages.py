"""The stages every `archlab demo` shares: a run folder it may replace, the corpus, a tokenizer and token data
(stages 1-3), the training and reloading of stages 4-5, and the closing lines."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from archlab.training.trainer import TrainConfig

MARKER = ".archlab-demo"   # only a folder carrying it is ever cleared by a new demo


def _check_out(out: Path, corpus: str | None = None) -> None:
    """A demo replaces only an earlier demo's folder, never its corpus or a folder a live process writes."""
    from archlab.data.prepare import input_paths
    from archlab.runs.outputs import check_output

    check_output(out, inputs=input_paths(corpus, None), overwrite=True)     # an earlier demo's folder: replaced
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        raise FileExistsError(f"{out} exists and is not an earlier demo run; pass another --out")


def _prepare_out(out: Path, corpus: str | None = None) -> None:
    _check_out(out, corpus)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by `archlab demo`; a new demo replaces this folder\n")


def prepare_demo_data(out: Path, corpus: str, *, quick: bool, vocab_size: int, specials: list[str],
                        progress: bool, log) -> dict:
    """Stages 1-3: corpus, tokenizer, token files under out/data; the prepared data's meta."""
    import archlab.tokenizer as tokenizers
    from archlab.data import corpora
    from archlab.data.prepare import prepare

    _check_out(out, corpus)                      # every check before the folder is touched
    files = corpora.corpus_files(corpus)
    _prepare_out(out, corpus)

    log(f"[1/5] corpus {corpus!r} (downloaded once, then cached under {corpora.cache_dir()})")
    if quick:
        files = files[:2]
    size = sum(f.stat().st_size for f in files)
    log(f"      {len(files)} files, {size / 1e6:.1f} MB")

    extra = f" (specials {', '.join(specials)})" if len(specials) > 1 else ""
    log(f"[2/5] training a byte-level BPE tokenizer, vocab {vocab_size}{extra}")
    tok = tokenizers.train(files if len(files) > 1 else files[0], vocab_size, specials, num_workers=2)

    log("[3/5] tokenizing into train/val token files")
    data_dir = out / "data"
    corpus_arg = files[0] if len(files) == 1 else corpus
    if quick:  # only the chosen files: a small corpus of plain strings
        docs = [corpora.read_text(f) for f in files]
        meta = prepare(docs, tok, data_dir, num_workers=0, progress=progress, corpus_name=corpus)
    else:
        meta = prepare(corpus_arg, tok, data_dir, num_workers=2, progress=progress)
    splits = meta["splits"]
    log(f"      train {splits['train']['tokens']:,} tokens, val {splits['val']['tokens']:,} tokens "
        f"({splits['train']['bytes'] / max(1, splits['train']['tokens']):.2f} bytes/token)")
    return meta


def budget_text(train_cfg: TrainConfig) -> str:
    return (f"{train_cfg.budget:g} minutes" if train_cfg.budget_unit == "minutes"
            else f"{train_cfg.budget:g} {train_cfg.budget_unit}")


def train_and_reload(model_cfg: Any, train_cfg: TrainConfig, data_dir: Path, out: Path, *, what: str, before: str,
                     progress: bool, log) -> tuple[Any, Any, Any]:
    """Stage 4 and the start of 5: name what trains (`what`, e.g. "a LLaMA-style model (...)") for how long at
    which precision and its validation figure `before`, train into `out`, then load the run back:
    (TrainResult, model, tokenizer). Example: result, model, tok = train_and_reload(m, t, out / "data", out,
    what="a small model", before="loss before: 7.6", progress=False, log=print)"""
    import torch

    from archlab.runs.model_folder import load_run
    from archlab.training.precision import resolve_dtype
    from archlab.training.trainer import train

    log(f"[4/5] training {what} for {budget_text(train_cfg)}, "
        f"{resolve_dtype(train_cfg.dtype, torch.device(train_cfg.device))}")
    log(f"      {before}")
    result = train(model_cfg, train_cfg, data_dir, out, progress=progress)
    log("[5/5] results")
    model, tokenizer = load_run(out)
    return result, model, tokenizer


def busy_machine(result: Any, progress: bool, log) -> None:
    """Under the throughput line: other processes' share of the CPU while the model trained, when it was large
    enough to cost steps (the trainer says so itself when it shows progress). Example: busy_machine(result, False,
    print)"""
    from archlab.training.throughput import busy_note

    note = None if progress else busy_note(result.cpu_others_share, "the model trained")
    if note:
        log(f"      note: {note}")


def sign_off(out: Path, seconds: float, next_command: str, log) -> None:
    """The closing lines: where the run folder is and what it holds, the time in all, the command to try next.
    Example: sign_off(Path("runs/demo"), 158.0, "archlab eval runs/demo", print)"""
    log(f"run folder: {out.resolve()}  (loss_curve.png, metrics.jsonl, samples.txt, checkpoints/); "
        f"{seconds:.0f} s in all")
    log(f"next: {next_command}")
    sys.stdout.flush()
