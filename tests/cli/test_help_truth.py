"""What a command's --help says about itself is what it does: the defaults it names, the formats it converts."""
from __future__ import annotations

import argparse

from archlab.cli import build_parser


def _command(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _option_help(parser: argparse.ArgumentParser, flag: str) -> str:
    return " ".join(next(a for a in parser._actions if flag in a.option_strings).help.split())


def test_demo_out_names_every_demo_default_folder_and_which_are_replaced():
    text = _option_help(_command("demo"), "--out")
    for folder in ("runs/demo", "runs/demo-encoder", "runs/demo-encoder_decoder", "runs/demo-post-training",
                   "runs/demo-real-model"):
        assert folder in text, text
    assert "--overwrite" in text, text          # the real-model demo refuses a non-empty folder without it


def test_convert_description_names_every_direction():
    description = " ".join(_command("convert").description.split())
    for word in ("Hugging Face", "GGUF", "PEFT"):
        assert word in description, description
