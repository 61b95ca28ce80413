"""The expert-load section of a report, for any suite whose runs have MoE layers: per-layer histograms of how the
routed slots spread over the experts, read from each run's metrics.jsonl (`moe/expert_fraction` of the last
training line: its last micro-batch), the busiest expert's share over training, and the load measured after
training on validation tokens when the suite asks for it (`measure: [expert_load]`, archlab.eval.expert_load).

Expert identities differ between seeds, so a histogram ranks each layer's experts by load before averaging seeds:
the bars show how unequal the load is, not which expert took it."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from archlab.lab.document import Block
from archlab.lab.plotstyle import pyplot, save, series_style

__all__ = ["section", "read_load"]


def read_load(run_dir: str | None) -> tuple[list[int], list[float], list[list[float]] | None]:
    """(steps, moe/max_expert_fraction per logged step, the last logged per-layer table) from a run's metrics.jsonl;
    empty lists and None when the run logged no expert load."""
    path = Path(run_dir) / "metrics.jsonl" if run_dir else None
    steps: list[int] = []
    busiest: list[float] = []
    table = None
    if path is None or not path.is_file():
        return steps, busiest, table
    for line in path.read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if "moe/expert_fraction" in rec:
            steps.append(int(rec["step"]))
            busiest.append(float(rec["moe/max_expert_fraction"]))
            table = rec["moe/expert_fraction"]
    return steps, busiest, table


def _ranked_mean(tables: list[list[list[float]]]) -> list[list[float]]:
    """(layers, n): each layer's shares sorted from the busiest expert down, averaged over the tables (seeds)."""
    ranked = [[sorted(row, reverse=True) for row in t] for t in tables]
    return [[statistics.fmean(col) for col in zip(*layer)] for layer in zip(*ranked)]


def _moe_rows(rows: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for r in rows:
        moe = ((r.config or {}).get("model", {}).get("mlp") or {}).get("moe")
        if moe and r.status == "done":
            out.setdefault(r.variant, []).append(r)
    return out


def section(suite, rows: list, img_dir: Path, rel: str) -> list[Block]:
    """Blocks for the suite's MoE runs ([] when it has none): the measured table, the histograms, the curve."""
    variants = _moe_rows(rows)
    if not variants:
        return []
    blocks = [Block("h3", "Expert load per layer")]
    measured = [[v, *(_per_layer(group, key) for key in ("expert_load_first_choice", "expert_load_routed"))]
                for v, group in variants.items() if any("expert_load_first_choice" in r.extra for r in group)]
    if measured:
        blocks.append(Block("p", (
            "Measured after training on the validation batches, mean over seeds: per MoE layer, the busiest "
            "expert's share of first choices (the tokens whose top-ranked expert it is; 1/n_experts at perfect "
            "balance) and of all routed slots (at most 1/top_k).")))
        blocks.append(Block("table", header=["variant", "busiest expert, first choices, per layer",
                                             "busiest expert, routed slots, per layer"], rows=measured))
    loads = {v: [read_load(r.run_dir) for r in group] for v, group in variants.items()}
    img_dir.mkdir(parents=True, exist_ok=True)
    figures = [_histograms(loads, img_dir / f"{suite.name}_expert_load.png"),
               _busiest_curve(loads, img_dir / f"{suite.name}_busiest_expert.png")]
    if any(f is not None for f in figures):
        blocks.append(Block("p", (
            "From metrics.jsonl: each expert's share of the routed slots in the last training micro-batch, per "
            "layer, experts ranked by load and averaged over seeds (dashed: perfect balance); and the busiest "
            "expert's share over all layers on every logged step.")))
    blocks += [Block("img", f"{rel}/{f.name}", header=[f.stem]) for f in figures if f is not None]
    return blocks


def _per_layer(group: list, key: str) -> str:
    tables = [r.extra[key] for r in group if key in r.extra]
    if not tables:
        return "–"
    per_layer = [statistics.fmean(max(t[i]) for t in tables) for i in range(len(tables[0]))]
    return " / ".join(f"{x:.0%}" for x in per_layer) + f" (mean {statistics.fmean(per_layer):.1%})"


def _histograms(loads: dict[str, list], out: Path) -> Path | None:
    """A grid: one row per variant, one panel per layer, bars = experts ranked by load."""
    tables = {v: _ranked_mean([t for _, _, t in runs if t]) for v, runs in loads.items()
              if any(t for _, _, t in runs)}
    if not tables:
        return None
    plt = pyplot()
    n_layers = max(len(t) for t in tables.values())
    fig, axes = plt.subplots(len(tables), n_layers, figsize=(2.2 * n_layers + 1, 1.9 * len(tables) + 0.6),
                             dpi=100, squeeze=False, sharey=True)
    for i, (variant, table) in enumerate(tables.items()):
        for j in range(n_layers):
            ax = axes[i][j]
            if j < len(table):
                shares = table[j]
                ax.bar(range(1, len(shares) + 1), shares, color="#5b8fd0")
                ax.axhline(1 / len(shares), color="grey", ls="--", lw=0.8)
            ax.set_xticks([])
            ax.grid(alpha=0.3, axis="y")
            if i == 0:
                ax.set_title(f"layer {j}", fontsize=8)
            if j == 0:
                ax.set_ylabel(variant, fontsize=6)
    fig.suptitle("share of routed slots per expert (ranked), last training micro-batch, mean over seeds", fontsize=9)
    return save(fig, out)


def _busiest_curve(loads: dict[str, list], out: Path) -> Path | None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    drawn = 0
    for variant, runs in loads.items():
        runs = [(s, b) for s, b, _ in runs if s]
        if not runs:
            continue
        n = min(len(s) for s, _ in runs)
        ax.plot(runs[0][0][:n], [statistics.fmean(col) for col in zip(*(b[:n] for _, b in runs))], label=variant,
                markevery=max(1, n // 10), ms=4, **series_style(drawn))
        drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("step")
    ax.set_ylabel("busiest expert's share of routed slots")
    ax.set_ylim(bottom=0)
    ax.set_title("busiest expert over all MoE layers, last micro-batch of each logged step (mean over seeds)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, out)
