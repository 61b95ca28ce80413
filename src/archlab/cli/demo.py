"""`archlab demo`: fetch Shakespeare, train a tokenizer and a small LLaMA-style model (or, with --arch encoder,
a BERT-style masked LM; with --arch encoder_decoder, a T5-style model on span corruption), report."""
from __future__ import annotations

import argparse
import contextlib
import math

EXAMPLE = """example:
  archlab demo                      # ~3-4 minutes on 2 CPU cores; run folder ./runs/demo
  archlab demo --minutes 1 --out runs/demo-short
  archlab demo --arch encoder       # a BERT-style masked LM, ~4 minutes; run folder ./runs/demo-encoder
  archlab demo --arch encoder_decoder   # a T5-style model on span corruption; ./runs/demo-encoder_decoder
  archlab demo --post-training      # pretraining, SFT, DPO and GRPO of a tiny model; ./runs/demo-post-training
  archlab demo --post-training --seed 1 --out runs/demo-post-training-1   # another init and data order
  archlab demo --real-model         # SmolLM2-135M-Instruct: convert, chat, diagnose, int8, GGUF; ./runs/demo-real-model
  archlab demo --quick              # seconds: a smoke test of every stage"""


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="the whole pipeline on Shakespeare in a few minutes",
                              description="Fetch the Shakespeare corpus, train a BPE tokenizer, prepare "
                              "data, train a small LLaMA-style model and show perplexity and a sample; with "
                              "--arch encoder train a BERT-style masked LM and show its MLM loss and accuracy "
                              "and a fill-mask example; with --arch encoder_decoder train a T5-style model on "
                              "span corruption and show a held-out line's spans filled in.",
                              epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=("decoder", "encoder", "encoder_decoder"), default="decoder",
                   help="decoder: next-token LM (default); encoder: masked LM (BERT); encoder_decoder: span "
                   "corruption (T5)")
    p.add_argument("--out", default=None,
                   help="run folder (default: runs/demo, runs/demo-encoder, runs/demo-encoder_decoder, "
                   "runs/demo-post-training; replaced each time), or with --real-model the demo folder (default "
                   "runs/demo-real-model; an existing, non-empty one needs --overwrite)")
    p.add_argument("--minutes", type=float, default=2.5, help="training time (default 2.5)")
    p.add_argument("--quick", action="store_true", help="tiny model, a dozen steps (seconds)")
    p.add_argument("--corpus", default="shakespeare", help="a built-in corpus name or a path")
    p.add_argument("--prompt", default=None,
                   help="prompt of the final sample (default 'ROMEO:'); with --arch encoder the fill-mask line, "
                   "holding [MASK]")
    p.add_argument("--post-training", action="store_true",
                   help="the post-training stages instead: pretrain a tiny model on a generated task, instruction-"
                   "tune it on chat examples (SFT), preference-tune it (DPO) and, from the SFT model, RL with a "
                   "verifiable reward (GRPO); held-out exact match and pass@1/pass@8 before/after")
    p.add_argument("--seed", type=int, default=None,
                   help="with --post-training: the model's init and the stages' data order (default 0); the "
                   "figures vary with it, as with the CPU")
    p.add_argument("--real-model", action="store_true",
                   help="a real pretrained model instead (the models extra): convert SmolLM2-135M-Instruct from "
                   "GGUF, chat with it, show its massive activation and sink, quantize to int8, export to GGUF")
    p.add_argument("--overwrite", action="store_true",
                   help="with --real-model: replace an existing, non-empty --out folder")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args) -> int:
    from archlab.config import ConfigError
    from archlab.demo.run import MASK_TOKEN, run_demo

    if args.real_model:
        return _real_model(args)
    if args.overwrite:
        raise ConfigError("--overwrite applies to --real-model (the other demos replace their own earlier folder)")
    if args.post_training:
        return _post_training(args)
    if args.seed is not None:
        raise ConfigError("--seed applies to --post-training (the other demos train with the config's seed 0)")
    if not 0 < args.minutes < math.inf:
        raise ConfigError(f"--minutes {args.minutes} must be a positive number")
    if args.arch == "encoder" and args.prompt is not None and MASK_TOKEN not in args.prompt:
        raise ConfigError(f"--prompt {args.prompt!r} holds no {MASK_TOKEN}: the encoder demo fills in its mask tokens")
    out = args.out or ("runs/demo" if args.arch == "decoder" else f"runs/demo-{args.arch}")
    run_demo(out, quick=args.quick, minutes=args.minutes, corpus=args.corpus, prompt=args.prompt,
             progress=not args.no_progress, arch=args.arch)
    return 0


def _post_training(args) -> int:
    from archlab.config import ConfigError, check_seed
    from archlab.demo.post_training import run_post_training_demo

    defaults = (("--arch", args.arch, "decoder"), ("--minutes", args.minutes, 2.5),
                ("--corpus", args.corpus, "shakespeare"), ("--prompt", args.prompt, None))
    given = [flag for flag, value, default in defaults if value != default]
    if given:
        raise ConfigError(f"--post-training generates its own task and sizes: drop {', '.join(given)}")
    seed = 0 if args.seed is None else args.seed
    check_seed("--seed", seed)
    run_post_training_demo(args.out or "runs/demo-post-training", quick=args.quick, seed=seed,
                           progress=not args.no_progress)
    return 0


def _real_model(args) -> int:
    from archlab.config import ConfigError
    from archlab.demo.real_model import run_real_model_demo
    from archlab.progress import quiet

    defaults = (("--arch", args.arch, "decoder"), ("--minutes", args.minutes, 2.5), ("--quick", args.quick, False),
                ("--corpus", args.corpus, "shakespeare"), ("--prompt", args.prompt, None),
                ("--post-training", args.post_training, False), ("--seed", args.seed, None))
    given = [flag for flag, value, default in defaults if value != default]
    if given:
        raise ConfigError(f"--real-model trains nothing and asks its own questions: drop {', '.join(given)}")
    with contextlib.nullcontext() if not args.no_progress else quiet():
        run_real_model_demo(args.out or "runs/demo-real-model", overwrite=args.overwrite)
    return 0
