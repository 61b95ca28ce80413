"""The `real_model` analysis of a report: what was measured on which model, text and CPU (or GPU), a table of every
variant's perplexity and figures, and the plots that show the claim: perplexity per variant (log scale when it spans
more than 10x), the largest |h| / median per layer when the probe recorded it (massive_activations), and perplexity
against the window per cache when the variants have a `window` axis (streaming)."""
from __future__ import annotations

from pathlib import Path

from archlab.lab.document import Block
from archlab.lab.plotstyle import pyplot, save, series_style
from archlab.lab.verdicts import curve

__all__ = ["section", "what_line"]

# figures a variant's row may carry (archlab.lab.real_model), shown in the table when present, in this order
FIGURES = {"peak_ratio": "max/median |h|", "peak_layer": "at layer", "n_massive": "massive entries",
           "massive_dim_ids": "their dims", "massive_at_first_token": "share at token 0", "n_zeroed": "zeroed",
           "scored_tokens": "tokens scored"}


def _done(rows: list) -> list:
    return [r for r in rows if r.status == "done" and r.extra.get("ppl") is not None]


def what_line(rows: list) -> str:
    """The runs' line of the report: the model, the text, where it ran, how long measuring took."""
    done = _done(rows)
    if not done:
        return "a pretrained model evaluated, none trained; no run finished"
    first = done[0].extra
    seconds = sum(r.extra.get("seconds", 0.0) for r in done)
    cores = f"{first['cores']} cores, " if first.get("cores") else ""
    return (f"a pretrained model evaluated, none trained: {first.get('model')} ({done[0].params:,} parameters, from "
            f"{Path(str(first.get('source'))).name}), {first.get('text')}; measured on {first.get('device')} "
            f"({cores}{first.get('threads')} torch thread(s) per run), {seconds:.0f} s measuring in all")


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) >= 1e6 else f"{x:,.0f}" if abs(x) >= 1_000 else f"{x:.4g}"
    return str(x)


def section(suite, rows: list, img_dir: Path, rel: str) -> list[Block]:
    """The table of variants and the suite's plots."""
    done = _done(rows)
    blocks = [Block("h3", "Measured per variant")]
    if not done:
        failed = [r for r in rows if r.status == "failed"]
        why = (failed[0].error or "").splitlines()[0][:200] if failed else "no row"
        return blocks + [Block("p", f"No finished run ({why}).")]
    shown = [k for k in FIGURES if any(k in r.extra for r in done)]
    blocks.append(Block("table", header=["variant", "perplexity", *(FIGURES[k] for k in shown), "seconds"],
                        rows=[[r.variant, _fmt(r.extra["ppl"]), *(_fmt(r.extra.get(k, "–")) for k in shown),
                               f"{r.extra.get('seconds', 0):.0f}"] for r in done]))
    img_dir.mkdir(parents=True, exist_ok=True)
    plots = [_ppl_bars(suite.name, done, img_dir / f"{suite.name}_ppl.png")]
    probe = next((r.extra for r in done if r.extra.get("ratios")), None)
    if probe:
        plots.append(_ratios(suite.name, probe, img_dir / f"{suite.name}_ratio_per_layer.png"))
    if any("window" in r.extra.get("labels", {}) for r in done):
        plots.append(_ppl_vs_window(suite.name, done, img_dir / f"{suite.name}_ppl_vs_window.png"))
    blocks.append(Block("h3", "Plots"))
    blocks.extend(Block("img", f"{rel}/{p.name}", header=[p.stem]) for p in plots)
    return blocks


def _ppl_bars(name: str, rows: list, out: Path) -> Path:
    plt = pyplot()
    values = [r.extra["ppl"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(5, 0.7 * len(rows) + 2), 4.2), dpi=100)
    bars = ax.bar(range(len(rows)), values, color="#5b8fd0")
    ax.bar_label(bars, labels=[_fmt(v) for v in values], fontsize=7, padding=2)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r.variant for r in rows], rotation=35, ha="right", fontsize=7)
    spread = max(values) / max(min(values), 1e-12)
    if spread > 10:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_ylabel("perplexity" + (" (log scale)" if spread > 10 else ""))
    ax.set_title(f"{name}: perplexity per variant", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    return save(fig, out)


def _ratios(name: str, extra: dict, out: Path) -> Path:
    plt = pyplot()
    ratios = extra["ratios"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(range(len(ratios)), ratios, **series_style(0))
    ax.axhline(1_000, color="grey", ls="--", lw=0.8)
    ax.text(0, 1_000, " 1,000x the median", fontsize=7, va="bottom")
    ax.set_yscale("log")
    ax.set_xlabel("layer (block output)")
    ax.set_ylabel("max |h| / median |h| (log scale)")
    ax.set_title(f"{name}: largest |h| over the median, per layer", fontsize=9)
    ax.grid(alpha=0.3)
    return save(fig, out)


def _ppl_vs_window(name: str, rows: list, out: Path) -> Path:
    plt = pyplot()
    caches = list(dict.fromkeys(r.extra["labels"].get("cache") for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    for i, cache in enumerate(caches):
        points = curve(rows, "ppl", "window", {"cache": cache} if cache is not None else {})
        ax.plot(list(points), list(points.values()), label=str(cache), **series_style(i))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("window (cache size, tokens)")
    ax.set_ylabel("perplexity past the window (log scale)")
    ax.set_title(f"{name}: perplexity past the window, per cache", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return save(fig, out)
