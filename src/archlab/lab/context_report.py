"""The `context` analysis of a report (suite context_extension, runs: extend): perplexity against evaluation length
per extension method, one curve per fine-tuning step count, a table of the same numbers with passkey accuracy, and
the perplexity at the extended length against fine-tuning steps."""
from __future__ import annotations

import statistics
from pathlib import Path

from archlab.lab.document import Block
from archlab.lab.plotstyle import pyplot, save, series_style


def _groups(rows: list) -> dict[tuple[str, int], list]:
    """(method, steps) -> the finished rows with perplexities, in the order the suite ran them."""
    out: dict[tuple[str, int], list] = {}
    for r in rows:
        labels = r.extra.get("labels", {})
        if r.status == "done" and r.extra.get("ppl_by_length") and "method" in labels:
            out.setdefault((labels["method"], int(r.extra.get("steps", labels.get("steps", 0)))), []).append(r)
    return out


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def runs_line(rows: list) -> str:
    """What the runs were: the bases' length and training, the extended length, the step counts."""
    done = [r for r in rows if r.extra.get("original_len")]
    if not done:
        return "no finished extension"
    base = done[0].config.get("base", {}).get("train", {})
    train = done[0].config.get("train", {})
    steps = sorted({int(r.extra.get("steps", 0)) for r in done})
    bases = {r.extra.get("base") for r in rows if r.extra.get("base")}
    return (f"{len(bases)} base{'s' * (len(bases) != 1)} trained at {done[0].extra['original_len']} tokens "
            f"({base.get('budget', 0):g} {base.get('budget_unit', 'steps')} of batch {base.get('batch_size')}), "
            f"extended to {done[0].extra['extended_len']} with {', '.join(map(str, steps))} fine-tuning steps of batch "
            f"{train.get('batch_size')} x {train.get('seq_len')}")


def section(suite, rows: list, img_dir: Path, rel: str) -> list[Block]:
    """The table and the two figures."""
    groups = _groups(rows)
    blocks = [Block("h3", "Perplexity by length and passkey retrieval")]
    if not groups:
        return blocks + [Block("p", "No finished run has perplexities by length.")]
    lengths = sorted({int(n) for rs in groups.values() for r in rs for n in r.extra["ppl_by_length"]})
    long = max(lengths)
    table = []
    for (method, steps), rs in groups.items():
        cells = [method, str(steps), str(len(rs))]
        for n in lengths:
            vals = [r.extra["ppl_by_length"][str(n)] for r in rs if str(n) in r.extra["ppl_by_length"]]
            cells.append("{:.2f} ± {:.2f}".format(*_mean_std(vals)) if vals else "–")
        keys = [r.extra["passkey_extended"] for r in rs if r.extra.get("passkey_extended") is not None]
        cells.append(f"{statistics.fmean(keys):.0%}" if keys else "n/a")
        table.append(cells)
    blocks.append(Block("table", header=["method", "steps", "seeds", *(f"ppl @ {n}" for n in lengths),
                                         f"passkey @ {long}"], rows=table))
    short = next((r.extra["original_len"] for rs in groups.values() for r in rs), None)
    blocks.append(Block("p", (
        f"Mean ± std over seeds. The bases were trained at {short} tokens; each column is the validation perplexity "
        f"of windows of that many tokens (the same windows for every run). Steps 0: the base's weights under the "
        f"method's RoPE scaling, no training.")))
    img_dir.mkdir(parents=True, exist_ok=True)
    for path in (_plot_by_length(groups, short, img_dir / f"{suite.name}_ppl_by_length.png"),
                 _plot_by_steps(groups, long, img_dir / f"{suite.name}_ppl_by_steps.png")):
        blocks.append(Block("img", f"{rel}/{path.name}", header=[path.stem]))
    return blocks


def _plot_by_length(groups: dict, short: int | None, out: Path) -> Path:
    plt = pyplot()
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    methods = list(dict.fromkeys(m for m, _ in groups))
    fig, axes = plt.subplots(1, len(methods), figsize=(3.6 * len(methods), 3.6), dpi=100, sharey=True, squeeze=False)
    for ax, method in zip(axes[0], methods):
        for i, steps in enumerate(sorted(s for m, s in groups if m == method)):
            rs = groups[(method, steps)]
            ns = sorted({int(n) for r in rs for n in r.extra["ppl_by_length"]})
            ys = [statistics.fmean(r.extra["ppl_by_length"][str(n)] for r in rs if str(n) in r.extra["ppl_by_length"])
                  for n in ns]
            ax.plot(ns, ys, label=f"{steps} steps", **series_style(i))
        if short:
            ax.axvline(short, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())           # 7, 10, 20 rather than 2 x 10^1
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("evaluation length (tokens)")
        ax.set_title(method, fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("validation perplexity (mean over seeds)")
    fig.suptitle("perplexity against length per extension method (dotted: the trained length)", fontsize=10)
    return save(fig, out)


def _plot_by_steps(groups: dict, long: int, out: Path) -> Path:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for i, method in enumerate(dict.fromkeys(m for m, _ in groups)):
        steps = sorted(s for m, s in groups if m == method)
        stats = [_mean_std([r.extra["ppl_extended"] for r in groups[(method, s)]]) for s in steps]
        ax.errorbar(steps, [m for m, _ in stats], yerr=[s for _, s in stats], capsize=3, label=method,
                    **series_style(i))
    ax.set_xlabel("fine-tuning steps at the extended length")
    ax.set_ylabel(f"validation perplexity at {long}")
    ax.set_title(f"perplexity at {long} tokens against fine-tuning steps (mean ± std over seeds)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, out)
