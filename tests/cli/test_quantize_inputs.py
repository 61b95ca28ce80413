"""`archlab quantize` checks its inputs before it loads the model (seconds on a real run): a run without a data
folder and no --text is refused in one line at once, nothing written; one with a data folder is scored on its
validation split."""
from __future__ import annotations

from pathlib import Path

import archlab
from archlab.cli import main
from archlab.interop.convert import _write_converted_run


def test_a_run_without_a_data_folder_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import archlab.runs.model_folder as model_folder

    run = tmp_path / "run"
    run.mkdir()
    _write_converted_run(run, archlab.TransformerLM(archlab.presets.tiny("llama3-8b")), {"test": True})

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the inputs were checked")

    monkeypatch.setattr(model_folder, "load_run", no_load)
    out = tmp_path / "q"
    assert main(["quantize", str(run), "--weights", "int8", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"{run} names no data folder with a validation split: pass --text FILE" in err, err
    assert not out.exists()


def test_without_text_the_runs_validation_split_is_scored(tmp_path, capsys):
    """No --text: the validation split of the data folder the run's config names, the first --max-tokens + 1 ids of
    it, is what both perplexities are measured on."""
    import shutil
    from pathlib import Path

    import torch
    import yaml

    from archlab.data.tokens import TokenDataset
    from archlab.eval.perplexity import perplexity
    from archlab.runs.model_folder import load_run

    run = tmp_path / "run"
    shutil.copytree(Path(__file__).parents[1] / "fixtures" / "run_v1", run)
    (tmp_path / "corpus").mkdir()
    for i in range(40):
        (tmp_path / "corpus" / f"d{i}.txt").write_text(f"document {i}: the quick brown fox jumps over the lazy dog.\n")
    assert main(["data", "prepare", "--corpus", str(tmp_path / "corpus"), "--tokenizer", "bytes", "--out",
                 str(tmp_path / "data"), "--workers", "0", "--quiet"]) == 0
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["data"]["dir"] = str(tmp_path / "data")
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    capsys.readouterr()
    assert main(["quantize", str(run), "--weights", "int8", "--out", str(tmp_path / "q"), "--seq-len", "16",
                 "--max-tokens", "40"]) == 0
    printed = capsys.readouterr().out
    ids = torch.tensor([int(i) for i in TokenDataset(str(tmp_path / "data"), "val").tokens[:41]])
    model, _ = load_run(run)
    assert f"perplexity on the validation split of {tmp_path / 'data'} (40 tokens" in printed, printed
    assert f"float {perplexity(model, ids, 16):.3f}" in printed, printed


def test_each_model_runs_once_per_window_and_the_figures_are_perplexitys(tmp_path, capsys, monkeypatch):
    """The float and int8 perplexities came from their own passes and compare_logits ran both models again: four
    forwards over the text where two give every figure (minutes on a real model, with nothing printed)."""
    import copy

    import torch

    from archlab.eval.perplexity import compare_logits, perplexity
    from archlab.models.decoder import TransformerLM
    from archlab.nn.int8 import quantize_int8

    torch.manual_seed(0)
    model = TransformerLM(archlab.presets.tiny("llama3-8b")).eval()
    ids = torch.randint(0, model.config.vocab_size, (70,))
    quantized = quantize_int8(copy.deepcopy(model)).eval()
    d = compare_logits(model, quantized, ids, 32)
    assert abs(d["ppl_a"] - perplexity(model, ids, 32)) < 1e-9 * d["ppl_a"]
    assert abs(d["ppl_b"] - perplexity(quantized, ids, 32)) < 1e-9 * d["ppl_b"]

    calls = []
    forward = TransformerLM.forward
    monkeypatch.setattr(TransformerLM, "forward", lambda self, *a, **k: (calls.append(1), forward(self, *a, **k))[1])
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 4)    # 180 bytes
    assert main(["quantize", str(Path(__file__).parents[1] / "fixtures" / "run_v1"), "--weights", "int8",
                 "--out", str(tmp_path / "q"), "--text", str(tmp_path / "text.txt"), "--seq-len", "32"]) == 0
    assert len(calls) == 2 * 6                                   # 179 predicted tokens: 6 windows of 32, each model
    assert "measuring float and int8 on 179 tokens" in capsys.readouterr().err
