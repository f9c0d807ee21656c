"""The window as a whole: loading models (and failing to), teaching, experiments."""

from __future__ import annotations

import csv
import json

import pytest
from ui_fixtures import UI_MODEL, UI_SPECS, WAIT_MS, load_and_wait, make_window, qasync_loop, ui_engine  # noqa: F401

from app.gui import load_engine
from engine.experiment import experiment_runner
from ui.dialogs.load_model import ModelDialog
from ui.live_run import seed_workload
from ui.loader import ModelSpec
from ui.model.formatting import model_title

TINY_RUN = dict(n=3, prefix=32, suffix=4, gen=4)


def test_model_dialog_offers_every_synthetic_spec(qtbot):
    dialog = ModelDialog()
    qtbot.addWidget(dialog)
    offered = [dialog.shape_combo.itemText(i) for i in range(dialog.shape_combo.count())]
    # The engine's list, not the picker's fallback of `tiny` alone.
    assert {"tiny", "tiny:q8_0", "qwen2.5-0.5b", "qwen2.5-0.5b:q4_k_m"} <= set(offered)


def test_a_bad_model_path_shows_an_error_without_harm(qtbot, make_window, ui_engine, tmp_path):
    w = make_window(load_fn=load_engine)
    failures = []
    w.load_failed.connect(failures.append)
    assert w.load_model(ModelSpec(str(tmp_path / "missing.gguf"), tuple(UI_SPECS)))
    qtbot.waitUntil(lambda: bool(failures), timeout=WAIT_MS)
    assert w.error_dialog.isVisible()
    assert "missing.gguf" in w.error_dialog.text() + w.error_dialog.informativeText()
    assert "not found" in w.error_dialog.informativeText()
    w.error_dialog.accept()
    # The engine that was serving still serves.
    assert w.engine is ui_engine
    chat = w.panels["chat"]
    chat.max_tokens.setValue(4)
    assert chat.send("still there?")
    qtbot.waitUntil(lambda: not chat.busy, timeout=WAIT_MS)
    assert chat.chat.messages[-1].meta["output_tokens"] >= 1

    # A file that is not GGUF is refused with a message too.
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"hello world")
    failures.clear()
    w.load_model(ModelSpec(str(bad), tuple(UI_SPECS)))
    qtbot.waitUntil(lambda: bool(failures), timeout=WAIT_MS)
    assert "not a GGUF file" in failures[0]
    w.error_dialog.accept()


def test_loading_a_model_replaces_the_panels(qtbot, make_window, ui_engine):
    w = make_window(load_fn=load_engine)
    old_chat = w.panels["chat"]
    progress = []
    w.loader.progress.connect(progress.append)
    load_and_wait(qtbot, w)
    assert w.engine is not ui_engine and list(w.engine.backends) == ["cpu"]
    assert w.panels["chat"] is not old_chat
    assert progress and progress[-1] == 1.0
    assert list(w.panels["backends"].cards) == ["cpu"]
    chat = w.panels["chat"]
    chat.max_tokens.setValue(4)
    assert chat.send("hi")
    qtbot.waitUntil(lambda: not chat.busy, timeout=WAIT_MS)
    assert chat.chat.messages[-1].meta["backend"] == "cpu"


def test_the_chat_greets_a_one_backend_engine_in_the_singular(qtbot, make_window):
    w = make_window(load_fn=load_engine)
    load_and_wait(qtbot, w)
    assert " on 1 backend (cpu). " in w.panels["chat"].transcript_text()


def test_a_first_start_says_it_is_measuring_the_backends_speed(qtbot, make_window):
    # A config (n_batch 88) nothing else stores rates for: the load measures it after the weights are
    # in, and the window says so instead of sitting on a full progress bar.
    w = make_window(load_fn=load_engine)
    said = []
    w.loader.status.connect(lambda text: said.append((text, w.state_label.text(), w.load_bar.maximum())))
    load_and_wait(qtbot, w, ("cpu:threads=1,cap=3,ctx=704,batch=88,name=fresh",))
    assert said, "no status line while the rates were measured"
    text, shown, maximum = said[0]
    assert text.startswith("measuring fresh's speed")
    assert shown == "measuring fresh's speed…" and maximum == 100  # its steps fill the bar
    assert w.state_label.text().startswith("engine") and w.state_label.toolTip() == ""
    assert w.engine.backends["fresh"].rates.source == "measured"


def test_the_window_shows_the_model_once_loaded(qtbot, qasync_loop, tmp_path):
    from PySide6.QtCore import QSettings

    from ui.main_window import MainWindow
    from ui.model.history import ChatStore

    w = MainWindow(load_fn=load_engine, store=ChatStore(tmp_path), gpu_offload=False,
                   settings=QSettings(str(tmp_path / "settings.ini"), QSettings.IniFormat))
    try:
        assert w.panels == {} and "No model" in w.placeholder_label.text()
        assert "GPU offload: no" in w.device_label.text()
        w.load_model(ModelSpec(UI_MODEL, ("cpu:threads=1,cap=2,ctx=512",)))
        assert "Loading" in w.placeholder_label.text()
        qtbot.waitUntil(lambda: w.engine is not None, timeout=WAIT_MS)
        assert model_title(w.engine.model.info) in w.model_label.text()
        assert w.engine.model.info.name in w.model_label.toolTip()
        assert w.stack.currentWidget() is w.panels["chat"]
    finally:
        w.shutdown()


def test_teaching_replay_shows_the_golden_numbers(qtbot, make_window):
    w = make_window()
    t = w.panels["teaching"]
    assert t.step == 0 and not t.back_button.isEnabled()
    seen = []
    while t.next_button.isEnabled():
        t.next_button.click()
        seen.append(t.shown_text())
    text = "\n".join(seen)
    for golden in ("3.027 s", "3.444 s", "3.118 s", "stays on the GPU", "CPU takes request 8"):
        assert golden in text
    # The chart shows request 8's bars: GPU prefill + decode stacked to 3.444 s.
    t.go(6)
    heights = [p + d for p, d in zip(t.bar_prefill.opts["height"], t.bar_decode.opts["height"])]
    assert [round(h, 3) for h in heights] == [3.444, 3.118]
    # A faster GPU keeps request 8: the verdict moves.
    t.gpu_decode.setValue(400.0)
    assert "stays on the GPU" in t.shown_text()
    t.reset_inputs()
    assert "3.444 s" in t.shown_text()


def test_teaching_verdict_for_request_7_is_shown_whole(qtbot, make_window):
    w = make_window()
    t = w.panels["teaching"]
    t.go(3)  # request 7: the CPU's score, and the verdict
    assert "3.027 s < 3.118 s: request 7 stays on the GPU" in t.shown_text()


def test_teaching_queue_cells_show_each_waiting_requests_tokens(qtbot, make_window):
    w = make_window()
    t = w.panels["teaching"]
    t.go(1)  # request 7 arrives: 2 queued + the new one, 20 prompt tokens left + 128 of budget each
    assert t.shown_text().count("20 + 128") == 3


def test_teaching_narration_follows_the_cached_prefix(qtbot, make_window):
    w = make_window()
    t = w.panels["teaching"]
    t.go(1)
    assert "20 + 128" in t.shown_text()
    t.cached.setValue(400)  # 116 prompt tokens left per request
    for step in (1, 2, 4):
        t.go(step)
        assert "116 + 128" in t.shown_text() and "20 + 128" not in t.shown_text()
    t.go(1)
    assert "116 prompt tokens to compute" in t.shown_text()


def test_teaching_runs_the_eight_arrivals_live(qtbot, make_window, ui_engine):
    w = make_window()
    t = w.panels["teaching"]
    t.live_button.click()
    assert t.run is not None
    qtbot.waitUntil(lambda: t.run.state == "done", timeout=WAIT_MS)
    decisions = t.run.result.ordered_decisions()
    assert len(decisions) == 8
    for row, d in enumerate(decisions):
        assert t.live_table.item(row, 1).text() == d.backend
        assert t.live_table.item(row, 2).text() == "496 tok"  # the warmed prefix
    assert "The article sent 7 to the GPU" in t.live_note.text()
    t.use_article_rates()
    assert ui_engine.backend("cpu0").rates.prefill_tok_s == 2551.0
    assert ui_engine.backend("cpu1").rates.decode_tok_s == 45.0


def _configure(panel, n, prefix, suffix, gen):
    panel.n_requests.setValue(n)
    panel.prefix.setValue(prefix)
    panel.suffix.setValue(suffix)
    panel.max_tokens.setValue(gen)
    panel.interval.setValue(10)


def test_experiments_compare_policies(qtbot, make_window, ui_engine, tmp_path):
    w = make_window()  # no bench runner: runs driven from the GUI thread
    ex = w.panels["experiments"]
    _configure(ex, **TINY_RUN)
    assert ex.start(["seed-score", "only:cpu1"])
    qtbot.waitUntil(lambda: not ex.running and len(ex.summaries) == 2, timeout=WAIT_MS)
    assert [s.policy for s in ex.summaries] == ["seed-score", "only:cpu1"]
    assert ex.summaries[1].metrics.routed == {"cpu1": 3}
    assert ex.table.rowCount() == 2 and ex.progress.value() == 6
    assert ui_engine.router.policy == "seed-score"  # restored
    with open(ex.export_csv(tmp_path / "r.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [r["policy"] for r in rows] == ["seed-score", "only:cpu1"] and rows[1]["requests_cpu1"] == "3"
    doc = json.loads(ex.export_json(tmp_path / "r.json").read_text())
    assert doc["workload"]["n_requests"] == 3 and len(doc["runs"]) == 2
    assert ex.export_png(tmp_path / "r.png").stat().st_size > 0


def test_experiments_through_the_benchmark_runner(qtbot, make_window, ui_engine):
    w = make_window(bench_runner_factory=experiment_runner)
    ex = w.panels["experiments"]
    assert ex.bench_runner is not None
    _configure(ex, **TINY_RUN)
    assert ex.start(["least-work"])
    qtbot.waitUntil(lambda: not ex.running and len(ex.summaries) == 1, timeout=WAIT_MS)
    s = ex.summaries[0]
    assert s.policy == "least-work" and s.metrics.completed == 3 and s.metrics.makespan_s > 0
    assert w.panels["routing"].model.rowCount() >= 3  # the run showed up live
    assert ui_engine.router.policy == "seed-score"


def test_demo_workload_from_the_run_menu(qtbot, make_window):
    w = make_window()
    run = w.start_demo(seed_workload(4, prefix_tokens=32, suffix_tokens=4, gen_tokens=4, interval_s=0.01))
    assert run is not None and w.start_demo() is None  # one at a time
    qtbot.waitUntil(lambda: run.state == "done", timeout=WAIT_MS)
    assert len(run.result.records) == 4
    assert w.panels["routing"].model.rowCount() == 4


def test_a_demo_run_appears_in_experiments(qtbot, make_window):
    w = make_window()
    run = w.start_demo(seed_workload(3, prefix_tokens=32, suffix_tokens=4, gen_tokens=4, interval_s=0.01))
    qtbot.waitUntil(lambda: run.state == "done", timeout=WAIT_MS)
    ex = w.panels["experiments"]
    assert len(ex.summaries) == 1 and ex.summaries[0].label == "demo" and ex.summaries[0].metrics.completed == 3
    assert ex.table.rowCount() == 1 and ex.table.item(0, 0).text() == "demo"


def test_recalibrate_runs_off_the_gui_thread(qtbot, make_window, ui_engine):
    """The Controls button runs the app's recalibrate function on a worker thread, shows its
    progress and outcome, and the router uses the rates it set. (The function here sets rates
    directly; `app.gui.recalibrate` wraps `engine.rates.measure.calibrate_backend`.)"""
    import threading

    from engine.core.snapshot import Rates

    threads = []

    def recalibrate(eng, progress):
        threads.append(threading.current_thread())
        for i, b in enumerate(eng.backends.values()):
            progress(f"measuring {b.name}")
            b.set_rates(Rates(100.0 + i, 10.0 + i, source="calibrated"))
        if len(threads) > 1:
            raise RuntimeError("no KV room")

    w = make_window(recalibrate=recalibrate)
    c = w.panels["controls"]
    messages = []
    c.status_message.connect(messages.append)
    c.recal_button.click()
    assert not c.recal_button.isEnabled()
    qtbot.waitUntil(lambda: c.recal_button.isEnabled(), timeout=WAIT_MS)
    assert threads[0] is not threading.main_thread()
    assert "measuring cpu0" in messages and messages[-1].startswith("recalibrated")
    assert ui_engine.backend("cpu1").rates == Rates(101.0, 11.0, source="calibrated")
    c.recal_button.click()  # a failure is shown, the button comes back
    qtbot.waitUntil(lambda: c.recal_button.isEnabled(), timeout=WAIT_MS)
    assert messages[-1] == "recalibration failed: no KV room"


def test_tandem_without_a_command_takes_the_apps_options():
    from app.cli import parse_args

    args = parse_args(["--model", "default"])
    assert args.command == "gui" and args.model == "default"
    args = parse_args(["-v", "--model", "synthetic:tiny", "--screenshot", "out.png", "--demo", "8"])
    assert (args.command, args.verbose, args.model, args.screenshot, args.demo) == \
        ("gui", True, "synthetic:tiny", "out.png", 8)
    args = parse_args(["gui", "--model", "synthetic:tiny", "--demo", "8"])
    assert args.command == "gui" and args.demo == 8
    assert parse_args(["serve", "--port", "9000"]).command == "serve"


def _shown_in(widget, area) -> bool:
    """`widget` is drawn whole inside `area` (a scroll area's viewport, a dock)."""
    top_left = widget.mapTo(area, widget.rect().topLeft())
    return area.rect().contains(top_left) and area.rect().contains(
        widget.mapTo(area, widget.rect().bottomRight()))


def test_the_window_stays_usable_at_1280x720(qtbot, make_window, ui_engine):
    w = make_window(engine=None, compact=True)  # as the app: the window shows, then the model arrives
    w.resize(1280, 720)
    w.show()
    qtbot.waitExposed(w)
    w.set_engine(ui_engine, owns=False)
    hint = w.minimumSizeHint()
    assert hint.width() <= 1280 and hint.height() <= 720, hint
    qtbot.waitUntil(lambda: w.width() == 1280 and w.height() == 720, timeout=WAIT_MS)
    w.show_panel("backends")
    backends = w.panels["backends"]
    qtbot.waitUntil(lambda: backends.columns == 2, timeout=WAIT_MS)  # side by side at full width
    for card in backends.cards.values():
        for button in (card.warm_button, card.flush_button, card.cap_spin):
            assert _shown_in(button, backends.viewport()), button.text() if hasattr(button, "text") else "cap"
    w.show_panel("teaching")
    table = w.panels["teaching"].live_table
    qtbot.waitUntil(lambda: table.isVisible(), timeout=WAIT_MS)
    last = table.rowViewportPosition(7) + table.rowHeight(7)
    assert 0 < last <= table.viewport().height()  # all 8 rows without scrolling
    chat = w.panels["chat"]
    assert chat.transcript.height() >= 80 and _shown_in(chat.send_button, w)


@pytest.fixture
def app_style(qapp):
    """The app's style sheet on the QApplication, as `app.gui` sets it (its rows are taller than
    a window's own style sheet gives); the application's previous sheet back afterwards."""
    from ui.theme import style_sheet

    before = qapp.styleSheet()
    qapp.setStyleSheet(style_sheet())
    yield
    qapp.setStyleSheet(before)


def test_teaching_live_table_shows_every_row_at_1280x720(qtbot, app_style, make_window, ui_engine):
    w = make_window(engine=None, compact=True)  # a 1280x720 screen: the chat above the panels
    w.resize(1280, 720)
    w.show()
    qtbot.waitExposed(w)
    w.set_engine(ui_engine, owns=False)
    qtbot.waitUntil(lambda: w.width() == 1280 and w.height() == 720, timeout=WAIT_MS)
    w.show_panel("teaching")
    t = w.panels["teaching"]
    t.run_live()
    qtbot.waitUntil(lambda: t.run.state == "done", timeout=WAIT_MS)
    table = t.live_table
    qtbot.waitUntil(lambda: table.item(7, 1) is not None and table.item(7, 1).text() != "", timeout=WAIT_MS)
    assert table.verticalScrollBar().maximum() == 0  # the eighth row is in view, not scrolled to


def test_a_screen_narrower_than_the_wide_layout_gets_the_compact_one(qtbot, app_style, make_window):
    from PySide6.QtCore import QSize

    from ui.main_window import compact_layout

    w = make_window(compact=False)  # the chat with Backends beside it, at its narrowest
    w.resize(1280, 720)
    w.show()
    qtbot.waitExposed(w)
    narrowest = w.minimumSizeHint().width()  # 1,323 px with two backends: wider than a 1280x1024 screen
    assert compact_layout(QSize(narrowest - 1, 1080))


def test_a_1920x1080_screen_gets_the_wide_layout():
    from PySide6.QtCore import QSize

    from ui.main_window import compact_layout

    assert not compact_layout(QSize(1920, 1080 - 40))  # a taskbar's worth less than the screen


def test_loop_probe_counts_every_tick_a_stall_made_late(qtbot):
    import time

    from PySide6.QtCore import QTimer

    from ui.loop_probe import LoopProbe

    probe = LoopProbe(interval_ms=10)
    probe.start()
    start = time.perf_counter()
    QTimer.singleShot(100, lambda: time.sleep(0.3))  # the GUI thread blocked for 300 ms
    qtbot.wait(600)
    elapsed = time.perf_counter() - start
    probe.stop()
    due = elapsed / 0.010
    assert 0.85 * due <= len(probe.samples) <= due + 1  # a sample per scheduled tick, stall included
    assert probe.missed >= 25  # the ticks that fell due during the stall
    late = sorted(probe.samples, reverse=True)
    assert late[0] >= 0.28 and late[14] >= 0.14  # the stall's ticks, 300 ms down to 0


@pytest.fixture
def reopened(make_window, tmp_path):
    """A window given a model, sampling settings and its Monitor drawer moved to the right, shut
    down, then a second window on the same settings file: (the settings file's path, the second window)."""
    from PySide6.QtCore import QSettings, Qt

    path = str(tmp_path / "kept.ini")
    w = make_window(settings=QSettings(path, QSettings.IniFormat))
    w.spec = ModelSpec(UI_MODEL)
    chat = w.panels["chat"]
    chat.temperature.setValue(0.3)
    chat.max_tokens.setValue(77)
    chat.seed.setValue(5)
    w.set_monitor_side(Qt.RightDockWidgetArea)
    w.shutdown()
    return path, make_window(settings=QSettings(path, QSettings.IniFormat))


def test_the_sampling_settings_persist_across_windows(reopened):
    _, again = reopened
    chat = again.panels["chat"]
    assert (chat.temperature.value(), chat.max_tokens.value(), chat.seed.value()) == (0.3, 77, 5)


def test_the_dock_layout_persists_across_windows(reopened):
    from PySide6.QtCore import Qt

    _, again = reopened
    assert not again.monitor.isHidden()
    assert again.dockWidgetArea(again.monitor) == Qt.RightDockWidgetArea


def test_the_last_model_persists_across_windows(reopened):
    from PySide6.QtCore import QSettings

    path, _ = reopened
    assert QSettings(path, QSettings.IniFormat).value("model/last") == UI_MODEL


def test_ctrl_slash_lists_the_shortcuts(qtbot, make_window):
    w = make_window()
    assert w.shortcuts_action.shortcut().toString() == "Ctrl+/"
    w.shortcuts_action.trigger()
    assert w.shortcuts_dialog.isVisible()
    text = w.shortcuts_dialog.text()
    for key in ("Ctrl+N", "Esc", "Shift+Enter", "Ctrl+/"):
        assert key in text


def test_context_meter_warns_before_sending_a_prompt_too_long(qtbot, make_window):
    w = make_window()
    chat = w.panels["chat"]
    chat.context_meter.refresh()
    assert chat.context_label.text().endswith("/ 1,024")
    chat.input.setPlainText("word " * 3000)
    qtbot.waitUntil(lambda: "too long" in chat.context_label.text(), timeout=WAIT_MS)
    prompt, _, n_ctx = chat.context_meter.usage()
    assert prompt > n_ctx == 1024
    chat.input.setPlainText("hi")
    qtbot.waitUntil(lambda: "too long" not in chat.context_label.text(), timeout=WAIT_MS)
