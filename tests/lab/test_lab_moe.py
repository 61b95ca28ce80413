"""The moe suite's pieces: matching at equal active parameters, the above / below rules against a threshold, and the
report's expert-load section read from metrics.jsonl."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from archlab.lab import suites
from archlab.lab.matching import active_param_count, param_count
from archlab.lab.moe_report import read_load, section
from archlab.lab.plan import plan
from archlab.lab.store import RunRecord
from archlab.lab.verdicts import HELD, INCONCLUSIVE, NOT_HELD, Rule, judge, tolerance


def test_the_moe_suite_matches_active_parameters_to_dense():
    planned = {p.variant.name: p.model for p in plan(suites.BUILTIN["moe"], Path("/nonexistent"), vocab_size=257)
               if p.seed == 0}
    dense = planned.pop("dense")
    assert dense.mlp.moe is None and dense.d_ff == 172
    for name, cfg in planned.items():
        assert cfg.mlp.moe.n_experts == 8 and cfg.mlp.moe.top_k == 2
        # 2 experts of half the width (+ the router) pass as many parameters per token as the dense MLP
        assert abs(active_param_count(cfg) / param_count(dense) - 1) < 0.02, name
        assert param_count(cfg) > 2.5 * param_count(dense)
    assert planned["moe8-top2,balance=bias"].mlp.moe.balance == "bias"
    assert planned["moe8-top2,balance=none"].mlp.moe.aux_loss_coef == 0


def _rows(values: list[float]) -> list[RunRecord]:
    return [RunRecord(suite="s", variant="v", seed=seed, status="done",
                      extra={"labels": {"balance": "none"}, "busiest_expert_share": x})
            for seed, x in enumerate(values)]


@pytest.mark.parametrize("kind, values, verdict", [
    ("above", [0.62, 0.58, 0.60], HELD),           # mean 0.60, std 0.02: 0.10 above 0.5
    ("above", [0.52, 0.48, 0.50], INCONCLUSIVE),   # at the threshold, within one std
    ("above", [0.30, 0.34, 0.32], NOT_HELD),
    ("below", [0.30, 0.34, 0.32], HELD),
    ("below", [0.62, 0.58, 0.60], NOT_HELD),
    ("above", [0.9], INCONCLUSIVE),                # one seed: no spread
])
def test_threshold_rules(kind, values, verdict):
    rule = Rule(kind=kind, metric="busiest_expert_share", a={"balance": "none"}, expected=0.5, statement="s")
    got = judge(rule, _rows(values))
    assert got.verdict == verdict, got.reason
    assert "0.5" in tolerance(rule)


def test_a_threshold_rule_needs_its_threshold():
    with pytest.raises(ValueError, match="needs `expected`"):
        Rule(kind="below", metric="busiest_expert_share", statement="s")


def _run(folder: Path, tables: list[list[list[float]]]) -> str:
    folder.mkdir(parents=True)
    lines = [{"step": 10 * (i + 1), "loss": 3.0, "moe/max_expert_fraction": max(max(r) for r in t),
              "moe/expert_fraction": t} for i, t in enumerate(tables)]
    lines.append({"step": 10 * len(tables), "val_loss": 2.5})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(folder)


def test_the_report_draws_each_layers_load_from_metrics(tmp_path):
    moe = {"model": {"mlp": {"moe": {"n_experts": 4, "top_k": 2}}}}
    first = [[[0.5, 0.3, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]], [[0.4, 0.3, 0.2, 0.1], [0.7, 0.1, 0.1, 0.1]]]
    rows = [RunRecord(suite="s", variant="moe", seed=0, status="done", config=moe, run_dir=_run(tmp_path / "a", first),
                      extra={"expert_load_first_choice": [[0.9, 0.1, 0, 0], [0.5, 0.5, 0, 0]],
                             "expert_load_routed": [[0.5, 0.3, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]]}),
            RunRecord(suite="s", variant="dense", seed=0, status="done", config={"model": {"mlp": {"moe": None}}},
                      run_dir=_run(tmp_path / "b", []))]
    steps, busiest, table = read_load(rows[0].run_dir)
    assert steps == [10, 20] and busiest == [0.5, 0.7] and table == first[-1]
    assert read_load(rows[1].run_dir) == ([], [], None)
    blocks = section(suites.BUILTIN["moe"], rows, tmp_path / "img", "img")
    measured = next(b for b in blocks if b.kind == "table")
    assert measured.rows == [["moe", "90% / 50% (mean 70.0%)", "50% / 25% (mean 37.5%)"]]   # dense has no row
    images = [b.text for b in blocks if b.kind == "img"]
    assert images == ["img/moe_expert_load.png", "img/moe_busiest_expert.png"]
    assert all((tmp_path / i).stat().st_size > 0 for i in images)
    assert section(suites.BUILTIN["moe"], rows[1:], tmp_path / "img", "img") == []    # no MoE run, no section


@pytest.mark.slow
def test_a_sweep_measures_the_expert_load_and_reports_it(tmp_path):
    """The real trainer on a 2-variant suite (3 steps): the MoE run's row carries the measured shares, the dense
    one none, and the report holds the expert-load section with its figures."""
    from archlab.data.prepare import prepare
    from archlab.lab import runner
    from archlab.lab.report import build_report

    prepare(["to be or not to be, that is the question " * 30] * 10, "bytes", tmp_path / "data", progress=False,
            num_workers=0)
    suite = suites.Suite(
        name="tiny_moe", claim="c", seeds=1, measure=["expert_load"],
        variants=[{"label": "dense", "set": {}, "labels": {"mlp": "dense"}},
                  {"label": "moe", "set": {"mlp.moe.n_experts": 4, "mlp.moe.top_k": 2, "mlp.moe.balance": "bias"},
                   "labels": {"mlp": "moe"}}],
        base={"model": {"d_model": 16, "n_layers": 2, "attention.n_heads": 2, "mlp.d_ff": 16},
              "train": {"batch_size": 2, "seq_len": 16, "eval_every": 0, "eval_batches": 2, "warmup_steps": 1,
                        "log_every": 1}})
    rows = {r.variant: r for r in runner.run_suite(suite, tmp_path / "sweep", data_dir=tmp_path / "data", budget=3,
                                                   progress=False)}
    assert "busiest_expert_share" not in rows["dense"].extra
    extra = rows["moe"].extra
    first, routed = extra["expert_load_first_choice"], extra["expert_load_routed"]
    assert len(first) == len(routed) == 2 and all(len(row) == 4 and abs(sum(row) - 1) < 1e-6 for row in first)
    assert extra["busiest_expert_share"] == pytest.approx(sum(max(row) for row in first) / 2)
    assert 0.25 <= extra["busiest_routed_share"] <= 0.5       # top 2: at most one of each token's two slots
    paths = build_report(tmp_path / "sweep")
    text = paths["md"].read_text()
    assert "### Expert load per layer" in text and "img/tiny_moe_expert_load.png" in text
    assert (paths["md"].parent / "img" / "tiny_moe_busiest_expert.png").is_file()
