"""Claims as rules over recorded results, and the verdict each rule computes.

Nothing here is written by hand per suite: a suite lists `Rule`s, the report calls `judge(rule, rows)`
and prints what comes back. Kinds:

  less    mean(metric | a) < mean(metric | b) by more than the spread over seeds   -> held
          mean(a) > mean(b) by more than the spread                               -> did not hold
          otherwise                                                               -> inconclusive
          (with a `margin` m, in the metric's units: "a clearly below b". The gap mean(b) - mean(a) must
          exceed m + spread to hold; a gap below m - spread did not hold; margin 0 is the rule above)
  parity  |mean(a) - mean(b)| <= allowed                                          -> held
          |mean(a) - mean(b)| >  allowed + spread                                 -> did not hold
          (allowed = tol_abs, in the metric's units (nats for a loss), when the rule sets it; else
          tol * |mean(b)|. A tolerance must sit below the smallest gap the lab calls an effect, or parity
          "holds" across a real one; `tolerance(rule)` words the bar the report prints beside the verdict)
  flat    the variants selected by `a`: (max mean - min mean) <= tol * min mean   -> held
          range > tol * min mean + spread (of the two extreme variants)            -> did not hold
  ratio   mean(a) / mean(b) == expected within tol (relative; deterministic metrics like KV bytes)
  above / below  bounds on a trained metric, judged as `bound` is with the limit `expected` (at_least / at_most)
          and the std over seeds as the noise: mean(metric | a) past it by more than the std     -> held
          on the other side by more than the std -> did not hold; otherwise (or one seed) -> inconclusive
  power_law  L(N, D) = E + A/N^alpha + B/D^beta fitted to the runs `a` selects (archlab.lab.scaling; N the
          `params` count). Over the ladder's range, the N term's fall A (N_min^-alpha - N_max^-alpha) and
          the D term's, each with its bootstrap interval, against tol x the median loss:
          both falls' lower bounds above it and the RMS log residual <= tol                -> held
          a fall's upper bound at or below it, or the residual above 2 tol                 -> did not hold
  sharper `metric` and `versus` along the ladder of model sizes (runs grouped by parameters, means over
          seeds): the sharpness of each is its largest rise between neighbouring sizes over its whole rise
          (1 = all at one step, 1/(sizes-1) = even steps). sharpness(metric) >= sharpness(versus) + tol
          -> held; below sharpness(versus) -> did not hold; either metric moving by < 0.05 -> inconclusive
  falls   `metric` along the numeric axis `over` (means over seeds per label): its value at the first label
          minus its minimum > tol x the minimum                                   -> held, else did not hold
  rises_past_best  along `over`, past the label where `metric` is lowest: its largest value minus its minimum
          > tol x the minimum (it rises) while `versus`, past its own lowest label, stays within tol x its
          minimum (it flattens)                                                   -> held, else did not hold
          (both: fewer than 3 labels with values -> inconclusive; meant for deterministic metrics such as
          n-gram estimates, so no spread over seeds enters)
  bound   mean(metric | a), or mean(metric | a) / mean(metric | b) when `b` is given, within
          [at_least, at_most] (either may be open)                                -> held, else did not hold
          (a deterministic measurement, e.g. a real model's perplexity under two conditions: no spread enters;
          `Rule.limits` gives the same pair for above / below, and one judge serves all three)

The spread is sqrt(std_a^2 + std_b^2), the standard deviation over seeds of one run of each side (so a
gap smaller than the seed-to-seed noise of a single comparison is "inconclusive"). A side with fewer
than two seeds is "inconclusive" for less / parity / flat: one seed has no spread.

Selectors: {axis: label} or {axis: [labels]}; {axis: None} means "the run has no label on that axis".
Per seed, the rows a side selects are averaged, so a side may be a group of variants (e.g. all gated
MLPs). The derived metric "lr_sensitivity" (Wortsman et al. 2023, arXiv 2309.14322) is computed per
seed over the `over` axis: mean over learning rates of min(loss, L0) - min over learning rates of loss,
with L0 = ln(vocab) the loss at initialization and a diverged run scored L0.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

import numpy as np

HELD, NOT_HELD, INCONCLUSIVE = "held", "did not hold", "inconclusive"
KINDS = ("less", "parity", "flat", "ratio", "power_law", "sharper", "falls", "rises_past_best", "above", "below",
         "bound")
SEEDED_BOUNDS = ("above", "below")     # bounds judged against the std over seeds; `bound` is judged exactly


@dataclass(frozen=True)
class Rule:
    kind: Literal["less", "parity", "flat", "ratio", "power_law", "sharper", "falls", "rises_past_best", "above",
                  "below", "bound"]
    statement: str
    metric: str = "final_val_loss"
    a: dict = field(default_factory=dict)
    b: dict | None = None
    tol: float = 0.0
    expected: float | None = None
    over: str | None = None          # axis for lr_sensitivity; the numeric axis of falls / rises_past_best
    params: Literal["total", "non_embedding"] = "total"    # power_law: which parameter count is N
    versus: str | None = None        # sharper: the smooth metric `metric` is compared with
    tol_abs: float | None = None     # parity: the allowed gap in the metric's units, instead of tol x |mean(b)|
    margin: float = 0.0              # less: how far below b (metric units) a must be, beyond the spread
    at_least: float | None = None    # bound: the lowest value (or a / b) that holds
    at_most: float | None = None     # bound: the highest

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"rule kind {self.kind!r} must be one of {', '.join(KINDS)}")
        if self.kind in ("falls", "rises_past_best") and not self.over:
            raise ValueError(f"rule {self.statement!r}: kind {self.kind} needs `over` (the numeric axis)")
        if self.kind == "rises_past_best" and not self.versus:
            raise ValueError(f"rule {self.statement!r}: kind rises_past_best needs `versus` (the metric that flattens)")
        if self.kind == "sharper" and not self.versus:
            raise ValueError(f"rule {self.statement!r}: kind sharper needs `versus` (the smooth metric)")
        if self.kind == "power_law" and not self.tol > 0:
            raise ValueError(f"rule {self.statement!r}: kind power_law needs `tol` > 0 (the RMS residual allowed)")
        if self.params not in ("total", "non_embedding"):
            raise ValueError(f"rule {self.statement!r}: params={self.params!r} must be total or non_embedding")
        if self.kind in ("less", "parity", "ratio") and self.b is None:
            raise ValueError(f"rule {self.statement!r}: kind {self.kind} needs a `b` selector")
        if self.kind in ("ratio", "above", "below") and self.expected is None:
            raise ValueError(f"rule {self.statement!r}: kind {self.kind} needs `expected`")
        if self.kind in SEEDED_BOUNDS and self.b is not None:
            raise ValueError(f"rule {self.statement!r}: kind {self.kind} judges one side (`a`); a ratio of two is "
                             "kind bound's")
        if self.tol_abs is not None and (self.kind != "parity" or not self.tol_abs >= 0):
            raise ValueError(f"rule {self.statement!r}: tol_abs is a parity rule's allowed gap (>= 0)")
        if self.margin and (self.kind != "less" or not self.margin > 0):
            raise ValueError(f"rule {self.statement!r}: margin is a less rule's required gap (> 0)")
        if self.kind == "bound" and self.at_least is None and self.at_most is None:
            raise ValueError(f"rule {self.statement!r}: kind bound needs at_least and/or at_most")
        if self.kind != "bound" and (self.at_least is not None or self.at_most is not None):
            raise ValueError(f"rule {self.statement!r}: at_least / at_most are a bound rule's limits")
        if self.metric == "lr_sensitivity" and not self.over:
            raise ValueError(f"rule {self.statement!r}: lr_sensitivity needs `over` (the LR axis)")

    @property
    def limits(self) -> tuple[float | None, float | None]:
        """(the lowest, the highest) value that holds, None for an open side: a bound rule's at_least / at_most;
        above's threshold is its lowest, below's its highest. Example: Rule(kind="above", expected=0.5, ...).limits
        -> (0.5, None)"""
        if self.kind in SEEDED_BOUNDS:
            return (self.expected, None) if self.kind == "above" else (None, self.expected)
        return self.at_least, self.at_most


@dataclass
class Side:
    """Per-seed values of one side of a rule and their summary."""

    label: str
    values: dict[int, float]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values.values()) if self.values else float("nan")

    @property
    def std(self) -> float:
        return statistics.stdev(self.values.values()) if self.n > 1 else 0.0

    def to_dict(self) -> dict:
        return {"label": self.label, "n": self.n, "mean": self.mean, "std": self.std,
                "values": dict(sorted(self.values.items()))}


@dataclass
class Verdict:
    rule: Rule
    verdict: str
    reason: str
    sides: list[Side] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"statement": self.rule.statement, "kind": self.rule.kind, "metric": self.rule.metric,
                "verdict": self.verdict, "reason": self.reason,
                "sides": [s.to_dict() for s in self.sides], "numbers": self.numbers}


# --------------------------------------------------------------------------- selection
def _labels(row) -> dict:
    return row.extra.get("labels", {}) if hasattr(row, "extra") else row.get("labels", {})


def selects(selector: dict, labels: dict) -> bool:
    for axis, want in selector.items():
        if want is None:
            if axis in labels:
                return False
            continue
        wants = [str(w) for w in want] if isinstance(want, (list, tuple)) else [str(want)]
        if str(labels.get(axis)) not in wants:
            return False
    return True


def describe(selector: dict) -> str:
    parts = []
    for axis, want in selector.items():
        if want is None:
            continue
        parts.append(f"{axis}={'|'.join(map(str, want)) if isinstance(want, (list, tuple)) else want}")
    return ",".join(parts) or "all"


def _usable(row) -> bool:
    return row.status in ("done", "diverged")


def _row_metric(row, metric: str) -> float | None:
    if metric == "diverged":
        return float(bool(row.diverged))
    value = row.metric(metric)
    if value is None or not math.isfinite(value):
        return None
    return value


def lr_sensitivity(losses: Iterable[float | None], initial: float) -> float:
    """Wortsman et al. 2023: E_lr[min(loss(lr), L0)] - min_lr loss(lr); None (diverged) counts as L0."""
    capped = [initial if (x is None or not math.isfinite(x)) else min(x, initial) for x in losses]
    if not capped:
        return float("nan")
    return statistics.fmean(capped) - min(capped)


def side_values(rows: list, selector: dict, metric: str, over: str | None = None) -> dict[int, float]:
    """Per-seed value of one side: the mean over the selected variants, or the LR sensitivity."""
    picked = [r for r in rows if _usable(r) and selects(selector, _labels(r))]
    by_seed: dict[int, list] = {}
    for r in picked:
        by_seed.setdefault(r.seed, []).append(r)
    out: dict[int, float] = {}
    for seed, group in by_seed.items():
        if metric == "lr_sensitivity":
            # one sensitivity per other-axes combination, averaged (usually exactly one)
            combos: dict[tuple, list] = {}
            for r in group:
                key = tuple(sorted((k, v) for k, v in _labels(r).items() if k != over))
                combos.setdefault(key, []).append(r)
            sens = []
            for members in combos.values():
                vocab = members[0].config.get("model", {}).get("vocab_size")
                initial = math.log(vocab) if vocab else max(
                    (m.final_val_loss for m in members if m.final_val_loss is not None), default=float("nan"))
                losses = [None if m.diverged else m.final_val_loss for m in members]
                sens.append(lr_sensitivity(losses, initial))
            out[seed] = statistics.fmean(sens)
        else:
            vals = [v for v in (_row_metric(r, metric) for r in group) if v is not None]
            if vals:
                out[seed] = statistics.fmean(vals)
    return out


# --------------------------------------------------------------------------- judging
def judge(rule: Rule, rows: list) -> Verdict:
    if rule.kind in _JUDGES:
        return _JUDGES[rule.kind](rule, rows)
    if rule.kind == "flat":
        return _judge_flat(rule, rows)
    if rule.kind == "sharper":
        return _judge_sharper(rule, rows)
    if rule.kind == "power_law":
        return _judge_power_law(rule, rows)
    a = Side(describe(rule.a), side_values(rows, rule.a, rule.metric, rule.over))
    b = Side(describe(rule.b), side_values(rows, rule.b, rule.metric, rule.over))
    sides = [a, b]
    if a.n == 0 or b.n == 0:
        missing = ", ".join(s.label for s in sides if s.n == 0)
        return Verdict(rule, INCONCLUSIVE, f"no finished runs with a value of {rule.metric} for {missing}", sides)
    if rule.kind == "ratio":
        ratio = a.mean / b.mean if b.mean else float("nan")
        ok = math.isfinite(ratio) and abs(ratio - rule.expected) <= max(rule.tol, 1e-9) * abs(rule.expected)
        return Verdict(rule, HELD if ok else NOT_HELD,
                       f"ratio {ratio:.6g} vs expected {rule.expected:.6g}", sides,
                       {"ratio": ratio, "expected": rule.expected})
    if a.n < 2 or b.n < 2:
        return Verdict(rule, INCONCLUSIVE, "fewer than 2 seeds on a side: no spread to compare against",
                       sides, {"diff": a.mean - b.mean})
    diff = a.mean - b.mean
    spread = math.sqrt(a.std ** 2 + b.std ** 2)
    numbers = {"diff": diff, "spread": spread}
    if rule.kind == "less":
        gap, margin = -diff, rule.margin          # how far a lies below b, and how far it must
        if gap > margin + spread:
            verdict = HELD
        elif gap < margin - spread:
            verdict = NOT_HELD
        else:
            verdict = INCONCLUSIVE
        reason = f"{a.label} - {b.label} = {diff:+.4g} (spread {spread:.3g})"
        if margin:
            numbers["margin"] = margin
            reason += f" vs margin {margin:g}{_units(rule.metric)}"
        return Verdict(rule, verdict, reason, sides, numbers)
    # parity
    allowed = rule.tol * abs(b.mean) if rule.tol_abs is None else rule.tol_abs
    numbers["allowed"] = allowed
    if abs(diff) <= allowed:
        verdict = HELD
    elif abs(diff) > allowed + spread:
        verdict = NOT_HELD
    else:
        verdict = INCONCLUSIVE
    bar = _allowed_text(rule) if rule.tol_abs is not None else f"{allowed:.3g} ({rule.tol:.0%})"
    reason = f"|{diff:+.4g}| vs tolerance {bar} + spread {spread:.3g}"
    return Verdict(rule, verdict, reason, sides, numbers)


def _units(metric: str) -> str:
    return " nats" if metric.endswith("loss") else ""


def _allowed_text(rule: Rule) -> str:
    if rule.tol_abs is not None:
        return f"{rule.tol_abs:g}{_units(rule.metric)}"
    return f"{rule.tol:.0%} of {describe(rule.b or {}) if rule.kind == 'parity' else 'the lowest'}"


_TOLERANCE_TEXT = {
    "less": lambda r: ("held if below by more than 1x the seed spread; did not hold if above by more" if not r.margin
                       else f"held if below by more than {r.margin:g}{_units(r.metric)} + 1x the seed spread; did not "
                            "hold if the gap falls short of that margin by more than the spread"),
    "parity": lambda r: (f"held if the gap is within {_allowed_text(r)}; did not hold if it exceeds that "
                         "by more than 1x the seed spread"),
    "flat": lambda r: (f"held if the range is within {_allowed_text(r)}; did not hold if it exceeds that "
                       "by more than 1x the seed spread"),
    "ratio": lambda r: f"held if within {max(r.tol, 1e-9):.0%} of {r.expected:g}",
    "above": lambda r: (f"held if above {r.expected:g} by more than 1x the std over seeds; did not hold if below "
                        "by more"),
    "below": lambda r: (f"held if below {r.expected:g} by more than 1x the std over seeds; did not hold if above "
                        "by more"),
    "bound": lambda r: "held if " + " and ".join(
        f"{r.metric + ' ratio' if r.b is not None else r.metric} {op} {x:,.4g}"
        for op, x in ((">=", r.at_least), ("<=", r.at_most)) if x is not None),
}


def tolerance(rule: Rule) -> str:
    """The rule's bar in words, printed beside its verdict; kinds whose reason states it give ''."""
    text = _TOLERANCE_TEXT.get(rule.kind)
    return text(rule) if text else ""


def _judge_flat(rule: Rule, rows: list) -> Verdict:
    groups: dict[str, list] = {}
    for r in rows:
        if _usable(r) and selects(rule.a, _labels(r)):
            groups.setdefault(r.variant, []).append(r)
    sides = [Side(name, side_values(members, {}, rule.metric, rule.over)) for name, members in groups.items()]
    sides = [s for s in sides if s.n]
    if len(sides) < 2:
        return Verdict(rule, INCONCLUSIVE, "fewer than two variants with results", sides)
    if any(s.n < 2 for s in sides):
        return Verdict(rule, INCONCLUSIVE, "fewer than 2 seeds for some variant: no spread", sides)
    lo = min(sides, key=lambda s: s.mean)
    hi = max(sides, key=lambda s: s.mean)
    gap = hi.mean - lo.mean
    allowed = rule.tol * abs(lo.mean)
    spread = math.sqrt(lo.std ** 2 + hi.std ** 2)
    if gap <= allowed:
        verdict = HELD
    elif gap > allowed + spread:
        verdict = NOT_HELD
    else:
        verdict = INCONCLUSIVE
    reason = (f"range {gap:.4g} ({hi.label} {hi.mean:.4g} - {lo.label} {lo.mean:.4g}) vs tolerance "
              f"{allowed:.3g} ({rule.tol:.0%}) + spread {spread:.3g}")
    return Verdict(rule, verdict, reason, sides,
                   {"range": gap, "allowed": allowed, "spread": spread, "best": lo.label, "worst": hi.label})


def _judge_power_law(rule: Rule, rows: list) -> Verdict:
    from archlab.lab import scaling

    fit, used = scaling.fit_rows([r for r in rows if selects(rule.a, _labels(r))], rule.params, rule.metric)
    if fit is None:
        return Verdict(rule, INCONCLUSIVE, f"{len(used)} finished runs: a fit of 5 constants needs at least 6")
    n, d, loss, _ = scaling.points(used, rule.params, rule.metric)
    noise = rule.tol * float(np.median(loss))          # a fall smaller than the residual allowed is no fall
    falls = {"N": fit.fall("N", n.min(), n.max()), "D": fit.fall("D", d.min(), d.max())}
    rms = fit.rms_residual
    if all(lo > noise for _, lo, _ in falls.values()) and rms <= rule.tol:
        verdict = HELD
    elif any(hi <= noise for _, _, hi in falls.values()) or rms > 2 * rule.tol:
        verdict = NOT_HELD
    else:
        verdict = INCONCLUSIVE
    (alo, ahi), (blo, bhi) = fit.interval("alpha"), fit.interval("beta")
    reason = (f"alpha {fit.law.alpha:.3g} [{alo:.3g}, {ahi:.3g}], beta {fit.law.beta:.3g} [{blo:.3g}, {bhi:.3g}]; "
              + "; ".join(f"the {t} term falls {p:.3g} [{lo:.3g}, {hi:.3g}] nats over the ladder"
                          for t, (p, lo, hi) in falls.items())
              + f" ({fit.level:.0%} bootstrap) vs {noise:.3g} ({rule.tol:.0%} of the median loss); RMS residual of "
              f"log L {rms:.2%} vs {rule.tol:.0%}; {fit.n_points} runs, N = {rule.params.replace('_', '-')} parameters")
    sides = [Side(name, dict(enumerate(fit.boot[:, scaling.PARAMS.index(name)].tolist())))
             for name in ("alpha", "beta")]
    return Verdict(rule, verdict, reason, sides, {**fit.law.to_dict(), "rms_residual": rms,
                                                  "alpha_interval": [alo, ahi], "beta_interval": [blo, bhi],
                                                  "fall_N": list(falls["N"]), "fall_D": list(falls["D"])})


def ladder(rows: list, metric: str) -> dict[int, dict[int, float]]:
    """params -> {seed: value} of the finished rows with a value of `metric`, sizes in increasing order."""
    out: dict[int, dict[int, float]] = {}
    for r in rows:
        value = _row_metric(r, metric) if _usable(r) and r.params else None
        if value is not None:
            out.setdefault(int(r.params), {})[r.seed] = value
    return dict(sorted(out.items()))


def sharpness(values: list[float]) -> float:
    """Largest rise between neighbours over the whole range (max - min); nan for a flat or short series."""
    span = max(values) - min(values) if len(values) > 1 else 0.0
    if span <= 0:
        return float("nan")
    return max(b - a for a, b in zip(values, values[1:])) / span


def _judge_sharper(rule: Rule, rows: list) -> Verdict:
    rows = [r for r in rows if selects(rule.a, _labels(r))]
    series = {m: ladder(rows, m) for m in (rule.metric, rule.versus)}
    means = {m: [statistics.fmean(v.values()) for v in s.values()] for m, s in series.items()}
    seeds = sorted({seed for s in series.values() for v in s.values() for seed in v})
    sides = [Side(f"sharpness of {m}", {seed: sharpness([v[seed] for v in s.values() if seed in v])
                                        for seed in seeds}) for m, s in series.items()]
    if min(len(s) for s in series.values()) < 3:
        return Verdict(rule, INCONCLUSIVE, "fewer than 3 model sizes with both metrics", sides)
    moved = {m: max(v) - min(v) for m, v in means.items()}
    sharp = {m: sharpness(v) for m, v in means.items()}
    numbers = {"sharpness": sharp, "range": moved, "ladder": {m: dict(zip(series[m], v)) for m, v in means.items()}}
    reason = (f"sharpness {rule.metric} {sharp[rule.metric]:.2f} vs {rule.versus} {sharp[rule.versus]:.2f} "
              f"(margin {rule.tol:.2f}); ranges {moved[rule.metric]:.3g} and {moved[rule.versus]:.3g} over "
              f"{len(means[rule.metric])} sizes")
    if min(moved.values()) < 0.05:
        return Verdict(rule, INCONCLUSIVE, reason + ": a metric barely moved across the ladder", sides, numbers)
    if sharp[rule.metric] >= sharp[rule.versus] + rule.tol:
        verdict = HELD
    elif sharp[rule.metric] < sharp[rule.versus]:
        verdict = NOT_HELD
    else:
        verdict = INCONCLUSIVE
    return Verdict(rule, verdict, reason, sides, numbers)


def curve(rows: list, metric: str, over: str, selector: dict | None = None) -> dict[float, float]:
    """label of the numeric axis `over` -> the mean over seeds of `metric`, in increasing label order."""
    values: dict[float, list[float]] = {}
    for r in rows:
        label = _labels(r).get(over)
        if label is None or not _usable(r) or not selects(selector or {}, _labels(r)):
            continue
        value = _row_metric(r, metric)
        if value is not None:
            values.setdefault(float(label), []).append(value)
    return {x: statistics.fmean(v) for x, v in sorted(values.items())}


def _past_best(points: dict[float, float]) -> tuple[float, float, float]:
    """(the label of the minimum, the minimum, the largest value at or past that label)."""
    best = min(points, key=points.__getitem__)
    return best, points[best], max(v for x, v in points.items() if x >= best)


def _fmt_label(x: float) -> str:
    return f"{x:g}"


def _judge_falls(rule: Rule, rows: list) -> Verdict:
    assert rule.over is not None                          # Rule.__post_init__ requires it
    points = curve(rows, rule.metric, rule.over, rule.a)
    if len(points) < 3:
        return Verdict(rule, INCONCLUSIVE, f"{len(points)} values of {rule.over} with {rule.metric}: need 3")
    first = next(iter(points))
    best, low, _ = _past_best(points)
    sides = [Side(f"{rule.metric} at {rule.over}={_fmt_label(first)}", {0: points[first]}),
             Side(f"at {rule.over}={_fmt_label(best)} (lowest)", {0: low})]
    fall = points[first] - low
    allowed = rule.tol * abs(low)
    reason = (f"{rule.metric} {points[first]:.4g} at {rule.over}={_fmt_label(first)}, lowest {low:.4g} at "
              f"{rule.over}={_fmt_label(best)}: falls {fall:.4g} vs tolerance {allowed:.3g} ({rule.tol:.0%})")
    numbers = {"curve": {_fmt_label(x): v for x, v in points.items()}, "best": best, "fall": fall, "allowed": allowed}
    return Verdict(rule, HELD if fall > allowed else NOT_HELD, reason, sides, numbers)


def _judge_rises_past_best(rule: Rule, rows: list) -> Verdict:
    assert rule.versus is not None and rule.over is not None
    curves = {m: curve(rows, m, rule.over, rule.a) for m in (rule.metric, rule.versus)}
    if min(len(c) for c in curves.values()) < 3:
        return Verdict(rule, INCONCLUSIVE, f"fewer than 3 values of {rule.over} with both metrics")
    (best, low, high), (vbest, vlow, vhigh) = (_past_best(c) for c in curves.values())
    sides = [Side(f"{m} lowest (at {rule.over}={_fmt_label(at)})", {0: lo}) for m, at, lo in
             ((rule.metric, best, low), (rule.versus, vbest, vlow))]
    sides += [Side(f"{m} highest past it", {0: hi}) for m, hi in ((rule.metric, high), (rule.versus, vhigh))]
    rise, vrise = high - low, vhigh - vlow
    allowed, vallowed = rule.tol * abs(low), rule.tol * abs(vlow)
    reason = (f"past {rule.over}={_fmt_label(best)}, {rule.metric} rises {rise:.4g} (from {low:.4g}) vs "
              f"{allowed:.3g} ({rule.tol:.0%}); past {rule.over}={_fmt_label(vbest)}, {rule.versus} rises "
              f"{vrise:.4g} (from {vlow:.4g}) vs {vallowed:.3g}")
    numbers = {"best": best, "rise": rise, "allowed": allowed, "versus_best": vbest, "versus_rise": vrise,
               "versus_allowed": vallowed}
    return Verdict(rule, HELD if rise > allowed and vrise <= vallowed else NOT_HELD, reason, sides, numbers)


def _judge_bound(rule: Rule, rows: list) -> Verdict:
    """bound, above, below: a value (mean(a), or mean(a) / mean(b)) against the rule's limits. A bound is a
    deterministic measurement, held on its closed limits; above / below bound a trained metric, so the value must
    clear the threshold by more than the std over the seeds of `a` (and one seed is inconclusive)."""
    sides = [Side(describe(sel), side_values(rows, sel, rule.metric)) for sel in (rule.a, rule.b) if sel is not None]
    if any(s.n == 0 for s in sides):
        missing = ", ".join(s.label for s in sides if s.n == 0)
        return Verdict(rule, INCONCLUSIVE, f"no finished runs with a value of {rule.metric} for {missing}", sides)
    a = sides[0]
    if len(sides) == 2:
        value = a.mean / sides[1].mean if sides[1].mean else float("nan")
    else:
        value = a.mean
    lowest, highest = rule.limits
    gap = min(value - lowest if lowest is not None else math.inf,      # how far inside the limits; < 0: outside
              highest - value if highest is not None else math.inf) if math.isfinite(value) else -math.inf
    if rule.kind in SEEDED_BOUNDS:
        if a.n < 2:
            return Verdict(rule, INCONCLUSIVE, f"{a.n} finished runs with {rule.metric} for {a.label}: no spread",
                           sides)
        verdict = HELD if gap > a.std else NOT_HELD if gap < -a.std else INCONCLUSIVE
        reason = f"{a.label}: {value:.4g} vs threshold {rule.expected:g} ({rule.kind}; std over seeds {a.std:.3g})"
        return Verdict(rule, verdict, reason, sides, {"gap": gap, "std": a.std, "threshold": rule.expected})
    what = f"{rule.metric} " + " / ".join(s.label for s in sides)
    return Verdict(rule, HELD if gap >= 0 else NOT_HELD, f"{what} = {value:,.4g}; {tolerance(rule)}", sides,
                   {"value": value, "at_least": rule.at_least, "at_most": rule.at_most})


_JUDGES = {"falls": _judge_falls, "rises_past_best": _judge_rises_past_best, "bound": _judge_bound,
                 "above": _judge_bound, "below": _judge_bound}


def judge_all(rules: list[Rule], rows: list) -> list[Verdict]:
    return [judge(rule, rows) for rule in rules]


def overall(verdicts: list[Verdict]) -> str:
    """One word per suite: held if every rule held, did not hold if any did not, else inconclusive."""
    kinds = {v.verdict for v in verdicts}
    if not kinds:
        return INCONCLUSIVE
    if kinds == {HELD}:
        return HELD
    if NOT_HELD in kinds:
        return NOT_HELD if HELD not in kinds else "mixed"
    return INCONCLUSIVE if HELD not in kinds else "mixed"
