"""fit_loss refuses what it cannot fit in one line naming the argument: losses that are all equal (a law with no
N or D term, whose optimal() would divide by zero), a level outside (0, 1), a negative n_boot."""
from __future__ import annotations

import numpy as np
import pytest

from archlab.errors import UserError
from archlab.lab.scaling import CHINCHILLA, LossLaw, fit_loss

N = np.array([1e6, 2e6, 4e6, 8e6, 1.6e7, 3.2e7])
D = np.array([2e8, 1e8, 5e8, 3e8, 8e8, 1.2e9])


@pytest.mark.parametrize("kwargs, match", [
    ({"L": [3.1] * 6}, r"every loss is 3\.1: .*nothing to fit"),
    ({"level": 1.5}, r"level=1\.5 must be in \(0, 1\)"),
    ({"level": 0}, r"level=0 must be in \(0, 1\)"),
    ({"n_boot": -5}, r"n_boot=-5 must be a whole number >= 0"),
    ({"n_boot": 2.5}, r"n_boot=2\.5 must be a whole number"),
    ({"n_starts": 0}, r"n_starts=0 must be a whole number >= 1"),
    ({"delta": 0.0}, r"delta=0\.0 .*must be a positive number"),
])
def test_what_fit_loss_cannot_fit_is_a_one_line_error(kwargs, match):
    args = {"L": CHINCHILLA(N, D), "n_boot": 0, **kwargs}
    with pytest.raises(UserError, match=match) as caught:
        fit_loss(N, D, **args)
    assert "\n" not in str(caught.value)


def test_a_law_without_a_term_has_no_optimal_size_rather_than_a_division_by_zero():
    flat = LossLaw(E=3.0, A=0.0, alpha=0.3, B=400.0, beta=0.3)
    with pytest.raises(UserError, match=r"no trade-off between N and D"):
        flat.optimal(1e20)
    n, d = CHINCHILLA.optimal(1e20)                         # a law with both terms still answers
    assert np.isfinite(n) and np.isfinite(d) and 6 * n * d == pytest.approx(1e20)
