"""`archlab data prepare`: tokenize a corpus into a self-describing data folder; `archlab data inspect-chat`:
what a chat .jsonl becomes (counts, and examples with the tokens the loss scores marked)."""
from __future__ import annotations

import argparse
import sys

PREPARE_EXAMPLE = """\
examples:
  archlab data prepare --corpus shakespeare --tokenizer bytes --out data/shakespeare-bytes
  archlab data prepare --corpus pystdlib --tokenizer runs/tok32k --out data/pystdlib --workers 4
  archlab data prepare --corpus docs.jsonl --text-field body --tokenizer runs/tok --out data/docs
  archlab data prepare --seq2seq --corpus wmt.jsonl --source-field de --target-field en --tokenizer runs/tok \\
      --out data/wmt-de-en

corpora: shakespeare, shakespeare-folio, pystdlib, pystdlib-full, hf:NAME[:CONFIG] (needs `datasets`),
or a file / folder of .txt .md .py ... (one document per file), .jsonl (one per line), .parquet (per row).
writes OUT/train.bin, OUT/val.bin (raw uint16/uint32 ids, end-of-text after each document),
OUT/meta.json and OUT/tokenizer/.
--seq2seq (encoder-decoder data; --pairs is its earlier name): one .jsonl file of {"source": ..., "target": ...}
lines; writes per split OUT/{train,val}.source.bin, .target.bin (ids, end-of-text after each side) and
.offsets.bin (int64, where each pair starts), OUT/meta.json and OUT/tokenizer/.
"""

INSPECT_CHAT_EXAMPLE = """\
examples:
  archlab data inspect-chat sft.jsonl --tokenizer runs/tok
  archlab data inspect-chat sft.jsonl --tokenizer runs/tok --mask last --max-tokens 512 --truncation keep_start
  archlab data inspect-chat pc.jsonl --tokenizer runs/tok --mask completion --show 3

lines: {"messages": [{"role": "system|user|assistant|tool", "content": ...}, ...]} or {"prompt": ..., "completion":
...} (strings, or lists of messages); the tokenizer folder's chat template renders conversations.
masks: assistant (default), all, last, completion. truncation: refuse (default), keep_start, keep_end, skip.
"""
SCORED = ("\u27e6", "\u27e7")      # the brackets around scored text in the examples shown


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
    prepare.add_argument("--seq2seq", action="store_true",
                         help="seq2seq source/target pairs for encoder-decoders from one .jsonl file "
                         "(archlab.data.seq2seq; --pairs is the earlier name of this flag)")
    prepare.add_argument("--pairs", dest="pairs_flag", action="store_true", help=argparse.SUPPRESS)   # deprecated
    prepare.add_argument("--source-field", default="source", help="with --seq2seq: the .jsonl field of the source")
    prepare.add_argument("--target-field", default="target", help="with --seq2seq: the .jsonl field of the target")
    prepare.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    prepare.add_argument("--sentences", action="store_true",
                         help="also write OUT/{train,val}.sentences.bin, where each sentence starts (int64 token "
                         "offsets), for BERT's next-sentence prediction")
    prepare.add_argument("--quiet", action="store_true", help="no progress bar")
    prepare.set_defaults(func=run_prepare)

    inspect = commands.add_parser(
        "inspect-chat", help="show what a chat .jsonl becomes: tokens, and which ones the loss scores",
        description="Read a chat or prompt/completion .jsonl through a tokenizer's chat template and print its "
        "token counts and the first examples, the text the loss scores between \u27e6 and \u27e7.",
        epilog=INSPECT_CHAT_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    inspect.add_argument("file", metavar="FILE.jsonl", help="the chat data, e.g. sft.jsonl")
    inspect.add_argument("--tokenizer", required=True, metavar="DIR",
                         help="tokenizer folder with a chat template (archlab tokenizer chat-template), e.g. runs/tok")
    inspect.add_argument("--mask", default="assistant", metavar="NAME",
                         help="the tokens the loss scores: assistant, all, last, completion (default assistant)")
    inspect.add_argument("--max-tokens", type=int, default=None, metavar="N",
                         help="the longest example (train.seq_len), e.g. --max-tokens 512")
    inspect.add_argument("--truncation", default="refuse", metavar="POLICY",
                         help="longer examples: refuse, keep_start, keep_end, skip (default refuse)")
    inspect.add_argument("--chat-template", default=None, metavar="NAME_OR_FILE",
                         help="a template of the folder by name, or a .jinja file (default: the folder's)")
    inspect.add_argument("--show", type=int, default=1, metavar="K", help="examples to print (default 1)")
    inspect.set_defaults(func=run_inspect_chat)


def run_prepare(args: argparse.Namespace) -> int:
    from archlab.data.prepare import prepare
    from archlab.errors import DataError

    if args.workers is not None and args.workers < 0:
        raise DataError(f"--workers {args.workers} must be >= 0")
    if args.pairs_flag:
        print("note: --pairs is deprecated: it is --seq2seq now (source/target pairs; preference pairs are "
              "archlab finetune --method dpo's)", file=sys.stderr)
    if args.seq2seq or args.pairs_flag:
        return run_prepare_seq2seq(args)
    meta = prepare(
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
    if not meta["splits"].get("val", {}).get("tokens", 1):
        print(f"note: the val split is empty: whole documents are held out (--val-fraction {args.val_fraction:g}) "
              "and this corpus has too few; `archlab eval` scores the val split by default: prepare a "
              "folder of files or a .jsonl of documents (or eval --split train)", file=sys.stderr)
    return 0


def run_prepare_seq2seq(args: argparse.Namespace) -> int:
    from archlab.data import seq2seq

    if getattr(args, "sentences", False):
        raise seq2seq.DataError("--sentences marks sentences of a token stream; it does not apply to --seq2seq")
    meta = seq2seq.prepare_seq2seq(
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


def _template_arg(value: str, chat, folder: str) -> str:
    """The source --chat-template names: a .jinja file (read, its syntax checked) or a template of the folder by
    name; anything else is refused (a name is never rendered as a template's text)."""
    from pathlib import Path

    from archlab.errors import UserError
    from archlab.tokenizer.chat_render import ChatTemplateSyntaxError, check_template_syntax

    templates = chat.templates
    named = templates if isinstance(templates, dict) else {} if templates is None else {"default": templates}
    if value in named:
        return named[value]
    file = Path(value)
    if not file.is_file():
        names = f"its templates: {', '.join(sorted(named))}" if named else "it has none"
        raise UserError(f"--chat-template {value}: no such file, nor a template of {folder} ({names}); "
                        "give a built-in one to a tokenizer with archlab tokenizer chat-template")
    try:
        source = file.read_text(encoding="utf-8")
        check_template_syntax(source)
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--chat-template {value}: cannot read it as UTF-8 text ({exc})") from None
    except ChatTemplateSyntaxError as exc:
        raise UserError(f"--chat-template {value}: {exc}") from None
    return source


def run_inspect_chat(args: argparse.Namespace) -> int:
    from archlab.data.chat import load_chat_data
    from archlab.errors import UserError
    from archlab.tokenizer.chat import ChatTokenizer

    if args.max_tokens is not None and args.max_tokens < 2:
        raise UserError(f"--max-tokens {args.max_tokens} must be at least 2")
    if args.show < 0:
        raise UserError(f"--show {args.show} must be >= 0")
    chat = ChatTokenizer.of(args.tokenizer)
    template = None if args.chat_template is None else _template_arg(args.chat_template, chat, args.tokenizer)
    data = load_chat_data(args.file, chat, mask=args.mask, max_tokens=args.max_tokens, truncation=args.truncation,
                          chat_template=template)
    tokens = sum(len(e.input_ids) for e in data.examples)
    scored = sum(e.n_scored for e in data.examples)
    longest = max((len(e.input_ids) for e in data.examples), default=0)
    print(f"{args.file}: {len(data.examples):,} examples, {tokens:,} tokens (longest {longest:,}), {scored:,} scored "
          f"with mask {args.mask!r} ({100 * scored / max(tokens, 1):.1f}%); {data.truncated} truncated "
          f"({args.truncation}), {data.skipped} skipped")
    for example in data.examples[:args.show]:
        print(f"\n-- line {example.line}: {len(example.input_ids)} tokens, {example.n_scored} scored "
              f"(between {SCORED[0]} and {SCORED[1]}):")
        print(_marked(chat.tokenizer, example))
    return 0


def _marked(tokenizer, example) -> str:
    """The example's text with each run of scored tokens (token j + 1 is scored when labels[j] is) bracketed."""
    from archlab.data.objectives import IGNORE

    flags = [False] + [label != IGNORE for label in example.labels[:-1]]
    out, start = [], 0
    for i in range(1, len(flags) + 1):
        if i == len(flags) or flags[i] != flags[start]:
            text = tokenizer.decode(example.input_ids[start:i])
            out.append(f"{SCORED[0]}{text}{SCORED[1]}" if flags[start] else text)
            start = i
    return "".join(out)
