"""`convert --to-peft` of a run no Hugging Face family expresses: one short line naming the closest family, said
before the --out checks (it used to ask for --overwrite first, then print every family's differences)."""
from __future__ import annotations

import random

import archlab
from archlab.cli import main
from archlab.data.prepare import prepare
from archlab.nn.lora import LoRAConfig
from archlab.training.trainer import TrainConfig, fit_vocab, train


def test_a_run_no_family_expresses_is_one_short_line_before_the_overwrite_check(tmp_path, capsys):
    rng = random.Random(0)
    prepare([" ".join(rng.choice("ab cd ef gh".split()) for _ in range(100)) for _ in range(10)], "bytes",
            tmp_path / "data", num_workers=0, progress=False)
    cfg = fit_vocab(archlab.presets.tiny("bloom-176b", d_model=32), tmp_path / "data")      # d_ff 128: not BLOOM's 4d
    train(cfg, TrainConfig(budget=1, batch_size=2, seq_len=16, eval_every=0, sample_every=-1, lora=LoRAConfig(r=2),
                           memory_check=False), tmp_path / "data", tmp_path / "run", progress=False)
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "old.txt").write_text("kept")
    capsys.readouterr()
    assert main(["convert", "--to-peft", str(tmp_path / "run"), "--out", str(tmp_path / "adapter")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) < 400, err
    assert "no Hugging Face family expresses this run's model (closest: bloom: differs in mlp.d_ff)" in err
    assert (tmp_path / "adapter" / "old.txt").read_text() == "kept"
