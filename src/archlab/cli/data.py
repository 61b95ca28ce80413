"""`archlab data prepare`: tokenize a corpus into a self-describing data folder."""
from __future__ import annotations

import argparse

PREPARE_EXAMPLE = """\
examples:
  archlab data prepare --corpus shakespeare --tokenizer bytes --out data/shakespeare-bytes
  archlab data prepare --corpus pystdlib --tokenizer runs/tok32k --out data/pystdlib --workers 4
  archlab data prepare --corpus docs.jsonl --text-field body --tokenizer runs/tok --out data/docs
  archlab data prepare --pairs --corpus wmt.jsonl --source-field de --target-field en --tokenizer runs/tok \
      --out data/wmt-de-en

corpora: shakespeare, shakespeare-folio, pystdlib, pystdlib-full, hf:NAME[:CONFIG] (needs `datasets`),
or a file / folder of .txt .md .py ... (one document per file), .jsonl (one per line), .parquet (per row).
writes OUT/train.bin, OUT/val.bin (raw uint16/uint32 ids, end-of-text after each document),
OUT/meta.json and OUT/tokenizer/.
--pairs (encoder-decoder data): one .jsonl file of {"source": ..., "target": ...} lines; writes per split
OUT/{train,val}.source.bin, .target.bin (ids, end-of-text after each side) and .offsets.bin (int64, where each
pair starts), OUT/meta.json and OUT/tokenizer/.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    data = subparsers.add_parser(
        "data", help="prepare token data from a corpus",
        description="Token data: corpora tokenized into memmap files for training. "
        "Example: archlab data prepare --corpus shakespeare --tokenizer bytes --out data/shakespeare",
    )
    commands = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    data.set_defaults(func=lambda args: (data.print_help(), 2)[1])

    prepare = commands.add_parser(
        "prepare", help="tokenize a corpus into train/val memmap files",
        description="Split a corpus by document into train and validation (a hash of seed and text), "
        "tokenize it in parallel and write token files, meta.json and a copy of the tokenizer.",
        epilog=PREPARE_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prepare.add_argument("--corpus", required=True, metavar="NAME_OR_PATH",
                         help="built-in corpus name, hf:NAME[:CONFIG], or a file/folder")
    prepare.add_argument("--tokenizer", required=True, metavar="DIR_OR_bytes",
                         help="a saved tokenizer folder, or 'bytes' for the byte-level tokenizer (vocab 257)")
    prepare.add_argument("--out", required=True, metavar="DATA_DIR",
                         help="output folder (must not exist unless --overwrite)")
    prepare.add_argument("--val-fraction", type=float, default=0.05,
                         help="fraction of documents held out for validation (default 0.05)")
    prepare.add_argument("--seed", type=int, default=0, help="seed of the train/val split (default 0)")
    prepare.add_argument("--workers", type=int, default=None,
                         help="tokenizing processes (default: CPUs, at most 8; 0 = in this process)")
    prepare.add_argument("--eot-token", default="<|endoftext|>", help="end-of-text token after each document")
    prepare.add_argument("--text-field", default="text", help=".jsonl field / .parquet column with the text")
    prepare.add_argument("--pairs", action="store_true",
                         help="source/target pairs for encoder-decoders from one .jsonl file (archlab.data.pairs)")
    prepare.add_argument("--source-field", default="source", help="with --pairs: the .jsonl field of the source")
    prepare.add_argument("--target-field", default="target", help="with --pairs: the .jsonl field of the target")
    prepare.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    prepare.add_argument("--sentences", action="store_true",
                         help="also write OUT/{train,val}.sentences.bin, where each sentence starts (int64 token "
                         "offsets), for BERT's next-sentence prediction")
    prepare.add_argument("--quiet", action="store_true", help="no progress bar")
    prepare.set_defaults(func=run_prepare)


def run_prepare(args: argparse.Namespace) -> int:
    from archlab.data import tokens as data

    if args.workers is not None and args.workers < 0:
        raise data.DataError(f"--workers {args.workers} must be >= 0")
    if args.pairs:
        return run_prepare_pairs(args)
    meta = data.prepare(
        args.corpus, args.tokenizer, args.out, val_fraction=args.val_fraction, seed=args.seed,
        num_workers=args.workers, eot_token=args.eot_token, text_field=args.text_field,
        overwrite=args.overwrite, progress=not args.quiet, sentences=args.sentences,
    )
    print(f"wrote {args.out}: vocab_size={meta['vocab_size']} dtype={meta['dtype']} eot_id={meta['eot_id']}")
    for split, info in meta["splits"].items():
        per = info["bytes"] / info["tokens"] if info["tokens"] else 0.0
        print(f"  {split:5s} {info['documents']:>9,} docs {info['tokens']:>14,} tokens "
              f"{info['bytes']:>14,} bytes ({per:.2f} bytes/token)"
              + (f" {info['sentences']:,} sentences" if "sentences" in info else ""))
    return 0


def run_prepare_pairs(args: argparse.Namespace) -> int:
    from archlab.data import pairs

    if getattr(args, "sentences", False):
        raise pairs.DataError("--sentences marks sentences of a token stream; it does not apply to --pairs")
    meta = pairs.prepare_pairs(
        args.corpus, args.tokenizer, args.out, source_field=args.source_field, target_field=args.target_field,
        val_fraction=args.val_fraction, seed=args.seed, eot_token=args.eot_token, num_workers=args.workers,
        overwrite=args.overwrite, progress=not args.quiet,
    )
    print(f"wrote {args.out}: pairs, vocab_size={meta['vocab_size']} dtype={meta['dtype']} eot_id={meta['eot_id']}")
    for split, info in meta["splits"].items():
        print(f"  {split:5s} {info['pairs']:>9,} pairs {info['source_tokens']:>12,} source tokens "
              f"(longest {info['max_source_len']:,}) {info['target_tokens']:>12,} target tokens "
              f"(longest {info['max_target_len']:,})")
    return 0
