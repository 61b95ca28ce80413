"""The `archlab` command: each subcommand group lives in its own module under archlab.cli.

A command module defines `register(subparsers)`, which adds its parsers and sets
`func=<callable taking the parsed args and returning an exit code>` on each.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# In the order `archlab --help` lists them.
COMMAND_MODULES = [
    "demo", "presets", "tokenizer", "data", "train", "generate", "convert", "lab", "diagnose",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="archlab",
        description="Build, train, compare and explain LM architectures. "
        "Example: archlab inspect llama2-7b --seq-len 4096",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        module_name = f"archlab.cli.{name}"
        if importlib.util.find_spec(module_name) is None:  # a command group not written yet
            continue
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
