"""The `ngram` analysis of a report: validation bits/byte against the order n for interpolated modified Kneser-Ney
and for maximum likelihood with add-k, as a table and one plot (the notes' n trade-off)."""
from __future__ import annotations

from pathlib import Path

from archlab.lab.document import Block
from archlab.lab.plotstyle import series_style
from archlab.lab.verdicts import curve

CURVES = {"kn_bpb": "modified Kneser-Ney", "add_k_bpb": "maximum likelihood + add-k"}


def section(suite, rows: list, img_dir: Path, rel: str) -> list[Block]:
    """A table per order (both estimates, the share of validation n-grams seen in training) and the plot."""
    curves = {m: curve(rows, m, "order") for m in CURVES}
    seen = curve(rows, "seen", "order")
    blocks = [Block("h3", "The n trade-off: bits/byte against the order n")]
    orders = sorted(set(curves["kn_bpb"]) | set(curves["add_k_bpb"]))
    if not orders:
        return blocks + [Block("p", "No finished n-gram run.")]
    k = next((r.extra["add_k"] for r in rows if "add_k" in r.extra), None)
    fmt = lambda points, n: f"{points[n]:.4f}" if n in points else "–"  # noqa: E731
    blocks.append(Block("table", header=["n", "Kneser-Ney bits/byte", f"add-{k:g} bits/byte" if k else "add-k",
                                         "validation n-grams seen in training"],
                        rows=[[f"{n:g}", fmt(curves["kn_bpb"], n), fmt(curves["add_k_bpb"], n),
                               f"{seen[n]:.1%}" if n in seen else "–"] for n in orders]))
    blocks.append(Block("p", (
        "As n grows, fewer validation n-grams occur in training. Add-k has no back-off: an unseen history gets the "
        "uniform 1/V and a rarely seen one little more than its few counts, so its bits/byte rise once counts run "
        "out; Kneser-Ney interpolates with the lower orders and keeps what the shorter histories know.")))
    devices = sorted({r.extra["device"] for r in rows if r.extra.get("device")})
    seconds = sum(r.extra.get("seconds", 0.0) for r in rows)
    first = next((r.extra for r in rows if r.extra.get("device")), None)
    if first:
        blocks.append(Block("p", (
            f"Data: corpus {first.get('corpus')}, vocabulary {first.get('vocab_size')}, {first.get('val_tokens'):,} "
            f"validation tokens ({first.get('val_bytes'):,} bytes), every one scored. Counted and scored on "
            f"{', '.join(devices)}: {seconds:.0f} s over the {len(orders)} orders (each run counts every order up "
            "to its own).")))
    img_dir.mkdir(parents=True, exist_ok=True)
    out = _plot(curves, k, img_dir / f"{suite.name}_bpb_vs_order.png")
    blocks.append(Block("img", f"{rel}/{out.name}", header=[out.stem]))
    return blocks


def _plot(curves: dict[str, dict[float, float]], k: float | None, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=100)
    for i, (metric, title) in enumerate(CURVES.items()):
        points = curves[metric]
        label = title.replace("add-k", f"add-{k:g}") if k else title
        ax.plot(list(points), list(points.values()), label=label, **series_style(i))
    ax.set_xlabel("order n")
    ax.set_ylabel("validation bits/byte")
    ax.set_title("n-gram models: validation bits/byte against n", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
