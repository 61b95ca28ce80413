"""`archlab train` and `archlab eval`."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from archlab.cli.sets import parse_sets

TRAIN_EXAMPLE = """example:
  archlab train --preset tiny:llama2-7b --data data/shakespeare --out runs/exp1 \\
      --set n_layers=4 --set train.lr=1e-3 --set train.budget=5 --set train.budget_unit=minutes
  torchrun --nproc_per_node=2 -m archlab.cli train --config runs/exp1/config.yaml --data ... --out ...
  archlab convert --from-hf ~/models/Qwen2.5-0.5B --out runs/qwen
  archlab data prepare --corpus my_docs/ --tokenizer runs/qwen/tokenizer --out data/mine
  archlab train --init-from runs/qwen --data data/mine --out runs/qwen-mine --set train.lr=3e-5
  archlab train --init-from runs/qwen-sft --data prefs.jsonl --out runs/qwen-dpo --set train.method=dpo \\
      --set train.dpo.beta=0.1 --set train.lr=5e-6          # preference tuning (DPO / IPO / SimPO)
  (model keys as ModelConfig.with_overrides, train keys prefixed `train.`; --resume continues a run;
  --init-from starts a new run from another model's weights: fresh optimizer and schedule, its model config)"""

PERPLEXITY_DEFINITION = """\
perplexity = exp(mean next-token cross-entropy, in nats) over the predicted tokens of non-overlapping
windows of --seq-len tokens taken in order from the split (each token sees only its window's earlier
tokens); bits/byte = total nats / ln 2 / the bytes those tokens decode to. `archlab demo` and train's
validation lines use the same windows, but only train.eval.batches batches of them, spread evenly over
the split when it holds more; `eval` uses the whole split unless --batches (spread the same way): so
figures on the same model differ by that sample. A fine-tune's data (archlab finetune) is scored as its
training scored it: chat examples on their answer tokens (no bits/byte), source/target pairs on the targets."""

EVAL_EXAMPLE = """example:
  archlab eval runs/exp1                       # validation loss / perplexity / bits per byte
  archlab eval runs/exp1 --tasks my_task --include-path tasks/ --limit 100   # lm-evaluation-harness
  archlab eval runs/exp1 --data data/other --batches 50"""


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a model on a prepared data folder",
                              description="Train a model; writes a self-describing run folder.",
                              epilog=TRAIN_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", help="model preset name (archlab presets); `tiny:NAME` for a test-sized one")
    p.add_argument("--config", help="YAML with `model` and/or `train` sections (e.g. a run's config.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override: model key (norm.kind=layernorm) or train key (train.lr=1e-3)")
    p.add_argument("--data", required=True, help="prepared data folder (archlab data prepare); with "
                   "--set train.method=dpo and --init-from, a .jsonl of prompt / chosen / rejected lines")
    p.add_argument("--out", required=True, help="run folder to write")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --out that verifies (sha256)")
    p.add_argument("--init-from", metavar="RUN_OR_HF_FOLDER_OR_HUB_ID",
                   help="start from these weights (a run folder's newest checkpoint, an HF folder, or hf:ORG/NAME): "
                   "its model config (--set may change what keeps the weights' shapes), a fresh optimizer and "
                   "schedule; --data must use its tokenizer")
    p.add_argument("--allow-new-data", action="store_true",
                   help="with --resume: continue on a --data other than the run's (refused by default)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar: plain log lines instead (the plan, a resume notice, a loss line at most "
                   "every 30 s)")
    p.set_defaults(func=run_train)

    from archlab.cli import eval_context

    e = subparsers.add_parser("eval", help="evaluate a run's latest checkpoint",
                              description="Validation loss, perplexity and bits per byte of a run.\n\n"
                              + PERPLEXITY_DEFINITION,
                              epilog=EVAL_EXAMPLE + eval_context.CONTEXT_EXAMPLE,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("run_dir", help="a run folder (archlab train --out, or archlab convert --from-hf --out)")
    e.add_argument("--data", help="data folder (default: the one in the run's config.yaml)")
    e.add_argument("--split", default="val", choices=["train", "val"], help="which split (default val)")
    e.add_argument("--batches", type=int, default=None, help="max batches (default: the whole split)")
    e.add_argument("--batch-size", type=int, default=None, help="windows per batch (default: the run's)")
    e.add_argument("--seq-len", type=int, default=None,
                   help="tokens per window (default: the run's training length; a converted run: max_seq_len)")
    e.add_argument("--checkpoint", help="a checkpoint folder (default: the latest)")
    e.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run (default auto)")
    e.add_argument("--json", action="store_true", help="print the result as one JSON object")
    e.add_argument("--tasks", default=None, metavar="NAME[,NAME...]",
                   help="lm-evaluation-harness tasks instead of the split's perplexity (the eval extra); "
                   "RUN may then also be an HF folder or an hf: id")
    e.add_argument("--include-path", default=None, metavar="DIR", help="with --tasks: a folder of task YAMLs")
    e.add_argument("--limit", type=int, default=None, metavar="N", help="with --tasks: at most N examples per task")
    e.add_argument("--num-fewshot", type=int, default=None, metavar="K", help="with --tasks: K-shot prompts")
    eval_context.add_arguments(e)
    e.set_defaults(func=run_eval)


def resolve_preset(name: str):
    """A ModelConfig from a preset name: `NAME`, or `tiny:NAME` / `tiny-NAME` for archlab.presets.tiny."""
    from archlab.models import presets

    for prefix in ("tiny:", "tiny-", "tiny/"):
        if name.startswith(prefix):
            return presets.tiny(name[len(prefix):])
    return presets.get(name)       # an unknown name: ConfigError naming it, the closest and the known ones


def build_configs(args, base_model=None):
    """(ModelConfig, TrainConfig) from --preset / --config / --set; `base_model` (the --init-from source's
    config) stands for the preset and keeps its vocabulary."""
    import yaml

    from archlab.config import ConfigError, ModelConfig
    from archlab.training.config import refuse_other_methods_sections
    from archlab.training.trainer import TrainConfig, fit_vocab

    file_data = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise ConfigError(f"--config {path}: no such file")
        try:
            file_data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config {path} is not valid YAML ({' '.join(str(exc).split())})") from exc
        if not isinstance(file_data, dict):
            raise ConfigError(f"--config {path} must hold a mapping with `model` / `train` sections")
    model_over, train_over = parse_sets(args.set)
    if base_model is not None:
        if args.preset or "model" in file_data:
            raise ConfigError("--init-from gives the model: drop --preset and the `model` section of --config "
                              "(--set may still change what keeps the weights' shapes)")
        model_cfg = base_model
    elif "model" in file_data:
        if args.preset:
            raise ConfigError("both --preset and a `model` section in --config: give one")
        model_cfg = ModelConfig.from_dict(file_data["model"])
    elif args.preset:
        model_cfg = resolve_preset(args.preset)
    else:
        raise ConfigError("no model: pass --preset NAME or --config FILE with a `model` section")
    if "vocab_size" not in model_over and "model" not in file_data and base_model is None:
        model_cfg = fit_vocab(model_cfg, args.data)   # a preset's vocab -> the data's tokenizer
    if model_over:
        model_cfg = model_cfg.with_overrides(model_over)
    if base_model is not None:              # a new rope_scaling on an --init-from model: a context extension
        from archlab.training.init_from import extended_config
        model_cfg, note = extended_config(base_model, model_cfg, model_over)
        if note:
            print(f"note: {note}", file=sys.stderr)
    train_cfg = TrainConfig.from_dict(file_data["train"]) if "train" in file_data else TrainConfig()
    if train_over:
        train_cfg = train_cfg.with_overrides(train_over)
        # the method is known once merged; --set only: a --config may be a run's config.yaml, every section in it
        refuse_other_methods_sections(train_over, train_cfg.method, option="train.method={}")
    return model_cfg, train_cfg


def run_train(args) -> int:
    from archlab.training.trainer import Diverged, train

    init_from = None
    if not args.init_from and Path(args.data).is_file():
        from archlab.data.formats import FORMATS, detect
        from archlab.errors import UserError
        from archlab.training.methods import METHODS

        held = detect(args.data).format
        readers = [name for name in METHODS.names() if held in METHODS.get(name).data_formats]
        raise UserError(f"--data {args.data} is a file of {FORMATS.get(held).summary}: a .jsonl trains a model given "
                        f"by --init-from BASE (archlab finetune BASE --method {'|'.join(readers)})")
    if args.init_from:
        from archlab.training.init_from import read_init_source
        init_from = read_init_source(args.init_from)
    model_cfg, train_cfg = build_configs(args, init_from.model_config if init_from is not None else None)
    try:
        result = train(model_cfg, train_cfg, args.data, args.out, resume=args.resume,
                       progress="lines" if args.no_progress else True, allow_new_data=args.allow_new_data,
                       init_from=init_from)
    except Diverged as exc:
        print(f"archlab train: error: {exc}", file=sys.stderr)
        return 3
    except FileExistsError as exc:
        from archlab.errors import UserError
        raise UserError(str(exc)) from exc
    import os
    if int(os.environ.get("RANK", "0")) == 0:
        val = f"{result.final_val_loss:.4f}" if result.final_val_loss is not None else "n/a"
        from archlab.units import human_bytes
        print(f"done: {result.steps} steps, {result.tokens_seen:,} tokens, val loss {val}, "
              f"{result.tokens_per_s:,.0f} tokens/s, peak memory {human_bytes(result.peak_memory_bytes)}"
              f"{' (process RSS)' if result.device == 'cpu' else ''}; "
              f"run folder {result.run_dir}"
              + (f" (started from the weights of {args.init_from})" if init_from is not None else ""))
    return 0


def run_tasks(args) -> int:
    """`archlab eval RUN --tasks ...`: the harness's table (or its results as JSON)."""
    from archlab.errors import UserError, is_network_error, one_line
    from archlab.runs.model_folder import load_model_and_tokenizer

    for flag, value in (("--limit", args.limit), ("--num-fewshot", args.num_fewshot)):
        if value is not None and value < (1 if flag == "--limit" else 0):
            raise UserError(f"{flag} {value} is out of range")
    try:
        from lm_eval.utils import make_table

        from archlab.eval.lmeval import run_tasks as run
    except ImportError:
        raise UserError("--tasks needs lm-evaluation-harness: pip install 'archlab[eval]'") from None
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    model, tokenizer = load_model_and_tokenizer(args.run_dir, "cuda" if args.device == "cuda" else "cpu",
                                                purpose="eval --tasks")
    try:
        results = run(model, tokenizer, tasks, include_path=args.include_path, limit=args.limit,
                      num_fewshot=args.num_fewshot, batch_size=args.batch_size or 8)
    except KeyError as exc:                  # the harness's "task not found"
        raise UserError(f"--tasks: {exc}") from exc
    except Exception as exc:                 # datasets' ConnectionError, raised as the harness loads a task
        if not is_network_error(exc):
            raise
        raise UserError(f"--tasks {','.join(tasks)}: the task's dataset needs the network: {one_line(exc)} "
                        "(connect, or set HF_DATASETS_OFFLINE=1 with the dataset in the local Hugging Face "
                        "cache, or give a local task with --include-path)") from exc
    if args.json:
        print(json.dumps(results["results"], default=str))
    else:
        print(make_table(results))
    return 0


def run_eval(args) -> int:
    import torch

    from archlab.cli import eval_context
    from archlab.data.batches import open_splits
    from archlab.data.tokens import TokenDataset
    from archlab.errors import DataError, UserError
    from archlab.eval.evaluate import evaluate
    from archlab.runs.model_folder import load_run, read_run_config

    for flag, value in (("--batches", args.batches), ("--batch-size", args.batch_size), ("--seq-len", args.seq_len)):
        if value is not None and value < 1:
            raise UserError(f"{flag} {value} must be at least 1")
    if args.tasks:
        return run_tasks(args)
    cfg = read_run_config(args.run_dir)
    data_dir = args.data or (cfg.get("data") or {}).get("dir")
    if not data_dir:
        raise DataError(f"{args.run_dir}/config.yaml names no data folder; pass --data")
    from archlab.runs.train_section import upgrade_train_section

    if not args.data and upgrade_train_section(cfg.get("train") or {}).get("method") == "dpo":
        run = Path(args.run_dir)
        raise UserError(f"{run} is a DPO run: its data {data_dir} holds preference pairs, and archlab eval "
                        "scores next-token loss on a prepared data folder: pass --data DIR (`archlab data prepare "
                        f"--corpus TEXT --tokenizer {run / 'tokenizer'} --out DIR`); its held-out pairs' figures "
                        f"(val_loss, val_rewards/accuracies) are in {run / 'metrics.jsonl'}")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    # a token stream (windows), or a fine-tune's examples: chat examples scored on their answers, source/target pairs
    dataset = dict(zip(("train", "val"), open_splits(data_dir)))[args.split]
    windows = isinstance(dataset, TokenDataset)
    model, _ = load_run(args.run_dir, checkpoint=args.checkpoint, device=device)
    if args.set:
        model = eval_context.with_overrides(model, args.set, device)
    train_cfg = cfg.get("train") or {}
    if model.config.vocab_size < dataset.vocab_size:
        raise DataError(f"{data_dir} has vocab_size={dataset.vocab_size}, the model "
                        f"{model.config.vocab_size}: a different tokenizer?")
    seq_len = args.seq_len or train_cfg.get("seq_len") or model.config.max_seq_len
    if model.config.position.kind == "learned" and seq_len > model.config.max_seq_len:
        raise UserError(f"--seq-len {seq_len} is past the model's max_seq_len={model.config.max_seq_len}")
    if windows and dataset.n_tokens == 0 and args.split == "val":
        raise DataError(f"the val split of {data_dir} is empty (data prepare holds out whole documents, and a single "
                        "text file is one): prepare a folder of files or a .jsonl of documents, or pass --split train")
    if windows and dataset.n_tokens < seq_len + 1:
        raise DataError(f"the {args.split} split of {data_dir} has {dataset.n_tokens} tokens, fewer than one "
                        f"window of --seq-len {seq_len} + 1: nothing to evaluate")
    if not windows and len(dataset) == 0:
        raise DataError(f"the {args.split} split of {data_dir} holds no examples: nothing to evaluate")
    batch_size = args.batch_size or train_cfg.get("batch_size", 16)
    if eval_context.wanted(args):
        if not windows or model.config.arch != "decoder":
            raise UserError("--stride / --by-position / --lengths / --passkey score a decoder on a token stream "
                            f"(archlab data prepare); {data_dir} holds a fine-tune's examples or the model is "
                            f"an {model.config.arch}")
        return eval_context.run(args, model, dataset, seq_len=seq_len, batch_size=batch_size, device=device,
                                dtype=train_cfg.get("dtype", "float32"))
    result = evaluate(model, dataset, batch_size=batch_size,
                      seq_len=seq_len, max_batches=args.batches, device=device,
                      dtype=train_cfg.get("dtype", "float32"), progress=True)
    if args.json:
        print(json.dumps({**result.to_dict(), "seq_len": seq_len}))
    else:
        bpb = f", {result.bpb:.4f} bits/byte" if math.isfinite(result.bpb) else ""
        where = f"in windows of {seq_len}" if windows else f"scored in {len(dataset):,} examples"
        print(f"{args.split}: loss {result.loss:.4f} nats, perplexity {result.ppl:.2f}{bpb} over {result.tokens:,} "
              f"tokens {where}")
    return 0
