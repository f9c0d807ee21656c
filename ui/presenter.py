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
from PySide6.QtWidgets import QHeaderView, QWidget

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
    for header in widget.findChildren(QHeaderView):
        _keep_last_column(header, on)
    for pw in widget.findChildren(pg.PlotWidget):
        if not pw.property("sparkline"):  # a card's 76 px history keeps its small type
            _plot_fonts(pw.getPlotItem(), on)
    hook = getattr(widget, "presenter_changed", None)
    if callable(hook):
        hook(on)


def _keep_last_column(header: QHeaderView, on: bool) -> None:
    """A table sized to its contents, last column stretched (Experiments' results): in large type
    the columns outgrow the table, and Qt then gives the stretched last column what is left, less
    than its heading needs; while on, it keeps its contents' width (the table scrolls sideways)."""
    last = header.count() - 1
    if on and last >= 0 and header.stretchLastSection() and \
            header.sectionResizeMode(last) == QHeaderView.ResizeMode.ResizeToContents:
        header.setProperty("presenter_stretch", True)
        header.setStretchLastSection(False)
    elif not on and header.property("presenter_stretch"):
        header.setProperty("presenter_stretch", False)
        header.setStretchLastSection(True)


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
    """A legend inside its plot's view: the columns it was made with if they fit, else the fewest
    that fit (entries side by side when one under another is too tall for the plot, one under
    another when a row is too wide); the one that overflows least if none fits."""
    legend = p.legend
    if legend is None or not legend.items:
        return
    made = legend.property("columns") or legend.columnCount
    legend.setProperty("columns", made)
    room = p.vb.boundingRect()
    if room.width() <= 0 or room.height() <= 0:
        return
    corner = legend.mapToItem(p.vb, legend.boundingRect().topLeft())
    best: tuple[float, int] | None = None
    for columns in [made, *[c for c in range(1, len(legend.items) + 1) if c != made]]:
        legend.setColumnCount(columns)
        legend.updateSize()
        size = legend.boundingRect()
        over = max(0.0, corner.x() + size.width() - room.width()) + max(0.0, corner.y() + size.height() - room.height())
        if over == 0:
            return
        if best is None or over < best[0]:
            best = (over, columns)
    if best is not None:
        legend.setColumnCount(best[1])
        legend.updateSize()


def set_axis_labels(plot: pg.PlotItem, bottom: str, left: str) -> None:
    """New texts for `plot`'s bottom and left axis labels, in the size they have now."""
    for name, text in (("bottom", bottom), ("left", left)):
        axis = plot.getAxis(name)
        axis.setLabel(text=text, units=axis.labelUnits or None, **axis.labelStyle)
