"""`archlab tokenizer train|stats`: train BPE / WordPiece / Unigram tokenizers and measure them."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

TRAIN_EXAMPLE = """example:
  archlab tokenizer train --input shakespeare --vocab-size 10000 --kind bpe \\
      --special-tokens '<|endoftext|>' --out runs/tok-shakespeare
  archlab tokenizer train --input a.txt notes/ --vocab-size 8000 --kind unigram --out runs/tok-uni"""

STATS_EXAMPLE = """example:
  archlab tokenizer stats runs/tok-shakespeare --input shakespeare-folio"""

CHAT_EXAMPLE = """example:
  archlab tokenizer chat-template runs/tok-shakespeare --format chatml
  archlab tokenizer chat-template runs/tok-shakespeare --format llama3 --overwrite

formats: chatml (<|im_start|>role ... <|im_end|>), llama3 (<|start_header_id|>role<|end_header_id|> ...
<|eot_id|>), plain (User: / Assistant:, the answer ends with the end-of-text token)"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "tokenizer", help="train and inspect tokenizers (BPE, WordPiece, Unigram)",
        description="Train and inspect tokenizers. Example: archlab tokenizer train --input corpus.txt "
        "--vocab-size 10000 --out runs/tok",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="tokenizer_command", metavar="SUBCOMMAND")
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])

    train = sub.add_parser(
        "train", help="train a tokenizer and save it as a folder holding tokenizer.json",
        description="Train a tokenizer on text files and save it as a folder holding tokenizer.json "
        "(loadable by archlab.tokenizer.load and by HF tokenizers).\n\n" + TRAIN_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("--input", nargs="+", required=True, metavar="CORPUS",
                       help="text files, folders (searched recursively) or built-in corpus names as `data "
                       "prepare --corpus` takes them (shakespeare, pystdlib, ...), e.g. --input corpus/ extra.txt")
    train.add_argument("--vocab-size", type=int, required=True, metavar="N",
                       help="final vocabulary size including special tokens, e.g. --vocab-size 10000")
    train.add_argument("--kind", choices=["bpe", "wordpiece", "unigram"], default="bpe",
                       help="tokenizer algorithm (default: bpe, byte-level as in GPT-2), e.g. --kind unigram")
    train.add_argument("--special-tokens", nargs="*", default=["<|endoftext|>"], metavar="TOKEN",
                       help="special tokens, never merged across (default: <|endoftext|>), "
                       "e.g. --special-tokens '<|endoftext|>' '<|pad|>'")
    train.add_argument("--out", required=True, metavar="DIR",
                       help="output folder for tokenizer.json (new or empty), e.g. --out runs/tok-10k")
    train.add_argument("--overwrite", action="store_true",
                       help="replace an existing --out folder (atomically: a failure leaves the old one intact)")
    train.add_argument("--workers", type=int, default=None, metavar="N",
                       help="pre-tokenization processes (default: all CPUs), e.g. --workers 4")
    train.add_argument("--no-progress", action="store_true", help="hide the progress bar, e.g. in CI logs")
    train.set_defaults(func=cmd_train)

    stats = sub.add_parser(
        "stats", help="bytes per token and vocabulary use of a saved tokenizer on some text",
        description="Encode files with a saved tokenizer and report bytes per token and the share of the "
        "vocabulary used.\n\n" + STATS_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    stats.add_argument("dir", metavar="DIR",
                       help="folder holding tokenizer.json (or the file), e.g. runs/tok-shakespeare")
    stats.add_argument("--input", nargs="+", required=True, metavar="CORPUS",
                       help="text to encode: files, folders or built-in corpus names, e.g. --input data/valid.txt")
    stats.add_argument("--json", action="store_true", help="print the numbers as one JSON object, e.g. for scripts")
    stats.add_argument("--top", type=int, default=10, metavar="K",
                       help="also list the K most frequent tokens (default 10), e.g. --top 20")
    stats.set_defaults(func=cmd_stats)

    chat = sub.add_parser(
        "chat-template", help="give a tokenizer a built-in chat template and its special tokens",
        description="Add a built-in chat format to a tokenizer folder: its special tokens into tokenizer.json "
        "(new ids after the vocabulary) and its Jinja template as chat_template.jinja. A run's or a prepared data "
        "folder's tokenizer takes no token past the vocabulary its model or token files were made with (finetune "
        "--chat-template grows a model's embedding instead).\n\n" + CHAT_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    chat.add_argument("dir", metavar="DIR", help="folder holding tokenizer.json, e.g. runs/tok-shakespeare")
    chat.add_argument("--format", required=True, metavar="NAME",
                      help="chatml, llama3 or plain, e.g. --format chatml")
    chat.add_argument("--overwrite", action="store_true", help="replace a chat template the folder has already")
    chat.set_defaults(func=cmd_chat_template)


def text_files(inputs: list[str]) -> list[Path]:
    """The files of --input: built-in corpus names as `data prepare --corpus` reads them, files and folders
    as they are; a binary file (a prepared folder's train.bin) is refused, naming it."""
    from archlab.data.corpora import BUILTIN_CORPORA, corpus_files, first_nul
    from archlab.errors import UserError
    from archlab.tokenizer.pretokenize import resolve_inputs

    files: list[Path] = []
    for item in inputs:
        if item in BUILTIN_CORPORA:
            files += corpus_files(item)
        elif not Path(item).exists():
            raise UserError(f"--input {item}: no such file or folder, nor a built-in corpus "
                            f"({', '.join(BUILTIN_CORPORA)})")
        else:
            files += resolve_inputs(item)
    for path in files:
        offset = first_nul(path)
        if offset is not None:
            raise UserError(f"--input: {path} is binary (a NUL byte at offset {offset:,}), not text: give the "
                            "text a data folder was prepared from (a corpus name, files or folders of text)")
    return files


def cmd_train(args) -> int:
    import archlab.tokenizer as tk
    from archlab.data.corpora import scan_files
    from archlab.errors import UserError
    from archlab.progress import progress_bar
    from archlab.runs.outputs import check_output, fresh_output

    # every check before any work (and before the progress bar)
    if args.vocab_size <= 0:
        raise UserError(f"--vocab-size {args.vocab_size} must be positive")
    for token in args.special_tokens:
        if not token:
            raise UserError("--special-tokens: an empty string is not a token")
    files = text_files(args.input)
    check_output(args.out, inputs=[*(i for i in args.input if Path(i).exists()), *map(str, files)],
                 overwrite=args.overwrite)
    report = scan_files(files)
    if not report.clean:
        print(f"warning: {report.summary()}", file=sys.stderr)
    start = time.perf_counter()
    bar = None if args.no_progress else progress_bar(total=args.vocab_size, desc=f"train {args.kind}", unit="tok")

    def progress(n: int) -> None:
        if bar is not None:
            done = n + 256 + len(args.special_tokens) if args.kind == "bpe" else n
            bar.update(max(0, min(done, args.vocab_size) - bar.n))

    try:
        tok = tk.train(files, args.vocab_size, args.special_tokens, kind=args.kind,
                       num_workers=args.workers, progress=progress)
        if bar is not None:
            bar.update(max(0, tok.vocab_size - bar.n))
    except ValueError as e:   # the trainers' argument checks (vocab too small for the alphabet, ...)
        raise UserError(str(e)) from e
    finally:
        if bar is not None:
            bar.close()
    with fresh_output(args.out, overwrite=args.overwrite, inputs=args.input) as tmp:
        tok.save(tmp)
    out = Path(args.out)
    print(f"{args.kind} tokenizer with {tok.vocab_size} tokens saved to {out / 'tokenizer.json'} "
          f"({time.perf_counter() - start:.1f} s)")
    if tok.vocab_size < args.vocab_size:
        print(f"note: {tok.vocab_size:,} tokens, not the {args.vocab_size:,} asked for: the training text yields "
              "no more (more text does)", file=sys.stderr)
    return 0


def cmd_stats(args) -> int:
    import archlab.tokenizer as tk
    from archlab.errors import UserError
    if args.top < 0:
        raise UserError(f"--top {args.top} must be >= 0")
    files = text_files(args.input)
    try:
        tok = tk.load(args.dir)
    except (ValueError, KeyError) as e:   # a tokenizer.json that is not one
        raise UserError(f"{args.dir}: not a readable tokenizer ({e})") from e
    counts: Counter = Counter()
    n_bytes = 0
    start = time.perf_counter()
    for f in files:
        with open(f, encoding="utf-8", errors="replace", newline="") as fh:
            text = fh.read()
        n_bytes += len(text.encode("utf-8"))
        counts.update(tok.encode(text))
    seconds = time.perf_counter() - start
    n_tokens = sum(counts.values())
    result = {
        "tokenizer": str(Path(args.dir)), "kind": tok.kind, "vocab_size": tok.vocab_size,
        "files": len(files), "bytes": n_bytes, "tokens": n_tokens,
        "bytes_per_token": n_bytes / n_tokens if n_tokens else 0.0,
        "vocab_used": len(counts), "vocab_used_fraction": len(counts) / tok.vocab_size,
        "encode_mb_per_s": n_bytes / 1e6 / seconds if seconds > 0 else 0.0,
        "top_tokens": [[tok.decode([i]), c] for i, c in counts.most_common(args.top)],
    }
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
        return 0
    print(f"{result['kind']} tokenizer, {tok.vocab_size} tokens: {n_bytes:,} bytes -> {n_tokens:,} tokens "
          f"= {result['bytes_per_token']:.3f} bytes/token")
    print(f"vocabulary used: {len(counts):,} / {tok.vocab_size:,} ({100 * result['vocab_used_fraction']:.1f}%)")
    print(f"encoding speed: {result['encode_mb_per_s']:.2f} MB/s")
    for text, c in result["top_tokens"]:
        print(f"  {c:>10,}  {text!r}")
    return 0


def _bound_vocab(owner: Path) -> tuple[str, int] | None:
    """("run" | "data folder", the vocabulary size its model or token files were made with) when `owner` is a run
    or a prepared data folder; None otherwise."""
    import yaml

    try:
        if (owner / "config.yaml").is_file():
            return "run", int(yaml.safe_load((owner / "config.yaml").read_text())["model"]["vocab_size"])
        if (owner / "meta.json").is_file():
            return "data folder", int(json.loads((owner / "meta.json").read_text())["vocab_size"])
    except (KeyError, TypeError, ValueError, yaml.YAMLError):
        return None                                   # not one of archlab's: nothing is bound to this tokenizer
    return None


def _refuse_a_bound_tokenizer(folder: Path, name: str) -> None:
    """A run's or a prepared data folder's tokenizer may take a template, but no token past the vocabulary its
    model (or token files) was made with: the model would have no row for it, and the run could no longer chat
    or generate. Checked before anything is written, with the live-writer check every writing command runs."""
    from archlab.errors import UserError
    from archlab.runs.outputs import check_output
    from archlab.tokenizer.chat_builtin import add_chat_tokens
    from archlab.tokenizer.loading import load

    check_output(folder, inputs=(), overwrite=True, out_flag="DIR")      # not inside a folder a live process writes
    owner = folder.parent if folder.name else Path(os.path.realpath(folder)).parent
    bound = _bound_vocab(owner)
    if bound is None or not (folder / "tokenizer.json").is_file():
        return
    kind, vocab = bound
    _, new_ids = add_chat_tokens(load(folder), name)
    if new_ids and max(new_ids) >= vocab:
        fix = (f"fine-tune with `archlab finetune {owner} --chat-template {name} ...`, which grows the embedding"
               if kind == "run" else f"give a copy the template (cp -r {folder} tok-{name}) and prepare with it")
        raise UserError(f"{folder} is the tokenizer of the {kind} {owner}, made for {vocab} ids: --format {name} "
                        f"would add special tokens {new_ids[0]}..{new_ids[-1]} past them; {fix}")


def cmd_chat_template(args) -> int:
    from archlab.tokenizer.chat_builtin import install_chat_template
    from archlab.tokenizer.loading import load

    _refuse_a_bound_tokenizer(Path(args.dir), args.format)
    new_ids = install_chat_template(args.dir, args.format, overwrite=args.overwrite)
    size = load(args.dir).vocab_size
    added = f"added {len(new_ids)} special tokens (ids {new_ids[0]}..{new_ids[-1]})" if new_ids else "no new tokens"
    print(f"{args.format} chat template written to {Path(args.dir) / 'chat_template.jinja'}; {added}; "
          f"vocabulary {size} tokens (a model needs vocab_size >= {size})")
    return 0
