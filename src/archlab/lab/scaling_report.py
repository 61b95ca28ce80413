"""The `scaling` analysis of a report: the law fitted with each parameter count beside Chinchilla's and
Kaplan's exponents, the IsoFLOP minima (approach 2) beside the law's optimum, and plots of loss against N,
D and compute with the fitted curves. Numbers from archlab.lab.scaling; the verdict is the suite's
power_law rules (archlab.lab.verdicts)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from archlab.lab import scaling
from archlab.lab.document import Block

COUNTS = {"total": "all parameters (Chinchilla)", "non_embedding": "non-embedding (Kaplan)"}


def _g(x: float | None, digits: int = 3) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:.{digits}g}"


def _with_interval(fit: scaling.LossFit, name: str) -> str:
    lo, hi = fit.interval(name)
    return f"{_g(getattr(fit.law, name))} [{_g(lo)}, {_g(hi)}]"


def section(suite, rows: list, img_dir: Path, rel: str) -> list[Block]:
    """Blocks of the analysis: fits table, IsoFLOP table, four plots."""
    fits = {count: scaling.fit_rows(rows, count)[0] for count in COUNTS}
    n, d, loss, used = scaling.points(rows, "total")
    blocks = [Block("h3", "Scaling law (Hoffmann et al. 2022, approach 3)")]
    if fits["total"] is None:
        return blocks + [Block("p", f"{len(used)} finished runs: too few to fit the law's 5 constants (need 6).")]
    c_max = float((6 * n * d).max())
    blocks.append(Block("p", (
        f"L(N, D) = E + A/N^alpha + B/D^beta fitted to {len(used)} runs by a Huber loss (delta 1e-3) on log L "
        "from a 4,500-point grid of starts (L-BFGS-B); brackets: 95% bootstrap intervals over "
        f"{len(fits['total'].boot)} resamples of the runs. Tokens per parameter and N_opt at C = {c_max:.3g} "
        "FLOPs (6 N D of the largest run), where the fitted law puts its compute-optimal split.")))
    header = ["N counts", "E", "A", "alpha", "B", "beta", "RMS residual", "tokens/param", "N_opt"]
    table = []
    for count, fit in fits.items():
        if fit is None:
            continue
        lo, hi = fit.tokens_per_param_interval(c_max)
        table.append([f"ours: {COUNTS[count]}", _with_interval(fit, "E"), _with_interval(fit, "A"),
                      _with_interval(fit, "alpha"), _with_interval(fit, "B"), _with_interval(fit, "beta"),
                      f"{fit.rms_residual:.2%}", f"{_g(float(fit.law.tokens_per_param(c_max)))} [{_g(lo)}, {_g(hi)}]",
                      _g(float(fit.law.optimal(c_max)[0]))])
    ch = scaling.CHINCHILLA
    table.append(["Chinchilla, published (eq. 10)", *(_g(v) for v in ch.to_dict().values()), "–",
                  f"~20 (approaches 1-2); eq. 10 at C=5.76e23: {_g(float(ch.tokens_per_param(5.76e23)))}", "–"])
    table.append(["Kaplan et al. 2020 (separate L(N), L(D))", "–", "–", _g(scaling.KAPLAN["alpha"]), "–",
                  _g(scaling.KAPLAN["beta"]), "–", "–", "–"])
    blocks.append(Block("table", header=header, rows=table))
    blocks.extend(_isoflop_blocks(n, d, loss, fits["total"]))
    img_dir.mkdir(parents=True, exist_ok=True)
    for path in (_plot_loss_vs(n, d, loss, fits["total"], "N", img_dir / f"{suite.name}_loss_vs_N.png"),
                 _plot_loss_vs(n, d, loss, fits["total"], "D", img_dir / f"{suite.name}_loss_vs_D.png"),
                 _plot_compute(n, d, loss, fits["total"], img_dir / f"{suite.name}_loss_vs_compute.png")):
        blocks.append(Block("img", f"{rel}/{path.name}", header=[path.stem]))
    return blocks


def _isoflop_blocks(n, d, loss, fit: scaling.LossFit) -> list[Block]:
    profiles = scaling.isoflop_profiles(n, d, loss)
    blocks = [Block("h3", "IsoFLOP profiles (approach 2)")]
    if not profiles:
        return blocks + [Block("p", "No compute budget (C = 6 N D within 25%) holds 3 sizes: no profile.")]
    rows = []
    for p in profiles:
        law_n = float(fit.law.optimal(p.C)[0])
        where = "inside" if p.inside else ("no minimum" if p.N_opt is None else "outside (extrapolated)")
        rows.append([f"{p.C:.3g}", f"{len(p.N)}: {_g(p.N.min())} .. {_g(p.N.max())}", _g(p.N_opt), where,
                     _g(p.L_opt, 4), _g(law_n)])
    blocks.append(Block("table", header=["C (FLOPs)", "sizes", "parabola's N_opt", "minimum", "its loss",
                                         "fitted law's N_opt"], rows=rows))
    slope = scaling.optimal_exponent(profiles)
    law_a = fit.law.beta / (fit.law.alpha + fit.law.beta)
    blocks.append(Block("p", (
        f"N_opt ~ C^a: a = {_g(slope[0]) if slope else '– (fewer than 2 interior minima)'} from the profiles' "
        f"minima, {_g(law_a)} from the fitted law (beta / (alpha + beta)); Chinchilla: 0.50 (approach 1), "
        "0.49 (approach 2), 0.46 (approach 3).")))
    return blocks


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _plot_loss_vs(n, d, loss, fit: scaling.LossFit, axis: str, out: Path) -> Path:
    """Loss against N (one line per token budget) or against D (one line per size), with the law's curves."""
    plt = _plt()
    x, other = (n, d) if axis == "N" else (d, n)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    keys = sorted(set(np.round(np.log2(other), 1)))                # runs of one budget (size) share a key
    for key in keys:
        sel = np.round(np.log2(other), 1) == key
        order = np.argsort(x[sel])
        line, = ax.plot(x[sel][order], loss[sel][order], "o", ms=4)
        grid = np.geomspace(x[sel].min() / 1.5, x[sel].max() * 1.5, 50)
        fixed = float(np.exp(np.mean(np.log(other[sel]))))
        curve = fit.law(grid, fixed) if axis == "N" else fit.law(fixed, grid)
        label = f"{'D' if axis == 'N' else 'N'} = {fixed:.3g}"
        ax.plot(grid, curve, "-", color=line.get_color(), lw=1, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters N (all)" if axis == "N" else "training tokens D")
    ax.set_ylabel("final val loss (nats)")
    ax.set_title(f"loss vs {axis}: points = runs, lines = fitted L(N, D)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def _plot_compute(n, d, loss, fit: scaling.LossFit, out: Path) -> Path:
    """Loss against C = 6 N D, coloured by size, with the law's compute-optimal frontier L(N_opt(C), D_opt(C))."""
    plt = _plt()
    c = 6 * n * d
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for size in sorted(set(n)):
        sel = n == size
        order = np.argsort(c[sel])
        ax.plot(c[sel][order], loss[sel][order], "o-", ms=4, lw=0.8, label=f"N = {size:.3g}")
    grid = np.geomspace(c.min() / 2, c.max() * 2, 80)
    ax.plot(grid, fit.law(*fit.law.optimal(grid)), "k--", lw=1.2, label="fitted law, compute-optimal")
    for p in scaling.isoflop_profiles(n, d, loss):
        if p.inside and p.L_opt is not None:
            ax.plot([p.C], [p.L_opt], "r*", ms=10)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training compute C = 6 N D (FLOPs)")
    ax.set_ylabel("final val loss (nats)")
    ax.set_title("loss vs compute; red stars = IsoFLOP minima", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
