"""`archlab finetune` on CPU, packed against padded: real tokens per second and the share of slots that hold them.

    PYTHONPATH=src .venv/bin/python benchmarks/finetune.py [--examples 400] [--steps 30] [--seq 256] [--batch 8]

A synthetic instruction task (reverse a list of words, lengths drawn log-normally so that many examples are
short and a few long) in ChatML, a BPE tokenizer trained on it, an untrained decoder (d 128, 4 layers) saved as
the base run; then two fine-tunes of --steps optimizer steps through archlab.training.finetune, the same
examples and settings but train.sft.packing: packed rows of --seq tokens with document ids, or one example per row
padded to the batch's longest. Printed: each run's real tokens per second (the trainer's count: padding
excluded), the real-token share of the slots over an epoch (archlab.data.sft.real_token_share), and the ratio.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
from pathlib import Path

import torch
import yaml

from archlab.config import ModelConfig
from archlab.data.sft import SFTDataset, real_token_share
from archlab.models import build_model
from archlab.runs.checkpoint import save_checkpoint
from archlab.runs.provenance import provenance_line
from archlab.tokenizer import train as train_bpe
from archlab.tokenizer.chat_builtin import install_chat_template
from archlab.training.config import SFTConfig, TrainConfig
from archlab.training.finetune import finetune

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = max(1, min(60, round(math.exp(rng.gauss(math.log(6), 0.9)))))
        words = [rng.choice(WORDS) for _ in range(k)]
        out.append({"messages": [{"role": "user", "content": "Reverse: " + " ".join(words)},
                                 {"role": "assistant", "content": " ".join(reversed(words))}]})
    return out


def base_run(root: Path, records: list[dict]) -> Path:
    text = "\n".join(m["content"] for r in records for m in r["messages"])
    (root / "corpus.txt").write_text(text * 2)
    tok = train_bpe(root / "corpus.txt", 512, ["<|endoftext|>"])
    tok.save(root / "tok")
    new = install_chat_template(root / "tok", "chatml")
    cfg = ModelConfig(vocab_size=512 + len(new), d_model=128, n_layers=4, max_seq_len=1024, attention={"n_heads": 4})
    base = root / "base"
    base.mkdir()
    (base / "config.yaml").write_text(yaml.safe_dump({"model": cfg.to_dict()}))
    torch.manual_seed(0)
    save_checkpoint(base / "checkpoints", 1, build_model(cfg).state_dict(), {})
    import shutil
    shutil.copytree(root / "tok", base / "tokenizer")
    return base


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=400)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    print(provenance_line("cpu", dtype="float32"))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        records = rows(args.examples)
        data = root / "sft.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
        base = base_run(root, records)
        results = {}
        for packing in (True, False):
            cfg = TrainConfig(batch_size=args.batch, seq_len=args.seq, budget=args.steps, lr=1e-3, warmup_steps=2,
                              eval_every=0, eval_batches=2, sample_every=-1, device="cpu", dtype="float32",
                              sft=SFTConfig(packing=packing), memory_check=False, checkpoint_every=0)
            out = root / ("packed" if packing else "padded")
            result = finetune(base, data, out, train_cfg=cfg, progress=False)
            share = real_token_share(SFTDataset(out / "data"), args.batch, args.seq, packing)
            results[packing] = result.tokens_per_s
            print(f"{'packed' if packing else 'padded'}: {result.tokens_seen:,} real tokens in {args.steps} steps, "
                  f"{result.tokens_per_s:,.0f} real tokens/s, real-token share of the slots {share:.1%}, "
                  f"val loss {result.final_val_loss:.3f}")
        print(f"packed / padded real tokens/s: {results[True] / results[False]:.2f}x")


if __name__ == "__main__":
    main()
