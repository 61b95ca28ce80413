"""`archlab report DIR`: Markdown + a static HTML page + PNG plots from one or more sweep folders.

For each suite in DIR/results.sqlite (or DIR/*/results.sqlite): the claim, the verdict of every rule
computed from the recorded numbers (archlab.lab.verdicts), the published figure beside ours, a table
per variant, and plots (matplotlib, Agg): loss curves per variant with the spread over seeds, final loss
per variant with error bars, loss against learning rate for suites with an LR axis, step time per
variant, the suite's own metrics, and per-layer expert-load histograms of runs with MoE layers
(lab/moe_report.py). Images are relative PNG paths, so report.html opens from disk.
"""
from __future__ import annotations

import html
import json
import math
import statistics
from pathlib import Path
from typing import Any, Callable

from archlab.lab import (
    baseline,
    context_report,
    emergence_report,
    moe_report,
    ngram_report,
    real_model_report,
    rlvr_report,
    scaling_report,
)
from archlab.lab import suites as suites_mod
from archlab.lab.document import Block
from archlab.lab.plotstyle import series_style
from archlab.lab.store import DB_FILE, ResultStore, RunRecord
from archlab.lab.verdicts import HELD, INCONCLUSIVE, NOT_HELD, Verdict, judge_all, overall, tolerance

STANDARD_METRICS = ("final_val_loss", "step_time_s", "lr_sensitivity", "diverged")
# a suite's `analysis`: its own section after the plots, (suite, rows, img_dir, rel) -> blocks
ANALYSES: dict[str, Callable[..., list[Block]]] = {"scaling": scaling_report.section,
                                                   "emergence": emergence_report.section,
                                                   "ngram": ngram_report.section,
                                                   "context": context_report.section,
                                                   "real_model": real_model_report.section,
                                                   "rlvr": rlvr_report.section}
MEASURED_METRICS = ("val_loss_2x", "max_attn_logit", "first_token_mass", "massive_ratio", "kv_cache_bytes",
                    "busiest_routed_share")


# --------------------------------------------------------------------------- document blocks
def to_markdown(blocks: list[Block]) -> str:
    out = []
    for b in blocks:
        if b.kind in ("h1", "h2", "h3"):
            out.append("#" * int(b.kind[1]) + " " + b.text)
        elif b.kind == "p":
            out.append(b.text)
        elif b.kind == "img":
            out.append(f"![{b.header[0] if b.header else ''}]({b.text})")
        elif b.kind == "table":
            esc = lambda c: str(c).replace("|", "\\|").replace("\n", " ")  # noqa: E731
            out.append("| " + " | ".join(map(esc, b.header)) + " |")
            out.append("|" + "---|" * len(b.header))
            out.extend("| " + " | ".join(map(esc, r)) + " |" for r in b.rows)
        out.append("")
    return "\n".join(out)


_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:.9em}td,th{border:1px solid #ccc;padding:3px 7px;
text-align:left;vertical-align:top}th{background:#f3f3f3}img{max-width:100%;margin:.3em 0}
.held{background:#d9f2d9}.did-not-hold{background:#f7d4d4}.inconclusive{background:#f5f0d0}.mixed{background:#e6e0f5}
code{background:#f3f3f3;padding:0 3px}"""


def to_html(blocks: list[Block], title: str) -> str:
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
           f"<style>{_CSS}</style></head><body>"]
    for b in blocks:
        if b.kind in ("h1", "h2", "h3"):
            out.append(f"<{b.kind}>{html.escape(b.text)}</{b.kind}>")
        elif b.kind == "p":
            out.append(f"<p>{_inline(b.text)}</p>")
        elif b.kind == "img":
            out.append(f"<img src='{html.escape(b.text)}' alt='{html.escape(b.header[0] if b.header else '')}'>")
        elif b.kind == "table":
            out.append("<table><tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in b.header) + "</tr>")
            for r in b.rows:
                cells = []
                for c in r:
                    c = str(c)
                    word = c.strip("*")
                    verdict = word in (HELD, NOT_HELD, INCONCLUSIVE, "mixed")
                    cls = f" class='{word.replace(' ', '-')}'" if verdict else ""
                    cells.append(f"<td{cls}>{_inline(c)}</td>")
                out.append("<tr>" + "".join(cells) + "</tr>")
            out.append("</table>")
    out.append("</body></html>")
    return "\n".join(out)


def _inline(text: str) -> str:
    """Markdown-ish **bold** and `code` to HTML (the rest escaped)."""
    import re
    t = html.escape(text)
    t = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", t)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", t)


# --------------------------------------------------------------------------- data helpers
def find_stores(path: str | Path) -> list[Path]:
    path = Path(path)
    if path.is_file() and path.suffix == ".sqlite":
        return [path]
    if (path / DB_FILE).is_file():
        return [path / DB_FILE]
    found = sorted(path.glob(f"*/{DB_FILE}"))
    if not found:
        raise FileNotFoundError(f"no {DB_FILE} in {path} or its sub-folders: run `archlab ablate` first")
    return found


def _suite_for(store: ResultStore, name: str) -> suites_mod.Suite | None:
    data = store.get_meta(f"suite:{name}")
    if data is not None:
        try:
            return suites_mod.Suite.from_dict(data)
        except Exception:  # noqa: BLE001 - fall back to the built-in definition
            pass
    return suites_mod.BUILTIN.get(name)


def _stats(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _fmt(x: Any, digits: int = 4) -> str:
    """A number for a table cell; "–" for none (None, or the NaN of a mean over no runs: a run that did not train
    has no step time)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
            return f"{x:.3g}"
        return f"{x:.{digits}g}"
    return str(x)


def _variants_in_order(rows: list[RunRecord]) -> list[str]:
    seen: dict[str, None] = {}
    for r in rows:
        seen.setdefault(r.variant, None)
    return list(seen)


def read_curve(run_dir: str | None) -> tuple[list[int], list[float]]:
    if not run_dir:
        return [], []
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return [], []
    steps, losses = [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if "loss" in rec and "val_loss" not in rec and not rec.get("nonfinite"):
            steps.append(int(rec["step"]))
            losses.append(float(rec["loss"]))
    return steps, losses


# --------------------------------------------------------------------------- plots
def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(plt, fig, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_curves(rows: list[RunRecord], out: Path, title: str) -> Path | None:
    fig = curves_figure(rows, title)
    return None if fig is None else _save(_plt(), fig, out)


def curves_figure(rows: list[RunRecord], title: str):
    """Train loss per variant: the mean over seeds, shaded between the min and max seed."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=100)
    drawn = 0
    for variant in _variants_in_order(rows):
        curves = [read_curve(r.run_dir) for r in rows if r.variant == variant]
        curves = [c for c in curves if c[0]]
        if not curves:
            continue
        n = min(len(c[0]) for c in curves)
        steps = curves[0][0][:n]
        cols = list(zip(*(c[1][:n] for c in curves)))   # per step: one loss per seed
        mean = [statistics.fmean(c) for c in cols]
        line, = ax.plot(steps, mean, lw=1.2, label=variant, markevery=max(1, n // 10), ms=4, **series_style(drawn))
        if len(curves) > 1:
            ax.fill_between(steps, [min(c) for c in cols], [max(c) for c in cols], color=line.get_color(), alpha=0.15)
        drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (nats)")
    ax.set_title(f"{title}: loss curves (mean over seeds, band = min..max)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6 if drawn > 8 else 8, ncol=2 if drawn > 8 else 1)
    _clip_ylim(ax, rows)
    return fig


def _clip_ylim(ax, rows):
    finals = [r.final_val_loss for r in rows if r.final_val_loss is not None]
    vocab = next((r.config.get("model", {}).get("vocab_size") for r in rows if r.config), None)
    if finals and vocab:
        ax.set_ylim(min(finals) * 0.9, math.log(vocab) * 1.05)


def plot_bars(rows: list[RunRecord], metric: str, out: Path, title: str, ylabel: str) -> Path | None:
    fig = bars_figure(rows, metric, title, ylabel)
    return None if fig is None else _save(_plt(), fig, out)


def bars_figure(rows: list[RunRecord], metric: str, title: str, ylabel: str):
    """Mean of `metric` per variant with the std over seeds as error bars; diverged runs annotated. The
    axis starts at 0, so bar heights compare as ratios; each bar is labelled with its mean, which is
    where a gap of a few percent reads (the verdict table judges it against the seed spread)."""
    plt = _plt()
    names, means, stds, notes = [], [], [], []
    for variant in _variants_in_order(rows):
        vr = [r for r in rows if r.variant == variant]
        vals = [v for v in (r.metric(metric) for r in vr if r.status == "done") if v is not None and math.isfinite(v)]
        div = sum(r.status == "diverged" for r in vr)
        if not vals and not div:
            continue
        m, s = _stats(vals)
        names.append(variant)
        means.append(m if vals else 0.0)
        stds.append(s if vals else 0.0)
        notes.append(f"{div} div." if div else "")
    if not names or all(not math.isfinite(m) or m == 0 for m in means):
        return None
    fig, ax = plt.subplots(figsize=(max(5, 0.6 * len(names) + 2), 4.2), dpi=100)
    xs = range(len(names))
    bars = ax.bar(xs, means, yerr=stds, capsize=3, color="#5b8fd0")
    ax.bar_label(bars, labels=[" ".join(t for t in (_fmt(m, 4) if m else "", note) if t)
                               for m, note in zip(means, notes)], fontsize=6, padding=2)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=35, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(title + " (axis from 0)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    return fig


def plot_lr(rows: list[RunRecord], lr_axis: str, out: Path, title: str) -> Path | None:
    fig = lr_figure(rows, lr_axis, title)
    return None if fig is None else _save(_plt(), fig, out)


def lr_figure(rows: list[RunRecord], lr_axis: str, title: str):
    """Final loss against learning rate, one line per setting of the other axes; diverged = x at ln V."""
    plt = _plt()
    groups: dict[str, dict[float, list]] = {}
    for r in rows:
        if r.status not in ("done", "diverged"):
            continue
        labels = r.extra.get("labels", {})
        if lr_axis not in labels:
            continue
        key = ",".join(f"{k}={v}" for k, v in labels.items() if k != lr_axis) or "all"
        lr = float(r.config.get("train", {}).get("lr", labels[lr_axis]))
        groups.setdefault(key, {}).setdefault(lr, []).append(r)
    if not groups:
        return None
    vocab = next((r.config.get("model", {}).get("vocab_size") for r in rows if r.config), 257)
    l0 = math.log(vocab)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for i, (key, by_lr) in enumerate(groups.items()):
        lrs = sorted(by_lr)
        ys = []
        for lr in lrs:
            vals = [min(r.final_val_loss, l0) if (r.final_val_loss is not None and not r.diverged) else l0
                    for r in by_lr[lr]]
            ys.append(statistics.fmean(vals))
        line, = ax.plot(lrs, ys, label=key, **series_style(i))
        for lr in lrs:
            if any(r.diverged for r in by_lr[lr]):
                ax.plot([lr], [l0], "x", color=line.get_color(), ms=9)
    ax.axhline(l0, color="grey", ls="--", lw=0.8)
    ax.text(min(min(g) for g in groups.values()), l0, " ln V (initial loss / diverged)", fontsize=7, va="bottom")
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final val loss (mean over seeds; diverged = ln V)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


# --------------------------------------------------------------------------- the report
def suite_section(suite: suites_mod.Suite, rows: list[RunRecord], img_dir: Path, rel: str,
                  ngram_line: str | None = None) -> tuple[list[Block], list[Verdict]]:
    """One suite's blocks; `ngram_line`: the n-gram baseline (archlab.lab.baseline), after the runs' summary."""
    verdicts = judge_all(suite.rules, rows)
    blocks = [Block("h2", f"{suite.name}: {overall(verdicts)}"), Block("p", f"**Claim.** {suite.claim}")]
    if suite.published:
        blocks.append(Block("p", f"**Published.** {suite.published}"))
    if suite.notes:
        blocks.append(Block("p", f"**Setup.** {suite.notes}"))
    status = {s: sum(r.status == s for r in rows) for s in ("done", "diverged", "failed", "running")}
    cfg = rows[0].config.get("train", {}) if rows else {}
    wall = sum(r.wall_s or 0 for r in rows)
    what = (f"budget {_fmt(cfg.get('budget'))} {cfg.get('budget_unit', '')}, batch {cfg.get('batch_size')} x seq "
            f"{cfg.get('seq_len')}" if suite.runs != "ngram" else "n-gram models counted and scored, none trained")
    if suite.runs == "finetune":
        what = f"fine-tuning {what}; {_bases_line(rows)}"
    if suite.runs == "extend":
        what = context_report.runs_line(rows)
    if suite.runs == "real_model":
        what = real_model_report.what_line(rows)
    blocks.append(Block("p", (
        f"Runs: {len(rows)} ({', '.join(f'{v} {k}' for k, v in status.items() if v)}); {what}; total wall time "
        f"{wall / 60:.1f} min.")))
    if ngram_line:
        blocks.append(Block("p", ngram_line))
    blocks.append(Block("h3", "Verdicts (computed from the table below by each rule)"))
    vrows = []
    for v in verdicts:
        ours = "; ".join(f"{s.label}: {_fmt(s.mean)} ± {_fmt(s.std, 2)} (n={s.n})" for s in v.sides)
        vrows.append([v.rule.statement, f"**{v.verdict}**", tolerance(v.rule) or "see test", ours, v.reason])
    blocks.append(Block("table", header=["rule", "verdict", "tolerance", "ours (mean ± std over seeds)", "test"],
                        rows=vrows))
    if suite.runs not in ("ngram", "real_model"):   # no curves, sizes or step times: their analysis shows them
        blocks.extend(_variant_blocks(suite, rows, verdicts, img_dir, rel))
        blocks.extend(moe_report.section(suite, rows, img_dir, rel))      # [] unless runs have MoE layers
    if suite.analysis:
        blocks.extend(ANALYSES[suite.analysis](suite, rows, img_dir, rel))
    return blocks, verdicts


def _bases_line(rows: list[RunRecord]) -> str:
    """How many pretrained bases a finetune suite's runs shared, what pretraining one took, what each knew."""
    bases: dict[str, tuple] = {}
    for r in rows:
        if r.extra.get("base"):
            seconds, plain = bases.get(r.extra["base"], (None, None))
            bases[r.extra["base"]] = (r.extra.get("base_s", seconds), r.extra.get("base_exact_plain", plain))
    if not bases:
        return "no base recorded"
    seconds = [s for s, _ in bases.values() if s is not None]
    plain = [p for _, p in bases.values() if p is not None]
    return (f"{len(bases)} pretrained base{'s' * (len(bases) != 1)}"
            + (f" ({statistics.fmean(seconds):.0f} s each)" if seconds else "")
            + (f", held-out exact match in the pretraining text's own format {min(plain):.0%}-{max(plain):.0%}"
               if plain else ""))


def _variant_blocks(suite: suites_mod.Suite, rows: list[RunRecord], verdicts: list[Verdict], img_dir: Path,
                    rel: str) -> list[Block]:
    """The table per variant of trained runs and the standard plots (curves, final loss, step time, metrics)."""
    blocks: list[Block] = []
    measured = {k for r in rows for k, x in r.extra.items()
                if k in MEASURED_METRICS and isinstance(x, (int, float))}
    extra_metrics = sorted(({v.rule.metric for v in verdicts} | measured) - set(STANDARD_METRICS))
    header = ["variant", "seeds", "params", "tokens", "final val loss", "best val loss", "step ms", "tokens/s",
              "diverged", *extra_metrics, "match / notes"]
    trows = []
    for variant in _variants_in_order(rows):
        vr = [r for r in rows if r.variant == variant]
        ok = [r for r in vr if r.status == "done"]
        fl = _stats([r.final_val_loss for r in ok if r.final_val_loss is not None])
        bl = _stats([r.best_val_loss for r in ok if r.best_val_loss is not None])
        st = _stats([1000 * r.step_time_s for r in ok if r.step_time_s])
        tps = _stats([r.tokens_per_s for r in ok if r.tokens_per_s])
        tokens = _stats([r.tokens_seen for r in ok if r.tokens_seen])    # read by the model: source + target
        cells = [variant, str(len(ok)), _fmt(vr[0].params), _fmt(tokens[0]), f"{_fmt(fl[0])} ± {_fmt(fl[1], 2)}",
                 f"{_fmt(bl[0])}", f"{_fmt(st[0], 3)} ± {_fmt(st[1], 2)}", _fmt(tps[0], 4),
                 f"{sum(r.diverged for r in vr)}/{len(vr)}"]
        for m in extra_metrics:
            vals = [x for x in (r.metric(m) for r in ok) if x is not None]
            notes = {r.extra.get(f"{m}_note") for r in ok if r.extra.get(f"{m}_note")}
            cells.append(_fmt(_stats(vals)[0]) if vals else ("n/a" if notes else "–"))
        notes = [vr[0].extra.get("match", "")]
        notes += sorted({r.extra.get(k) for r in vr for k in r.extra if k.endswith("_note")} - {None})
        failed = [r for r in vr if r.status == "failed"]
        if failed:
            notes.append(f"{len(failed)} failed: {(failed[0].error or '').splitlines()[0][:120]}")
        cells.append("; ".join(n for n in notes if n))
        trows.append(cells)
    blocks.append(Block("h3", "Results per variant"))
    blocks.append(Block("table", header=header, rows=trows))
    img_dir.mkdir(parents=True, exist_ok=True)
    plots = [
        plot_curves(rows, img_dir / f"{suite.name}_curves.png", suite.name),
        plot_bars(rows, "final_val_loss", img_dir / f"{suite.name}_final_loss.png",
                  f"{suite.name}: final val loss (± std over seeds)", "final val loss (nats)"),
    ]
    if suite.lr_axis:
        plots.append(plot_lr(rows, suite.lr_axis, img_dir / f"{suite.name}_loss_vs_lr.png",
                             f"{suite.name}: loss vs learning rate"))
    plots.append(plot_bars(rows, "step_time_s", img_dir / f"{suite.name}_step_time.png",
                           f"{suite.name}: step time (± std over seeds)", "seconds per step"))
    for m in extra_metrics:
        plots.append(plot_bars(rows, m, img_dir / f"{suite.name}_{m}.png", f"{suite.name}: {m}", m))
    blocks.append(Block("h3", "Plots"))
    for p in plots:
        if p is not None:
            blocks.append(Block("img", f"{rel}/{p.name}", header=[p.stem]))
    return blocks


def build_report(path: str | Path, out_dir: str | Path | None = None) -> dict[str, Path]:
    """Write report.md, report.html, verdicts.json and PNGs into out_dir (default DIR/report)."""
    path = Path(path)
    stores = find_stores(path)
    out = Path(out_dir) if out_dir is not None else (path.parent if path.is_file() else path) / "report"
    out.mkdir(parents=True, exist_ok=True)
    img_dir = out / "img"
    blocks = [Block("h1", "archlab ablation report")]
    summary_rows, all_verdicts, sections = [], {}, []
    for db in stores:
        with ResultStore(db, readonly=True) as store:
            for name in store.suites():
                suite = _suite_for(store, name)
                rows = store.runs(name)
                if suite is None:
                    continue
                recorded = (store.get_meta(f"sweep:{name}") or {}).get("data")
                # a fine-tuning loss is on chat answers, a real model's on its own tokens: not what an n-gram reads
                line = (baseline.ngram_line(rows, recorded, db.parent)
                        if suite.runs not in ("finetune", "real_model") else None)
                sec, verdicts = suite_section(suite, rows, img_dir, "img", line)
                sections.extend(sec)
                all_verdicts[name] = [v.to_dict() for v in verdicts]
                counts = {k: sum(v.verdict == k for v in verdicts) for k in (HELD, NOT_HELD, INCONCLUSIVE)}
                summary_rows.append([name, f"**{overall(verdicts)}**", str(counts[HELD]), str(counts[NOT_HELD]),
                                     str(counts[INCONCLUSIVE]), suite.claim])
    blocks.append(Block("p", (
        "Verdicts are computed from the recorded numbers by each suite's rules (archlab.lab.verdicts): "
        "`less` holds when the gap exceeds the spread over seeds sqrt(std_a² + std_b²), `parity` when the "
        "gap is within the tolerance, `flat` when the range of means is within the tolerance; "
        "otherwise inconclusive (or did not hold when the gap is beyond tolerance + spread). `falls` and "
        "`rises_past_best` compare a deterministic curve over a numeric axis (an n-gram order) with a relative "
        "tolerance; `bound` compares a deterministic measurement, or the ratio of two (a real model's perplexity "
        "under two conditions), with the claim's bar. "
        "Small models, short budgets: read 'inconclusive' as 'not resolved at this budget'.")))
    blocks.append(Block("table", header=["suite", "overall", "held", "did not hold", "inconclusive", "claim"],
                        rows=summary_rows))
    blocks.extend(sections)
    paths = {"md": out / "report.md", "html": out / "report.html", "json": out / "verdicts.json"}
    paths["md"].write_text(to_markdown(blocks))
    paths["html"].write_text(to_html(blocks, "archlab ablation report"))
    paths["json"].write_text(json.dumps(all_verdicts, indent=2, default=str) + "\n")
    return paths
