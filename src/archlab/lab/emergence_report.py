"""The `emergence` analysis of a report: per model size, the sharp metric (exact match) beside the smooth
ones (per-digit accuracy, answer NLL) and the exact match that independent digits would give
(digit accuracy ** answer length, Schaeffer et al. 2023), plotted against parameters and compute; and, where the
runs scored it, in-context learning (k-shot accuracy on fresh random mappings by shot count, archlab.eval.incontext)
beside the strongest induction head (prefix-matching score, Olsson et al. 2022)."""
from __future__ import annotations

import statistics
from pathlib import Path

from archlab.lab.document import Block
from archlab.lab.verdicts import ladder

METRICS = {"exact_match": "exact match", "digit_accuracy": "per-digit accuracy", "answer_nll": "answer NLL (nats)"}


def _mean_std(values: dict[int, float]) -> tuple[float, float]:
    vals = list(values.values())
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def section(suite, rows: list, img_dir: Path, rel: str) -> list[Block]:
    """A table per size and two figures (against parameters, against training compute 6 N D)."""
    series = {m: ladder(rows, m) for m in METRICS}
    sizes = list(series["exact_match"])
    blocks = [Block("h3", "Emergence: the sharp metric beside the smooth ones")]
    if not sizes:
        return blocks + [Block("p", "No finished run has the addition scores.")]
    tokens = {int(r.params): r.tokens_seen for r in rows if r.params and r.tokens_seen}
    k = next((int(r.extra["answer_digits"]) for r in rows if r.extra.get("answer_digits")), 0)
    per_position = _per_position(rows)
    table = []
    for n in sizes:
        cells = [f"{n:,}", f"{6 * n * tokens.get(n, 0):.3g}"]
        for m in METRICS:
            mean, std = _mean_std(series[m][n]) if series[m].get(n) else (float("nan"), 0.0)
            cells.append(f"{mean:.3f} ± {std:.3f}")
        digit = _mean_std(series["digit_accuracy"][n])[0] if series["digit_accuracy"].get(n) else float("nan")
        cells += [f"{digit ** k:.3f}", " / ".join(f"{p:.2f}" for p in per_position.get(n, []))]
        table.append(cells)
    blocks.append(Block("table", header=["params", "compute 6ND", *METRICS.values(), f"digit accuracy ^ {k}",
                                         "per position (units first)"], rows=table))
    blocks.append(Block("p", (
        f"If each of the {k} answer digits were right independently with the per-digit accuracy p, exact "
        f"match would be p^{k}: a smooth rise of p turns into a late, steep rise of exact match. The positions are "
        "the sub-tasks: the units digit needs no carry, the next ones need the carry from below.")))
    img_dir.mkdir(parents=True, exist_ok=True)
    for axis in ("params", "compute"):
        out = _plot(series, tokens, k, axis, img_dir / f"{suite.name}_vs_{axis}.png")
        blocks.append(Block("img", f"{rel}/{out.name}", header=[out.stem]))
    return blocks + _icl_blocks(suite, rows, img_dir, rel)


ICL = {"icl_accuracy": "k-shot accuracy (1-3 shots)", "icl_nll": "k-shot NLL (nats)",
       "prefix_matching_max": "strongest induction head (prefix matching)"}


_ICL_NOTE = ("Each episode maps 3 letters to random letters drawn afresh, each shown 4 times: a value whose key came "
             "before can only be read from the line itself (0 shots: chance, 1/26). Guessing among the values already "
             "in the line (up to 3) gets about a third right without matching keys; above that the model matches "
             "keys. The prefix-matching score is the largest, over heads, mean attention from a token of a repeated "
             "random letter sequence to the token after its first occurrence (1 = a perfect induction head; uniform "
             "attention over 32-63 keys gives ~0.02).")


def _icl_blocks(suite, rows: list, img_dir: Path, rel: str) -> list[Block]:
    """Per size: k-shot accuracy overall and per shot count, its NLL and the strongest head's prefix-matching score."""
    series = {m: ladder(rows, m) for m in ICL}
    sizes = list(series["icl_accuracy"])
    if not sizes:
        return []
    per_shot = _per_position(rows, "icl_accuracy_per_shot")
    table = []
    for n in sizes:
        cells = [f"{n:,}"]
        for m in ICL:
            mean, std = _mean_std(series[m][n]) if series[m].get(n) else (float("nan"), 0.0)
            cells.append(f"{mean:.3f} ± {std:.3f}")
        table.append(cells + [" / ".join(f"{p:.2f}" for p in per_shot.get(n, []))])
    blocks = [Block("h3", "In-context learning: k-shot lookups of fresh random mappings"),
              Block("table", header=["params", *ICL.values(), "accuracy by shots (0, 1, 2, ...)"], rows=table),
              Block("p", _ICL_NOTE)]
    out = _plot_icl(series, per_shot, img_dir / f"{suite.name}_icl.png")
    return blocks + [Block("img", f"{rel}/{out.name}", header=[out.stem])]


def _plot_icl(series: dict, per_shot: dict, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), dpi=100)
    sizes = list(series["icl_accuracy"])
    shots = max((len(v) for v in per_shot.values()), default=0)
    for s in range(shots):
        axes[0].plot(sizes, [per_shot.get(n, [float("nan")] * shots)[s] for n in sizes], "o-", label=f"{s} shots")
    axes[0].axhline(1 / 26, color="k", ls=":", lw=1, label="chance (1/26)")
    axes[0].set_title("k-shot accuracy on fresh mappings (mean over seeds)", fontsize=9)
    axes[0].legend(fontsize=7)
    stats = [_mean_std(series["prefix_matching_max"][n]) if n in series["prefix_matching_max"] else (float("nan"), 0)
             for n in sizes]
    axes[1].errorbar(sizes, [m for m, _ in stats], yerr=[e for _, e in stats], fmt="o-", capsize=3)
    axes[1].set_title("strongest induction head: prefix-matching score", fontsize=9)
    for ax in axes:
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("parameters")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def _per_position(rows: list, key: str = "digit_accuracy_per_position") -> dict[int, list[float]]:
    """params -> a per-position (or per-shot) list of the rows' `key`, the mean over seeds."""
    out: dict[int, list[list[float]]] = {}
    for r in rows:
        values = r.extra.get(key)
        if r.status == "done" and r.params and values:
            out.setdefault(int(r.params), []).append(values)
    return {n: [statistics.fmean(col) for col in zip(*vals)] for n, vals in sorted(out.items())}


def _plot(series: dict, tokens: dict, k: int, axis: str, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8), dpi=100)
    for ax, (metric, title) in zip(axes, METRICS.items()):
        sizes = list(series[metric])
        xs = [n if axis == "params" else 6 * n * tokens.get(n, 0) for n in sizes]
        stats = [_mean_std(series[metric][n]) for n in sizes]
        ax.errorbar(xs, [m for m, _ in stats], yerr=[s for _, s in stats], fmt="o-", capsize=3, label=title)
        if metric == "exact_match" and series["digit_accuracy"]:
            pred = [_mean_std(series["digit_accuracy"][n])[0] ** k if n in series["digit_accuracy"]
                    else float("nan") for n in sizes]
            ax.plot(xs, pred, "k--", lw=1, label=f"digit accuracy ^ {k}")
            ax.legend(fontsize=7)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())                 # minor labels of a short log axis overlap
        ax.set_xlabel("parameters" if axis == "params" else "training compute 6 N D (FLOPs)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(f"addition ({k}-digit answers) across the model ladder (mean ± std over seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
