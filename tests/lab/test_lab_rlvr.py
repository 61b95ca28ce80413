"""The rlvr suite: GRPO from a fine-tuned model with pass@k before and after (archlab.lab.finetune.rlvr_stage) and
its report section (archlab.lab.rlvr_report)."""
from __future__ import annotations

import pytest

from archlab.config import ConfigError
from archlab.data import reverse_words
from archlab.lab import rlvr_report, suites
from archlab.lab.finetune import pass_ks
from archlab.lab.plan import plan
from archlab.lab.report import build_report
from archlab.lab.runner import run_suite
from archlab.lab.store import RunRecord


def _tiny(**finetune) -> suites.Suite:
    base = suites._post_training_base()
    base["model"].update({"d_model": 32, "mlp.d_ff": 64, "attention.n_heads": 2})
    base["train"].update({"eval_every": 2, "log_every": 1, "batch_size": 8, "warmup_steps": 1})
    rlvr = suites.BUILTIN["rlvr"]
    return suites.Suite(name="rlvr_tiny", claim=rlvr.claim, variants=rlvr.variants, runs="finetune",
                        corpus="reverse-words", seeds=2, base=base, scales={"small": {"budget": 3, "unit": "steps"}},
                        finetune={"pretrain": {"budget": 4, "batch_size": 8, "eval_every": 2, "warmup_steps": 1},
                                  "test_words": 5, "rlvr": {"steps": 1, "samples": 4, "prompts": 16, **finetune}},
                        rules=rlvr.rules, analysis="rlvr")


def test_the_rlvr_suite_shares_one_base_and_judges_the_gains_against_the_seed_spread(tmp_path):
    suite = suites.BUILTIN["rlvr"]
    runs = plan(suite, tmp_path, vocab_size=259)
    assert len(runs) == 3 and len({r.base.folder for r in runs}) == 1 and {r.seed for r in runs} == {0, 1, 2}
    assert runs[0].train.budget == 80 and suite.finetune == {"rlvr": {"steps": 40, "samples": 16}}
    assert [(r.kind, r.metric, r.expected) for r in suite.rules] == [("above", "pass1_gain", 0.0),
                                                                   ("below", "passk_share", 0.5)]
    assert suite.analysis == "rlvr"


@pytest.mark.parametrize("rlvr", [{"steps": 0}, {"samples": "8"}, {"colour": 1}, [1]])
def test_bad_rlvr_settings_are_refused_by_name(tmp_path, rlvr):
    suite = _tiny()
    suite.finetune = {**suite.finetune, "rlvr": rlvr}
    with pytest.raises(ConfigError, match="finetune.rlvr"):
        plan(suite, tmp_path, vocab_size=259)


def test_pass_ks_are_the_powers_of_two_and_the_sample_count():
    assert pass_ks(1) == (1,) and pass_ks(16) == (1, 2, 4, 8, 16) and pass_ks(6) == (1, 2, 4, 6)


def _row(seed: int, before: dict, after: dict) -> RunRecord:
    return RunRecord(suite="s", variant="grpo", seed=seed, status="done",
                     extra={"pass_before": before, "pass_after": after, "rlvr_k": 4, "rlvr_steps": 2,
                            "grpo_s": 3.0, "test_words": 5})


def test_the_report_section_tabulates_mean_and_std_over_seeds_and_plots_both_curves(tmp_path):
    rows = [_row(0, {"pass@1": 0.2, "pass@4": 0.8}, {"pass@1": 0.6, "pass@4": 0.9}),
            _row(1, {"pass@1": 0.4, "pass@4": 0.8}, {"pass@1": 0.6, "pass@4": 0.7}),
            RunRecord(suite="s", variant="grpo", seed=2, status="failed")]
    assert rlvr_report.curves(rows) == {"before": {1: [0.2, 0.4], 4: [0.8, 0.8]}, "after": {1: [0.6, 0.6],
                                                                                          4: [0.9, 0.7]}}
    blocks = rlvr_report.section(suites.BUILTIN["rlvr"], rows, tmp_path, "img")
    (table,) = [b for b in blocks if b.kind == "table"]
    # k=1: before mean 0.3, std sqrt(0.02) = 0.141; gains 0.4 and 0.2 -> 0.3 +- 0.141; k=4: gains 0.1, -0.1
    assert table.rows == [["1", "0.300 ± 0.141", "0.600 ± 0.000", "0.300 ± 0.141"],
                          ["4", "0.800 ± 0.000", "0.800 ± 0.141", "0.000 ± 0.141"]]
    assert (tmp_path / "rlvr_pass_at_k.png").stat().st_size > 0 and blocks[-1].kind == "img"
    assert rlvr_report.section(suites.BUILTIN["rlvr"], rows[2:], tmp_path, "img")[-1].text.startswith("No finished")


@pytest.mark.slow
def test_an_rlvr_sweep_records_pass_at_k_before_and_after_grpo_and_reports(tmp_path):
    data = reverse_words.prepare_task_folder(tmp_path / "data", quick=True, progress=False)
    rows = run_suite(_tiny(), tmp_path / "sweep", data_dir=data, progress=False)
    assert [r.status for r in rows] == ["done", "done"], [r.error for r in rows]
    for r in rows:
        assert "measure_error" not in r.extra, r.extra["measure_error"]
        assert set(r.extra["pass_before"]) == set(r.extra["pass_after"]) == {"pass@1", "pass@2", "pass@4"}
        before, after = r.extra["pass_before"], r.extra["pass_after"]
        assert before["pass@1"] <= before["pass@2"] <= before["pass@4"]          # pass@k never falls with k
        assert r.extra["pass1_gain"] == pytest.approx(after["pass@1"] - before["pass@1"])
        assert r.extra["passk_gain"] == pytest.approx(after["pass@4"] - before["pass@4"])
        assert r.extra["rlvr_steps"] == 1 and (tmp_path / "sweep" / "runs").exists()
    grpo = sorted((tmp_path / "sweep" / "runs").rglob("seed0-grpo"))
    assert grpo and (grpo[0] / "metrics.jsonl").is_file()                 # GRPO's own run folder beside the SFT run
    text = build_report(tmp_path / "sweep")["md"].read_text()
    assert "pass@k before and after GRPO" in text and "rlvr_tiny_pass_at_k.png" in text
