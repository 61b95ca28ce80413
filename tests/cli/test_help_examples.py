"""Every `--set KEY=VALUE` a command's --help shows (in its examples and in the --set option's own help) names a
real key and a value it takes: a user who copies it gets no "unknown key"."""
from __future__ import annotations

import argparse
import re

import pytest

import archlab
from archlab.cli import build_parser
from archlab.cli.sets import parse_sets
from archlab.training.config import TrainConfig

PAIR = re.compile(r"(?<![\w.-])([a-z_][a-z0-9_.]*)=([^\s,;)\]]+)")   # lower-case keys: KEY=VALUE is a placeholder


def _commands(parser: argparse.ArgumentParser, prefix: str = "archlab") -> dict[str, argparse.ArgumentParser]:
    found = {prefix: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(_commands(sub, f"{prefix} {name}"))
    return found


def _set_pairs(parser: argparse.ArgumentParser) -> list[str]:
    """KEY=VALUE after each `--set` in the help text, and in the --set option's help (its examples)."""
    text = parser.format_help()
    pairs = [f"{k}={v}" for k, v in re.findall(r"--set\s+([a-z_][a-z0-9_.]*)=([^\s,;)\]]+)", text)]
    for action in parser._actions:
        if "--set" in action.option_strings and action.help:
            pairs += [f"{k}={v}" for k, v in PAIR.findall(action.help)]
    return sorted(set(pairs))


COMMANDS = _commands(build_parser())
CASES = [(name, pair) for name, parser in COMMANDS.items() for pair in _set_pairs(parser)]


def test_the_help_texts_show_set_examples():
    assert len(CASES) >= 10, CASES
    assert {"archlab train", "archlab finetune"} <= {name for name, _ in CASES}


@pytest.mark.parametrize("command, pair", CASES, ids=[f"{c.split()[-1]}:{p}" for c, p in CASES])
def test_every_set_example_in_every_help_is_a_real_key(command, pair):
    model, train = parse_sets([pair])
    if model:
        archlab.presets.tiny("llama2-7b").with_overrides(model)     # an unknown key: ConfigError naming it
    if train:   # a LoRA setting is checked on a LoRA run (an example shows it beside --lora-r)
        TrainConfig().with_overrides({"lora.r": "8", **train} if any(k.startswith("lora.") for k in train) else train)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_no_example_line_is_two_joined_by_a_lost_backslash(command):
    """A backslash at a line's end inside a plain Python string joins the lines: the help showed
    'train.lr=5e-6       --set train.dpo.beta=0.1' on one line."""
    import re

    joined = [line for line in COMMANDS[command].format_help().splitlines() if re.search(r"[^\s#] {3,}--\w", line)]
    assert not joined, joined
