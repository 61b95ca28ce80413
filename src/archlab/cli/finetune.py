"""`archlab finetune`: post-training of a trained model with a method (training/methods: sft on chat data, dpo on
preference pairs), full or LoRA."""
from __future__ import annotations

import argparse
import math
import sys

EXAMPLE = """example:
  archlab finetune runs/base --data sft.jsonl --out runs/sft --set train.lr=1e-4 --set train.budget=200
  archlab finetune runs/base --data sft.jsonl --out runs/sft-lora --lora-r 8 --lora-targets all-linear
  archlab finetune runs/base --data sft.jsonl --out runs/sft-lora --lora-r 8 --lora-trainable-tokens template
  archlab finetune runs/gpt2 --data sft.jsonl --out runs/sft-lora --lora-r 8 --lora-modules-to-save wpe
  archlab finetune runs/base --data sft.jsonl --out runs/sft --chat-template chatml --set train.seq_len=512
  archlab finetune runs/t5 --data pairs.jsonl --out runs/t5-sft          # encoder-decoder: prompt -> completion
  archlab finetune runs/sft --method dpo --data prefs.jsonl --out runs/dpo --set train.lr=5e-6 \\
      --set train.dpo.beta=0.1        # preference lines {"prompt", "chosen", "rejected"}; train.dpo.loss=ipo|simpo|orpo
  archlab finetune runs/sft --method dpo --data kto.jsonl --out runs/kto --set train.dpo.loss=kto \\
      --set train.dpo.undesirable_weight=1.33    # KTO: {"prompt", "completion", "label": true|false} lines, or pairs
  archlab finetune runs/sft --method reward --data prefs.jsonl --out runs/rm     # then: archlab score runs/rm ...
  archlab finetune runs/sft --method grpo --data prompts.jsonl --out runs/grpo --reward exact_match \\
      --set train.grpo.num_generations=8 --set train.grpo.max_completion_length=64   # lines {"prompt", "answer"}
  archlab finetune runs/sft --method grpo --data prompts.jsonl --out runs/grpo --reward FILE.py:FUNC \\
      --reward format --set train.grpo.beta=0.04 --set train.grpo.loss_type=grpo     # or --reward runs/rm
  archlab finetune runs/sft --method ppo --data prompts.jsonl --out runs/ppo --reward runs/rm \\
      --set train.ppo.response_length=32 --set train.ppo.kl_coef=0.05    # or --reward FILE.py:FUNC; train.ppo.*
  (lines: {"messages": [{"role", "content"}, ...]} or {"prompt", "completion"}; the loss on train.sft.loss_mask:
  assistant (default), all, last, completion; examples packed into rows of train.seq_len (default 256, or the
  base's context when shorter) with no attention across them, or one per row with --set train.sft.packing=false;
  OUT/data keeps the prepared examples)"""


REWARD_SETTINGS = {"grpo": "train.grpo.rewards", "ppo": "train.ppo.reward"}   # what --reward sets, per method


def register(subparsers) -> None:
    p = subparsers.add_parser("finetune", help="fine-tune a trained model: sft on chat data, dpo on preferences",
                              description="Post-training: start from BASE's weights, train with --method on --data "
                              "and write a run folder. sft (default): the chat examples of --data (decoders: the loss "
                              "on the assistant's tokens; encoder-decoders: prompt -> completion); dpo: preference "
                              "pairs against BASE as the reference (with train.dpo.loss=kto also TRL's unpaired "
                              "prompt/completion/label lines); reward: a scalar head on the same pairs; grpo "
                              "and ppo: prompt lines, completions sampled and scored by --reward (ppo: with a value "
                              "head and BASE as the KL reference).",
                              epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", metavar="BASE", help="a run folder, an HF folder, or hf:ORG/NAME")
    p.add_argument("--method", default="sft", metavar="sft|dpo|reward|grpo|ppo",
                   help="how to train (default sft): sft on chat lines; dpo, or a reward model, on prompt/chosen/"
                   "rejected lines (dpo with --set train.dpo.loss=kto also prompt/completion/label lines); grpo or ppo "
                   "on prompt lines with rewards (training/methods)")
    p.add_argument("--reward", action="append", default=[], metavar="NAME|RUN|FILE.py:FUNC",
                   help="--method grpo (repeatable; train.grpo.rewards): a built-in (exact_match against each line's "
                   "'answer', format: train.grpo.format_regex), a reward run folder, or your own function "
                   "FILE.py:FUNC with TRL's signature (prompts, completions, **columns) -> list[float]; --method ppo: "
                   "one of them (train.ppo.reward), usually a reward run")
    p.add_argument("--data", required=True, help="a .jsonl: chat lines (messages, or prompt/completion) for sft, "
                   "prompt/chosen/rejected lines for dpo and reward (or prompt/completion/label lines for dpo's kto "
                   "loss), {\"prompt\", ...} lines for grpo and ppo")
    p.add_argument("--out", required=True, help="run folder to write")
    p.add_argument("--val", help="validation .jsonl (default: a seeded hash of each --data line picks "
                   "--val-fraction of them)")
    p.add_argument("--val-fraction", type=float, help="share of --data held out (default 0.05; dpo: "
                   "train.dpo.val_fraction)")
    p.add_argument("--chat-template", metavar="chatml|llama3|plain|FILE",
                   help="template to train with instead of the base tokenizer's own; a built-in one adds its "
                   "special tokens (new embedding rows = the mean embedding)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override: train.lr=1e-4, train.sft.loss_mask=last, train.sft.packing=false, "
                   "train.lora.dropout=0.05, attention.dropout=0.1 ...")
    p.add_argument("--lora-r", type=int, help="LoRA rank (train.lora.r): adapters only, the base frozen")
    p.add_argument("--lora-alpha", type=float, help="LoRA alpha (train.lora.alpha, default 16)")
    p.add_argument("--lora-targets", help="LoRA targets (train.lora.targets): q,v (default), all-linear, module "
                   "names, or a regex matched in full against module names as PEFT does ('.*attn[.](q|v)_proj')")
    p.add_argument("--lora-trainable-tokens", metavar="IDS|TOKENS|template",
                   help="input-embedding rows that train beside the adapters (train.lora.trainable_tokens): a comma "
                   "list of token ids or texts, or template (the chat template's special tokens)")
    p.add_argument("--lora-modules-to-save", metavar="MODULES",
                   help="modules that train whole beside the adapters (train.lora.modules_to_save, PEFT's "
                   "modules_to_save): e.g. abs_position (learned positions), final_norm, lm_head")
    p.add_argument("--resume", action="store_true", help="continue the fine-tune in --out from its newest checkpoint")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    p.set_defaults(func=run_finetune)


def _lora_sets(args) -> list[str]:
    from archlab.errors import UserError

    if args.lora_alpha is not None and not math.isfinite(args.lora_alpha):
        raise UserError(f"--lora-alpha {args.lora_alpha} must be a finite number")
    flags = (("lora.r", args.lora_r), ("lora.alpha", args.lora_alpha), ("lora.targets", args.lora_targets),
             ("lora.trainable_tokens", args.lora_trainable_tokens),
             ("lora.modules_to_save", args.lora_modules_to_save))
    return [f"train.{key}={value}" for key, value in flags if value is not None]


def run_finetune(args) -> int:
    from archlab.cli.sets import parse_sets
    from archlab.errors import UserError
    from archlab.training.config import refuse_other_methods_sections
    from archlab.training.finetune import finetune
    from archlab.training.trainer import Diverged, TrainConfig
    from archlab.units import human_bytes

    if args.val_fraction is not None and not math.isfinite(args.val_fraction):
        raise UserError(f"--val-fraction {args.val_fraction} must be in [0, 1)")
    if args.reward and args.method not in REWARD_SETTINGS:
        raise UserError(f"--reward is for --method {' or '.join(REWARD_SETTINGS)}, not --method {args.method}")
    if args.method == "ppo" and len(args.reward) > 1:
        raise UserError(f"--method ppo takes one --reward, got {len(args.reward)}: {', '.join(args.reward)}")
    rewards = [f"{REWARD_SETTINGS[args.method]}={','.join(args.reward)}"] if args.reward else []
    model_over, train_over = parse_sets(args.set + _lora_sets(args) + rewards)
    refuse_other_methods_sections(train_over, args.method)
    train_cfg = TrainConfig().with_overrides(train_over) if train_over else TrainConfig()
    if "seq_len" not in train_over:               # not given: rows no longer than the base's context
        from archlab.training.init_from import source_context

        context = int(model_over["max_seq_len"]) if "max_seq_len" in model_over else source_context(args.base)
        if context is not None and context < train_cfg.seq_len:
            train_cfg = train_cfg.with_overrides({"seq_len": context})
    try:
        result = finetune(args.base, args.data, args.out, train_cfg=train_cfg, method=args.method,
                          model_overrides=model_over or None,
                          val=args.val, chat_template=args.chat_template, val_fraction=args.val_fraction,
                          resume=args.resume, progress="lines" if args.no_progress else True)
    except Diverged as exc:
        print(f"archlab finetune: error: {exc}", file=sys.stderr)
        return 3
    except FileExistsError as exc:
        raise UserError(str(exc)) from exc
    val = f"{result.final_val_loss:.4f} (on the scored tokens)" if result.final_val_loss is not None else "n/a"
    rate = (f"{result.tokens_per_s:,.0f} tokens/s" if result.tokens_per_s > 0     # a resume already at its budget
            else f"no step left to train (its budget of {train_cfg.budget:g} {train_cfg.budget_unit} reached)")
    print(f"done: {result.steps} steps, {result.tokens_seen:,} real tokens, val loss {val}, "
          f"{rate}, peak memory {human_bytes(result.peak_memory_bytes)}; "
          f"run folder {result.run_dir} (started from {args.base})")
    return 0
