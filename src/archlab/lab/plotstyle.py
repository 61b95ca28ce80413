"""How the lab's plots look and are written: a line style and marker per series and some transparency on
later ones, so a curve drawn over another of the same values still shows; pyplot on Agg and one way to save."""
from __future__ import annotations

DASHES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def series_style(i: int) -> dict:
    """matplotlib keyword arguments for the i-th series: (line style, marker) pairs differ for the first
    lcm(4, 8) = 8 series; alpha falls from 1 by 0.1 per series down to 0.55."""
    return {"ls": DASHES[i % len(DASHES)], "marker": MARKERS[i % len(MARKERS)], "alpha": max(0.55, 1.0 - 0.1 * i)}


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, out):
    """Lay out, write and close a figure; returns `out`."""
    fig.tight_layout()
    fig.savefig(out)
    pyplot().close(fig)
    return out
