"""`archlab convert` (HF folder or GGUF file <-> archlab run folder, PEFT adapters) and `archlab verify` (archlab vs
transformers): the arguments and the printing; the conversions themselves are library calls in
archlab.interop.convert.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from archlab.config import ConfigError
from archlab.interop.convert import (
    compare_with_transformers,
    convert_from_gguf,
    convert_from_hf,
    convert_to_gguf,
    convert_to_hf,
    no_hf_tokenizer,
)

CONVERT_EXAMPLE = """\
examples:
  archlab convert --from-hf ~/models/Qwen2.5-0.5B --out runs/qwen2.5-0.5b
  archlab convert --from-hf hf:Qwen/Qwen2.5-0.5B@main --out runs/qwen    # a hub id (safetensors only)
  archlab convert --to-hf runs/my-run --out exported/my-run          # family inferred from the config
  archlab convert --to-hf runs/my-run --out exported/my-run --family mistral
  archlab convert --to-peft runs/my-lora-run --out exported/my-adapter    # adapter_config.json + safetensors
  archlab convert --from-gguf SmolLM2-135M-Instruct.Q4_1.gguf --out runs/smollm2   # dequantized, tokenizer rebuilt
  archlab convert --from-gguf smollm2-135m-instruct --out runs/smollm2   # a packaged model (the `models` extra)
  archlab convert --to-gguf runs/smollm2 --out smollm2-q8_0.gguf --type q8_0   # for llama.cpp / Ollama
"""

VERIFY_EXAMPLE = """\
examples:
  archlab verify ~/models/Qwen2.5-0.5B
  archlab verify exported/my-run --seq-len 64 --batch 2 --tolerance 1e-4

prints the max absolute and relative logit difference and the mean KL(transformers || archlab)
over a fixed random token batch; exits 1 when the relative difference exceeds --tolerance.
"""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# each option that changes what some directions write: (the directions, how the help names them); --no-check
# (skip a read-back) is harmless where there is none
DIRECTION_OPTIONS = {
    "type": (("to_gguf",), "--to-gguf"),
    "dtype": (("from_hf", "from_gguf"), "--from-hf and --from-gguf"),
    "family": (("to_hf", "to_peft"), "--to-hf and --to-peft"),
}


def check_direction_options(args: argparse.Namespace) -> None:
    """An option given with a direction it does not apply to is a UserError (it would be silently ignored)."""
    from archlab.errors import UserError

    for option, (directions, named) in DIRECTION_OPTIONS.items():
        if getattr(args, option) not in (None, False) and not any(getattr(args, d) for d in directions):
            flag = "--" + option.replace("_", "-")
            hint = "; an int8 run: archlab quantize" if option == "type" and args.from_gguf else ""
            raise UserError(f"{flag} is for {named} only: it would not apply here{hint}")


def run_convert(args: argparse.Namespace) -> int:
    check_direction_options(args)
    args.type = args.type or "f16"
    try:
        if args.from_hf:
            dtype = DTYPES[args.dtype] if args.dtype else None
            out = convert_from_hf(args.from_hf, args.out, dtype=dtype, overwrite=args.overwrite)
            print(f"wrote run folder {out} (config.yaml, checkpoints/step_0000000"
                  + (", tokenizer/" if (out / "tokenizer").is_dir() else "") + ")")
        elif args.from_gguf:
            from archlab.interop.gguf.packaged import resolve_gguf
            out = convert_from_gguf(resolve_gguf(args.from_gguf), args.out, dtype=DTYPES[args.dtype or "float32"],
                                    overwrite=args.overwrite)
            print(f"wrote run folder {out} (config.yaml, checkpoints/step_0000000, generation_config.json"
                  + (", tokenizer/" if (out / "tokenizer").is_dir() else "") + ")")
        elif args.to_gguf:
            from archlab.interop.gguf.validate import report_lines
            report = convert_to_gguf(args.to_gguf, args.out, qtype=args.type, overwrite=args.overwrite,
                                     check=not args.no_check)
            print(f"wrote GGUF file {args.out} ({args.type})")
            for line in report_lines(report):
                print(line)
        elif args.to_peft:
            from archlab.interop.peft import CONFIG_FILE, WEIGHTS_FILE
            from archlab.runs.model_folder import export_peft
            out = export_peft(args.to_peft, args.out, family=args.family, overwrite=args.overwrite)
            print(f"wrote PEFT adapter {out} ({CONFIG_FILE}, {WEIGHTS_FILE})")
        else:
            model_type = convert_to_hf(args.to_hf, args.out, family=args.family, overwrite=args.overwrite)
            print(f"wrote Hugging Face folder {args.out} (model_type {model_type!r})")
            if not (Path(args.out) / "tokenizer.json").is_file():
                print(f"note: {args.out} holds no tokenizer: {no_hf_tokenizer(Path(args.to_hf))}", file=sys.stderr)
    except (ConfigError, ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"archlab convert: error: {exc}", file=sys.stderr)
        return 2
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from archlab.errors import UserError

    for flag, value in (("--seq-len", args.seq_len), ("--batch", args.batch)):
        if value < 1:
            raise UserError(f"{flag} {value} must be at least 1")
    try:
        stats = compare_with_transformers(args.folder, seq_len=args.seq_len, batch=args.batch,
                                          seed=args.seed, dtype=DTYPES[args.dtype])
    except ImportError:
        print("archlab verify: error: needs `transformers` (pip install archlab[hf])", file=sys.stderr)
        return 2
    except (ConfigError, ValueError, FileNotFoundError, OSError) as exc:
        print(f"archlab verify: error: {exc}", file=sys.stderr)
        return 2
    print(f"max abs logit diff   {stats['max_abs']:.3e}")
    print(f"max rel logit diff   {stats['max_rel']:.3e}   (tolerance {args.tolerance:g})")
    print(f"mean KL(hf || ours)  {stats['mean_kl']:.3e}")
    ok = math.isfinite(stats["max_rel"]) and stats["max_rel"] <= args.tolerance
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    c = subparsers.add_parser(
        "convert", help="convert between Hugging Face folders, GGUF files and archlab run folders",
        description="Hugging Face folder (config.json + safetensors) or GGUF file (llama.cpp, Ollama) -> archlab "
        "run folder; run folder -> Hugging Face folder, GGUF file (f32, f16, q8_0) or a LoRA run's PEFT adapter. "
        "Example: archlab convert --from-gguf smollm2-135m-instruct --out runs/smollm2",
        epilog=CONVERT_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="HF_DIR", help="Hugging Face folder to import")
    src.add_argument("--from-gguf", metavar="FILE",
                     help="GGUF file (llama.cpp's format) to import: weights dequantized to --dtype (default "
                     "float32), tokenizer and chat template rebuilt from its metadata; or a packaged model's name "
                     "(smollm2-135m-instruct, gemma-3-270m: the `models` extra)")
    src.add_argument("--to-gguf", metavar="RUN_DIR",
                     help="archlab run folder to export as one GGUF file (--out FILE.gguf, --type) for llama.cpp / "
                     "Ollama, tokenizer and chat template included; read back by archlab and transformers after")
    src.add_argument("--to-hf", metavar="RUN_DIR",
                     help="archlab run folder to export (latest checkpoint; a LoRA run's adapters merged in)")
    src.add_argument("--to-peft", metavar="RUN_DIR",
                     help="a LoRA run's adapters (latest checkpoint) as a PEFT adapter folder for its base")
    c.add_argument("--out", required=True, metavar="DIR",
                   help="folder to write (must be new or empty); with --to-gguf, the .gguf file")
    c.add_argument("--type", default=None, choices=["f32", "f16", "q8_0"],
                   help="with --to-gguf: how the 2-D weights are stored (default f16; norms and biases stay f32)")
    c.add_argument("--no-check", action="store_true",
                   help="with --to-gguf: skip reading the file back (archlab and transformers) after writing")
    c.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out folder (atomically: a failure leaves the old one intact)")
    c.add_argument("--family", default=None, metavar="MODEL_TYPE",
                   help="with --to-hf / --to-peft: HF model_type to write (default: inferred from the config)")
    c.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="with --from-hf: weight dtype of the run (default: the checkpoint's); "
                   "with --from-gguf: the dtype dequantized to (default float32)")
    c.set_defaults(func=run_convert)

    v = subparsers.add_parser(
        "verify", help="compare archlab's and transformers' logits on a Hugging Face folder",
        description="Load an HF folder with archlab and with transformers and compare logits on a "
        "fixed random token batch. Example: archlab verify ~/models/Qwen2.5-0.5B",
        epilog=VERIFY_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    v.add_argument("folder", metavar="HF_DIR", help="Hugging Face folder (config.json + safetensors)")
    v.add_argument("--seq-len", type=int, default=32, help="tokens per row (default 32)")
    v.add_argument("--batch", type=int, default=2, help="rows (default 2)")
    v.add_argument("--seed", type=int, default=0, help="seed of the random tokens (default 0)")
    v.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="compute dtype (default float32)")
    v.add_argument("--tolerance", type=float, default=1e-4,
                   help="max relative logit difference accepted (default 1e-4)")
    v.set_defaults(func=run_verify)
