"""What the time plots add to their curves: marks where something changed, hover tips, and a
word instead of empty axes.

- `ChangeTracker` (Qt-free) compares each tick's snapshots with the last: a backend's live cap or
  ceiling, its health, the router's policy. What changed comes back as short texts
  ("cpu0 live cap 4→8", "policy → cache-aware", "cpu1 down").
- `ChangeMarks` draws them on a pyqtgraph plot as labelled vertical lines at the time they were
  seen, with the whole text as the line's tooltip; on a plot whose x axis is "seconds before
  now" (a card's sparkline) the lines move left each tick and go when they leave the window.
- `hover_tips(scatter, fmt)` makes a scatter's points show a tooltip when the pointer is on them.
- `EmptyHint` shows a sentence in the middle of a plot with no data and hides its axes, so a
  plot never shows made-up 0..1 axes; the axes come back, fitted, with the first point.

Main thread only (pyqtgraph items), except `ChangeTracker`, which is plain Python.
"""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import Qt

from .theme import GRID_ALPHA, MUTED, WORKING

MAX_MARKS = 40  # older marks go first past this many


class ChangeTracker:
    """Remembers the last tick's caps, health and policy; `update` says what changed since."""

    def __init__(self) -> None:
        self._backends: dict[str, tuple[int, int, bool]] | None = None
        self._policy: str | None = None

    def update(self, snapshots, policy: str) -> list[str]:
        now = {s.name: (s.cap, s.cap_ceiling or s.cap, s.healthy) for s in snapshots}
        changes: list[str] = []
        if self._backends is not None:
            for name, (cap, ceiling, healthy) in now.items():
                old = self._backends.get(name)
                if old is None:
                    continue
                if ceiling != old[1]:
                    changes.append(f"{name} ceiling {old[1]}→{ceiling}")
                if cap != old[0]:
                    changes.append(f"{name} live cap {old[0]}→{cap}")
                if healthy != old[2]:
                    changes.append(f"{name} {'healthy again' if healthy else 'down'}")
        if self._policy is not None and policy != self._policy:
            changes.append(f"policy → {policy}")
        self._backends, self._policy = now, policy
        return changes


class ChangeMarks:
    """Labelled vertical lines on `plot`. `relative`: x is seconds before now (call `scroll`)."""

    def __init__(self, plot: pg.PlotItem, relative_window_s: float | None = None, labels: bool = True):
        self.plot = plot
        self.window = relative_window_s
        self.labels = labels
        self.marks: list[tuple[float, pg.InfiniteLine]] = []  # (time or x, line)

    def add(self, x: float, texts: list[str]) -> None:
        if not texts:
            return
        text = "; ".join(texts)
        pen = pg.mkPen(WORKING, width=1.2, style=Qt.PenStyle.DashLine)
        line = pg.InfiniteLine(pos=x, angle=90, pen=pen, movable=False)
        if self.labels:
            short = texts[0] if len(texts) == 1 else f"{texts[0]} (+{len(texts) - 1})"
            pg.InfLineLabel(line, text=short, position=0.92, rotateAxis=(1, 0), anchor=(1, 1),
                            color=MUTED)
        line.setToolTip(text)
        self.plot.addItem(line, ignoreBounds=True)
        self.marks.append((x, line))
        while len(self.marks) > MAX_MARKS:
            self.plot.removeItem(self.marks.pop(0)[1])

    def scroll(self, now: float) -> None:
        """For a 'seconds before now' axis: marks were added at absolute times; place them."""
        keep = []
        for t, line in self.marks:
            x = t - now
            if self.window is not None and x < -self.window:
                self.plot.removeItem(line)
                continue
            line.setPos(x)
            keep.append((t, line))
        self.marks = keep

    def texts(self) -> list[str]:
        return [line.toolTip() for _, line in self.marks]


def hover_tips(scatter: pg.ScatterPlotItem, fmt) -> None:
    """Hovering a point of `scatter` shows `fmt(x, y, data)` as a tooltip (pyqtgraph's own
    hover handling: `hoverable` and `tip`)."""
    scatter.opts["hoverable"] = True
    scatter.opts["tip"] = lambda x, y, data: fmt(x, y, data)
    scatter.setAcceptHoverEvents(True)


class EmptyHint:
    """`text` in the middle of `plot` while it has no data; its axes hidden meanwhile."""

    def __init__(self, plot: pg.PlotItem, text: str):
        self.plot = plot
        self.item = pg.TextItem(text, color=MUTED, anchor=(0.5, 0.5))
        plot.vb.addItem(self.item, ignoreBounds=True)
        self.empty: bool | None = None
        self.set_empty(True)
        plot.vb.sigResized.connect(self._place)
        plot.vb.sigRangeChanged.connect(self._place)

    def set_empty(self, empty: bool) -> None:
        if empty == self.empty:
            return
        self.empty = empty
        self.item.setVisible(empty)
        for axis in ("left", "bottom"):
            self.plot.getAxis(axis).setStyle(showValues=not empty)
        self.plot.showGrid(x=not empty, y=not empty, alpha=GRID_ALPHA)
        self._place()

    def _place(self, *_args) -> None:
        (x0, x1), (y0, y1) = self.plot.vb.viewRange()
        self.item.setPos((x0 + x1) / 2, (y0 + y1) / 2)
