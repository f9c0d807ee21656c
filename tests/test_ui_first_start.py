"""A first start that tells the truth, a demo that explains itself, one cap concept, the
presenter view, and nothing clipped at 1280x720."""

from __future__ import annotations

import threading

import pytest
from ui_fixtures import WAIT_MS, make_window, qasync_loop, ui_engine  # noqa: F401

from app.gui import load_engine
from ui.loader import ModelSpec

FRESH = "cpu:threads=1,cap=3,ctx=704,batch=72,name=fresh"  # a config nothing else stores rates for


@pytest.fixture
def app_style(qapp):
    """The app's style sheet on the QApplication, as `app.gui` sets it."""
    from ui.theme import style_sheet

    before = qapp.styleSheet()
    qapp.setStyleSheet(style_sheet())
    yield
    qapp.setStyleSheet(before)


def _load_fresh(qtbot, w, backend: str) -> None:
    from ui_fixtures import UI_MODEL

    loaded = []
    w.engine_loaded.connect(loaded.append)
    assert w.load_model(ModelSpec(UI_MODEL, (backend,)))
    qtbot.waitUntil(lambda: bool(loaded), timeout=WAIT_MS)


def test_a_first_start_names_its_phases_with_a_filling_bar(qtbot, make_window):
    from ui_fixtures import UI_MODEL

    w = make_window(engine=None, load_fn=load_engine)
    seen = []  # (phase, buttons enabled, bar maximum) when each phase starts
    steps = []
    w.loader.phase.connect(lambda key: seen.append((key, w.load_screen.load_button.isEnabled(),
                                                    w.load_action.isEnabled(), w.placeholder_progress.maximum())))
    w.loader.step.connect(lambda done, total, what: steps.append((done, total, w.placeholder_progress.value())))
    loaded = []
    w.engine_loaded.connect(loaded.append)
    assert w.load_model(ModelSpec(UI_MODEL, (FRESH,)))
    assert not w.load_screen.load_button.isEnabled() and not w.get_model_action.isEnabled()
    assert not w.load_model(ModelSpec(UI_MODEL, (FRESH,)))  # no second load meanwhile
    qtbot.waitUntil(lambda: bool(loaded), timeout=WAIT_MS)

    assert [k for k, *_ in seen] == ["loading", "measuring"]
    assert all(not button and not action and maximum == 100 for _k, button, action, maximum in seen)
    assert steps and steps[-1][0] == steps[-1][1]  # every step of the measurement counted
    assert [d for d, *_ in steps] == list(range(1, steps[-1][1] + 1))
    assert steps[-1][2] == 100  # a determinate bar, full at the end
    assert w.load_action.isEnabled() and w.load_screen.load_button.isEnabled()
    assert w.engine.backend_snapshot("fresh").rates.source == "measured"


def test_calibration_counters_reset_before_the_first_request(qtbot, make_window):
    w = make_window(engine=None, load_fn=load_engine)
    _load_fresh(qtbot, w, FRESH.replace("batch=72", "batch=80"))
    # The measurement's requests are not the user's: every counter starts at zero, and the cap
    # was not "set by the user".
    b = w.engine.backend_snapshot("fresh")
    assert b.rates.source == "measured"  # it was measured at this load
    assert (b.cache.query_tokens, b.cache.hit_tokens, b.cache.evictions) == (0, 0, 0)
    assert (b.prefill_tok_s, b.decode_tok_s, b.steps, b.prompt_tokens_computed) == (0.0, 0.0, 0, 0)
    assert b.cap_reason == "start"
    card = w.panels["backends"].cards["fresh"]
    qtbot.waitUntil(lambda: card.hit_label.text() != "", timeout=WAIT_MS)
    assert "0 / 0 tokens" in card.hit_label.text() and "0 evicted" in card.cache_label.text()
    assert "set by the user" not in card.limit_label.text()

    # The user's first request is what the counters count.
    chat = w.panels["chat"]
    chat.max_tokens.setValue(4)
    assert chat.send("hello")
    qtbot.waitUntil(lambda: not chat.busy, timeout=WAIT_MS)
    after = w.engine.backend_snapshot("fresh")
    prompt = chat.chat.messages[-1].meta["prompt_tokens"]
    assert after.cache.query_tokens == prompt and after.cache.hit_tokens == 0
    assert after.steps > 0


def test_reset_the_counters_zeroes_them_again(qtbot, make_window, ui_engine):
    w = make_window()
    chat = w.panels["chat"]
    chat.max_tokens.setValue(4)
    assert chat.send("hello")
    qtbot.waitUntil(lambda: not chat.busy, timeout=WAIT_MS)
    assert sum(s.cache.query_tokens for s in ui_engine.snapshot()) > 0
    w.reset_counters()  # View ▸ Reset the counters
    qtbot.waitUntil(lambda: all(s.cache.query_tokens == 0 and s.steps == 0 for s in ui_engine.snapshot()),
                    timeout=WAIT_MS)


def test_load_times_estimate_what_is_left_from_the_phase_pace():
    from ui.first_start import LoadTimes, fmt_duration

    t = LoadTimes(started=100.0)
    t.new_phase(now=102.0)
    t.fraction = 0.05
    assert t.left(now=103.0) is None  # too early to say
    t.fraction = 0.25
    assert t.left(now=106.0) == pytest.approx(12.0)  # 4 s for a quarter: 12 s for the rest
    assert t.elapsed(now=106.0) == 6.0
    assert fmt_duration(75) == "1 min 15 s" and fmt_duration(3.4) == "3 s"


def test_one_cap_concept_names_the_ceiling_beside_the_live_cap(qtbot, make_window, ui_engine):
    from ui.formatting import live_cap_text

    w = make_window()
    ui_engine.set_cap("cpu0", 3)
    ticked = []
    w.bridge.tick.connect(ticked.append)
    qtbot.waitUntil(lambda: len(ticked) >= 2, timeout=WAIT_MS)
    snap = ui_engine.backend_snapshot("cpu0")
    card = w.panels["backends"].cards["cpu0"]
    controls = w.panels["controls"]
    text = live_cap_text(snap)
    assert text.startswith(f"live cap {snap.cap}") and "ceiling 3" in text
    assert card.limit_label.text() == text
    assert card.cap_spin.value() == 3 and controls.cap_spins["cpu0"].value() == 3
    assert card.running_bar.format().endswith(f"live cap {snap.cap}")
    assert controls.live_labels["cpu0"].text() in (f"live {snap.cap}", "fixed")
    assert "ceiling" in w.backends_label.toolTip() and "live cap" in w.backends_label.toolTip()


def test_the_status_bar_says_machine_busy_only_while_the_lag_lasts(qtbot, make_window):
    from ui.loop_probe import LAG_CHUNK_S, LAG_CHUNKS

    w = make_window()
    ticked = []
    w.bridge.tick.connect(ticked.append)
    w.probe.stop()  # the figures below are the only samples
    per_s = round(1 / w.probe.interval_s)

    def samples(*runs: tuple[float, float]) -> None:  # (seconds, lateness) runs of the schedule
        w.probe.samples.clear()
        for seconds, late in runs:
            w.probe.samples.extend([late] * round(seconds * per_s))
        n = len(ticked)
        qtbot.waitUntil(lambda: len(ticked) >= n + 2, timeout=WAIT_MS)

    samples((0.5, 0.040))  # 40 ms p95: a figure for developers only
    assert w.lag_label.isHidden()
    w.developer_action.setChecked(True)
    samples((0.5, 0.040))
    assert not w.lag_label.isHidden() and w.lag_label.text() == "UI lag p95 40 ms"
    w.developer_action.setChecked(False)
    samples((20.0, 0.010), (2.0, 0.900))  # a 2 s stall: nothing to tell the class
    assert w.lag_label.isHidden()
    samples((LAG_CHUNK_S * LAG_CHUNKS, 0.900))  # late for 15 s on end: the machine is busy
    assert not w.lag_label.isHidden() and w.lag_label.text() == "machine busy"
    assert "900 ms" in w.lag_label.toolTip()
    samples((LAG_CHUNK_S * LAG_CHUNKS, 0.900), (LAG_CHUNK_S, 0.010))  # on time again for 5 s
    assert w.lag_label.isHidden()


def test_a_demo_says_it_is_warming(qtbot, app_style, make_window, ui_engine):
    from ui.live_run import seed_workload
    from ui.run_strip import run_phase

    w = make_window(engine=None, compact=True)
    w.resize(1280, 720)
    w.show()
    qtbot.waitExposed(w)
    w.set_engine(ui_engine, owns=False)
    routing, latency = w.panels["routing"], w.panels["latency"]
    assert routing.hint.empty and all(h.empty for h in latency.hints.values()) and latency.tput_hint.empty
    # Hold one backend's worker so the warm-up cannot end while the test looks at it.
    gate = threading.Event()
    held = ui_engine.backend("cpu1").call(lambda _b: gate.wait(30))
    try:
        run = w.start_demo(seed_workload(4, prefix_tokens=64, suffix_tokens=8, gen_tokens=8))
        assert run.state in ("flushing", "warming")  # held there by the gate
        strip = routing.run_strip
        qtbot.waitUntil(lambda: "Warming the shared prefix" in strip.text(), timeout=WAIT_MS)
        assert f"{len(run.workload.prefix)} tokens" in strip.text() and strip.isVisibleTo(routing)
        assert "Warming the shared prefix" in latency.run_strip.text()
        assert not w.step_run()
        message = w.statusBar().currentMessage()
        assert "warming the shared prefix" in message
        sb = w.statusBar()
        permanent = sum(c.width() for c in (w.model_label, w.backends_label, w.device_label, w.state_label,
                                             w.server_label, w.load_bar, w.lag_label) if c.isVisible())
        assert sb.fontMetrics().horizontalAdvance(message) < sb.width() - permanent  # not cut off
        qtbot.waitUntil(lambda: "no request yet" in routing.count_label.text(), timeout=WAIT_MS)
    finally:
        gate.set()
        held.result(30)
    qtbot.waitUntil(lambda: run.state == "done", timeout=WAIT_MS)
    assert "done" in routing.run_strip.text()
    assert run_phase("running", 2, 0, 4) == "arrivals" and run_phase("running", 4, 1, 4) == "draining"


def test_plots_show_real_axes_from_the_first_point(qtbot, make_window, ui_engine):
    from ui.live_run import seed_workload

    w = make_window()
    routing, latency = w.panels["routing"], w.panels["latency"]
    assert routing.hint.empty and all(h.empty for h in latency.hints.values()) and latency.tput_hint.empty
    run = w.start_demo(seed_workload(4, prefix_tokens=64, suffix_tokens=8, gen_tokens=8))
    qtbot.waitUntil(lambda: run.state == "done", timeout=WAIT_MS)
    # Real axes from the first point, tooltips on the points.
    qtbot.waitUntil(lambda: not routing.hint.empty and not latency.hints["e2e"].empty, timeout=WAIT_MS)
    assert routing.plot.getAxis("left").style["showValues"]
    tips = [p.data() for p in routing.marks.points()]
    assert tips and tips[0].startswith("#1 → ") and "score" in tips[0]
    bins = latency.bin_points["e2e"]
    assert any(len(c.scatter.points()) for c in bins.values())
    some = next(c for c in bins.values() if len(c.scatter.points()))
    assert "request" in some.scatter.points()[0].data() and " – " in some.scatter.points()[0].data()
    assert some.scatter.opts["hoverable"]


def test_time_plots_mark_where_a_cap_or_the_policy_changed(qtbot, make_window, ui_engine):
    w = make_window()
    ticked = []
    w.bridge.tick.connect(ticked.append)
    qtbot.waitUntil(lambda: len(ticked) >= 2, timeout=WAIT_MS)
    ui_engine.set_cap("cpu0", 2)
    n = len(ticked)
    qtbot.waitUntil(lambda: len(ticked) >= n + 2, timeout=WAIT_MS)
    ui_engine.router.set_policy("round-robin")
    n = len(ticked)
    qtbot.waitUntil(lambda: len(ticked) >= n + 2, timeout=WAIT_MS)
    latency = w.panels["latency"].marks.texts()
    assert any("cpu0 ceiling 4→2" in t for t in latency) and any("policy → round-robin" in t for t in latency)
    card = w.panels["backends"].cards["cpu0"].marks.texts()
    assert any("ceiling 4→2" in t for t in card) and any("policy" in t for t in card)
    assert any("policy → round-robin" in t for t in w.panels["routing"].change_marks.texts())


def test_presenter_view_makes_the_teaching_panels_large(qtbot, app_style, make_window, ui_engine):
    w = make_window(engine=None, compact=True)
    w.resize(1280, 720)
    w.show()
    qtbot.waitExposed(w)
    w.set_engine(ui_engine, owns=False)
    qtbot.waitUntil(lambda: (w.width(), w.height()) == (1280, 720), timeout=WAIT_MS)
    from ui.live_run import seed_workload

    run = w.start_demo(seed_workload(4, prefix_tokens=64, suffix_tokens=8, gen_tokens=8))  # figures to show
    qtbot.waitUntil(lambda: run.state == "done", timeout=WAIT_MS)
    routing = w.panels["routing"]
    routing.select_row(0)
    before = routing.explain.font().pointSize()
    w.presenter_action.trigger()  # F11
    assert w.presenter and w.presenter_action.isChecked()
    texts = (routing.explain, w.panels["teaching"].text, w.panels["latency"].summary)
    for text in texts:  # the routing explanation, Teaching's steps, the latency figures
        qtbot.waitUntil(lambda t=text: t.font().pointSize() >= 16, timeout=WAIT_MS)
    assert w.minimumSizeHint().width() <= 1280  # large type, still on a 1280x720 projector
    assert routing.explain.font().pointSize() >= 16 > before
    assert w.panels["routing"].clear_button.font().pointSize() < 16  # controls keep their size
    assert routing.plot.getAxis("left").style["tickFont"].pointSize() >= 14
    assert "17pt" in routing.plot.titleLabel.text or routing.plot.titleLabel.opts.get("size") == "17pt"
    w.resize(1280, 720)  # full screen on a 1280x720 projector (this test's screen may be another size)
    qtbot.waitUntil(lambda: (w.width(), w.height()) == (1280, 720), timeout=WAIT_MS)
    ticked = []
    w.bridge.tick.connect(ticked.append)
    for key in ("routing", "teaching", "latency"):  # every plot and its title whole on the 1280x720 screen
        w.show_panel(key)
        n = len(ticked)
        qtbot.waitUntil(lambda n=n: len(ticked) >= n + 2, timeout=WAIT_MS)
        plots: list = []
        assert not _clipped_plots(w, plots), key
        assert plots, key
    w.presenter_action.trigger()
    assert not w.presenter
    qtbot.waitUntil(lambda: routing.explain.font().pointSize() == before, timeout=WAIT_MS)
    assert routing.plot.getAxis("left").style["tickFont"].pointSize() < 14


def _clipped_labels(window, checked: list | None = None) -> list[str]:
    """Visible labels whose text does not fit their width (or, wrapped, their height); each label
    looked at is appended to `checked`."""
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QTextDocument
    from PySide6.QtWidgets import QLabel, QSizePolicy

    out = []
    for label in window.findChildren(QLabel):
        if not label.isVisible() or label.visibleRegion().isEmpty() or not label.text().strip():
            continue  # hidden, or in a dock behind another tab
        if checked is not None:
            checked.append(label)
        if label.sizePolicy().horizontalPolicy() == QSizePolicy.Ignored and not label.wordWrap():
            continue  # deliberately elided (it says so with a tooltip)
        room = label.contentsRect().width() - 2 * label.margin() - 2 * label.indent() if label.indent() > 0 else \
            label.contentsRect().width() - 2 * label.margin()
        if label.wordWrap():
            if label.heightForWidth(label.width()) > label.height() + 2:
                out.append(f"{label.text()[:60]!r}: needs {label.heightForWidth(label.width())} px high, "
                           f"has {label.height()}")
            continue
        fmt = label.textFormat()
        if fmt == Qt.RichText or (fmt == Qt.AutoText and "<" in label.text() and ">" in label.text()):
            doc = QTextDocument()
            doc.setDefaultFont(label.font())
            doc.setDocumentMargin(0)
            doc.setHtml(label.text())
            need = doc.idealWidth()
        else:
            need = max(label.fontMetrics().horizontalAdvance(line) for line in label.text().split("\n"))
        if need > room + 1:
            out.append(f"{label.text()[:60]!r}: needs {need:.0f} px, has {room}")
    return out


def _clipped_plots(window, checked: list | None = None) -> list[str]:
    """Visible plots cut by their view (the plot wider or taller than the widget showing it, so its
    right or bottom part is off screen) or whose title's text is wider than the title's room; each
    plot looked at is appended to `checked`."""
    import pyqtgraph as pg

    out = []
    for pw in window.findChildren(pg.PlotWidget):
        if not pw.isVisible() or pw.visibleRegion().isEmpty():
            continue
        if checked is not None:
            checked.append(pw)
        item = pw.getPlotItem()
        view = pw.viewport().size()
        shown = item.sceneBoundingRect()
        name = item.titleLabel.text or pw.objectName() or type(pw.parent()).__name__
        if shown.right() > view.width() + 1 or shown.bottom() > view.height() + 1:
            out.append(f"plot {name[:50]!r}: {shown.width():.0f}x{shown.height():.0f} px in a "
                       f"{view.width()}x{view.height()} view")
        title = item.titleLabel
        if title.isVisible() and title.text:
            text = title.item.mapRectToParent(title.item.boundingRect())
            if text.width() > title.rect().width() + 1 or text.left() < -1:
                out.append(f"title {title.text[:50]!r}: needs {text.width():.0f} px, has {title.rect().width():.0f}")
    return out


@pytest.mark.parametrize("size", [(1280, 720), (1366, 768), (1920, 1080), (2560, 1440)])
def test_nothing_is_clipped_at_each_screen_size(qtbot, app_style, make_window, ui_engine, size):
    from PySide6.QtCore import QSize

    from ui.main_window import compact_layout

    w = make_window(engine=None, compact=compact_layout(QSize(*size)))  # as a screen this size opens it
    w.resize(*size)
    w.show()
    qtbot.waitExposed(w)
    w.set_engine(ui_engine, owns=False)
    qtbot.waitUntil(lambda: (w.width(), w.height()) == size, timeout=WAIT_MS)
    ticked = []
    w.bridge.tick.connect(ticked.append)
    problems = {}
    plots_seen: list = []
    for key in ("backends", "controls", "routing", "latency", "teaching", "experiments"):
        w.show_panel(key)
        n = len(ticked)
        qtbot.waitUntil(lambda n=n: len(ticked) >= n + 2, timeout=WAIT_MS)  # the panel's figures filled in
        seen: list = []
        found = _clipped_labels(w, seen) + _clipped_plots(w, plots_seen)
        assert len(seen) >= 8, (key, len(seen))  # the panel's own labels were looked at
        if found:
            problems[key] = found
    assert len({id(p) for p in plots_seen}) >= 5  # routing's, latency's, teaching's, experiments' plots
    assert not problems, "\n".join(f"{k}: {p}" for k, v in problems.items() for p in v)


@pytest.mark.parametrize("size,compact", [((1280, 720), True), ((1920, 1080), False)])
def test_the_routing_table_never_scrolls_sideways(qtbot, app_style, make_window, ui_engine, size, compact):
    from ui.live_run import seed_workload

    w = make_window(engine=None, compact=compact)
    w.resize(*size)
    w.show()
    qtbot.waitExposed(w)
    w.set_engine(ui_engine, owns=False)
    qtbot.waitUntil(lambda: (w.width(), w.height()) == size, timeout=WAIT_MS)
    w.show_panel("routing")
    run = w.start_demo(seed_workload(4, prefix_tokens=64, suffix_tokens=8, gen_tokens=8))
    qtbot.waitUntil(lambda: run.state == "done", timeout=WAIT_MS)
    table = w.panels["routing"].table
    qtbot.waitUntil(lambda: table.model().rowCount() == 4, timeout=WAIT_MS)
    assert table.horizontalScrollBar().maximum() == 0
    header = table.horizontalHeader()
    for col in range(table.model().columnCount()):  # every cell's text fits its column
        for row in range(4):
            text = table.model().index(row, col).data() or ""
            assert table.fontMetrics().horizontalAdvance(text) <= header.sectionSize(col), (row, col, text)
