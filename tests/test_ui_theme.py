"""The light theme, the system's colour scheme followed live, the choice kept across starts."""

from __future__ import annotations

import pyqtgraph as pg
import pytest
from PySide6.QtCore import QSettings, Qt
from PySide6.QtGui import QGuiApplication
from ui_fixtures import make_window, qasync_loop, ui_engine  # noqa: F401

from ui.theme import DARK, LIGHT, palette


@pytest.fixture
def dark_after():
    yield
    from ui import theme

    theme._current = DARK  # the palette is process-wide: later tests start dark


def plot_backgrounds(w) -> set[str]:
    return {v.backgroundBrush().color().name() for v in w.findChildren(pg.GraphicsView)}


def test_light_theme_recolours_the_open_plots(qtbot, make_window, dark_after):
    w = make_window()
    assert plot_backgrounds(w) == {DARK.plot_bg}
    w.theme_actions["light"].trigger()
    assert palette() is LIGHT
    assert plot_backgrounds(w) == {LIGHT.plot_bg}
    assert "#f5f6f8" in w.styleSheet()  # the light style sheet, on the window
    axis = w.panels["latency"].findChildren(pg.PlotWidget)[0].getPlotItem().getAxis("left")
    assert axis.textPen().color().name() == LIGHT.plot_fg
    legend = w.panels["routing"].plot.legend
    assert all(LIGHT.text in label.item.toHtml() for _sample, label in legend.items)


def test_theme_choice_survives_a_restart(qtbot, make_window, tmp_path, dark_after):
    path = str(tmp_path / "kept.ini")
    w = make_window(settings=QSettings(path, QSettings.IniFormat))
    w.set_theme("light")
    w.shutdown()
    again = make_window(settings=QSettings(path, QSettings.IniFormat))
    assert again.theme.choice == "light"
    assert again.theme_actions["light"].isChecked()
    assert plot_backgrounds(again) == {LIGHT.plot_bg}


def test_following_the_system_tracks_its_colour_scheme(qtbot, make_window, dark_after):
    w = make_window()
    w.set_theme("system")
    hints = QGuiApplication.styleHints()
    hints.colorSchemeChanged.emit(Qt.ColorScheme.Light)
    assert w.theme.palette is LIGHT
    assert plot_backgrounds(w) == {LIGHT.plot_bg}
    hints.colorSchemeChanged.emit(Qt.ColorScheme.Dark)
    assert w.theme.palette is DARK
    assert plot_backgrounds(w) == {DARK.plot_bg}


def test_a_fixed_theme_ignores_the_systems_scheme(qtbot, make_window, dark_after):
    w = make_window()
    w.set_theme("dark")
    QGuiApplication.styleHints().colorSchemeChanged.emit(Qt.ColorScheme.Light)
    assert w.theme.palette is DARK
    assert plot_backgrounds(w) == {DARK.plot_bg}


def test_teaching_chart_labels_follow_the_theme(qtbot, make_window, dark_after):
    w = make_window()
    teaching = w.panels["teaching"]
    teaching.go(6)  # a verdict: the chart's title and its bars' labels are shown
    w.set_theme("light")
    title = teaching.chart.getPlotItem().titleLabel.item.toHtml()
    assert LIGHT.text in title and DARK.text not in title
    assert all(label.color.name() == LIGHT.text for label in teaching.bar_labels)


def test_teaching_queue_cells_follow_the_theme(qtbot, make_window, dark_after):
    w = make_window()
    teaching = w.panels["teaching"]
    teaching.go(1)  # request 7 arrives: the GPU's running and queued cells
    dark = teaching.text.toHtml()
    w.set_theme("light")
    light = teaching.text.toHtml()
    assert light != dark
    assert LIGHT.chosen_bg in light and DARK.chosen_bg not in light  # the new request's cell
    w.set_theme("dark")
    assert teaching.text.toHtml() == dark


def _decision(backends: list[str]):
    """A real routing decision over idle backends of these names (the router alone, no engine)."""
    from engine.core.snapshot import BackendSnapshot, Rates
    from engine.routing import RouteQuery, Router

    rates = Rates(prefill_tok_s=500.0, decode_tok_s=50.0, source="measured")
    snaps = [BackendSnapshot(name=b, device="cpu", cap=4, n_ctx=4096, rates=rates) for b in backends]
    return Router("seed-score").route(RouteQuery("req-1", prompt_tokens=40, max_tokens=16), snaps)


def test_routing_text_follows_the_theme(qtbot, make_window, dark_after):
    from ui.panels.routing import BACKEND_COLUMN

    w = make_window()
    view = w.panels["routing"]
    view.add_decision(_decision(view.backends))
    view.select_row(0)
    name = view.model.index(0, BACKEND_COLUMN)
    dark_name, dark_text = name.data(Qt.ForegroundRole).color().name(), view.explain.toHtml()
    w.set_theme("light")
    assert name.data(Qt.ForegroundRole).color().name() != dark_name  # deeper on white
    assert LIGHT.transcript.muted in view.explain.toHtml()
    w.set_theme("dark")
    assert name.data(Qt.ForegroundRole).color().name() == dark_name
    assert view.explain.toHtml() == dark_text
