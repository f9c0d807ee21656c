"""Colours, fonts and the style sheet: one place so every view paints a backend the same way.

Two palettes, dark (the default) and light, each a style sheet in `resources/` plus the colours
pyqtgraph and the tables paint with. `Theme` holds the user's choice ("system", "dark" or
"light"), persists it in `QSettings` (`ui/theme`), applies it to a window (its style sheet, and
every plot in it re-coloured in place) and, while the choice is "system", follows Qt 6's
`QStyleHints.colorScheme()` through `colorSchemeChanged`. `palette()` is the palette in use, for
views that pick a colour when they paint (the routing table's chosen cell) and for HTML that
carries inline colours (the chat transcript: `Palette.transcript`, re-rendered on `Theme.changed`).

Thread contract: main thread only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyqtgraph as pg
from PySide6.QtCore import QObject, QSettings, Qt, Signal
from PySide6.QtGui import QColor, QGuiApplication

from .markdown import DARK_CODE, LIGHT_CODE, CodeColors
from .plot_title import fit_title

RESOURCES = Path(__file__).resolve().parent.parent / "resources"
STYLE_SHEET = RESOURCES / "tandem.qss"
LIGHT_STYLE_SHEET = RESOURCES / "tandem-light.qss"
CHOICES = ("system", "dark", "light")

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


@dataclass(frozen=True)
class TranscriptColors:
    """Inline colours of HTML shown on the theme's text background (the chat transcript)."""

    user: str  # "You"
    assistant: str  # "Assistant"
    muted: str  # meta lines, links, the welcome text (the style sheet's QLabel#muted)
    error: str  # a refused prompt, a failed reply, a context that is too long
    warn: str  # a context that will not fit the max tokens, the synthetic-model warning
    unlikely: str  # "r,g,b" shading an unlikely token (alpha grows as its probability falls)
    code: CodeColors
    backend_darker: int  # QColor.darker factor for backend colours written as text (100: as plotted)

    def backend(self, hex_color: str) -> str:
        return QColor(hex_color).darker(self.backend_darker).name()


DARK_TRANSCRIPT = TranscriptColors("#8fbcff", "#9be39b", MUTED, "#ff7b7b", "#f5c26b", "255,90,90", DARK_CODE, 100)
# On white the dark theme's pastels wash out: the same hues, deep enough for 10pt text.
LIGHT_TRANSCRIPT = TranscriptColors("#1f5fbf", "#1d7a35", "#5f6877", "#c0343f", "#a8610a", "230,60,60", LIGHT_CODE,
                                    160)


@dataclass(frozen=True)
class Palette:
    name: str
    sheet: Path
    plot_bg: str
    plot_fg: str
    text: str
    legend_bg: tuple[int, int, int, int]
    chosen_bg: str
    transcript: TranscriptColors


DARK = Palette("dark", STYLE_SHEET, PLOT_BG, PLOT_FG, TEXT, LEGEND_BG, CHOSEN_BG, DARK_TRANSCRIPT)
LIGHT = Palette("light", LIGHT_STYLE_SHEET, "#ffffff", "#4a5261", "#1f2329", (255, 255, 255, 220), "#cdebd3",
                LIGHT_TRANSCRIPT)
_current = DARK


def palette() -> Palette:
    """The palette in use (dark until a `Theme` applies another)."""
    return _current


def system_scheme() -> str:
    """"light" or "dark": the system's colour scheme as Qt 6 reports it (dark when unknown)."""
    app = QGuiApplication.instance()
    if app is None:
        return "dark"
    return "light" if QGuiApplication.styleHints().colorScheme() == Qt.ColorScheme.Light else "dark"


def resolve(choice: str, system: str | None = None) -> Palette:
    """The palette a choice means ("system" follows `system`, or the system's scheme now)."""
    if choice == "system":
        choice = system or system_scheme()
    return LIGHT if choice == "light" else DARK


class Theme(QObject):
    """The theme choice of one window: `set_choice` applies and persists it."""

    changed = Signal(str)  # the palette's name, after it is applied

    def __init__(self, window, settings: QSettings, parent: QObject | None = None):
        super().__init__(parent)
        self.window = window
        self.settings = settings
        choice = str(settings.value("ui/theme", "system"))
        self.choice = choice if choice in CHOICES else "system"
        self.palette = resolve(self.choice)
        QGuiApplication.styleHints().colorSchemeChanged.connect(self._on_system_scheme)
        self._following = True

    def set_choice(self, choice: str) -> None:
        if choice not in CHOICES:
            raise ValueError(f"unknown theme {choice!r}: one of {', '.join(CHOICES)}")
        self.choice = choice
        self.settings.setValue("ui/theme", choice)
        self.apply(resolve(choice))

    def apply(self, pal: Palette | None = None) -> None:
        """Paint the window (and the application's style sheet, if it has one) with `pal`."""
        global _current
        pal = pal or self.palette
        self.palette = _current = pal
        sheet = style_sheet(pal)
        self.window.setStyleSheet(sheet)
        from PySide6.QtWidgets import QApplication

        app = QGuiApplication.instance()
        if isinstance(app, QApplication) and app.styleSheet():
            app.setStyleSheet(sheet)
        configure_pyqtgraph()
        recolor_plots(self.window)
        self.changed.emit(pal.name)

    def disconnect_system(self) -> None:
        """Stop listening to the system's scheme (the window is closing; idempotent)."""
        if self._following:
            self._following = False
            QGuiApplication.styleHints().colorSchemeChanged.disconnect(self._on_system_scheme)

    def _on_system_scheme(self, scheme) -> None:
        if self.choice == "system":
            self.apply(resolve("system", "light" if scheme == Qt.ColorScheme.Light else "dark"))


def recolor_plots(root) -> None:
    """Re-colour every pyqtgraph view under `root` with the palette in use: backgrounds, axes,
    titles, legends (curves keep their backend colours)."""
    pal = _current
    for view in root.findChildren(pg.GraphicsView):
        view.setBackground(pal.plot_bg)
        for item in view.scene().items():
            if isinstance(item, pg.AxisItem):
                item.setPen(pal.plot_fg)
                item.setTextPen(pal.plot_fg)
            elif isinstance(item, pg.PlotItem):
                if item.titleLabel.text:
                    item.titleLabel.setText(item.titleLabel.text, color=pal.text)
            elif isinstance(item, pg.LegendItem):
                item.setBrush(pg.mkBrush(pal.legend_bg))
                item.setLabelTextColor(pal.text)
                for _sample, label in item.items:
                    label.setText(label.text)  # setLabelTextColor only records the colour


def backend_color(index: int) -> str:
    return BACKEND_COLORS[index % len(BACKEND_COLORS)]


def qcolor(hex_color: str, alpha: int = 255) -> QColor:
    c = QColor(hex_color)
    c.setAlpha(alpha)
    return c


def style_sheet(pal: Palette | None = None) -> str:
    """The palette's style sheet, its `@RESOURCES@` (the spin boxes' arrow images) made absolute."""
    try:
        return (pal or _current).sheet.read_text(encoding="utf-8").replace("@RESOURCES@", RESOURCES.as_posix())
    except OSError:
        return ""


def configure_pyqtgraph() -> None:
    """Global pyqtgraph options for plots created from now on (the palette in use)."""
    pg.setConfigOptions(antialias=True, background=_current.plot_bg, foreground=_current.plot_fg)


def style_plot(plot: pg.PlotItem, title: str, x: str, y: str) -> None:
    fit_title(plot)  # a long title wraps rather than widening the plot past its widget
    plot.setTitle(title, color=_current.text, size="10pt")
    plot.setLabel("bottom", x)
    plot.setLabel("left", y)
    plot.showGrid(x=True, y=True, alpha=GRID_ALPHA)
    plot.setMenuEnabled(True)  # right-click: View All, axes, and the scene's Export…


def scrollable(widget, min_width: int = 0):
    """`widget` inside a frameless, resizable scroll area (a tall form in a short dock scrolls)."""
    from PySide6.QtWidgets import QFrame, QScrollArea

    area = QScrollArea()
    area.setWidgetResizable(True)
    area.setFrameShape(QFrame.Shape.NoFrame)
    area.setWidget(widget)
    if min_width:
        area.setMinimumWidth(min_width)
    return area


def scrollable_column(widget):
    """`widget` (a form column beside other panes) in a vertical-only scroll area as wide as the
    form needs: it scrolls down on a short screen but is never cut at the side, also when its
    type grows (the presenter view): the area's minimum width follows the form's."""
    from PySide6.QtCore import QEvent, QSize, Qt
    from PySide6.QtWidgets import QFrame, QScrollArea

    class ColumnArea(QScrollArea):
        def minimumSizeHint(self) -> QSize:
            inner = self.widget()
            need = inner.minimumSizeHint().width() if inner is not None else 0
            return QSize(need + self.verticalScrollBar().sizeHint().width() + 2, super().minimumSizeHint().height())

        def eventFilter(self, watched, event) -> bool:
            if watched is self.widget() and event.type() in (QEvent.Type.LayoutRequest, QEvent.Type.FontChange,
                                                             QEvent.Type.StyleChange):
                self.updateGeometry()  # the form's minimum width may have changed
            return super().eventFilter(watched, event)

    area = ColumnArea()
    area.setWidgetResizable(True)
    area.setFrameShape(QFrame.Shape.NoFrame)
    area.setWidget(widget)
    area.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
    widget.installEventFilter(area)
    return area


def wrap_label(label, wrap: bool = True):
    """Word-wrap a label without making its layout height-for-width (which makes docks and
    scroll areas ask for the height of an unwrapped plot at their full width)."""
    label.setWordWrap(wrap)
    policy = label.sizePolicy()
    policy.setHeightForWidth(False)
    label.setSizePolicy(policy)
    return label
