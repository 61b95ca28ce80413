"""`archlab quantize RUN --weights int8 --out DIR`: a run folder with int8 weights, and what it costs in
perplexity (float vs int8 on the run's validation text or --text) and in logits (the largest difference)."""
from __future__ import annotations

import argparse
import sys

EXAMPLE = """\
examples:
  archlab quantize runs/smollm2 --weights int8 --out runs/smollm2-int8 --text notes.txt
  archlab quantize runs/demo --weights int8 --out runs/demo-int8          # scored on the run's validation split
  archlab generate runs/smollm2-int8 --prompt "The capital of France is"

int8: every Linear, and the token embedding (a tied head multiplies by the same rows) or the LM head, as int8
rows with one float32 scale each; decoding multiplies by them with fbgemm's int8 kernel where torch has it
(docs/real_models_int8.md). train, finetune, --init-from and convert --to-hf refuse a quantized run.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    from archlab.runs.quantize import SCHEMES

    p = subparsers.add_parser(
        "quantize", help="int8 weights for a run folder, with the perplexity it costs",
        description="Write RUN's model with int8 weights (one scale per output row) as a new run folder, and print "
        "the float and int8 perplexity and the largest logit difference. "
        "Example: archlab quantize runs/smollm2 --weights int8 --out runs/smollm2-int8 --text notes.txt",
        epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run", metavar="RUN", help="a float run folder (archlab train, or convert --from-hf)")
    p.add_argument("--weights", required=True, choices=sorted(SCHEMES), help="the weight format: int8 (per row)")
    p.add_argument("--out", required=True, metavar="DIR", help="the run folder to write (must be new or empty)")
    p.add_argument("--text", metavar="FILE",
                   help="text to measure perplexity on (default: the validation split of the run's data folder)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per scored window (default 256)")
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens scored at most (default 2048)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder (atomically)")
    p.set_defaults(func=run)


def _val_folder(args, run_cfg: dict) -> str:
    """The run's data folder, whose validation split is scored when --text is not given: checked before the model
    loads (seconds on a large run), so a run without one is refused at once."""
    from pathlib import Path

    from archlab.errors import UserError

    data_dir = (run_cfg.get("data") or {}).get("dir")
    if not data_dir or not Path(data_dir).is_dir():
        raise UserError(f"{args.run} names no data folder with a validation split: pass --text FILE")
    return str(data_dir)


def _tokens(args, data_dir: str | None, tokenizer, limit: int):
    """The ids to score: --text encoded with the run's tokenizer, else the validation split of `data_dir` (the run's
    data folder, checked by _val_folder)."""
    from pathlib import Path

    import torch

    from archlab.errors import UserError

    if args.text:
        if tokenizer is None:
            raise UserError(f"{args.run} has no tokenizer/ to encode --text {args.text}")
        text = Path(args.text).read_bytes().decode("utf-8", errors="replace")
        enc = tokenizer.encode(text)
        ids = list(enc.ids) if hasattr(enc, "ids") else list(enc)
        what = f"--text {args.text}"
    else:
        from archlab.data.tokens import TokenDataset
        val = TokenDataset(data_dir, "val")
        ids = [int(i) for i in val.tokens[: limit + 1]]
        what = f"the validation split of {data_dir}"
    if len(ids) < 2:
        raise UserError(f"{what} holds {len(ids)} token(s): need at least 2 to measure perplexity")
    return torch.tensor(ids[: limit + 1]), what


def run(args: argparse.Namespace) -> int:
    import copy
    from pathlib import Path

    from archlab.errors import UserError
    from archlab.eval.perplexity import compare_logits
    from archlab.nn.int8 import quantize_int8
    from archlab.runs.model_folder import CONFIG_FILE, load_run, read_run_config, refuse_quantized
    from archlab.runs.outputs import check_output
    from archlab.runs.quantize import write_quantized_run

    for flag, value in (("--seq-len", args.seq_len), ("--max-tokens", args.max_tokens)):
        if value < 1:
            raise UserError(f"{flag} {value} must be at least 1")
    source = Path(args.run)
    if not (source / CONFIG_FILE).is_file():
        raise UserError(f"{source} is not a run folder (no {CONFIG_FILE}): convert an HF folder first "
                        "(archlab convert --from-hf DIR --out RUN)")
    refuse_quantized(source, "quantize")
    if args.text and not Path(args.text).is_file():
        raise UserError(f"--text {args.text}: no such file")
    check_output(args.out, inputs=[source, args.text], overwrite=args.overwrite)       # before the (long) load
    data_dir = None if args.text else _val_folder(args, read_run_config(source))     # before the (long) load too
    model, tokenizer = load_run(source)
    if model.config.arch != "decoder":
        raise UserError(f"{source} holds a {model.config.arch} model: quantize handles decoder-only LMs")
    ids, what = _tokens(args, data_dir, tokenizer, args.max_tokens)
    seq_len = min(args.seq_len, model.config.max_seq_len)
    quantized = quantize_int8(copy.deepcopy(model)).eval()
    print(f"measuring float and int8 on {ids.numel() - 1:,} tokens ...", file=sys.stderr, flush=True)
    diff = compare_logits(model, quantized, ids, seq_len)      # each model once per window
    ppl_float, ppl_int8 = diff["ppl_a"], diff["ppl_b"]
    change = ppl_int8 / ppl_float - 1
    measured = {"text": what, "tokens": ids.numel() - 1, "seq_len": seq_len, "ppl_float": ppl_float,
                "ppl_int8": ppl_int8, "max_abs_logit_diff": diff["max_abs"], "top1_agreement": diff["top1_agreement"]}
    out = write_quantized_run(source, quantized, args.out, args.weights, args.overwrite, measured)
    print(f"perplexity on {what} ({ids.numel() - 1:,} tokens, windows of {seq_len}): float {ppl_float:.3f}, "
          f"int8 {ppl_int8:.3f} ({change:+.2%})")
    print(f"max |logit difference| {diff['max_abs']:.4g} (relative {diff['max_rel']:.2e}); "
          f"top-1 agreement {diff['top1_agreement']:.1%}")
    sizes = [sum(t.numel() * t.element_size() for t in m.state_dict().values()) for m in (model, quantized)]
    print(f"wrote {out} (int8 weights: {sizes[1] / 2**20:.1f} MiB, float {sizes[0] / 2**20:.1f} MiB)")
    return 0
