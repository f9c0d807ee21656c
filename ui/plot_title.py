"""A plot title that fits its plot: it wraps onto more lines instead of widening the plot.

pyqtgraph's `LabelItem` makes its text's width the label's minimum width, and the title sits in
the plot's layout, so a long title (or a large one in the presenter view) made the whole plot
wider than the widget showing it: the plot's right side, and the title's end, were cut off at
1080p and in the presenter view. `FitTitle` asks for no width: its preferred width is the
title's, its minimum 0, and when the room is narrower it wraps the words (centred) and makes the
title's row as tall as the lines. `fit_title(plot)` puts one in a `PlotItem`'s title slot.
Pure pyqtgraph; main thread only.
"""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QTextOption

ROW_MIN = 30  # px: pyqtgraph's fixed height of a plot's title row


class FitTitle(pg.LabelItem):
    def __init__(self, plot: pg.PlotItem):
        self._natural = 0.0  # the title's width on one line
        super().__init__(" ", parent=plot, size="11pt")
        option = QTextOption(Qt.AlignmentFlag.AlignHCenter)
        option.setWrapMode(QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere)
        self.item.document().setDefaultTextOption(option)

    def setText(self, text, **args):
        self.item.setTextWidth(-1)  # measure on one line (resizeEvent wraps it again)
        self._natural = 0.0
        super().setText(text, **args)

    def resizeEvent(self, ev):
        self.item.setTextWidth(-1)
        self._natural = self.item.boundingRect().width()
        room = self.rect().width()
        if 0 < room < self._natural:
            self.item.setTextWidth(room)  # wrap to the room there is
        super().resizeEvent(ev)

    def updateMin(self):
        bounds = self.itemRect()
        natural = max(self._natural, bounds.width())
        height = bounds.height()
        self.setMinimumWidth(0)
        self.setMinimumHeight(height)
        self._sizeHint = {
            Qt.SizeHint.MinimumSize: (0, height),
            Qt.SizeHint.PreferredSize: (natural, height),
            Qt.SizeHint.MaximumSize: (-1, -1),
            Qt.SizeHint.MinimumDescent: (0, 0),
        }
        plot = self.parentItem()
        if self.isVisible() and self.text and isinstance(plot, pg.PlotItem):
            row = max(ROW_MIN, int(height + 0.999))  # pyqtgraph fixes the row at 30 px: the lines need more
            self.setMaximumHeight(row)
            plot.layout.setRowFixedHeight(0, row)
        self.updateGeometry()
        if isinstance(plot, pg.PlotItem):
            _refit(plot)


def _refit(plot: pg.PlotItem) -> None:
    """Give `plot` its view's whole room again. Qt keeps a widget at least its minimum size, and
    pyqtgraph sizes a plot only when its view resizes: a title wrapped for a moment at a sliver of
    width (one letter a line) made the plot's minimum height, and so the plot, taller than its
    view, and the plot stayed so (its bottom axis off screen) after the title unwrapped."""
    scene = plot.scene()
    for view in scene.views() if scene is not None else ():
        room = getattr(view, "range", None)
        shows = id(getattr(view, "centralWidget", None)) == id(plot)  # the view's plot (`is` would narrow `plot`)
        if shows and room is not None and plot.geometry() != room:
            plot.setGeometry(room)


def fit_title(plot: pg.PlotItem) -> FitTitle:
    """Give `plot` a `FitTitle` in its title slot (the old title's text and style carried over)."""
    old = plot.titleLabel
    if isinstance(old, FitTitle):
        return old
    new = FitTitle(plot)
    plot.layout.removeItem(old)
    old.setParentItem(None)
    if old.scene() is not None:
        old.scene().removeItem(old)
    plot.layout.addItem(new, 0, 1)
    plot.titleLabel = new
    style = {k: v for k, v in old.opts.items() if k in ("color", "size", "bold", "italic", "family")}
    plot.setTitle(old.text if old.isVisible() and old.text.strip() else None, **style)
    return new
