"""The lab end to end with the real trainer: a tiny two-variant suite trained for a few steps, its
report (Markdown, HTML, PNGs, verdicts) and `archlab diagnose` on one of its runs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from archlab.cli import main
from archlab.lab import runner, suites
from archlab.lab.report import build_report
from archlab.lab.store import ResultStore
from archlab.lab.verdicts import HELD, INCONCLUSIVE, NOT_HELD, Rule


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    from archlab.data.prepare import prepare

    root = tmp_path_factory.mktemp("lab")
    text = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. "
    prepare([f"{i} {text * 30}" for i in range(20)], "bytes", root / "data", progress=False, num_workers=0)
    suite = suites.Suite(
        name="tiny_pos", claim="RoPE beats learned positions", seeds=2,
        axes=[{"name": "pos", "key": "position.kind", "values": ["learned", "rope"]}],
        base={"model": {"d_model": 32, "n_layers": 2, "attention.n_heads": 2, "mlp.d_ff": 64},
              "train": {"batch_size": 4, "seq_len": 16, "eval_every": 4, "eval_batches": 2, "warmup_steps": 2}},
        measure=["val_loss_2x", "sinks", "max_attn_logit"],
        rules=[Rule(kind="less", statement="rope below learned", a={"pos": "rope"}, b={"pos": "learned"}),
               Rule(kind="less", statement="rope extrapolates", metric="val_loss_2x", a={"pos": "rope"},
                    b={"pos": "learned"})],
    )
    rows = runner.run_suite(suite, root / "sweep", data_dir=root / "data", budget=8, progress=False)
    assert len(rows) == 4
    return root / "sweep"


def test_tiny_sweep_records_every_column(sweep):
    with ResultStore(sweep) as store:
        rows = store.runs("tiny_pos")
    assert {r.status for r in rows} == {"done"}
    for r in rows:
        assert r.steps == 8 and r.tokens_seen == 8 * 4 * 16
        assert r.final_val_loss is not None and r.best_val_loss <= r.final_val_loss + 1e-9
        assert r.params > 0 and r.flops_per_token > 0 and r.step_time_s > 0 and r.tokens_per_s > 0
        assert 0 < r.extra["first_token_mass"] <= 1 and r.extra["max_attn_logit"] > 0
        assert (Path(r.run_dir) / "metrics.jsonl").is_file()
        if r.extra["labels"]["pos"] == "learned":
            assert r.extra["val_loss_2x"] is None and "n/a" in r.extra["val_loss_2x_note"]
        else:
            assert r.extra["val_loss_2x"] > 0


def test_report_from_real_sweep(sweep, tmp_path):
    paths = build_report(sweep, tmp_path / "report")
    verdicts = json.loads(paths["json"].read_text())["tiny_pos"]
    assert [v["verdict"] in (HELD, NOT_HELD, INCONCLUSIVE) for v in verdicts] == [True, True]
    assert verdicts[1]["verdict"] == INCONCLUSIVE          # learned has no value at 2x: nothing to compare
    md = paths["md"].read_text()
    assert "rope below learned" in md and "val_loss_2x" in md and "n/a" in md
    html = paths["html"].read_text()
    for name in ("tiny_pos_curves.png", "tiny_pos_final_loss.png", "tiny_pos_step_time.png",
                 "tiny_pos_first_token_mass.png"):
        assert f"img/{name}" in html
        assert (tmp_path / "report" / "img" / name).stat().st_size > 1000


def test_cli_report_and_diagnose(sweep, tmp_path, capsys):
    assert main(["report", str(sweep), "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "report.html").is_file()
    run_dir = sweep / "runs" / "pos=rope" / "seed0"
    text = tmp_path / "t.txt"
    text.write_text("Whether 'tis nobler in the mind to suffer the slings and arrows.")
    assert main(["diagnose", str(run_dir), "--text", str(text), "--out", str(tmp_path / "d")]) == 0
    summary = json.loads((tmp_path / "d" / "summary.json").read_text())
    assert summary["summary"]["n_tokens"] == 16 and len(summary["layers"]) == 2   # clipped to max_seq_len
    assert "first-token attention mass" in capsys.readouterr().out
    assert main(["ablate", "--list"]) == 0
    assert main(["ablate", "no_such_suite"]) == 2


def test_ablate_set_takes_old_and_new_train_keys_typed(monkeypatch, tmp_path):
    """`--set train.eval_every=0` (an old flat key) reaches the runs typed, as does a current one: each value is read
    from the nested train config at its key's current dotted name (eval.every)."""
    seen: dict = {}
    monkeypatch.setattr(runner, "run_suite", lambda suite, out, **kw: seen.update(kw["train_overrides"]) or [])
    main(["ablate", "bias", "--set", "train.eval_every=0", "--set", "train.lr=1e-3", "--out", str(tmp_path / "s")])
    assert seen == {"eval_every": 0, "lr": 0.001}
