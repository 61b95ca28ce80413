"""The n-gram side of the lab: the add-k estimate against hand-computed probabilities, the `falls` and
`rises_past_best` rules on synthetic curves, the `ngram_baseline` suite run on a tiny prepared data folder (its
verdicts recomputed from the numbers), and the 5-gram line every report prints (and caches)."""
from __future__ import annotations

import json
import math
import random
from fractions import Fraction as F

import numpy as np
import pytest

from archlab.config import ConfigError
from archlab.data.prepare import prepare
from archlab.data.tokens import TokenDataset
from archlab.eval.ngram import NgramCounts, evaluate_ngram
from archlab.lab import baseline, runner, suites
from archlab.lab.plan import plan
from archlab.lab.report import build_report
from archlab.lab.store import ResultStore, RunRecord
from archlab.lab.verdicts import HELD, INCONCLUSIVE, NOT_HELD, Rule, judge


# ---- add-k by hand ----------------------------------------------------------------------------------------------
def test_add_k_probabilities_worked_by_hand():
    """V = {a=0, b=1, $=2}, training text `a b a b a $` after a start `$`. Unigrams (the start token is no unigram):
    a 3, b 2, $ 1 of 6. Bigrams: $a 1, ab 2, ba 2, a$ 1, so c(a.) = 3, c(b.) = 2, c($.) = 1.
    Add-1 bigram: P(a|$) = (1+1)/(1+3) = 1/2, P(b|a) = (2+1)/(3+3) = 1/2, P($|b) = (0+1)/(2+3) = 1/5.
    Add-1/2 unigram: P(a) = (3+1/2)/(6+3/2) = 7/15, P($) = (1+1/2)/(15/2) = 1/5.
    Trigram, stream `b b a`: b after `$` alone uses the bigram ($b: 0 of 1 -> 1/4); b after `$ b` (never seen)
    and a after `b b` (never seen) get 1/V = 1/3."""
    counts = NgramCounts(np.array([0, 1, 0, 1, 0, 2]), vocab_size=3, max_order=3, bos=2)
    nats = counts.add_k(2, 1.0).token_nats(np.array([0, 1, 2]))
    np.testing.assert_allclose(np.exp(-nats), [float(F(1, 2)), float(F(1, 2)), float(F(1, 5))], rtol=1e-12)
    nats = counts.add_k(1, 0.5).token_nats(np.array([0, 2]))
    np.testing.assert_allclose(np.exp(-nats), [float(F(7, 15)), float(F(1, 5))], rtol=1e-12)
    nats = counts.add_k(3, 1.0).token_nats(np.array([1, 1, 0]))
    np.testing.assert_allclose(np.exp(-nats), [1 / 4, 1 / 3, 1 / 3], rtol=1e-12)


def test_add_k_distribution_sums_to_one_and_refuses_bad_k():
    counts = NgramCounts(np.array([0, 1, 0, 1, 0, 2, 1, 1]), vocab_size=3, max_order=2, bos=2)
    model = counts.add_k(2, 0.3)
    for history in range(3):       # P(w | h) over every w sums to 1, seen or unseen history alike
        stream = np.array([history, 0, history, 1, history, 2])
        p = np.exp(-model.token_nats(stream))[1::2]
        assert p.sum() == pytest.approx(1.0, abs=1e-12)
    with pytest.raises(Exception, match="k > 0"):
        counts.add_k(2, 0.0)


# ---- the curve rules --------------------------------------------------------------------------------------------
def _rows(curves: dict[str, list[float]]) -> list[RunRecord]:
    n = len(next(iter(curves.values())))
    return [RunRecord(suite="s", variant=f"order={i + 1}", seed=0, status="done",
                      extra={"labels": {"order": str(i + 1)}, **{m: v[i] for m, v in curves.items()}})
            for i in range(n)]


FALLS = Rule(kind="falls", metric="kn_bpb", over="order", tol=0.02, statement="falls")
RISES = Rule(kind="rises_past_best", metric="add_k_bpb", versus="kn_bpb", over="order", tol=0.02, statement="rises")


def test_falls_and_rises_past_best_by_hand():
    kn, add_k = [3.2, 2.3, 2.04, 2.01, 2.012, 2.011], [3.2, 2.5, 3.2, 3.6, 3.8, 3.9]
    rows = _rows({"kn_bpb": kn, "add_k_bpb": add_k})
    falls = judge(FALLS, rows)
    assert falls.verdict == HELD and falls.numbers["best"] == 4 and falls.numbers["fall"] == pytest.approx(1.19)
    rises = judge(RISES, rows)
    assert rises.verdict == HELD
    assert rises.numbers["best"] == 2 and rises.numbers["rise"] == pytest.approx(1.4)
    assert rises.numbers["versus_best"] == 4 and rises.numbers["versus_rise"] == pytest.approx(0.002)


def test_curve_rules_refuse_a_flat_estimate_a_rising_kn_and_short_curves():
    flat = _rows({"kn_bpb": [3.0, 2.99, 2.98, 2.98], "add_k_bpb": [3.2, 2.5, 2.51, 2.52]})
    assert judge(FALLS, flat).verdict == NOT_HELD                 # 0.02 < 2% of 2.98
    assert judge(RISES, flat).verdict == NOT_HELD                 # add-k rises 0.02 < 2% of 2.5
    kn_rises = _rows({"kn_bpb": [3.0, 2.0, 2.1, 2.2], "add_k_bpb": [3.2, 2.5, 3.0, 3.5]})
    assert judge(RISES, kn_rises).verdict == NOT_HELD             # KN rises 0.2 > 2% of 2.0: no flattening
    assert judge(FALLS, _rows({"kn_bpb": [3.0, 2.0]})).verdict == INCONCLUSIVE
    with pytest.raises(ValueError, match="over"):
        Rule(kind="falls", metric="kn_bpb", statement="x")


# ---- the suite on a tiny data folder ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rng = random.Random(0)
    words = "the king is dead long live the queen and all her court".split()
    docs = [" ".join(rng.choice(words) for _ in range(200)) for _ in range(120)]
    out = tmp_path_factory.mktemp("lab_ngram") / "data"
    prepare(docs, "bytes", out, num_workers=0, progress=False)
    return out


def test_ngram_baseline_suite_runs_and_its_verdicts_follow_the_numbers(data, tmp_path):
    suite = suites.BUILTIN["ngram_baseline"]
    rows = runner.run_suite(suite, tmp_path / "sweep", data_dir=data, progress=False)
    assert [r.status for r in rows] == ["done"] * 8 and all(r.params is None for r in rows)
    expected = evaluate_ngram(data, list(range(1, 9)), estimators=("kneser_ney", "add_k"), k=1.0)
    kn = {r.order: r.bpb for r in expected if r.estimator == "kneser_ney"}
    add_k = {r.order: r.bpb for r in expected if r.estimator == "add_k"}
    by_order = {int(r.extra["labels"]["order"]): r for r in rows}
    for n, r in by_order.items():
        assert r.extra["kn_bpb"] == pytest.approx(kn[n], rel=1e-12)
        assert r.extra["add_k_bpb"] == pytest.approx(add_k[n], rel=1e-12)
    # the rules' verdicts, recomputed from the definitions over the same numbers
    best_kn = min(kn, key=kn.__getitem__)
    best_add = min(add_k, key=add_k.__getitem__)
    kn_falls = kn[1] - kn[best_kn] > 0.02 * kn[best_kn]
    add_falls = add_k[1] - add_k[best_add] > 0.02 * add_k[best_add]
    add_rises = max(v for n, v in add_k.items() if n >= best_add) - add_k[best_add] > 0.02 * add_k[best_add]
    kn_flat = max(v for n, v in kn.items() if n >= best_kn) - kn[best_kn] <= 0.02 * kn[best_kn]
    verdicts = [judge(rule, rows).verdict for rule in suite.rules]
    assert verdicts == [HELD if ok else NOT_HELD for ok in (kn_falls, add_falls, add_rises and kn_flat)]
    assert verdicts == [HELD, HELD, HELD]          # this corpus shows the trade-off: best add-1 order 4 or less
    assert best_add <= 4


def test_ngram_settings_are_checked_before_any_run(tmp_path):
    bad = suites.Suite(name="bad", claim="c", runs="ngram", axes=[{"name": "order", "key": "ngram.order",
                                                                  "values": [0, 2]}])
    with pytest.raises(ConfigError, match="ngram.order=0"):
        plan(bad, tmp_path, vocab_size=257)
    stray = suites.Suite(name="stray", claim="c", variants=[{"label": "x", "set": {"ngram.order": 3}}])
    with pytest.raises(ConfigError, match="runs: ngram"):
        plan(stray, tmp_path, vocab_size=257)
    with pytest.raises(ConfigError, match="runs="):
        suites.Suite(name="kind", claim="c", runs="bogus", variants=[{"label": "x", "set": {}}])


# ---- the 5-gram line of every report ----------------------------------------------------------------------------
def _synthetic_sweep(sweep, data, losses: dict[str, float]) -> None:
    suite = suites.Suite(name="norms", claim="c", seeds=1,
                         axes=[{"name": "norm", "key": "norm.kind", "values": list(losses)}])
    with ResultStore(sweep) as store:
        store.set_meta("suite:norms", suite.to_dict())
        store.set_meta("sweep:norms", {"scale": "small", "data": str(data)})
        for variant, loss in losses.items():
            store.put(RunRecord(suite="norms", variant=f"norm={variant}", seed=0, status="done",
                                final_val_loss=loss, extra={"labels": {"norm": variant}}))


def test_every_report_shows_the_5gram_line_beside_the_runs(data, tmp_path, monkeypatch):
    sweep = tmp_path / "sweep"
    _synthetic_sweep(sweep, data, {"layernorm": 1.2, "rmsnorm": 1.0})
    md = build_report(sweep)["md"].read_text()
    bpb = evaluate_ngram(data, [5])[0].bpb
    per_byte = TokenDataset(data, "val").bytes_per_token * math.log(2)
    assert f"5-gram (modified KN) on the same validation bytes: {bpb:.4f} bits/byte" in md
    assert f"best {1.0 / per_byte:.4f} bits/byte (norm=rmsnorm), worst {1.2 / per_byte:.4f} (norm=layernorm)" in md
    cache = json.loads((sweep / baseline.CACHE_FILE).read_text())
    assert [entry["bpb"] for entry in cache.values()] == [pytest.approx(bpb, rel=1e-12)]
    # counted once per data folder: the second report reads the cache
    monkeypatch.setattr("archlab.eval.ngram.evaluate_ngram", lambda *a, **k: pytest.fail("counted again"))
    assert f"{bpb:.4f} bits/byte" in build_report(sweep)["md"].read_text()


def test_the_line_says_when_the_data_folder_is_gone(tmp_path):
    sweep = tmp_path / "sweep"
    _synthetic_sweep(sweep, tmp_path / "moved", {"rmsnorm": 1.0})
    md = build_report(sweep)["md"].read_text()
    assert "5-gram (modified KN): not computed" in md and str(tmp_path / "moved") in md


def test_the_line_says_why_a_folder_it_cannot_count_is_skipped(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_text(json.dumps({"format": "something-else"}))
    sweep = tmp_path / "sweep"
    _synthetic_sweep(sweep, data, {"rmsnorm": 1.0})
    md = build_report(sweep)["md"].read_text()
    assert "5-gram (modified KN): not computed (" in md
