"""`archlab fill-mask MODEL TEXT`: an encoder's top-k tokens at each mask token of a text."""
from __future__ import annotations

import argparse
import json

EXAMPLE = """example:
  archlab fill-mask runs/demo-encoder "ROMEO: I [MASK] thee, good friar."
  archlab fill-mask runs/demo-encoder "What [MASK] is this? [MASK] me, sir." --top-k 10 --json
  archlab fill-mask path/to/hf_bert "The capital of France is [MASK]."     # RoBERTa: <mask>
write the tokenizer's mask token ([MASK], or <mask> for RoBERTa) where a token should be filled in; every
mask is predicted from one forward, each on its own, and the text is printed with the top-1 tokens filled in.
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "fill-mask", help="an encoder's most likely tokens at the [MASK] positions of a text",
        description="Load an encoder (an archlab run folder with arch=encoder, or an HF bert / roberta folder) "
        "and print, for each mask token in TEXT, the top-k tokens with their probabilities, then the text "
        "with the top-1 tokens filled in.",
        epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", help="encoder run folder, HF model folder or hf:ORG/NAME")
    p.add_argument("text", metavar="TEXT", help="text holding one or more mask tokens ([MASK] or <mask>)")
    p.add_argument("--top-k", type=int, default=5, help="tokens listed per mask (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=run)


def run(args) -> int:
    from archlab.cli.generate import check_device
    from archlab.errors import UserError
    from archlab.eval.fill_mask import fill_mask
    from archlab.runs.model_folder import load_masked_lm

    if args.top_k < 1:
        raise UserError(f"--top-k {args.top_k} must be at least 1")
    check_device(args.device)
    model, tokenizer = load_masked_lm(args.model, args.device)
    if tokenizer is None:
        raise UserError(f"{args.model} has no tokenizer/ folder to encode the text")
    result = fill_mask(model, tokenizer, args.text, top_k=args.top_k)
    print(json.dumps(result.to_dict(), ensure_ascii=False) if args.json else result.format())
    return 0
