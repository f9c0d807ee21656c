"""The teacher's view (View ▸ Presenter, F11): large type on the panels a class looks at.

On a projector at 1280x720 the app's 10 pt text and pyqtgraph's 8 pt ticks cannot be read from
the back of a room. `present(widget, on)` scales a panel's text: a style sheet on the panel
(`font-size: PRESENTER_PT` for labels, text, tables and their headings, which Qt cascades to the
panel's children and which wins over the app's sheet; buttons and inputs keep their size), and on
each of its plots the title, axis labels, tick labels and legend. Rich
text with explicit sizes (`<span style='font-size:…'>`) keeps them. Off restores what was
there. Pure widget code; main thread only.
"""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtGui import QFont
from PySide6.QtWidgets import QWidget

PRESENTER_PT = 17  # body text: about 23 px, readable from ~8 m on a 2 m wide 720p picture
PLOT_PT = 15  # tick labels, axis labels and legends
TITLE_PT = 17
HEADING_PT = 13  # table headings: several short lines over narrow columns


def present(widget: QWidget, on: bool) -> None:
    """Large type on `widget` and its plots (on), or back as it was (off). Idempotent."""
    was = widget.property("presenter")
    if bool(was) == on:
        return
    if on:
        widget.setProperty("presenter_sheet", widget.styleSheet())
        # text, not controls: buttons and inputs keep their size, so the panel stays as narrow
        widget.setStyleSheet(widget.styleSheet() + f"\nQLabel, QTextBrowser, QTableView, QTableWidget "
                                                   f"{{ font-size: {PRESENTER_PT}pt; }}\n"
                                                   f"QHeaderView {{ font-size: {HEADING_PT}pt; }}")
    else:
        widget.setStyleSheet(widget.property("presenter_sheet") or "")
    widget.setProperty("presenter", on)
    for pw in widget.findChildren(pg.PlotWidget):
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
        axis.setLabel(text=axis.labelText, units=axis.labelUnits or None,
                      **{"font-size": f"{PLOT_PT if on else 9}pt"})
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

