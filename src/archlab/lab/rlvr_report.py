"""The `rlvr` analysis of a report: pass@k of sampled answers before and after GRPO (archlab.lab.finetune
rlvr_stage), as a table (mean and std over seeds at each k) and one plot of both curves (Yue et al. 2025's figure)."""
from __future__ import annotations

import statistics
from pathlib import Path

from archlab.lab.document import Block
from archlab.lab.plotstyle import pyplot, save


def curves(rows: list) -> dict[str, dict[int, list[float]]]:
    """{"before" | "after": {k: [pass@k of each finished run]}} from the rows' pass_before / pass_after.
    Example: curves(rows)["after"][1] -> [0.93, 0.95]"""
    out: dict[str, dict[int, list[float]]] = {"before": {}, "after": {}}
    for r in rows:
        if r.status != "done":
            continue
        for when in out:
            for name, value in (r.extra.get(f"pass_{when}") or {}).items():
                out[when].setdefault(int(name.removeprefix("pass@")), []).append(float(value))
    return {when: dict(sorted(points.items())) for when, points in out.items()}


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def section(suite, rows: list, img_dir: Path, rel: str) -> list[Block]:
    """The pass@k table (before, after, gain, each mean ± std over seeds) and the curves' plot."""
    series = curves(rows)
    blocks = [Block("h3", "pass@k before and after GRPO")]
    ks = [k for k in series["before"] if k in series["after"]]
    if not ks:
        return blocks + [Block("p", "No finished run with pass@k measured before and after GRPO.")]
    fmt = lambda m, s: f"{round(m, 3) + 0.0:.3f} ± {s:.3f}"  # noqa: E731 - never "-0.000"
    table = []
    for k in ks:
        gains = [a - b for a, b in zip(series["after"][k], series["before"][k])]
        table.append([str(k), fmt(*_mean_std(series["before"][k])), fmt(*_mean_std(series["after"][k])),
                      fmt(*_mean_std(gains))])
    blocks.append(Block("table", header=["k", "pass@k before (fine-tuned)", "pass@k after GRPO", "gain"],
                        rows=table))
    first = next(r.extra for r in rows if r.status == "done" and "rlvr_steps" in r.extra)
    seconds = [r.extra["grpo_s"] for r in rows if r.status == "done" and "grpo_s" in r.extra]
    blocks.append(Block("p", (
        f"{len(series['before'][ks[0]])} runs (one per seed), {first.get('rlvr_k')} answers sampled per held-out "
        f"word ({first.get('test_words')} words) at GRPO's temperature, scored right when exactly the lowercase "
        f"reversal; pass@k is Chen et al.'s unbiased estimator. GRPO: {first.get('rlvr_steps')} steps, "
        f"{statistics.fmean(seconds):.0f} s a run on average.")))
    out = _plot(series, ks, img_dir / f"{suite.name}_pass_at_k.png")
    return blocks + [Block("img", f"{rel}/{out.name}", header=[out.stem])]


def _plot(series: dict, ks: list[int], out: Path) -> Path:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5, 3.8), dpi=100)
    for when, label, style in (("before", "fine-tuned (before GRPO)", "o--"), ("after", "after GRPO", "s-")):
        stats = [_mean_std(series[when][k]) for k in ks]
        ax.errorbar(ks, [m for m, _ in stats], yerr=[s for _, s in stats], fmt=style, capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set(xlabel="k (answers sampled)", ylabel="pass@k (held-out words)", ylim=(0, 1.02))
    ax.set_title("pass@k before and after RL with a verifiable reward", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return save(fig, out)
