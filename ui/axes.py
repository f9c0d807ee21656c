"""Plot axes for the views' histograms and counts: the range a count axis needs and its tick
step, the span of log-spaced bins in use, labelled 1-2-5 ticks on a log10(seconds) axis.
Qt-free (pyqtgraph is given the numbers), so they test without a screen; pure functions.
"""

from __future__ import annotations

import math

import numpy as np

from .formatting import fmt_seconds_short


def count_axis_top(top: float) -> tuple[float, int]:
    """(axis maximum, tick step) for a count axis (requests): whole-number ticks, ~4 of them,
    a little headroom; 0..2 when empty."""
    top = max(float(top), 1.0)
    raw = top / 4
    step = 1
    for s in (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10000):
        step = s
        if s >= raw:
            break
    return math.ceil(top * 1.1 / step) * step, step


def occupied_log_range(histograms, edges) -> tuple[float, float] | None:
    """log10(seconds) span of the bins any histogram uses, one bin of margin each side; None
    when every histogram is empty."""
    used = np.zeros(len(edges) - 1, dtype=bool)
    for h in histograms:
        used |= np.asarray(h) > 0
    idx = np.flatnonzero(used)
    if idx.size == 0:
        return None
    lo = max(int(idx[0]) - 1, 0)
    hi = min(int(idx[-1]) + 2, len(edges) - 1)
    return math.log10(edges[lo]), math.log10(edges[hi])


def log_ticks(lo: float, hi: float) -> list[tuple[float, str]]:
    """Ticks for a log10(seconds) axis from `lo` to `hi`: 1-2-5 steps, labelled '20 ms', '1 s'
    (pyqtgraph's own log ticks crowd '2·10 3·10 …' when the range is under a decade)."""
    out = []
    for exp in range(math.floor(lo) - 1, math.ceil(hi) + 1):
        for m in (1, 2, 5):
            v = m * 10.0 ** exp
            x = math.log10(v)
            if lo - 1e-9 <= x <= hi + 1e-9:
                out.append((x, fmt_seconds_short(v)))
    if len(out) > 7:  # a wide range: decades only
        out = [(x, t) for x, t in out if abs(x - round(x)) < 1e-9]
    return out
