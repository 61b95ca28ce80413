"""Dead-unit fraction in `archlab diagnose`: on hand-made MLPs whose dead units are known (a zero row of the
ReLU's input weights is never positive; a row equal to the MLP's input at some token is positive there), for
relu, relu2 and reglu (its gate); None for GeLU-family MLPs; and in the command's output."""
from __future__ import annotations

import json

import pytest
import torch

from archlab.config import ModelConfig
from archlab.eval.diagnostics import dead_unit_fractions, diagnose
from archlab.models.decoder import TransformerLM

F_WIDTH = 8


def planted(activation: str, dead_per_layer, ids: torch.Tensor) -> TransformerLM:
    """Layer i: units 0..dead-1 have zero input weights (pre-activation 0 everywhere: dead); unit k >= dead reads
    the MLP's own input at token k mod t (pre-activation |x|^2 > 0 there: alive). Layers are set in order, each
    from its input under the layers before it."""
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=16, d_model=16, n_layers=len(dead_per_layer), max_seq_len=32,
                                      attention={"n_heads": 2}, mlp={"activation": activation, "d_ff": F_WIDTH},
                                      init={"std": 0.5})).eval()
    with torch.no_grad():
        for blk, dead in zip(model.blocks, dead_per_layer):
            seen: list[torch.Tensor] = []
            hook = blk.mlp.register_forward_pre_hook(lambda _m, args, seen=seen: seen.append(args[0].flatten(0, -2)))
            model(ids)
            hook.remove()
            x = seen[0]                                                              # (b t, d)
            w = (blk.mlp.gate_proj if blk.mlp.gate_proj is not None else blk.mlp.up_proj).weight   # (f, d)
            w[:dead] = 0.0
            for k in range(dead, F_WIDTH):
                w[k] = x[k % len(x)]
    return model


IDS = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("activation", ["relu", "relu2", "reglu"])
def test_planted_dead_units_are_counted(activation):
    assert dead_unit_fractions(planted(activation, (2, 0, 4), IDS), IDS) == [2 / 8, 0.0, 4 / 8]


def test_gelu_family_has_no_dead_units_to_count_and_the_summary_averages_layers():
    ids = IDS
    assert dead_unit_fractions(planted("swiglu", (2, 0, 4), ids), ids) == [None, None, None]
    result = diagnose(planted("relu", (2, 0, 4), ids), ids)
    assert [layer["dead_unit_fraction"] for layer in result["layers"]] == [0.25, 0.0, 0.5]
    assert result["summary"]["dead_unit_fraction"] == pytest.approx(0.25)
    assert diagnose(planted("gelu", (2, 0, 4), ids), ids)["summary"]["dead_unit_fraction"] is None


def test_diagnose_cli_prints_and_writes_the_dead_share(tmp_path, capsys):
    from archlab.cli import main
    from archlab.data.prepare import prepare

    prepare(["abc def " * 40] * 4, "bytes", tmp_path / "d", num_workers=0, progress=False)
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny:gpt2", "--data", str(tmp_path / "d"), "--out", str(run), "--no-progress",
                 "--set", "mlp.activation=relu", "--set", "d_model=32", "--set", "train.batch_size=1",
                 "--set", "train.seq_len=16", "--set", "train.budget=1", "--set", "train.eval_batches=1",
                 "--set", "train.sample_every=-1"]) == 0
    (tmp_path / "t.txt").write_text("abc def abc def abc")
    capsys.readouterr()
    assert main(["diagnose", str(run), "--text", str(tmp_path / "t.txt"), "--out", str(tmp_path / "diag")]) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "diag" / "summary.json").read_text())
    share = summary["summary"]["dead_unit_fraction"]
    assert 0.0 <= share <= 1.0 and f"dead MLP units {share:.1%}" in out and "  dead " in out


def test_a_model_without_relu_family_mlps_is_not_run_again():
    """The count needs a forward only where a ReLU-family MLP exists: on SmolLM2 (SwiGLU) `diagnose` ran a whole
    extra forward over the text to return 30 Nones."""
    model = planted("swiglu", (0, 0), IDS)
    calls = []
    model.register_forward_pre_hook(lambda _m, _args: calls.append(1))
    assert dead_unit_fractions(model, IDS) == [None, None] and calls == []
