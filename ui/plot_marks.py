"""What the time plots add to their curves: marks where something changed, hover tips, and a
word instead of empty axes.

- `ChangeTracker` (Qt-free) compares each tick's snapshots with the last: a backend's live cap or
  ceiling, its health, the router's policy. What changed comes back as short texts
  ("cpu0 live cap 4→8", "policy → cache-aware", "cpu1 down").
- `ChangeMarks` draws them on a pyqtgraph plot as labelled vertical lines at the time they were
  seen, with the whole text as the line's tooltip; the labels are laid out at the top of the
  plot so none is cut at its edge or lies on another or on the legend (`place_label`); on a
  plot whose x axis is "seconds before now" (a card's sparkline) the lines move left each tick
  and go when they leave the window.
- `hover_tips(scatter, fmt)` makes a scatter's points show a tooltip when the pointer is on them.
- `EmptyHint` shows a sentence in the middle of a plot with no data and hides its axes, so a
  plot never shows made-up 0..1 axes; the axes come back, fitted, with the first point.

Main thread only (pyqtgraph items), except `ChangeTracker`, which is plain Python.
"""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QFont

from .theme import GRID_ALPHA, MUTED, WORKING, palette

MAX_MARKS = 40  # older marks go first past this many
MAX_LABEL_ROWS = 3  # rows of change labels at the top of a plot
LABEL_PT = 8


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
    """Labelled vertical lines on `plot`. `relative`: x is seconds before now (call `scroll`).

    A change a person made, or a backend's health, gets a dashed line and a label; the engine's
    own (an adaptive cap moving) a dotted line, its text in the tooltip. Labels sit at the top
    of the plot, beside their line (at its right, or at its left where the
    right has no room), each in the first row where it overlaps no other label and not the
    legend; newer marks are placed first, and a label with no room left is hidden (its line's
    tooltip still says what changed). They are laid out again whenever the view moves or resizes.
    """

    def __init__(self, plot: pg.PlotItem, relative_window_s: float | None = None, labels: bool = True):
        self.plot = plot
        self.window = relative_window_s
        self.labels = labels
        self.marks: list[tuple[float, pg.InfiniteLine]] = []  # (time or x, line)
        self._labels: dict[int, pg.TextItem] = {}  # id(line) -> its label
        self._watched = None  # the legend whose moves lay the labels out again
        self._font = QFont()
        self._font.setPointSize(LABEL_PT)
        if labels:
            plot.vb.sigResized.connect(self.layout)
            plot.vb.sigRangeChanged.connect(self.layout)

    def add(self, x: float, texts: list[str]) -> None:
        if not texts:
            return
        text = "; ".join(texts)
        said = [t for t in texts if not is_engines_own(t)]  # what a person did, or a backend's health
        pen = pg.mkPen(WORKING, width=1.2 if said else 0.8, style=Qt.PenStyle.DashLine if said else Qt.PenStyle.DotLine)
        line = pg.InfiniteLine(pos=x, angle=90, pen=pen, movable=False)
        line.setToolTip(text)
        self.plot.addItem(line, ignoreBounds=True)
        if self.labels and said:
            short = said[0] if len(texts) == 1 else f"{said[0]} (+{len(texts) - 1})"
            pal = palette()
            label = pg.TextItem(short, color=pal.transcript.muted, fill=pg.mkBrush(pal.legend_bg), anchor=(0, 0))
            label.setFont(self._font)
            label.setToolTip(text)
            label.setZValue(20)
            self.plot.vb.addItem(label, ignoreBounds=True)
            self._labels[id(line)] = label
        self.marks.append((x, line))
        while len(self.marks) > MAX_MARKS:
            self._remove(self.marks.pop(0)[1])
        self.layout()

    def scroll(self, now: float) -> None:
        """For a 'seconds before now' axis: marks were added at absolute times; place them."""
        keep = []
        for t, line in self.marks:
            x = t - now
            if self.window is not None and x < -self.window:
                self._remove(line)
                continue
            line.setPos(x)
            keep.append((t, line))
        self.marks = keep
        self.layout()

    def texts(self) -> list[str]:
        return [line.toolTip() for _, line in self.marks]

    def label_items(self) -> list[pg.TextItem]:
        """The labels shown now (hidden ones, with no room, left out)."""
        return [lab for lab in self._labels.values() if lab.isVisible()]

    def set_font_size(self, pt: int) -> None:
        """The labels' size (the presenter view's large type)."""
        self._font.setPointSize(pt)
        for label in self._labels.values():
            label.setFont(self._font)
        self.layout()

    def restyle(self) -> None:
        """The palette in use's colours (after a theme change)."""
        pal = palette()
        for label in self._labels.values():
            label.setColor(pal.transcript.muted)
            label.fill = pg.mkBrush(pal.legend_bg)
            label.update()

    def layout(self, *_args) -> None:
        """Place every label (see the class's docstring)."""
        if not self._labels:
            return
        vb = self.plot.vb
        room = vb.boundingRect()
        (x0, x1), _ = vb.viewRange()
        legend = self.plot.legend
        taken: list[QRectF] = []
        if legend is not None and legend is not self._watched:  # laid out again when it moves or grows
            self._watched = legend
            for signal in (legend.xChanged, legend.yChanged, legend.geometryChanged):
                signal.connect(self.layout)
        if legend is not None and legend.isVisible() and legend.items:
            taken.append(legend.mapRectToItem(vb, legend.boundingRect()))
        for _t, line in sorted(self.marks, key=lambda m: -m[1].value()):
            label = self._labels.get(id(line))
            if label is None:
                continue
            px = vb.mapFromView(QPointF(line.value(), 0)).x()
            size = label.textItem.boundingRect().size()
            spot = place_label(px, size.width(), size.height(), room, taken) if x0 <= line.value() <= x1 else None
            label.setVisible(spot is not None)
            if spot is not None:
                taken.append(spot)
                label.setPos(vb.mapToView(spot.topLeft()))

    def _remove(self, line: pg.InfiniteLine) -> None:
        self.plot.removeItem(line)
        label = self._labels.pop(id(line), None)
        if label is not None:
            self.plot.vb.removeItem(label)


def is_engines_own(change: str) -> bool:
    """A change the engine made by itself (an adaptive cap moving), not one a person made (a
    ceiling, the policy) nor a backend's health: its line stays, dotted, unlabelled (the
    tooltip says it), so the labels a class reads are the moments a control acted."""
    return " live cap " in f" {change}"


def place_label(px: float, w: float, h: float, room: QRectF, taken: list[QRectF]) -> QRectF | None:
    """Where a mark's label goes: the first of `MAX_LABEL_ROWS` rows from the top of `room` where,
    at the right of the line at `px` (or else at its left), it stays inside `room` and keeps a
    few pixels from everything in `taken`; None if nowhere."""
    gap = 3.0
    for row in range(MAX_LABEL_ROWS):
        y = room.top() + gap + row * (h + 2 * gap)
        if y + h > room.bottom():
            return None
        for left in (px + gap, px - gap - w):
            rect = QRectF(left, y, w, h)
            if rect.left() >= room.left() and rect.right() <= room.right() and \
                    not any(rect.intersects(t.adjusted(-gap, -gap, gap, gap)) for t in taken):
                return rect
    return None


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
