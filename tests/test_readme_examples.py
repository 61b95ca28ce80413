"""The README's commands on the demo run work as written: each `archlab ... runs/demo ...` line of its
bash blocks runs (in-process, from a folder holding a demo-shaped run at runs/demo) and exits 0."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from archlab.cli import main
from archlab.demo.encoder_decoder import SENTINELS, encoder_decoder_demo_configs
from archlab.demo.run import demo_configs, encoder_demo_configs
from archlab.training.trainer import train

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_demo_commands() -> list[str]:
    """`archlab` lines in ```bash blocks that use runs/demo (comments dropped)."""
    commands, in_bash = [], False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            in_bash = line.strip() == "```bash"
            continue
        text = line.split("  #")[0].strip()
        serves = text.startswith("archlab serve")      # runs until stopped: tests/serve/test_serve.py covers it
        if in_bash and text.startswith("archlab ") and "runs/demo" in text and "..." not in text and not serves:
            commands.append(text)
    return commands


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory):
    """A folder whose runs/demo has the demo's model and context (256 tokens), briefly trained, whose
    runs/demo-encoder has the encoder demo's model and runs/demo-encoder_decoder the encoder-decoder demo's."""
    from archlab.data.prepare import prepare
    from archlab.tokenizer import Tokenizer, train_bpe

    root = tmp_path_factory.mktemp("readme")
    corpus = root / "corpus.txt"
    corpus.write_text("ROMEO: But soft, what light through yonder window breaks? " * 200)
    vocab, merges = train_bpe(str(corpus), 320, ["<|endoftext|>"])
    prepare([corpus.read_text()] * 8, Tokenizer(vocab, merges, ["<|endoftext|>"]), root / "data",
            num_workers=0, progress=False)
    model, cfg = demo_configs(quick=False, vocab_size=len(vocab), minutes=1)
    cfg = cfg.with_overrides({"budget": 2, "budget_unit": "steps", "batch_size": 2, "eval_batches": 1,
                              "dtype": "float32"})
    train(model, cfg, root / "data", root / "runs" / "demo", progress=False)
    # runs/demo-encoder: the encoder demo's model, on a tokenizer with [MASK]
    specials = ["<|endoftext|>", "[MASK]"]
    vocab, merges = train_bpe(str(corpus), 320, specials)
    prepare([corpus.read_text()] * 8, Tokenizer(vocab, merges, specials), root / "mlm_data", num_workers=0,
            progress=False)
    model, _ = encoder_demo_configs(quick=False, vocab_size=len(vocab), minutes=1)
    train(model, cfg, root / "mlm_data", root / "runs" / "demo-encoder", progress=False)
    # runs/demo-encoder_decoder: the encoder-decoder demo's model, on a tokenizer with T5's sentinels
    specials = ["<|endoftext|>", *SENTINELS]
    vocab, merges = train_bpe(str(corpus), 340, specials)
    prepare([corpus.read_text()] * 8, Tokenizer(vocab, merges, specials), root / "s2s_data", num_workers=0,
            progress=False)
    model, s2s_cfg = encoder_decoder_demo_configs(quick=False, vocab_size=len(vocab), minutes=1, start_id=0)
    s2s_cfg = s2s_cfg.with_overrides({"budget": 2, "budget_unit": "steps", "batch_size": 2, "eval_batches": 1,
                                      "dtype": "float32"})
    train(model, s2s_cfg, root / "s2s_data", root / "runs" / "demo-encoder_decoder", progress=False)
    (root / "some.txt").write_text("ROMEO: But soft, what light through yonder window breaks? " * 10)
    return root


def test_the_readme_has_demo_commands():
    commands = readme_demo_commands()
    assert len(commands) >= 4 and any("--sink-window" in c for c in commands)


@pytest.mark.parametrize("command", readme_demo_commands())
def test_a_readme_command_runs_as_written_on_the_demo_run(demo_folder, monkeypatch, capsys, command):
    monkeypatch.chdir(demo_folder)
    argv = shlex.split(command)[1:]
    if "--max-new-tokens" in argv:        # the same command, fewer tokens: it is the flags that are checked
        i = argv.index("--max-new-tokens")
        argv[i + 1] = str(min(int(argv[i + 1]), 300))
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert not re.search(r"error:", captured.err)
