"""Legend glyphs that look like what they stand for, and legends made with them.

pyqtgraph's legend draws a filled curve (a histogram, an area) as a triangle, and a line as a
line over the whole 20 px sample. `Glyph` draws a filled curve as a bar (its fill and outline),
a line as a short line in its pen (dashes included) with its symbol on it, a bar chart as a bar.
`add_legend(plot, **kw)` is `PlotItem.addLegend` with these glyphs. Main thread only.
"""

from __future__ import annotations

import pyqtgraph as pg
from pyqtgraph import functions as fn
from pyqtgraph.graphicsItems.LegendItem import ItemSample
from pyqtgraph.graphicsItems.ScatterPlotItem import drawSymbol
from PySide6.QtCore import QPointF, QRectF, Qt

SIZE = 20  # px: the sample's box (pyqtgraph's)


class Glyph(ItemSample):
    """A legend sample: a bar for a filled curve or a bar chart, a line (and symbol) otherwise."""

    def paint(self, p, *args) -> None:
        item = self.item
        if not item.isVisible():
            super().paint(p, *args)  # pyqtgraph's "hidden" eye
            return
        opts = item.opts
        p.setRenderHint(p.RenderHint.Antialiasing)
        if isinstance(item, pg.BarGraphItem):
            self._bar(p, opts.get("brush"), opts.get("pen"))
        elif opts.get("fillLevel") is not None and (opts.get("fillBrush") or opts.get("brush")) is not None:
            self._bar(p, opts.get("fillBrush") or opts.get("brush"), opts.get("pen"))
        elif not isinstance(item, pg.ScatterPlotItem):
            pen = fn.mkPen(opts.get("pen"))
            pen.setCapStyle(Qt.PenCapStyle.FlatCap)
            p.setPen(pen)
            p.drawLine(QPointF(1, SIZE / 2), QPointF(SIZE - 1, SIZE / 2))
        symbol = opts.get("symbol")
        if symbol is not None:
            sopts = item.scatter.opts if isinstance(item, pg.PlotDataItem) else opts
            p.translate(SIZE / 2, SIZE / 2)
            drawSymbol(p, symbol, min(sopts["size"], 9), fn.mkPen(sopts["pen"]), fn.mkBrush(sopts["brush"]))

    @staticmethod
    def _bar(p, brush, pen) -> None:
        p.setBrush(fn.mkBrush(brush))
        p.setPen(fn.mkPen(pen) if pen is not None else Qt.PenStyle.NoPen)
        p.drawRect(QRectF(3, 4, SIZE - 6, SIZE - 7))


def add_legend(plot: pg.PlotItem, **kw) -> pg.LegendItem:
    """`plot.addLegend(**kw)` drawing its samples as `Glyph`s."""
    return plot.addLegend(sampleType=Glyph, **kw)
