"""Colours, fonts and the style sheet: one place so every view paints a backend the same way."""

from __future__ import annotations

from pathlib import Path

import pyqtgraph as pg
from PySide6.QtGui import QColor

RESOURCES = Path(__file__).resolve().parent.parent / "resources"
STYLE_SHEET = RESOURCES / "tandem.qss"

# Backend colours by position in the engine's backend order.
BACKEND_COLORS = ["#4c9aff", "#f5a623", "#7ed67e", "#d987f5", "#ff6b6b", "#4fd1c5"]
PLOT_BG = "#171a1f"
PLOT_FG = "#aab2bf"
GRID_ALPHA = 0.18
LEGEND_BG = (23, 26, 31, 210)  # legends stay readable over the curves
CHOSEN_BG = "#2d4a33"  # table cell background of the backend a decision chose
TEXT = "#d8dee9"
MUTED = "#8b95a5"
HEALTHY = "#7ed67e"
FAILED = "#ff6b6b"  # errors: a failed backend, a server that could not start
WORKING = "#f5a623"  # a restart under way


def backend_color(index: int) -> str:
    return BACKEND_COLORS[index % len(BACKEND_COLORS)]


def qcolor(hex_color: str, alpha: int = 255) -> QColor:
    c = QColor(hex_color)
    c.setAlpha(alpha)
    return c


def style_sheet() -> str:
    try:
        return STYLE_SHEET.read_text(encoding="utf-8")
    except OSError:
        return ""


def configure_pyqtgraph() -> None:
    """Global pyqtgraph options; call once, before any plot is created."""
    pg.setConfigOptions(antialias=True, background=PLOT_BG, foreground=PLOT_FG)


def style_plot(plot: pg.PlotItem, title: str, x: str, y: str) -> None:
    plot.setTitle(f"<span style='color:{TEXT};font-size:10pt'>{title}</span>")
    plot.setLabel("bottom", x)
    plot.setLabel("left", y)
    plot.showGrid(x=True, y=True, alpha=GRID_ALPHA)
    plot.setMenuEnabled(True)  # right-click: View All, axes, and the scene's Export…


def scrollable(widget, min_width: int = 0):
    """`widget` inside a frameless, resizable scroll area (a tall form in a short dock scrolls)."""
    from PySide6.QtWidgets import QFrame, QScrollArea

    area = QScrollArea()
    area.setWidgetResizable(True)
    area.setFrameShape(QFrame.NoFrame)
    area.setWidget(widget)
    if min_width:
        area.setMinimumWidth(min_width)
    return area


def wrap_label(label, wrap: bool = True):
    """Word-wrap a label without making its layout height-for-width (which makes docks and
    scroll areas ask for the height of an unwrapped plot at their full width)."""
    label.setWordWrap(wrap)
    policy = label.sizePolicy()
    policy.setHeightForWidth(False)
    label.setSizePolicy(policy)
    return label
