"""The `archlab` command: each subcommand group lives in its own module under archlab.cli.

A command module defines `register(subparsers)`, which adds its parsers and sets
`func=<callable taking the parsed args and returning an exit code>` on each.

Errors go one way (archlab.errors): a `UserError` (or an OS error such as a missing file or a full
disk) prints one line `archlab COMMAND: error: ...` and exits 2; anything else is a bug and prints its
traceback with a request to report it. `ARCHLAB_DEBUG=1` shows tracebacks always.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from archlab.errors import one_line_warnings, report

# In the order `archlab --help` lists them.
COMMAND_MODULES = [
    "demo", "presets", "tokenizer", "data", "train", "finetune", "score", "generate", "chat", "fill_mask", "convert",
    "lab", "diagnose", "check", "serve", "ngram", "quantize",
]


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its usage errors as one line (`archlab train: error: ... (see --help)`), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="archlab",
        description="Build, train, compare and explain LM architectures. "
        "Example: archlab inspect llama2-7b --seq-len 4096",
    )
    from archlab import __version__
    parser.add_argument("--version", action="version", version=f"archlab {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"archlab.cli.{name}").register(subparsers)
    return parser


def _command_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)command parser `argv` reaches, e.g. `archlab tokenizer train`'s for ["tokenizer", "train", ...]."""
    for word in argv:
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subparsers or word not in subparsers[0].choices:
            continue
        parser = subparsers[0].choices[word]
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:       # named by the command typed, with its own --help (the top parser would say `archlab`)
        _command_parser(parser, argv).error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    prog = f"archlab {args.command}"
    with one_line_warnings(prog):
        try:
            status = int(args.func(args) or 0)
            sys.stdout.flush()      # a reader that left early shows here, inside the error path
            return status
        except SystemExit:
            raise
        except BaseException as exc:  # noqa: BLE001 - the CLI's one error path (archlab.errors)
            return report(exc, prog)


if __name__ == "__main__":
    sys.exit(main())
