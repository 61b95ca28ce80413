"""`archlab diagnose RUN_DIR_OR_HF_DIR --text FILE`: attention sinks, massive activations, entropy."""
from __future__ import annotations

import argparse

EXAMPLE = """\
examples:
  archlab diagnose runs/tiny --text notes.txt
  archlab diagnose path/to/hf_model --text prompt.txt --max-tokens 128 --out diag/
writes OUT/summary.json (per layer: first-token attention mass, entropy and prefix-matching (induction) score
per head, max/median |hidden state| and where the largest ones are, the share of dead ReLU-family MLP units)
and OUT/sinks.png, entropy.png, induction.png, massive_activations.png.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "diagnose", help="attention sinks, massive activations and attention entropy on a text",
        description="Measure attention sinks (first-token attention mass per layer and head), massive "
        "activations (max/median |hidden state| per layer, with token and dimension), attention "
        "entropy, induction heads (each head's prefix-matching score on the text's tokens drawn at random and "
        "repeated, Olsson et al. 2022) and, for ReLU-family MLPs (relu, relu2, reglu), the share of units never "
        "active on the text. Example: archlab diagnose runs/tiny --text notes.txt",
        epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="RUN_DIR_OR_HF_DIR", help="an archlab run folder or an HF model folder")
    p.add_argument("--text", required=True, metavar="FILE", help="text file to run the model on")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="tokens of the text to use, at most the model's context (default 256; a longer text is "
                   "cut, and the command says so)")
    p.add_argument("--out", metavar="DIR", help="output folder (default MODEL/diagnostics, rewritten each time; a "
                   "given folder that exists and is not empty needs --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="write into an existing non-empty --out folder")
    p.add_argument("--top-k", type=int, default=5, help="largest activations listed per layer")
    p.add_argument("--json", action="store_true",
                   help="print the summary (summary.json's `summary`) as one JSON line instead of the table; "
                   "e.g. archlab diagnose runs/smollm2 --text notes.txt --json | jq .max_ratio")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json
    import sys
    from pathlib import Path

    import torch

    from archlab.errors import UserError
    from archlab.eval import diagnostics

    for flag, value in (("--max-tokens", args.max_tokens), ("--top-k", args.top_k)):
        if value < 1:
            raise UserError(f"{flag} {value} must be at least 1")
    if args.out:      # the default, MODEL/diagnostics, is the model's own and is rewritten (inside the model is fine)
        from archlab.runs.outputs import check_output
        check_output(args.out, inputs=[args.text], overwrite=args.overwrite)
    if not Path(args.text).is_file():
        raise UserError(f"--text {args.text}: {'a folder, not a file' if Path(args.text).is_dir() else 'no such file'}")
    text = Path(args.text).read_bytes().decode("utf-8", errors="replace")
    model, tokenizer = diagnostics.load_model_and_tokenizer(args.model)
    limit = min(args.max_tokens, model.config.max_seq_len)
    ids, pieces = diagnostics.encode_text(tokenizer, text, limit + 1)     # one past the limit: is it cut?
    if len(ids) > limit:
        ids, pieces = ids[:limit], pieces[:limit]
        why = (f"--max-tokens {args.max_tokens}" if limit == args.max_tokens
               else f"the model's context, max_seq_len {limit}")
        print(f"--text {args.text} is longer than {limit} tokens: diagnosing its first {limit} ({why})",
              file=sys.stderr if args.json else sys.stdout)
    if len(ids) < 2:
        raise UserError(f"--text {args.text} encodes to {len(ids)} token(s); need at least 2")
    result = diagnostics.diagnose(model, torch.tensor([ids]), pieces, top_k=args.top_k, progress=True)
    default = Path("diagnostics") / args.model.split("/")[-1] if args.model.startswith("hf:") else \
        Path(args.model) / "diagnostics"             # never into the hub cache
    out = Path(args.out) if args.out else default
    paths = diagnostics.save_report(result, out)
    s = result["summary"]
    if args.json:
        print(json.dumps(s, default=str))
        return 0
    print(f"{s['n_tokens']} tokens, {s['n_layers']} layers: first-token attention mass {s['first_token_mass']:.3f} "
          f"(mean over layers and heads), max |h| {s['max_activation']:.4g}, max/median ratio "
          f"{s['max_ratio']:.4g} at layer {s['max_ratio_layer']}, mean entropy {s['mean_entropy']:.3f} nats "
          f"(uniform {s['uniform_entropy']:.3f}), final effective rank {s['final_effective_rank']:.1f} "
          f"of at most {min(s['n_tokens'], model.config.d_model)}"
          + (f", dead MLP units {s['dead_unit_fraction']:.1%}" if s["dead_unit_fraction"] is not None else ""))
    if s["max_prefix_matching"] is not None:
        layer, head = s["max_prefix_matching_at"]
        print(f"  strongest induction head: layer {layer} head {head}, prefix-matching score "
              f"{s['max_prefix_matching']:.3f} (its attention to the token after an earlier copy of the current one, "
              f"on random draws of the text's tokens, repeated; 1 = a perfect induction head)")
    for layer in result["layers"]:
        top = layer["top"][0]
        sink = sum(layer["first_token_mass"]) / len(layer["first_token_mass"])
        dead = layer["dead_unit_fraction"]
        print(f"  layer {layer['layer']:2d}: sink {sink:.3f}"
              f"  ratio {layer['ratio']:9.4g}  erank {layer['effective_rank']:6.1f}"
              + (f"  dead {dead:6.1%}" if dead is not None else "")
              + f"  max at token {top['token_index']} ({top['token']!r}) dim {top['dim']}")
    print(f"wrote {paths['json']} and {len(paths) - 1} PNGs in {paths['json'].parent}")
    return 0
