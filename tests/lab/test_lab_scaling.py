"""The scaling-law fitter (archlab.lab.scaling) on synthetic points drawn from known laws: Chinchilla's
published constants (Hoffmann et al. 2022, eq. 10) and a tiny-scale law, with 1% multiplicative noise."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from archlab.errors import UserError
from archlab.lab.scaling import CHINCHILLA, LossLaw, fit_loss, isoflop_profiles, optimal_exponent

TINY = LossLaw(E=1.2, A=60.0, alpha=0.45, B=150.0, beta=0.38)    # a law of the size the lab's ladder sees


def _grid(law, n_range, d_range, k=7, noise=0.0, seed=1):
    n, d = (x.ravel() for x in np.meshgrid(np.geomspace(*n_range, k), np.geomspace(*d_range, k)))
    loss = law(n, d) * (1 + noise * np.random.default_rng(seed).standard_normal(n.size))
    return n, d, loss


def test_optimal_allocation_spends_the_budget_and_is_the_minimum_along_it():
    C = 5.76e23
    n_opt, d_opt = CHINCHILLA.optimal(C)
    assert 6 * n_opt * d_opt == pytest.approx(C, rel=1e-12)
    ns = np.geomspace(n_opt / 10, n_opt * 10, 20001)               # brute force along the IsoFLOP line
    brute = ns[np.argmin(CHINCHILLA(ns, C / (6 * ns)))]
    assert brute == pytest.approx(n_opt, rel=1e-3)
    # hand-computed: G = (0.34*406.4 / (0.28*410.7))^(1/0.62), N_opt = G (C/6)^(0.28/0.62)
    g = (0.34 * 406.4 / (0.28 * 410.7)) ** (1 / 0.62)
    assert n_opt == pytest.approx(g * (C / 6) ** (0.28 / 0.62), rel=1e-12)
    assert CHINCHILLA.tokens_per_param(C) == pytest.approx(d_opt / n_opt)


def test_noiseless_chinchilla_points_give_back_the_published_constants():
    n, d, loss = _grid(CHINCHILLA, (7e7, 1.6e10), (5e9, 5e11))
    fit = fit_loss(n, d, loss, n_boot=0)
    for name, value in CHINCHILLA.to_dict().items():
        assert getattr(fit.law, name) == pytest.approx(value, rel=0.01), name
    assert fit.law.tokens_per_param(5.76e23) == pytest.approx(CHINCHILLA.tokens_per_param(5.76e23), rel=0.02)
    assert fit.rms_residual < 1e-4


@pytest.mark.parametrize("law,n_range,d_range", [(CHINCHILLA, (7e7, 1.6e10), (5e9, 5e11)),
                                                 (TINY, (2e4, 1e6), (1e5, 2e6))], ids=["chinchilla", "tiny"])
def test_exponents_within_their_bootstrap_intervals_at_one_percent_noise(law, n_range, d_range):
    n, d, loss = _grid(law, n_range, d_range, noise=0.01)
    fit = fit_loss(n, d, loss, n_boot=100, seed=0)
    for name in ("alpha", "beta"):
        lo, hi = fit.interval(name)
        assert lo < getattr(law, name) < hi, (name, lo, hi)
        assert hi - lo < 0.5 * getattr(law, name)                  # an interval that says something
    C = 6 * n.max() * d.max()
    lo, hi = fit.tokens_per_param_interval(C)
    assert lo < law.tokens_per_param(C) < hi
    assert 0.005 < fit.rms_residual < 0.015                         # the 1% noise, seen in the residuals


def test_bootstrap_is_seeded():
    n, d, loss = _grid(TINY, (2e4, 1e6), (1e5, 2e6), k=5, noise=0.01)
    a, b = fit_loss(n, d, loss, n_boot=10, seed=3), fit_loss(n, d, loss, n_boot=10, seed=3)
    assert np.array_equal(a.boot, b.boot)
    assert not np.array_equal(a.boot, fit_loss(n, d, loss, n_boot=10, seed=4).boot)


def _isoflop_points(law, budgets, noise=0.0, per=7, span=4.0, seed=2):
    rng = np.random.default_rng(seed)
    n, d, loss, groups = [], [], [], []
    for C in budgets:
        n_opt, _ = law.optimal(C)
        for x in np.geomspace(n_opt / span, n_opt * span, per):
            n.append(x)
            d.append(C / (6 * x))
            loss.append(law(x, C / (6 * x)) * (1 + noise * rng.standard_normal()))
            groups.append(C)
    return np.array(n), np.array(d), np.array(loss), groups


def test_isoflop_minima_sit_at_the_analytic_optimum():
    budgets = [1e18, 1e19, 1e20, 1e21]
    n, d, loss, _ = _isoflop_points(CHINCHILLA, budgets)
    profiles = isoflop_profiles(n, d, loss)                        # grouped by C = 6ND alone
    assert [p.C for p in profiles] == pytest.approx(budgets, rel=1e-9)
    for p in profiles:
        assert p.convex and p.inside
        assert p.N_opt == pytest.approx(float(CHINCHILLA.optimal(p.C)[0]), rel=0.05)
        assert p.L_opt == pytest.approx(float(CHINCHILLA(*CHINCHILLA.optimal(p.C))), rel=1e-3)
    a, _ = optimal_exponent(profiles)
    assert a == pytest.approx(0.28 / 0.62, abs=0.01)               # N_opt ~ C^(beta / (alpha + beta))


def test_isoflop_minima_with_noise_and_given_groups():
    budgets = [1e8, 1e9, 1e10, 1e11]
    n, d, loss, groups = _isoflop_points(TINY, budgets, noise=0.01, per=9)
    profiles = isoflop_profiles(n, d, loss, groups=groups)
    assert len(profiles) == 4
    a, _ = optimal_exponent(profiles)
    assert a == pytest.approx(TINY.beta / (TINY.alpha + TINY.beta), abs=0.1)
    for p in profiles:
        assert abs(math.log(p.N_opt / float(TINY.optimal(p.C)[0]))) < math.log(1.6)


def test_profiles_need_three_sizes_and_report_a_minimum_outside_the_range():
    n = np.array([1e5, 2e5, 4e5, 1e5, 2e5])
    d = 1e12 / (6 * n)
    loss = np.array([3.0, 2.9, 2.85, 1.0, 1.1])                    # the second budget has only two sizes
    profiles = isoflop_profiles(n, d, loss, groups=["a", "a", "a", "b", "b"])
    assert len(profiles) == 1 and profiles[0].convex and not profiles[0].inside   # still falling at 4e5


@pytest.mark.parametrize("args,match", [(([1, 2, 3], [1, 2, 3], [1, 2, 3]), "at least 5"),
                                        (([1, 2, 3, 4, 5], [1, 2, 3, 4], [1, 2, 3, 4, 5]), "same length"),
                                        (([1, 2, 3, 4, -5], [1] * 5, [1] * 5), "positive")])
def test_bad_points_are_one_line_errors(args, match):
    with pytest.raises(UserError, match=match):
        fit_loss(*args)


# --------------------------------------------------------------------------- the `scaling` suite and its report
def _scaling_table(tmp_path, law, noise=0.01, seed=5):
    """The scaling suite's planned runs as a finished results table, their losses drawn from `law`."""
    from archlab.lab import suites
    from archlab.lab.plan import plan
    from archlab.lab.runner import _config
    from archlab.lab.store import ResultStore, RunRecord
    from archlab.models.accounting import param_count

    suite = suites.BUILTIN["scaling"]
    rng = np.random.default_rng(seed)
    with ResultStore(tmp_path / "sweep") as store:
        store.set_meta("suite:scaling", suite.to_dict())
        for run in plan(suite, tmp_path / "sweep", vocab_size=257):
            n, d = param_count(run.model), run.train.budget
            store.put(RunRecord(suite="scaling", variant=run.variant.name, seed=run.seed, status="done",
                                config=_config(run), params=n, tokens_seen=int(d), steps=int(d // 1024),
                                final_val_loss=float(law(n, d)) * (1 + noise * rng.standard_normal()),
                                extra={"labels": run.variant.labels}))
    return suite, tmp_path / "sweep"


def test_scaling_suite_is_a_ladder_of_sizes_by_token_budgets_at_both_scales():
    from archlab.lab import suites
    from archlab.lab.plan import plan
    from archlab.models.accounting import non_embedding_param_count, param_count

    suite = suites.BUILTIN["scaling"]
    for scale, tokens in (("small", 1e5), ("large", 1e7)):
        runs = plan(suite, Path("/nonexistent"), scale=scale, vocab_size=257)
        assert len(runs) == 30
        sizes = sorted({param_count(r.model) for r in runs})
        budgets = sorted({r.train.budget for r in runs})
        assert budgets == [tokens * 2 ** k for k in range(6)] and {r.train.budget_unit for r in runs} == {"tokens"}
        ratios = [b / a for a, b in zip(sizes, sizes[1:])]
        assert all(1.5 < q < 3.5 for q in ratios), ratios            # each size about twice the last
        for r in runs:
            assert r.model.attention.n_heads * 16 == r.model.d_model
            assert non_embedding_param_count(r.model) < param_count(r.model)
    small = plan(suite, Path("/nonexistent"), vocab_size=257)
    # the reduced ladder's cost: sum over runs of 6 N D = 4.7e13 FLOPs, ~20 single-core minutes of training steps
    # at the speeds measured for these sizes (13 us/token for d32L2 up to 73 us/token for d96L5): keep it there
    assert 3e13 < sum(6 * param_count(r.model) * r.train.budget for r in small) < 6e13


@pytest.fixture
def fewer_resamples(monkeypatch):
    """Reports' intervals from 60 resamples instead of 200: the same code, a third of the fitting time."""
    from archlab.lab import scaling
    monkeypatch.setattr(scaling, "REPORT_BOOTSTRAP", 60)


def test_scaling_report_fits_the_ladder_and_judges_the_power_law(tmp_path, fewer_resamples):
    import json

    from archlab.lab.report import build_report

    _, sweep = _scaling_table(tmp_path, TINY)
    paths = build_report(sweep)
    verdicts = json.loads(paths["json"].read_text())["scaling"]
    assert [v["verdict"] for v in verdicts] == ["held", "held"]
    total = verdicts[0]["numbers"]
    assert total["alpha_interval"][0] < TINY.alpha < total["alpha_interval"][1]
    assert total["beta_interval"][0] < TINY.beta < total["beta_interval"][1]
    md = paths["md"].read_text()
    for text in ("Scaling law (Hoffmann et al. 2022, approach 3)", "ours: all parameters (Chinchilla)",
                 "ours: non-embedding (Kaplan)", "Chinchilla, published (eq. 10)", "0.076", "IsoFLOP profiles"):
        assert text in md, text
    for name in ("loss_vs_N", "loss_vs_D", "loss_vs_compute"):
        img = paths["html"].parent / "img" / f"scaling_{name}.png"
        assert f"img/scaling_{name}.png" in md and img.stat().st_size > 5000


def test_power_law_verdict_refuses_a_loss_that_does_not_fall_with_n(tmp_path, fewer_resamples):
    from archlab.lab.store import ResultStore
    from archlab.lab.verdicts import judge

    flat_in_n = LossLaw(E=1.2, A=1e-6, alpha=0.45, B=150.0, beta=0.38)   # N plays no part
    suite, sweep = _scaling_table(tmp_path, flat_in_n, noise=0.005)
    with ResultStore(sweep, readonly=True) as store:
        rows = store.runs("scaling")
    verdict = judge(suite.rules[0], rows)
    assert verdict.verdict == "did not hold", verdict.reason
    assert verdict.numbers["fall_N"][2] < 0.02 * 2 < verdict.numbers["fall_D"][1]   # no fall in N, a clear one in D
    few = judge(suite.rules[0], rows[:5])
    assert few.verdict == "inconclusive" and "at least 6" in few.reason
