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
    (pyqtgraph's own log ticks crowd '2·10 3·10 …' when the range is under a decade); every whole
    multiple ('300 ms', '400 ms') where 1-2-5 steps would leave fewer than two."""
    out = _ticks_at(lo, hi, (1, 2, 5))
    if len(out) < 2:  # a narrow range (every value in a bin or two): every whole multiple
        out = _ticks_at(lo, hi, range(1, 10))
    if len(out) > 7:  # a wide range: decades only
        out = [(x, t) for x, t in out if abs(x - round(x)) < 1e-9]
    return out


def _ticks_at(lo: float, hi: float, multiples) -> list[tuple[float, str]]:
    out = []
    for exp in range(math.floor(lo) - 1, math.ceil(hi) + 1):
        for m in multiples:
            v = m * 10.0 ** exp
            x = math.log10(v)
            if lo - 1e-9 <= x <= hi + 1e-9:
                out.append((x, fmt_seconds_short(v)))
    return out


def dodged_steps(edges, counts, index: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A step-mode histogram (x edges, y counts) for backend `index` of `n` sharing `edges`:
    each bin's bar takes the `index`-th of `n` equal slices of the bin (equal on a log axis), with
    empty gaps between, so two backends' equal bins stand side by side instead of one hiding the
    other. With one backend, the bins as they are."""
    edges = np.asarray(edges, dtype=float)
    counts = np.asarray(counts, dtype=float)
    if n <= 1:
        return edges, counts
    lo, hi = np.log10(edges[:-1]), np.log10(edges[1:])
    width = (hi - lo) / n
    x = np.empty(2 * len(counts))
    x[0::2] = 10 ** (lo + index * width)
    x[1::2] = 10 ** (lo + (index + 1) * width)
    y = np.zeros(2 * len(counts) - 1)
    y[0::2] = counts
    return x, y


def thin_ticks(ticks: list[tuple[float, str]], lo: float, hi: float, width_px: float, text_width,
               gap_px: float = 10.0) -> list[tuple[float, str]]:
    """The most of `ticks` (on an axis from `lo` to `hi`, `width_px` wide) whose labels
    (`text_width(label)` px wide, centred on their tick) stand apart: those whose label lies
    within the axis (pyqtgraph does not draw one that runs past its ends), then all of them, else
    1s and 5s, else decades, else every other decade, else the first."""
    span = hi - lo
    if span <= 0 or width_px <= 0:
        return ticks

    def extent(tick: tuple[float, str]) -> tuple[float, float]:
        centre = (tick[0] - lo) / span * width_px
        half = text_width(tick[1]) / 2
        return centre - half, centre + half

    def mult(x: float) -> int:
        return round(10 ** (x - math.floor(x + 1e-9)))

    inside = [t for t in ticks if extent(t)[0] >= 0 and extent(t)[1] <= width_px]
    choices = [inside, [t for t in inside if mult(t[0]) in (1, 5)], [t for t in inside if mult(t[0]) == 1],
               [t for t in inside if mult(t[0]) == 1 and math.floor(t[0] + 1e-9) % 2 == 0]]
    for chosen in choices:
        spans = [extent(t) for t in chosen]
        if chosen and all(spans[k + 1][0] - spans[k][1] >= gap_px for k in range(len(spans) - 1)):
            return chosen
    return inside[:1]
