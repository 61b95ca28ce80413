"""Scaling laws from a table of runs: the parametric fit L(N, D) = E + A/N^alpha + B/D^beta, IsoFLOP
profiles, and the compute-optimal model size they imply.

Hoffmann et al. 2022 (arXiv 2203.15556, "Chinchilla"):
  approach 3  fit the law by minimising a Huber loss (delta 1e-3) between log L and the log of the law,
              written as a log-sum-exp of a - alpha log N, b - beta log D and e (A = e^a, B = e^b, E = e^e),
              with L-BFGS from the best points of a grid of starts; intervals by bootstrap (resample the
              points, refit).
  approach 2  per compute budget C = 6 N D, a parabola of L in log N; its vertex is that budget's
              compute-optimal N, and a line through log N_opt against log C gives N_opt ~ C^a.
Under the law, minimising L at fixed C gives N_opt = G (C/6)^(beta/(alpha+beta)) and
D_opt = (C/6) / N_opt with G = (alpha A / (beta B))^(1/(alpha+beta)) (their eq. 4).
Besiroglu et al. 2024 (arXiv 2404.10102) refit Chinchilla's points and found the published constants
outside their intervals: we always print intervals.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from archlab.errors import UserError

__all__ = ["CHINCHILLA", "KAPLAN", "LossLaw", "LossFit", "IsoFLOPProfile", "fit_loss", "fit_rows",
           "isoflop_profiles", "optimal_exponent", "points"]

PARAMS = ("E", "A", "alpha", "B", "beta")
REPORT_BOOTSTRAP = 200      # resamples behind a report's intervals (~2 s of fitting for 25 runs)
# box for (a, b, e, alpha, beta): A, B in [2e-9, 5e21], E in [5e-5, 150] nats, exponents in [0, 5]. Wide of any
# real law; it stops a term the data do not support from drifting to A -> 0 over hundreds of iterations
BOUNDS = [(-20.0, 50.0), (-20.0, 50.0), (-10.0, 5.0), (0.0, 5.0), (0.0, 5.0)]


@dataclass(frozen=True)
class LossLaw:
    """L(N, D) = E + A / N^alpha + B / D^beta (N parameters, D training tokens, L nats per token)."""

    E: float
    A: float
    alpha: float
    B: float
    beta: float

    def __call__(self, N, D):
        N, D = np.asarray(N, dtype=float), np.asarray(D, dtype=float)
        return self.E + self.A / N ** self.alpha + self.B / D ** self.beta

    def optimal(self, C) -> tuple[np.ndarray, np.ndarray]:
        """(N_opt, D_opt) minimising the law at compute C = 6 N D; a UserError for a law without both terms
        (A alpha or B beta zero: no trade-off between N and D to optimise)."""
        if not (self.alpha * self.A > 0 and self.beta * self.B > 0):
            raise UserError(f"this law has no trade-off between N and D (A alpha = {self.alpha * self.A:g}, "
                            f"B beta = {self.beta * self.B:g}): no compute-optimal size")
        k = np.asarray(C, dtype=float) / 6.0
        s = self.alpha + self.beta
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / s)
        n = g * k ** (self.beta / s)
        return n, k / n

    def tokens_per_param(self, C) -> np.ndarray:
        """D_opt / N_opt at compute C (constant only when alpha == beta)."""
        n, d = self.optimal(C)
        return d / n

    def to_dict(self) -> dict[str, float]:
        return {k: float(getattr(self, k)) for k in PARAMS}


# Hoffmann et al. 2022, eq. 10 (approach 3); N counts all parameters
CHINCHILLA = LossLaw(E=1.69, A=406.4, alpha=0.34, B=410.7, beta=0.28)
# Kaplan et al. 2020 (arXiv 2001.08361) eqs. 1.1-1.2, separate laws L(N) = (N_c/N)^0.076 (non-embedding N)
# and L(D) = (D_c/D)^0.095: exponents only, their form has no E
KAPLAN = {"alpha": 0.076, "beta": 0.095, "N_c": 8.8e13, "D_c": 5.4e13}


@dataclass
class LossFit:
    """The fitted law, its residuals on log L and its bootstrap intervals (percentile, `level`)."""

    law: LossLaw
    objective: float                     # Huber sum / delta at the optimum
    residuals: np.ndarray                # log L - log law(N, D), per point
    n_points: int
    level: float = 0.95
    boot: np.ndarray = field(default_factory=lambda: np.zeros((0, 5)))   # (n_boot, 5): E, A, alpha, B, beta

    @property
    def rms_residual(self) -> float:
        """Root mean square of the log residuals: the law's typical relative error."""
        return float(np.sqrt(np.mean(self.residuals ** 2)))

    def interval(self, name: str) -> tuple[float, float]:
        """Bootstrap percentile interval of one constant (nan, nan) without bootstrap."""
        if not len(self.boot):
            return float("nan"), float("nan")
        col = self.boot[:, PARAMS.index(name)]
        tail = 100 * (1 - self.level) / 2
        return float(np.percentile(col, tail)), float(np.percentile(col, 100 - tail))

    def tokens_per_param_interval(self, C: float) -> tuple[float, float]:
        if not len(self.boot):
            return float("nan"), float("nan")
        ratios = [LossLaw(*row).tokens_per_param(C) for row in self.boot]
        tail = 100 * (1 - self.level) / 2
        return float(np.percentile(ratios, tail)), float(np.percentile(ratios, 100 - tail))

    def fall(self, term: str, lo: float, hi: float) -> tuple[float, float, float]:
        """How much the law's N term ("N": A/N^alpha) or D term falls from lo to hi, in nats, and its
        bootstrap interval: an exponent above 0 with a vanishing A is no fall at all."""
        col = (1, 2) if term == "N" else (3, 4)

        def drop(coef, exp):
            return coef * (lo ** -exp - hi ** -exp)

        law = self.law.to_dict()
        point = float(drop(law[PARAMS[col[0]]], law[PARAMS[col[1]]]))
        if not len(self.boot):
            return point, float("nan"), float("nan")
        drops = drop(self.boot[:, col[0]], self.boot[:, col[1]])
        tail = 100 * (1 - self.level) / 2
        return point, float(np.percentile(drops, tail)), float(np.percentile(drops, 100 - tail))

    def to_dict(self) -> dict:
        return {**self.law.to_dict(), "rms_residual": self.rms_residual, "n_points": self.n_points,
                "intervals": {k: self.interval(k) for k in PARAMS}, "level": self.level}


# --------------------------------------------------------------------------- approach 3
def _grid() -> np.ndarray:
    """Hoffmann et al.'s starting points as (a, b, e, alpha, beta) rows: 6 x 6 x 5 x 5 x 5 = 4,500."""
    a = np.arange(0.0, 26.0, 5.0)
    e = np.arange(-1.0, 1.01, 0.5)
    ex = np.arange(0.0, 2.01, 0.5)
    mesh = np.meshgrid(a, a, e, ex, ex, indexing="ij")
    return np.stack([m.ravel() for m in mesh], axis=1)


def _terms(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray) -> np.ndarray:
    """The three log terms of the law, (..., points, 3), for theta (..., 5) = (a, b, e, alpha, beta)."""
    a, b, e, alpha, beta = (theta[..., i:i + 1] for i in range(5))
    return np.stack([a - alpha * log_n, b - beta * log_d, np.broadcast_to(e, (a - alpha * log_n).shape)], -1)


def _objective(theta: np.ndarray, log_n, log_d, log_l, delta: float) -> tuple[float, np.ndarray]:
    """Huber(logsumexp(terms) - log L) summed over points, divided by delta; and its gradient."""
    t = _terms(theta, log_n, log_d)                          # (points, 3)
    top = t.max(-1, keepdims=True)
    w = np.exp(t - top)
    pred = top[..., 0] + np.log(w.sum(-1))                   # (points,)
    w /= w.sum(-1, keepdims=True)                            # softmax: d pred / d term
    r = pred - log_l
    small = np.abs(r) <= delta
    value = np.where(small, 0.5 * r ** 2 / delta, np.abs(r) - 0.5 * delta).sum()
    dr = np.clip(r / delta, -1.0, 1.0)                       # Huber'(r) / delta
    grad = np.array([(dr * w[:, 0]).sum(), (dr * w[:, 1]).sum(), (dr * w[:, 2]).sum(),
                     -(dr * w[:, 0] * log_n).sum(), -(dr * w[:, 1] * log_d).sum()])
    return float(value), grad


def _grid_objective(grid: np.ndarray, log_n, log_d, log_l, delta: float) -> np.ndarray:
    """The objective at every grid row at once, (rows,)."""
    t = _terms(grid, log_n, log_d)                           # (rows, points, 3)
    pred = np.logaddexp.reduce(t, axis=-1)                   # (rows, points)
    r = np.abs(pred - log_l)
    return np.where(r <= delta, 0.5 * r ** 2 / delta, r - 0.5 * delta).sum(-1)


def _minimise(starts: Iterable[np.ndarray], log_n, log_d, log_l, delta: float) -> tuple[np.ndarray, float]:
    from scipy.optimize import minimize

    best, best_value = None, math.inf
    for x0 in starts:
        res = minimize(_objective, x0, args=(log_n, log_d, log_l, delta), jac=True, method="L-BFGS-B",
                       bounds=BOUNDS, options={"maxiter": 500, "ftol": 1e-15, "gtol": 1e-10})
        if np.all(np.isfinite(res.x)) and res.fun < best_value:
            best, best_value = res.x, float(res.fun)
    assert best is not None
    return best, best_value


def _law(theta: np.ndarray) -> LossLaw:
    a, b, e, alpha, beta = (float(x) for x in theta)
    return LossLaw(E=math.exp(e), A=math.exp(a), alpha=alpha, B=math.exp(b), beta=beta)


def _check(N, D, L) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    N, D, L = (np.asarray(x, dtype=float).ravel() for x in (N, D, L))
    if not (len(N) == len(D) == len(L)):
        raise UserError(f"fit_loss: N, D and L must have the same length, got {len(N)}, {len(D)}, {len(L)}")
    if len(N) < 5:
        raise UserError(f"fit_loss: {len(N)} points cannot fix the law's 5 constants (need at least 5)")
    if not (np.all(np.isfinite(N + D + L)) and np.all(N > 0) and np.all(D > 0) and np.all(L > 0)):
        raise UserError("fit_loss: N, D and L must be positive and finite")
    if np.ptp(np.log(L)) <= 1e-12:
        raise UserError(f"fit_loss: every loss is {L[0]:g}: the law's N and D terms have nothing to fit (and "
                        "optimal() would divide by zero); give runs whose losses differ")
    return N, D, L


def _check_settings(n_boot, level, n_starts, delta) -> None:
    if isinstance(n_boot, bool) or not isinstance(n_boot, (int, np.integer)) or n_boot < 0:
        raise UserError(f"fit_loss: n_boot={n_boot!r} must be a whole number >= 0 (0: no intervals)")
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level < 1:
        raise UserError(f"fit_loss: level={level!r} must be in (0, 1), e.g. 0.95 for 95% intervals")
    if isinstance(n_starts, bool) or not isinstance(n_starts, (int, np.integer)) or n_starts < 1:
        raise UserError(f"fit_loss: n_starts={n_starts!r} must be a whole number >= 1")
    if not isinstance(delta, (int, float)) or not math.isfinite(delta) or delta <= 0:
        raise UserError(f"fit_loss: delta={delta!r} (the Huber threshold) must be a positive number")


def fit_loss(N: Sequence[float], D: Sequence[float], L: Sequence[float], *, delta: float = 1e-3,
             n_starts: int = 8, n_boot: int = 200, level: float = 0.95, seed: int = 0) -> LossFit:
    """Fit L(N, D) = E + A/N^alpha + B/D^beta (Hoffmann et al. 2022, approach 3).

    The Huber objective is evaluated on the whole 4,500-point grid of starts and L-BFGS runs from the
    `n_starts` best; each of `n_boot` bootstrap refits (points resampled with replacement, numpy seeded
    by `seed`) starts from the full fit's optimum.
    """
    _check_settings(n_boot, level, n_starts, delta)
    N, D, L = _check(N, D, L)
    with _one_thread():
        return _fit(N, D, L, delta, n_starts, n_boot, level, seed)


def _one_thread():
    """BLAS on one thread: L-BFGS-B's small LAPACK calls ran ~300x slower on a loaded 2-core machine
    with OpenBLAS's thread pool (4 s instead of 13 ms per fit)."""
    import scipy.optimize  # noqa: F401 - loads scipy's own BLAS, so that the limit below reaches it
    from threadpoolctl import threadpool_limits

    return threadpool_limits(1)


def _fit(N, D, L, delta: float, n_starts: int, n_boot: int, level: float, seed: int) -> LossFit:
    log_n, log_d, log_l = np.log(N), np.log(D), np.log(L)
    grid = _grid()
    order = np.argsort(_grid_objective(grid, log_n, log_d, log_l, delta))
    theta, value = _minimise(grid[order[:n_starts]], log_n, log_d, log_l, delta)
    law = _law(theta)
    residuals = log_l - np.log(law(N, D))
    rng = np.random.default_rng(seed)
    boot = []
    for _ in range(n_boot):
        idx = rng.integers(0, len(N), len(N))
        th, _ = _minimise([theta], log_n[idx], log_d[idx], log_l[idx], delta)
        boot.append([getattr(_law(th), k) for k in PARAMS])
    return LossFit(law, value, residuals, len(N), level, np.array(boot).reshape(-1, 5))


# --------------------------------------------------------------------------- approach 2
@dataclass
class IsoFLOPProfile:
    """One compute budget's runs and the parabola L = c2 x^2 + c1 x + c0 in x = ln N through them."""

    C: float
    N: np.ndarray
    L: np.ndarray
    coef: tuple[float, float, float]     # (c2, c1, c0)

    @property
    def convex(self) -> bool:
        return self.coef[0] > 0

    @property
    def N_opt(self) -> float | None:
        """The vertex's N, or None when the parabola opens downward (no minimum)."""
        return float(math.exp(-self.coef[1] / (2 * self.coef[0]))) if self.convex else None

    @property
    def L_opt(self) -> float | None:
        n = self.N_opt
        return None if n is None else float(np.polyval(self.coef, math.log(n)))

    @property
    def inside(self) -> bool:
        """True when the minimum lies within the sizes this budget trained (not an extrapolation)."""
        n = self.N_opt
        return n is not None and float(self.N.min()) <= n <= float(self.N.max())


def isoflop_profiles(N, D, L, *, groups: Sequence | None = None, rel_tol: float = 0.25) -> list[IsoFLOPProfile]:
    """Profiles of the budgets with at least 3 distinct sizes, in order of compute.

    groups: one key per point naming its budget (e.g. a suite's compute label); without it, points
    whose C = 6 N D lie within a factor (1 + rel_tol) of a group's smallest C share that group.
    """
    N, D, L = (np.asarray(x, dtype=float).ravel() for x in (N, D, L))
    C = 6 * N * D
    if groups is None:
        keys, first = [], None
        order = np.argsort(C)
        labels = np.empty(len(C), dtype=int)
        for i in order:
            if first is None or C[i] > first * (1 + rel_tol):
                first = C[i]
                keys.append(len(keys))
            labels[i] = keys[-1]
        groups = labels.tolist()
    out = []
    for key in dict.fromkeys(groups):
        idx = np.array([i for i, g in enumerate(groups) if g == key])
        if len(np.unique(N[idx])) < 3:
            continue
        coef = np.polyfit(np.log(N[idx]), L[idx], 2)
        out.append(IsoFLOPProfile(float(np.exp(np.mean(np.log(C[idx])))), N[idx], L[idx],
                                  (float(coef[0]), float(coef[1]), float(coef[2]))))
    return sorted(out, key=lambda p: p.C)


def optimal_exponent(profiles: Sequence[IsoFLOPProfile]) -> tuple[float, float] | None:
    """(a, k) of N_opt = k C^a through the profiles' interior minima (least squares in log-log);
    None with fewer than two. D_opt = C / (6 N_opt) then grows as C^(1 - a)."""
    pts = [(p.C, p.N_opt) for p in profiles if p.inside and p.N_opt is not None]
    if len(pts) < 2:
        return None
    x, y = np.log([c for c, _ in pts]), np.log([n for _, n in pts])
    a, c = np.polyfit(x, y, 1)
    return float(a), float(math.exp(c))


# --------------------------------------------------------------------------- from a results table
def points(rows: Iterable, params: str = "total", metric: str = "final_val_loss"
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list]:
    """(N, D, L, rows used) from finished lab rows: N their total or non-embedding parameters (Chinchilla
    counts all, Kaplan et al. leave out the vocabulary and position matrices), D the tokens they read."""
    if params not in ("total", "non_embedding"):
        raise UserError(f"params={params!r} must be 'total' or 'non_embedding'")
    n, d, loss, used = [], [], [], []
    for row in rows:
        value = row.metric(metric)
        if row.status != "done" or value is None or not math.isfinite(value) or not row.tokens_seen:
            continue
        n.append(float(row.params) if params == "total" else float(non_embedding(row.config["model"])))
        d.append(float(row.tokens_seen))
        loss.append(float(value))
        used.append(row)
    return np.array(n), np.array(d), np.array(loss), used


def fit_rows(rows: Iterable, params: str = "total", metric: str = "final_val_loss", n_boot: int | None = None,
             seed: int = 0) -> tuple[LossFit | None, list]:
    """The law fitted to finished rows (None with fewer than 6 points), and the rows used; n_boot defaults
    to REPORT_BOOTSTRAP. The same points give the same fit object: the verdict and the report share one."""
    n, d, loss, used = points(rows, params, metric)
    if len(used) < 6:
        return None, used
    return _fit_cached(tuple(n), tuple(d), tuple(loss), n_boot or REPORT_BOOTSTRAP, seed), used


@functools.lru_cache(maxsize=8)
def _fit_cached(n: tuple, d: tuple, loss: tuple, n_boot: int, seed: int) -> LossFit:
    return fit_loss(n, d, loss, n_boot=n_boot, seed=seed)


def non_embedding(model: dict) -> int:
    """Parameters outside the vocabulary and position matrices, from a ModelConfig dict."""
    from archlab.config import ModelConfig
    from archlab.models import accounting

    return accounting.non_embedding_param_count(ModelConfig.from_dict(model))
