"""`archlab demo --quick` runs every stage on a local corpus and leaves a complete run folder."""
from __future__ import annotations

import json
import random

import pytest

from archlab.cli import main as cli_main
from archlab.data.tokens import TokenDataset
from archlab.demo.run import run_demo

WORDS = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    rng = random.Random(0)
    for i in range(2):
        (folder / f"play{i}.txt").write_text(
            "\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(400)))
    return folder


def test_quick_demo_trains_and_leaves_a_run_folder(tmp_path, corpus):
    lines = []
    result = run_demo(tmp_path / "demo", quick=True, corpus=str(corpus), progress=False, log=lines.append)
    assert result.val_ppl_after < result.val_ppl_before
    assert result.sample.startswith("ROMEO:")
    # the 5-gram baseline, scored on the same validation targets as the model
    from archlab.eval.evaluate import evaluate
    from archlab.eval.ngram import evaluate_ngram
    from archlab.runs.model_folder import load_run
    scored = evaluate(load_run(tmp_path / "demo")[0], TokenDataset(tmp_path / "demo" / "data", "val"), batch_size=4,
                      seq_len=32, max_batches=2).tokens
    assert result.ngram_bpb == evaluate_ngram(tmp_path / "demo" / "data", [5], span=(1, 1 + scored))[0].bpb
    line = next(line for line in lines if "5-gram (modified Kneser-Ney) on the same bytes" in line)
    assert f"{result.ngram_bpb:.3f} bits/byte; the model: {result.val_bpb_after:.3f} bits/byte" in line
    for name in ("config.yaml", "metrics.jsonl", "loss_curve.png", "samples.txt", "tokenizer", "data"):
        assert (tmp_path / "demo" / name).exists(), name
    assert any("run folder:" in line and str(tmp_path / "demo") in line for line in lines)
    # a second demo replaces the first
    run_demo(tmp_path / "demo", quick=True, corpus=str(corpus), progress=False, log=lambda *_: None)


def test_demo_never_clears_a_folder_it_did_not_write(tmp_path, corpus, capsys):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("...")
    assert cli_main(["demo", "--quick", "--out", str(precious), "--corpus", str(corpus)]) == 2
    assert "not an earlier demo run" in capsys.readouterr().err
    assert (precious / "thesis.tex").exists()


def test_demo_never_clears_a_live_demo_or_its_own_corpus(tmp_path, corpus, capsys):
    import socket
    import time

    from archlab.demo.stages import MARKER
    live = tmp_path / "live"
    (live / "run").mkdir(parents=True)
    (live / MARKER).write_text("earlier demo")
    (live / "run" / ".lock").write_text(json.dumps({"pid": 1, "host": socket.gethostname(), "since": time.time(),
                                                    "heartbeat": time.time()}))      # pid 1: always alive
    assert cli_main(["demo", "--quick", "--out", str(live), "--corpus", str(corpus)]) == 2
    assert "pid 1 on" in capsys.readouterr().err and (live / "run" / ".lock").exists()
    assert cli_main(["demo", "--quick", "--out", str(corpus), "--corpus", str(corpus)]) == 2
    assert "is the input" in capsys.readouterr().err and len(list(corpus.iterdir())) == 2


def test_quick_encoder_demo_trains_a_masked_lm_and_fills_in_masks(tmp_path, corpus):
    from archlab.tokenizer import load

    lines = []
    result = run_demo(tmp_path / "enc", quick=True, corpus=str(corpus), progress=False, log=lines.append,
                      arch="encoder", prompt="to be or [MASK] to be, that is [MASK] question")
    assert result.val_loss_after < result.val_loss_before
    assert 0.0 <= result.val_accuracy_before <= 1.0 and 0.0 <= result.val_accuracy_after <= 1.0
    assert len(result.fill_mask.masks) == 2 and "[MASK]" not in result.fill_mask.filled
    for name in ("config.yaml", "metrics.jsonl", "loss_curve.png", "samples.txt", "tokenizer", "data"):
        assert (tmp_path / "enc" / name).exists(), name
    tok = load(tmp_path / "enc" / "tokenizer")
    assert tok.special_tokens == ["<|endoftext|>", "[MASK]"]          # end-of-text first: the data's separator
    assert json.loads((tmp_path / "enc" / "data" / "meta.json").read_text())["eot_id"] == tok.eot_id
    assert any("validation MLM loss" in line and "accuracy" in line for line in lines)
    assert any("filled: to be or" in line for line in lines)
    assert "fill-mask" in (tmp_path / "enc" / "samples.txt").read_text()


def test_encoder_demo_from_the_cli_uses_its_own_folder(tmp_path, corpus, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["demo", "--arch", "encoder", "--quick", "--corpus", str(corpus), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "runs" / "demo-encoder" / "config.yaml").exists() and not (tmp_path / "runs" / "demo").exists()
    assert "Juliet is" in out and "next: archlab fill-mask runs/demo-encoder" in out
    assert cli_main(["fill-mask", "runs/demo-encoder", "to be or [MASK] to be", "--top-k", "2"]) == 0
    assert "filled: to be or" in capsys.readouterr().out


def test_quick_encoder_decoder_demo_learns_span_corruption_and_fills_spans(tmp_path, corpus, monkeypatch, capsys):
    """From the CLI: a T5-style model trains on span corruption, the held-out line's spans are generated from the
    source with its sentinels, and `archlab generate --source` reads the run folder."""
    monkeypatch.chdir(tmp_path)
    assert cli_main(["demo", "--arch", "encoder_decoder", "--quick", "--corpus", str(corpus), "--no-progress"]) == 0
    out = capsys.readouterr().out
    run = tmp_path / "runs" / "demo-encoder_decoder"
    for name in ("config.yaml", "metrics.jsonl", "loss_curve.png", "samples.txt", "tokenizer", "data"):
        assert (run / name).exists(), name
    loss = [line for line in out.splitlines() if "validation loss on the held-out spans:" in line][0]
    before, after = (float(x) for x in loss.split(":")[-1].replace("before", "").split("after")[0].split("->"))
    assert after < before
    source = [line for line in out.splitlines() if line.strip().startswith("source:")][0]
    truth = [line for line in out.splitlines() if line.strip().startswith("truth:")][0]
    assert "<extra_id_0>" in source and truth.split()[1].startswith("<extra_id_0>")
    assert "span filling" in (run / "samples.txt").read_text()
    assert cli_main(["generate", str(run), "--source", "to be or <extra_id_0> to be", "--max-new-tokens", "4"]) == 0
