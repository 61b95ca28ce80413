"""`archlab ngram DATA`: the modified Kneser-Ney n-gram baseline of a prepared data folder, in bits per byte."""
from __future__ import annotations

import argparse
import json

NGRAM_EXAMPLE = """example:
  archlab ngram runs/demo/data                 # 5-gram: validation bits/byte, bits/token, perplexity, memory
  archlab ngram runs/demo/data --orders 1-8    # the trade-off: bits/byte falls with n, then flattens
  archlab ngram runs/demo/data --order 3 --json
Counted on the train split, scored on every validation token; bits/byte = total nats / ln 2 / UTF-8 bytes,
as `archlab train` and `archlab eval` report it."""

MAX_ORDER = 16


def register(subparsers) -> None:
    p = subparsers.add_parser("ngram", help="n-gram baseline (modified Kneser-Ney) of a prepared data folder",
                              description="Interpolated modified Kneser-Ney (Chen & Goodman 1998) counted on a "
                              "data folder's train split and scored on its validation split in bits per byte.",
                              epilog=NGRAM_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="a prepared token data folder (archlab data prepare)")
    p.add_argument("--order", type=int, default=5, help="n of the n-gram model (default 5)")
    p.add_argument("--orders", metavar="A-B", help="a table over the orders A..B instead of one order (e.g. 1-8)")
    p.add_argument("--json", action="store_true", help="print the result(s) as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_ngram)


def parse_orders(text: str) -> list[int]:
    """"1-8" -> [1, ..., 8]; "5" -> [5]; a UserError naming --orders otherwise."""
    from archlab.errors import UserError

    first, _, last = text.partition("-")
    try:
        lo, hi = int(first), int(last or first)
    except ValueError:
        raise UserError(f"--orders {text!r} must look like A-B with whole numbers, e.g. 1-8") from None
    if not 1 <= lo <= hi <= MAX_ORDER:
        raise UserError(f"--orders {text!r} must satisfy 1 <= A <= B <= {MAX_ORDER}")
    return list(range(lo, hi + 1))


def run_ngram(args) -> int:
    from archlab.errors import UserError
    from archlab.eval.ngram import evaluate_ngram
    from archlab.units import human_bytes

    if args.orders:
        orders = parse_orders(args.orders)
    elif not 1 <= args.order <= MAX_ORDER:
        raise UserError(f"--order {args.order} must be in 1..{MAX_ORDER}")
    else:
        orders = [args.order]
    results = evaluate_ngram(args.data, orders, progress=not args.no_progress and not args.json)
    if args.json:
        rows = [r.to_dict() for r in results]
        print(json.dumps(rows if args.orders else rows[0]))
        return 0
    last = results[-1]
    print(f"modified Kneser-Ney on {args.data}: {last.tokens:,} validation tokens ({last.n_bytes:,} bytes)")
    if len(results) == 1:
        print(f"{last.order}-gram: {last.bpb:.4f} bits/byte, {last.bits_per_token:.4f} bits/token, "
              f"perplexity {last.ppl:,.2f}; {last.seen:.1%} of validation {last.order}-grams seen in training")
    else:
        print(f"{'order':>5}  {'bits/byte':>9}  {'bits/token':>10}  {'perplexity':>10}  {'n-grams':>10}  "
              f"{'val seen':>8}  {'tables':>9}")
        for r in results:
            print(f"{r.order:>5}  {r.bpb:>9.4f}  {r.bits_per_token:>10.4f}  {r.ppl:>10,.2f}  {r.ngrams:>10,}  "
                  f"{r.seen:>8.1%}  {human_bytes(r.table_bytes):>9}")
        best = min(results, key=lambda r: r.bpb)
        print(f"lowest: order {best.order} at {best.bpb:.4f} bits/byte")
    print(f"tables {human_bytes(last.table_bytes)}, peak memory {human_bytes(last.peak_rss_bytes)} (process RSS), "
          f"{last.seconds:.1f} s")
    return 0
