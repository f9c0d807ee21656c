"""The teacher's view (View ▸ Presenter, F11): large type on the panels a class looks at.

On a projector at 1280x720 the app's 10 pt text and pyqtgraph's 8 pt ticks cannot be read from
the back of a room. `present(widget, on)` scales a panel's text: a style sheet on the panel
(`font-size: PRESENTER_PT` for labels, text, tables and their headings, `VALUE_PT` for the values a
class reads off a control (a ceiling, a policy, a bar's count), which Qt cascades to the panel's
children and which wins over the app's sheet; buttons keep their size), and on each of its plots
the title, axis labels, tick labels and legend (a legend wider than its plot goes to one column).
A card's sparkline (a plot with the `sparkline` property) is left to its panel. Rich text with
explicit sizes (`<span style='font-size:…'>`) keeps them. The panel's `presenter_changed(on)`, if
it has one, is called last, to lay itself out for the large type. Off restores what was there.
Pure widget code; main thread only.
"""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtGui import QFont
from PySide6.QtWidgets import QWidget

PRESENTER_PT = 17  # body text: about 23 px, readable from ~8 m on a 2 m wide 720p picture
PLOT_PT = 15  # tick labels, axis labels and legends
TITLE_PT = 17
HEADING_PT = 13  # table headings: several short lines over narrow columns
VALUE_PT = 15  # spin boxes, lists to pick from, progress bars' counts, group titles

SHEET = f"""
QLabel, QTextBrowser, QTableView, QTableWidget {{ font-size: {PRESENTER_PT}pt; }}
QHeaderView {{ font-size: {HEADING_PT}pt; }}
QSpinBox, QDoubleSpinBox, QComboBox, QCheckBox, QGroupBox {{ font-size: {VALUE_PT}pt; }}
QProgressBar {{ font-size: {VALUE_PT}pt; min-height: 26px; max-height: 28px; }}
QCheckBox::indicator {{ width: 20px; height: 20px; }}
"""


def present(widget: QWidget, on: bool) -> None:
    """Large type on `widget` and its plots (on), or back as it was (off). Idempotent."""
    was = widget.property("presenter")
    if bool(was) == on:
        return
    if on:
        widget.setProperty("presenter_sheet", widget.styleSheet())
        widget.setStyleSheet(widget.styleSheet() + SHEET)
    else:
        widget.setStyleSheet(widget.property("presenter_sheet") or "")
    widget.setProperty("presenter", on)
    for pw in widget.findChildren(pg.PlotWidget):
        if not pw.property("sparkline"):  # a card's 76 px history keeps its small type
            _plot_fonts(pw.getPlotItem(), on)
    hook = getattr(widget, "presenter_changed", None)
    if callable(hook):
        hook(on)


def _plot_fonts(p: pg.PlotItem, on: bool) -> None:
    tick = QFont()
    tick.setPointSize(PLOT_PT if on else 8)
    for name in ("left", "bottom"):
        axis = p.getAxis(name)
        axis.setStyle(tickFont=tick, tickTextOffset=6 if on else 3)
        style = {**axis.labelStyle, "font-size": f"{PLOT_PT if on else 9}pt"}  # its colour kept
        axis.setLabel(text=axis.labelText, units=axis.labelUnits or None, **style)
        if name == "left":
            axis.setWidth(None)  # the wider labels need a wider axis
    title = p.titleLabel
    if title.text:
        title.setText(title.text, size=f"{TITLE_PT if on else 10}pt")  # wraps to its plot (ui.plot_title)
    legend = p.legend
    if legend is not None:
        legend.setLabelTextSize(f"{PLOT_PT if on else 9}pt")
        for _sample, label in legend.items:
            label.setText(label.text, size=f"{PLOT_PT if on else 9}pt")
        fit_legend(p)
        if not legend.property("fitted"):  # and again whenever the plot's size changes
            legend.setProperty("fitted", True)
            p.vb.sigResized.connect(lambda _vb, plot=p: fit_legend(plot))


def fit_legend(p: pg.PlotItem) -> None:
    """A legend as wide as its plot's view at most: its entries one under another when a row of
    them would run past the view's right edge (it remembers the columns it was made with)."""
    legend = p.legend
    if legend is None or not legend.items:
        return
    made = legend.property("columns") or legend.columnCount
    legend.setProperty("columns", made)
    legend.setColumnCount(made)
    legend.updateSize()
    left = legend.pos().x()
    if made > 1 and left + legend.boundingRect().width() > p.vb.width():
        legend.setColumnCount(1)


def set_axis_labels(plot: pg.PlotItem, bottom: str, left: str) -> None:
    """New texts for `plot`'s bottom and left axis labels, in the size they have now."""
    for name, text in (("bottom", bottom), ("left", left)):
        axis = plot.getAxis(name)
        axis.setLabel(text=text, units=axis.labelUnits or None, **axis.labelStyle)
