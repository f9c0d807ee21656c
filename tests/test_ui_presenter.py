"""The presenter view (F11) at 1280x720 with two and with four backends: every Monitor tab in large
type, and nothing of it elided or cut. Each check compares what is drawn with the text it stands
for: a cell's text against the text Qt would draw in the cell's width (`QFontMetrics.elidedText`),
a heading against the size its section needs, a tab's title against the tab's width, an axis
label's rectangle against its tick labels' (as pyqtgraph lays them out to draw them) and against
the plot's view, a plot title against its room, a label against its width."""

from __future__ import annotations

import pytest
from test_ui_first_start import _clipped_labels, _clipped_plots, app_style  # noqa: F401
from ui_fixtures import UI_MODEL, WAIT_MS, make_window, qasync_loop, ui_engine  # noqa: F401

TABS = ("backends", "controls", "routing", "latency", "teaching", "experiments")
SIZE = (1280, 720)


@pytest.fixture(scope="module")
def four_backends():
    from engine.backends.config import parse_backend_specs
    from engine.engine import Engine

    eng = Engine.load(UI_MODEL, parse_backend_specs(["cpu:threads=1,cap=4,ctx=1024"] * 4))
    yield eng
    eng.close()


def to_projector(qtbot, w) -> None:
    """The presenter view's full screen as a 1280x720 projector shows it (this test's screen has
    another size, and a full-screen window takes the screen's)."""
    w.showNormal()
    w.resize(*SIZE)
    qtbot.waitUntil(lambda: (w.width(), w.height()) == SIZE, timeout=WAIT_MS)
    qtbot.wait(200)
    assert (w.width(), w.height()) == SIZE and w.presenter


def elided_cells(view) -> list[str]:
    """Cells of a table in sight whose text Qt draws elided (or cut: a row too short, a column
    past the view's right edge)."""
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QStyle

    model = view.model()
    fm = view.fontMetrics()
    margin = view.style().pixelMetric(QStyle.PixelMetric.PM_FocusFrameHMargin, None, view) + 1
    first = max(view.rowAt(0), 0)
    last = view.rowAt(view.viewport().height() - 1)
    last = model.rowCount() - 1 if last < 0 else last
    out = []
    for row in range(first, last + 1):
        for col in range(model.columnCount()):
            if view.isColumnHidden(col):
                continue
            index = model.index(row, col)
            text = str(index.data() or "")
            rect = view.visualRect(index)
            room = rect.width() - 2 * margin
            if text and fm.elidedText(text, Qt.TextElideMode.ElideRight, room) != text:
                out.append(f"cell ({row}, {col}) {text!r}: needs {fm.horizontalAdvance(text)} px, has {room}")
            if text and rect.height() < fm.height():
                out.append(f"cell ({row}, {col}) {text!r}: {rect.height()} px high, the text {fm.height()}")
            if rect.right() > view.viewport().width():
                out.append(f"column {col}: past the table's right edge")
    return out


def cut_headings(view) -> list[str]:
    """Visible sections of a table's horizontal header narrower or lower than their text needs."""
    h = view.horizontalHeader()
    out = []
    for i in range(h.count()):
        if h.isSectionHidden(i):
            continue
        need = h.sectionSizeFromContents(i)
        text = str(view.model().headerData(i, h.orientation()) or "")
        if need.width() > h.sectionSize(i) + 1 or need.height() > h.height() + 1:
            out.append(f"heading {text!r}: needs {need.width()}x{need.height()} px, "
                       f"has {h.sectionSize(i)}x{h.height()}")
    return out


def cut_tabs(window) -> list[str]:
    """Tab titles shown narrower than they need (elided), or off the bar."""
    from PySide6.QtWidgets import QTabBar

    out = []
    for bar in window.findChildren(QTabBar):
        if not bar.isVisible():
            continue
        for i in range(bar.count()):
            rect = bar.tabRect(i)
            if rect.width() < bar.tabSizeHint(i).width() - 1 or rect.right() > bar.width():
                out.append(f"tab {bar.tabText(i)!r}: {rect.width()} px of {bar.tabSizeHint(i).width()}")
    return out


def axis_collisions(pw) -> list[str]:
    """A plot's axis labels that lie on its tick labels, or that (or whose tick labels) run out
    of the plot's view; legends and plot titles past the plot's view box."""
    from PySide6.QtCore import QRectF
    from PySide6.QtGui import QImage, QPainter

    item = pw.getPlotItem()
    view = QRectF(pw.viewport().rect())
    image = QImage(8, 8, QImage.Format.Format_ARGB32)
    painter = QPainter(image)
    out = []
    try:
        for name in ("left", "bottom"):
            axis = item.getAxis(name)
            if not axis.isVisible():
                continue
            specs = axis.generateDrawSpecs(painter)
            ticks = specs[2] if specs is not None else []
            label = None
            if axis.label.isVisible() and axis.labelText:
                m = axis.label.document().documentMargin()
                label = axis.label.mapRectToParent(axis.label.boundingRect().adjusted(m, m, -m, -m))
                if not view.contains(axis.mapRectToScene(label).adjusted(1, 1, -1, -1)):
                    out.append(f"{name} axis label {axis.labelText!r} is cut by the plot's edge")
            for rect, _flags, text in ticks:
                if label is not None and rect.intersects(label):
                    out.append(f"{name} axis label {axis.labelText!r} lies on the tick label {text!r}")
                if not view.contains(axis.mapRectToScene(rect).adjusted(1, 1, -1, -1)):
                    out.append(f"{name} tick label {text!r} is cut by the plot's edge")
    finally:
        painter.end()
    legend = item.legend
    if legend is not None and legend.isVisible() and legend.items:
        inside = item.vb.sceneBoundingRect().adjusted(-1, -1, 1, 1)
        if not inside.contains(legend.sceneBoundingRect()):
            out.append(f"the legend of {item.titleLabel.text[:40]!r} runs past its plot")
    return out


def presenter_problems(qtbot, w, ticked) -> dict[str, list[str]]:
    """Every Monitor tab in turn, two ticks after it came to the front: what is elided or cut."""
    import pyqtgraph as pg
    from PySide6.QtWidgets import QTableView

    problems = {}
    for key in TABS:
        w.show_panel(key)
        n = len(ticked)
        qtbot.waitUntil(lambda n=n: len(ticked) >= n + 2, timeout=WAIT_MS)
        found = cut_tabs(w) + _clipped_labels(w) + _clipped_plots(w)
        tables = [t for t in w.panels[key].findChildren(QTableView) if t.isVisible() and not t.visibleRegion().isEmpty()]
        for table in tables:
            found += cut_headings(table) + (elided_cells(table) if table.horizontalScrollBar().maximum() == 0
                                            else [])  # a table that scrolls sideways elides nothing
        for pw in w.panels[key].findChildren(pg.PlotWidget):
            if pw.isVisible() and not pw.visibleRegion().isEmpty() and not pw.property("sparkline"):
                found += axis_collisions(pw)
        if found:
            problems[key] = found
    return problems


@pytest.mark.parametrize("backends", [2, 4])
def test_the_presenter_view_leaves_nothing_elided_or_cut_at_1280x720(qtbot, app_style, make_window, ui_engine,
                                                                four_backends, backends):
    from ui.live_run import seed_workload
    from ui.panels.presenter import PRESENTER_PT
    from ui.panels.routing import BACKEND_COLUMN, FIXED

    eng = ui_engine if backends == 2 else four_backends
    w = make_window(engine=None, compact=True)
    w.resize(*SIZE)
    w.show()
    qtbot.waitExposed(w)
    w.set_engine(eng, owns=False)
    ticked: list = []
    w.bridge.tick.connect(ticked.append)
    run = w.start_demo(seed_workload(6, prefix_tokens=64, suffix_tokens=8, gen_tokens=8))
    qtbot.waitUntil(lambda: run.state == "done", timeout=WAIT_MS)
    teaching = w.panels["teaching"]
    teaching.run_live()  # Teaching's live table filled with every backend's scores
    qtbot.waitUntil(lambda: teaching.run is not None and not teaching.run.running, timeout=WAIT_MS)
    eng.set_cap("cpu0", 2)  # marks on the time plots, and a cap reason on the cards
    eng.router.set_policy("round-robin")
    n = len(ticked)
    qtbot.waitUntil(lambda: len(ticked) >= n + 2, timeout=WAIT_MS)

    w.presenter_action.trigger()  # F11
    to_projector(qtbot, w)
    assert not w.stack.isVisible() and w.monitor.width() == SIZE[0]  # one panel, the whole screen

    routing = w.panels["routing"]
    shown = [c for c in range(routing.model.columnCount()) if not routing.table.isColumnHidden(c)]
    assert shown == [0, BACKEND_COLUMN] + [routing.model.column_of(b, "score") for b in eng.backend_names]
    assert FIXED[0] == "#" and routing.table.font().pointSize() == PRESENTER_PT
    for key in TABS:  # every tab in large type
        assert w.panels[key].property("presenter"), key

    problems = presenter_problems(qtbot, w, ticked)
    assert not problems, "\n".join(f"{k}: {p}" for k, v in problems.items() for p in v)


def test_the_presenter_explanation_is_a_sentence_with_the_arithmetic_on_demand(qtbot, app_style, make_window,
                                                                                ui_engine):
    from PySide6.QtCore import QUrl

    from ui.live_run import seed_workload
    from ui.panels.routing import DETAILS_LINK

    w = make_window(engine=None, compact=True)
    w.resize(*SIZE)
    w.show()
    qtbot.waitExposed(w)
    w.set_engine(ui_engine, owns=False)
    run = w.start_demo(seed_workload(4, prefix_tokens=64, suffix_tokens=8, gen_tokens=8))
    qtbot.waitUntil(lambda: run.state == "done", timeout=WAIT_MS)
    routing = w.panels["routing"]
    qtbot.waitUntil(lambda: routing.model.rowCount() == 4, timeout=WAIT_MS)
    w.presenter_action.trigger()
    to_projector(qtbot, w)
    d = routing.model.decisions[-1]  # no row selected: the newest one is explained
    text = routing.explain.toPlainText()
    assert text.startswith(f"#4 → {d.backend}") and "Show the arithmetic" in text  # named as its row is
    assert all(f"{s.name} {s.prefill_tokens:.0f} + {s.decode_tokens:.0f}" in text for s in d.scores)
    assert f"{d.chosen.score_s:.3f} s" in text
    assert d.reason not in text  # the router's record is one click away
    doc = routing.explain.document()
    doc.setTextWidth(routing.explain.viewport().width())
    assert doc.size().height() <= routing.explain.viewport().height()  # read whole, no scrolling
    routing.explain.anchorClicked.emit(QUrl(DETAILS_LINK))
    assert d.reason in routing.explain.toPlainText()
    assert all(f"{s.score_s:.3f} s" in routing.explain.toPlainText() for s in d.scores)
