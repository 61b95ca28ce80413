"""Pretrain one norm_transfer base at given settings and print its pretraining loss and held-out exact match.

    python docs/lab_report/norm_transfer/probe_pretraining.py post 1e-3 50 600 [--embedding-norm] [--layernorm]

The base is the suite's (archlab.lab.finetune.ensure_base: the post-training demo's 2-layer decoder on plain
'reverse abcde' / 'edcba' documents), built in /tmp/norm_probe/<settings>, on one thread. DATA: the suite's prepared
data folder (sweeps/norm_transfer/data after `archlab ablate norm_transfer`)."""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from archlab.demo.post_training import post_training_configs
from archlab.lab.finetune import ensure_base
from archlab.lab.plan import BaseSpec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("position", choices=["pre", "post"])
    p.add_argument("lr", type=float)
    p.add_argument("warmup", type=int)
    p.add_argument("steps", type=int)
    p.add_argument("--embedding-norm", action="store_true", help="a norm on the embeddings (BERT's)")
    p.add_argument("--layernorm", action="store_true", help="LayerNorm instead of RMSNorm")
    p.add_argument("--data", default="sweeps/norm_transfer/data")
    args = p.parse_args()
    torch.set_num_threads(1)
    demo = post_training_configs(quick=False)
    overrides = {"norm.position": args.position, "seed": 0, "norm.embedding_norm": args.embedding_norm,
                 **({"norm.kind": "layernorm"} if args.layernorm else {})}
    model = demo["model"].with_overrides(overrides)
    train = dataclasses.replace(demo["base"], lr=args.lr, warmup_steps=args.warmup, budget=float(args.steps), seed=0)
    name = "-".join(f"{k}={v}" for k, v in sorted(vars(args).items()) if k != "data")
    _, record = ensure_base(BaseSpec(model, train, Path("/tmp/norm_probe") / name, 200), Path(args.data))
    print(json.dumps({**{k: v for k, v in vars(args).items() if k != "data"},
                      "pretraining_val_loss": round(record["final_val_loss"], 4),
                      "exact_match_plain": record["exact_plain"], "seconds": round(record["seconds"])}))


if __name__ == "__main__":
    main()
