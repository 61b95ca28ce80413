"""The lab: suite expansion, parameter matching, verdict rules, the resumable runner (with a fake
trainer) and the results store."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from archlab.config import ConfigError, ModelConfig
from archlab.lab import matching, runner, suites
from archlab.lab.plan import plan
from archlab.lab.store import ResultStore, RunRecord
from archlab.lab.verdicts import HELD, INCONCLUSIVE, NOT_HELD, Rule, judge, lr_sensitivity, tolerance


# --------------------------------------------------------------------------- suites
@pytest.mark.parametrize("name", suites.names())
def test_every_builtin_suite_expands_to_valid_configs(name, tmp_path):
    suite = suites.BUILTIN[name]
    model = None
    if suite.runs == "real_model":         # a run folder stands in for the packaged model (the models extra)
        (tmp_path / "config.yaml").write_text("model: {}\n")
        model = str(tmp_path)
    planned = plan(suite, Path("/nonexistent"), vocab_size=257, model=model)
    variants = suite.expand()
    assert len(planned) == len(variants) * suite.seeds
    assert len({(p.variant.name, p.seed) for p in planned}) == len(planned)
    for p in planned:
        assert p.model.max_seq_len == p.train.seq_len   # learned positions sized to the training length
        # the data's vocabulary, unless a variant pads it (rank_collapse: a spare id as the encoder's [MASK])
        assert p.model.vocab_size == p.variant.model.get("vocab_size", 257)
        assert p.model.seed == p.seed == p.train.seed
    # every rule selects at least one variant on each side
    for rule in suite.rules:
        for sel in (rule.a, rule.b):
            if sel is not None:
                from archlab.lab.verdicts import selects
                assert any(selects(sel, v.labels) for v in variants), (rule.statement, sel)


def test_axes_product_and_explicit_variants():
    suite = suites.Suite(
        name="t", claim="c",
        axes=[{"name": "norm", "key": "norm.kind", "values": ["layernorm", "rmsnorm"]},
              {"name": "lr", "values": [{"label": "1e-3", "set": {"train.lr": 1e-3}},
                                        {"label": "1e-2", "set": {"train.lr": 1e-2}}]}],
        variants=[{"label": "extra", "set": {"block.parallel": True, "train.weight_decay": 0.0}}],
    )
    vs = suite.expand()
    assert [v.name for v in vs] == ["norm=layernorm,lr=1e-3", "norm=layernorm,lr=1e-2",
                                    "norm=rmsnorm,lr=1e-3", "norm=rmsnorm,lr=1e-2", "extra"]
    assert vs[1].model == {"norm.kind": "layernorm"} and vs[1].train == {"lr": 1e-2}
    assert vs[1].labels == {"norm": "layernorm", "lr": "1e-2"}
    assert vs[-1].model == {"block.parallel": True} and vs[-1].train == {"weight_decay": 0.0}



def test_a_nested_and_a_flat_train_key_merge_into_one_the_later_layer_winning(tmp_path):
    from archlab.runs.train_section import merge_train

    assert merge_train({"eval_every": 100, "lr": 0.1}, {"train.eval.every": 50}) == {"lr": 0.1, "eval.every": 50}
    assert merge_train({"eval.every": 50}, {"eval_every": 7}) == {"eval.every": 7}
    nested = suites.Suite(name="t", claim="c", base={"train": {"eval.every": 30}}, axes=[{"name": "e", "values": [
        {"label": "flat", "set": {"train.eval_every": 7}}, {"label": "none", "set": {}}]}])
    merged = nested.base_overrides("small")[1]
    assert merged["eval.every"] == 30 and "eval_every" not in merged        # BASE_TRAIN's eval_every is replaced
    runs = plan(nested, tmp_path, vocab_size=257, train_overrides={"eval.every": 50})     # --set train.eval.every=50
    assert {r.variant.name: r.train.eval.every for r in runs} == {"e=flat": 7, "e=none": 50}   # the variant's wins

def test_suite_yaml_roundtrip_and_errors(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("""
name: mine
claim: rmsnorm is as good
axes:
  - {name: norm, key: norm.kind, values: [layernorm, rmsnorm]}
seeds: 3
rules:
  - {kind: parity, a: {norm: rmsnorm}, b: {norm: layernorm}, tol: 0.02, statement: parity}
""")
    suite = suites.load(path)
    assert suite.seeds == 3 and suite.rules[0].kind == "parity" and len(suite.expand()) == 2
    assert suites.Suite.from_dict(suite.to_dict()).expand() == suite.expand()
    with pytest.raises(ConfigError, match="neither a built-in suite"):
        suites.load("no-such-suite")
    with pytest.raises(ConfigError, match="unknown suite field"):
        suites.Suite.from_dict({"name": "x", "claim": "y", "axes": [], "colour": 1})
    bad = suites.Suite(name="b", claim="c", axes=[{"name": "x", "key": "norm.kind", "values": ["nope"]}])
    with pytest.raises(ConfigError, match="variant norm=nope.*norm.kind='nope'|norm.kind"):
        plan(bad, tmp_path, vocab_size=257)


# --------------------------------------------------------------------------- matching
def test_gated_mlp_matched_to_plain_by_params_has_two_thirds_width():
    base = ModelConfig(vocab_size=257, d_model=64, n_layers=4, attention={"n_heads": 4},
                       mlp={"activation": "relu", "d_ff": 256})
    target = matching.param_count(base)
    gated = base.with_overrides({"mlp.activation": "swiglu"})
    res = matching.match(gated, target, by="params", tolerance=0.01)
    assert abs(res.measure - target) / target <= 0.01
    assert res.value == pytest.approx(256 * 2 / 3, abs=2)           # Shazeer 2020's 2/3 rule
    # the count it matched is the built model's
    from archlab.models.decoder import TransformerLM
    assert TransformerLM(res.config).num_params() == res.measure


def test_match_d_model_for_depth_and_by_flops():
    base = ModelConfig(vocab_size=257, d_model=64, n_layers=4, attention={"n_heads": 4, "head_dim": 16},
                       mlp={"d_ff": None, "d_ff_ratio": 4.0})
    target = matching.param_count(base)
    deep = base.with_overrides({"n_layers": 8})
    res = matching.match(deep, target, knob="d_model", tolerance=0.02)
    assert res.config.d_model < 64 and abs(res.rel_error) <= 0.02
    flops = matching.flops_per_token(base, 64)
    res_f = matching.match(base.with_overrides({"mlp.activation": "relu"}), flops, by="flops", seq_len=64,
                           tolerance=0.02)
    assert abs(matching.flops_per_token(res_f.config, 64) - flops) / flops <= 0.02


def test_match_reports_an_unreachable_tolerance():
    base = ModelConfig(vocab_size=257, d_model=64, n_layers=2, attention={"n_heads": 4}, mlp={"d_ff": 128})
    target = matching.param_count(base) + 7          # off by 7 params, knob moves in steps of 64 * 3
    with pytest.raises(matching.MatchError, match="tolerance"):
        matching.match(base, target, multiple=64, tolerance=1e-9)


# --------------------------------------------------------------------------- verdicts
def _rows(values: dict[str, list[float]], metric="final_val_loss", axis="v", diverged=()):
    rows = []
    for variant, vals in values.items():
        for seed, x in enumerate(vals):
            r = RunRecord(suite="s", variant=variant, seed=seed, status="done",
                          config={"model": {"vocab_size": 257}}, extra={"labels": {axis: variant}})
            if metric in ("final_val_loss", "step_time_s"):
                setattr(r, metric, x)
            else:
                r.extra[metric] = x
            if (variant, seed) in diverged:
                r.status, r.diverged, r.final_val_loss = "diverged", True, None
            rows.append(r)
    return rows


def test_less_rule_held_not_held_inconclusive():
    rule = Rule(kind="less", statement="A below B", a={"v": "A"}, b={"v": "B"})
    assert judge(rule, _rows({"A": [2.00, 2.02, 2.01], "B": [2.10, 2.12, 2.11]})).verdict == HELD
    assert judge(rule, _rows({"A": [2.10, 2.12, 2.11], "B": [2.00, 2.02, 2.01]})).verdict == NOT_HELD
    # gap 0.02, spread sqrt(0.1^2 + 0.1^2) = 0.14: the seeds cover the gap
    v = judge(rule, _rows({"A": [1.9, 2.0, 2.1], "B": [1.92, 2.02, 2.12]}))
    assert v.verdict == INCONCLUSIVE and v.numbers["spread"] == pytest.approx(math.sqrt(0.02), rel=1e-6)
    assert judge(rule, _rows({"A": [2.0], "B": [3.0]})).verdict == INCONCLUSIVE   # one seed: no spread
    assert judge(rule, _rows({"A": [2.0, 2.1]})).verdict == INCONCLUSIVE          # no B at all


def test_less_rule_with_a_margin_needs_the_gap_beyond_margin_plus_spread():
    rule = Rule(kind="less", statement="A clearly below B", a={"v": "A"}, b={"v": "B"}, margin=0.05)
    d = 0.01 / math.sqrt(2)                       # stdev of (x - d, x, x + d) is d: spread sqrt(2) d = 0.01
    def rows(a, b):
        return _rows({"A": [a - d, a, a + d], "B": [b - d, b, b + d]})
    v = judge(rule, rows(2.00, 2.07))             # gap 0.07 > 0.05 + 0.01
    assert v.verdict == HELD and v.numbers["margin"] == 0.05 and "margin 0.05 nats" in v.reason
    assert judge(rule, rows(2.00, 2.055)).verdict == INCONCLUSIVE   # 0.04 <= 0.055 <= 0.06
    assert judge(rule, rows(2.00, 2.03)).verdict == NOT_HELD        # below: worse, but not by the margin
    assert judge(rule, rows(2.10, 2.00)).verdict == NOT_HELD
    assert "0.05 nats + 1x the seed spread" in tolerance(rule)
    with pytest.raises(ValueError, match="margin"):
        Rule(kind="parity", statement="x", a={}, b={}, margin=0.1)


def test_bias_suite_states_its_tolerance_and_a_gap_of_2_5_spreads_is_not_parity():
    rule = suites.load("bias").rules[0]
    assert rule.tol_abs == 0.02 and "0.02 nats" in tolerance(rule)
    d = 0.0196 / math.sqrt(2)                     # stdev of (x - d, x, x + d) is d: spread sqrt(2) d = 0.0196
    gap = {"none-ln": [2.589 - d, 2.589, 2.589 + d], "all": [2.540 - d, 2.540, 2.540 + d]}
    v = judge(rule, _rows(gap, axis="bias"))
    assert v.numbers["diff"] == pytest.approx(0.049) and v.numbers["spread"] == pytest.approx(0.0196)
    assert v.verdict == NOT_HELD                  # 0.049 > 0.02 + 0.0196
    near = {"none-ln": [2.575 - d, 2.575, 2.575 + d], "all": gap["all"]}
    assert judge(rule, _rows(near, axis="bias")).verdict == INCONCLUSIVE    # 0.02 < 0.035 < 0.0396
    with pytest.raises(ValueError, match="tol_abs"):
        Rule(kind="less", statement="x", a={}, b={}, tol_abs=0.1)


def test_group_side_averages_variants_per_seed():
    rule = Rule(kind="less", statement="gated below plain", a={"v": ["g1", "g2"]}, b={"v": ["p1", "p2"]})
    v = judge(rule, _rows({"g1": [1.0, 1.1], "g2": [1.2, 1.3], "p1": [1.5, 1.6], "p2": [1.7, 1.8]}))
    assert v.sides[0].values == {0: pytest.approx(1.1), 1: pytest.approx(1.2)}
    assert v.sides[1].values == {0: pytest.approx(1.6), 1: pytest.approx(1.7)}
    assert v.verdict == HELD


def test_parity_flat_and_ratio_rules():
    parity = Rule(kind="parity", statement="A ~ B", a={"v": "A"}, b={"v": "B"}, tol=0.02)
    assert judge(parity, _rows({"A": [2.00, 2.01], "B": [2.02, 2.03]})).verdict == HELD
    assert judge(parity, _rows({"A": [2.50, 2.51], "B": [2.00, 2.01]})).verdict == NOT_HELD
    # gap 0.06 > tol 0.04 but within tol + spread (0.14)
    assert judge(parity, _rows({"A": [1.96, 2.16], "B": [1.90, 2.10]})).verdict == INCONCLUSIVE
    flat = Rule(kind="flat", statement="flat", a={"v": ["1", "2", "4"]}, tol=0.03)
    assert judge(flat, _rows({"1": [2.0, 2.01], "2": [2.02, 2.03], "4": [2.01, 2.0], "32": [3.0, 3.0]})).verdict == HELD
    v = judge(flat, _rows({"1": [2.0, 2.01], "2": [2.5, 2.51], "4": [2.01, 2.0]}))
    assert v.verdict == NOT_HELD and v.numbers["worst"] == "2"
    ratio = Rule(kind="ratio", statement="1/8", metric="kv_cache_bytes", a={"v": "mqa"}, b={"v": "mha"}, expected=1 / 8)
    assert judge(ratio, _rows({"mqa": [128, 128], "mha": [1024, 1024]}, metric="kv_cache_bytes")).verdict == HELD
    assert judge(ratio, _rows({"mqa": [256, 256], "mha": [1024, 1024]}, metric="kv_cache_bytes")).verdict == NOT_HELD


def test_lr_sensitivity_matches_wortsman_definition():
    l0 = math.log(257)
    # losses over an LR grid, a diverged run counts as L0
    assert lr_sensitivity([2.0, 2.5, None], l0) == pytest.approx((2.0 + 2.5 + l0) / 3 - 2.0)
    assert lr_sensitivity([2.0, 9.0], l0) == pytest.approx((2.0 + l0) / 2 - 2.0)   # capped at L0
    rows = []
    for trick, losses in {"none": [2.0, 2.4, None], "qk": [2.0, 2.05, 2.1]}.items():
        for seed, jitter in enumerate((0.0, 0.01)):
            for lr, loss in zip(("0.001", "0.01", "0.1"), losses):
                r = RunRecord(suite="s", variant=f"{trick},{lr}", seed=seed, status="done",
                              config={"model": {"vocab_size": 257}},
                              final_val_loss=None if loss is None else loss + jitter,
                              extra={"labels": {"trick": trick, "lr": lr}})
                if loss is None:
                    r.status, r.diverged = "diverged", True
                rows.append(r)
    rule = Rule(kind="less", statement="qk less sensitive", metric="lr_sensitivity", over="lr",
                a={"trick": "qk"}, b={"trick": "none"})
    v = judge(rule, rows)
    assert v.sides[0].values[0] == pytest.approx(0.05)
    assert v.sides[1].values[0] == pytest.approx((2.0 + 2.4 + l0) / 3 - 2.0)
    assert v.verdict == HELD


# --------------------------------------------------------------------------- store + runner (fake trainer)
def test_store_roundtrip(tmp_path):
    with ResultStore(tmp_path) as store:
        store.put(RunRecord(suite="s", variant="a", seed=0, status="done", config={"x": 1}, params=10,
                            final_val_loss=2.5, extra={"labels": {"v": "a"}, "val_loss_2x": 3.0}))
        store.set_meta("k", {"a": [1, 2]})
    with ResultStore(tmp_path / "results.sqlite") as store:
        (row,) = store.runs("s")
        assert row.params == 10 and row.config == {"x": 1} and row.metric("val_loss_2x") == 3.0
        assert row.metric("final_val_loss") == 2.5 and store.get_meta("k") == {"a": [1, 2]}
        with pytest.raises(ValueError, match="status"):
            store.put(RunRecord(suite="s", variant="a", seed=0, status="weird"))


def _tiny_data(tmp_path) -> Path:
    from archlab.data.prepare import prepare
    docs = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 20 for i in range(12)]
    prepare(docs, "bytes", tmp_path / "data", progress=False, num_workers=0)
    return tmp_path / "data"


class FakeTrainer:
    """Stands in for archlab.training.trainer.train: writes metrics.jsonl; crashes or diverges on request."""

    def __init__(self, crash=(), diverge=()):
        self.calls, self.crash, self.diverge = [], set(crash), set(diverge)

    def __call__(self, model_cfg, train_cfg, data_dir, out_dir, *, resume=False, progress=True):
        from archlab.training.trainer import Diverged, TrainResult
        key = (model_cfg.norm.kind, train_cfg.seed)
        self.calls.append(key)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if key in self.crash:
            raise RuntimeError("boom")
        loss = 2.0 + 0.1 * (model_cfg.norm.kind == "layernorm") + 0.01 * train_cfg.seed
        lines = [{"step": s, "tokens": s * 64, "loss": loss + 1.0 / s} for s in (1, 2, 3)]
        (out / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        result = TrainResult(steps=3, tokens_seen=192, final_val_loss=loss, best_val_loss=loss,
                             final_train_loss=loss, tokens_per_s=1000.0, peak_memory_bytes=1,
                             device="cpu", diverged=False, run_dir=out, metrics_path=out / "metrics.jsonl")
        if key in self.diverge:
            result.diverged, result.final_val_loss = True, None
            raise Diverged("nan", 2, None, result)
        return result


def test_resume_skips_finished_runs_and_records_crashes(tmp_path):
    data = _tiny_data(tmp_path)
    suite = suites.Suite(name="norms", claim="c",
                         axes=[{"name": "norm", "key": "norm.kind", "values": ["layernorm", "rmsnorm"]}], seeds=2,
                         rules=[Rule(kind="less", statement="rms below", a={"norm": "rmsnorm"},
                                     b={"norm": "layernorm"})])
    kw = dict(data_dir=data, budget=3, progress=False, measure=False)
    fake = FakeTrainer(crash={("rmsnorm", 0)}, diverge={("layernorm", 1)})
    rows = runner.run_suite(suite, tmp_path / "sweep", train_fn=fake, **kw)
    status = {(r.variant, r.seed): r.status for r in rows}
    assert status == {("norm=layernorm", 0): "done", ("norm=layernorm", 1): "diverged",
                      ("norm=rmsnorm", 0): "failed", ("norm=rmsnorm", 1): "done"}
    assert len(fake.calls) == 4                                    # the crash did not stop the sweep
    failed = next(r for r in rows if r.status == "failed")
    assert "boom" in failed.error
    done = next(r for r in rows if r.variant == "norm=rmsnorm" and r.seed == 1)
    assert done.final_val_loss == pytest.approx(2.01) and done.step_time_s == pytest.approx(64 * 16 / 1000.0)
    assert done.params == matching.param_count(ModelConfig.from_dict(done.config["model"]))
    assert done.extra["labels"] == {"norm": "rmsnorm"}
    # resume: only the crashed run trains again
    fake2 = FakeTrainer()
    rows = runner.run_suite(suite, tmp_path / "sweep", train_fn=fake2, **kw)
    assert fake2.calls == [("rmsnorm", 0)]
    assert {r.status for r in rows} == {"done", "diverged"}
    # a different budget in the same folder is refused rather than mixed in
    with pytest.raises(runner.LabError, match="different config"):
        runner.run_suite(suite, tmp_path / "sweep", train_fn=FakeTrainer(), **{**kw, "budget": 5})


def test_a_second_driver_on_a_sweep_folder_is_refused_before_it_writes(tmp_path):
    """Another process drives the sweep: this one raises LockedError with the table untouched and no run."""
    import os
    import subprocess
    import sys

    from archlab.runs.lock import LockedError

    data = _tiny_data(tmp_path)
    suite = suites.Suite(name="norms", claim="c", seeds=1,
                         axes=[{"name": "norm", "key": "norm.kind", "values": ["layernorm", "rmsnorm"]}])
    kw = dict(data_dir=data, budget=3, progress=False, measure=False)
    sweep = tmp_path / "sweep"
    runner.run_suite(suite, sweep, train_fn=FakeTrainer(crash={("rmsnorm", 0)}), **kw)
    table = (sweep / "results.sqlite").read_bytes()
    src = str(Path(runner.__file__).parents[2])
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom archlab.runs.lock import RunLock\n"
                               "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)", str(sweep)],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": src})
    try:
        assert holder.stdout.readline().strip() == "held"
        second = FakeTrainer()
        with pytest.raises(LockedError, match=f"pid {holder.pid}"):
            runner.run_suite(suite, sweep, train_fn=second, **kw)
        assert second.calls == [] and (sweep / "results.sqlite").read_bytes() == table
    finally:
        holder.kill()
        holder.wait()


def test_report_from_synthetic_sweep_has_verdicts_and_plots(tmp_path):
    from archlab.lab.report import build_report
    data = _tiny_data(tmp_path)
    suite = suites.Suite(name="norms", claim="c",
                         axes=[{"name": "norm", "key": "norm.kind", "values": ["layernorm", "rmsnorm"]}], seeds=3,
                         rules=[Rule(kind="less", statement="rms below", a={"norm": "rmsnorm"},
                                     b={"norm": "layernorm"})])
    runner.run_suite(suite, tmp_path / "sweep", train_fn=FakeTrainer(), data_dir=data, budget=3,
                     progress=False, measure=False)
    paths = build_report(tmp_path / "sweep")
    verdicts = json.loads(paths["json"].read_text())
    assert verdicts["norms"][0]["verdict"] == HELD                 # 2.0x vs 2.1x, spread 0.014
    md = paths["md"].read_text()
    assert "rms below" in md and "**held**" in md
    html = paths["html"].read_text()
    for img in ("img/norms_curves.png", "img/norms_final_loss.png", "img/norms_step_time.png"):
        assert img in html and (paths["html"].parent / img).stat().st_size > 1000


def _synthetic_runs(tmp_path, variants=("a", "b", "c"), seeds=2) -> list[RunRecord]:
    """Runs whose loss curves coincide (the same numbers for every variant) and whose final losses differ
    by about 2%, with metrics.jsonl files as the trainer writes them."""
    rows = []
    for i, variant in enumerate(variants):
        for seed in range(seeds):
            run_dir = tmp_path / variant / str(seed)
            run_dir.mkdir(parents=True)
            (run_dir / "metrics.jsonl").write_text("".join(
                json.dumps({"step": step, "loss": 5.0 - 0.2 * step}) + "\n" for step in range(12)))
            rows.append(RunRecord(suite="s", variant=variant, seed=seed, status="done", run_dir=str(run_dir),
                                  final_val_loss=2.54 + 0.025 * i + 0.001 * (2 * seed - 1), step_time_s=0.1,
                                  config={"model": {"vocab_size": 257}, "train": {"lr": 10.0 ** -(i + 2)}},
                                  extra={"labels": {"v": "x", "lr": str(10.0 ** -(i + 2))}}))
    return rows


def test_report_bars_start_at_zero_and_label_each_mean(tmp_path):
    from archlab.lab.report import bars_figure
    fig = bars_figure(_synthetic_runs(tmp_path), "final_val_loss", "t", "loss")
    ax = fig.axes[0]
    assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] > 2.6
    assert [t.get_text() for t in ax.texts] == ["2.54", "2.565", "2.59"]


def test_report_curves_that_coincide_each_show_in_a_distinct_style(tmp_path):
    from archlab.lab.report import curves_figure, lr_figure
    lines = curves_figure(_synthetic_runs(tmp_path), "t").axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["a", "b", "c"]
    assert len({(line.get_linestyle(), line.get_marker()) for line in lines}) == 3
    assert lines[0].get_alpha() == 1 and all(line.get_alpha() < 1 for line in lines[1:])
    lr_rows = _synthetic_runs(tmp_path / "lr", variants=("a",))
    for r, v in zip(lr_rows, ("p", "q")):
        r.extra["labels"]["v"] = v          # two settings of the other axis: two lines over the LR axis
    lines = [line for line in lr_figure(lr_rows, "lr", "t").axes[0].get_lines() if line.get_label().startswith("v=")]
    assert len(lines) == 2 and lines[0].get_linestyle() != lines[1].get_linestyle()


def _timing_suite(**kw):
    return suites.Suite(name="depth", claim="c", seeds=2,
                        axes=[{"name": "layers", "key": "n_layers", "values": [1, 8]}],
                        base={"model": {"d_model": 32, "attention.n_heads": 2, "mlp.d_ff": 64},
                              "train": {"batch_size": 4, "seq_len": 32}}, **kw)


def test_paired_step_times_rank_the_slower_variant_per_seed(tmp_path):
    from archlab.lab import timing
    runs = plan(_timing_suite(), tmp_path, budget=3, vocab_size=64)
    times = timing.paired_step_times(runs, rounds_per_seed=3, warmup=1)
    assert set(times) == {("layers=1", 0), ("layers=1", 1), ("layers=8", 0), ("layers=8", 1)}
    assert all(t > 0 for t in times.values())
    for seed in (0, 1):                                           # 8 blocks do ~8x the work of 1
        assert times[("layers=8", seed)] > 2 * times[("layers=1", seed)]


def test_paired_step_times_at_a_stated_length_show_the_window_kernels_saving(tmp_path):
    """The local_global suite's speed claim, at the length it names: a window's step below full attention's."""
    from archlab.lab import timing
    suite = suites.load("local_global")
    assert suite.timing_seq_len == 4096
    runs = [r for r in plan(suite, tmp_path, budget=3, vocab_size=64, seeds=1) if r.variant.name != "LLLG-w32"]
    times = timing.paired_step_times(runs, rounds_per_seed=3, warmup=1, seq_len=2048)
    assert times[("local-w32", 0)] < times[("full", 0)]


def test_sweep_records_paired_step_times_once(tmp_path, monkeypatch):
    from archlab.lab import timing
    data = _tiny_data(tmp_path)
    calls = []
    monkeypatch.setattr(timing, "paired_step_times",
                        lambda runs, progress=False, seq_len=None: calls.append(len(runs)) or
                        {(r.variant.name, r.seed): 0.01 * r.model.n_layers for r in runs})
    suite = _timing_suite(measure=["paired_step_time"],
                          rules=[Rule(kind="less", metric=timing.METRIC, statement="shallow faster",
                                      a={"layers": 1}, b={"layers": 8})])
    kw = dict(data_dir=data, budget=3, progress=False)
    rows = runner.run_suite(suite, tmp_path / "sweep", train_fn=FakeTrainer(), **kw)
    assert calls == [4]
    assert {(r.variant, r.extra[timing.METRIC]) for r in rows} == {("layers=1", 0.01), ("layers=8", 0.08)}
    runner.run_suite(suite, tmp_path / "sweep", train_fn=FakeTrainer(), **kw)   # resumed: kept
    assert calls == [4]


def test_report_reads_the_results_table_without_writing_to_it(tmp_path):
    import os
    import stat

    from archlab.lab.report import build_report
    from archlab.lab.store import DB_FILE
    data = _tiny_data(tmp_path)
    suite = suites.Suite(name="norms", claim="c", seeds=1,
                         axes=[{"name": "norm", "key": "norm.kind", "values": ["layernorm", "rmsnorm"]}])
    runner.run_suite(suite, tmp_path / "sweep", train_fn=FakeTrainer(), data_dir=data, budget=3,
                     progress=False, measure=False)
    db = tmp_path / "sweep" / DB_FILE
    before = db.read_bytes()
    os.chmod(db, stat.S_IRUSR | stat.S_IRGRP)               # a read-only table still reports
    try:
        paths = build_report(tmp_path / "sweep")
    finally:
        os.chmod(db, 0o644)
    assert db.read_bytes() == before and paths["md"].parent == tmp_path / "sweep" / "report"


def test_report_on_a_corrupt_table_is_one_line(tmp_path, capsys):
    from archlab.cli import main
    from archlab.lab.store import DB_FILE
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / DB_FILE).write_bytes(b"this is not sqlite" * 100)
    assert main(["report", str(tmp_path / "sweep")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a readable archlab results table" in err


def test_lm_architecture_compares_kinds_at_matched_params_tokens_and_targets(tmp_path):
    """Its three variants have parameter counts within 2%, read the same number of tokens per window and are
    scored on exactly the same targets."""
    import torch

    from archlab.data.batches import objective_for, tokens_processed
    from archlab.data.prepare import prepare
    from archlab.data.tokens import Rows

    prepare(["to be or not to be that is the question " * 40] * 3, "bytes", tmp_path / "data", num_workers=0,
            progress=False)
    from archlab.data.tokens import TokenDataset
    val = TokenDataset(tmp_path / "data", "train")
    planned = [p for p in plan(suites.BUILTIN["lm_architecture"], tmp_path, vocab_size=257) if p.seed == 0]
    assert {p.model.arch for p in planned} == {"decoder", "encoder_decoder"}
    assert sum(p.model.attention.prefix_lm for p in planned) == 1
    counts = [matching.param_count(p.model) for p in planned]
    assert max(counts) / min(counts) < 1.02
    x = torch.randint(0, 256, (2, planned[0].train.seq_len))
    scored, read = set(), set()
    for p in planned:
        inputs, labels = objective_for(p.model, p.train, val).objective.turn(Rows(x), step=0)
        scored.add(tuple(labels[labels != -100].tolist()))
        read.add(tokens_processed(inputs, labels, p.model.arch))
    assert len(scored) == 1 and len(read) == 1
