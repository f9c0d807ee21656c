"""Focus chat / Focus monitor (ui.focus) at 1280x720: each gets the height when it is the point."""

from __future__ import annotations

from ui_fixtures import WAIT_MS, make_window, qasync_loop, ui_engine  # noqa: F401


def shown(qtbot, w, width: int = 1280, height: int = 720):
    w.resize(width, height)
    w.show()
    qtbot.waitExposed(w)
    qtbot.waitUntil(lambda: (w.width(), w.height()) == (width, height), timeout=WAIT_MS)


def on_screen(widget, window) -> bool:
    """Whether all of `widget` lies inside `window`'s visible area (not below the fold)."""
    top_left = widget.mapTo(window, widget.rect().topLeft())
    return widget.isVisible() and top_left.y() >= 0 and top_left.y() + widget.height() <= window.height()


def test_each_focus_mode_gives_its_side_the_height(qtbot, make_window):
    w = make_window(compact=True)
    shown(qtbot, w)
    chat = w.panels["chat"]
    w.monitor_action.trigger()  # both, as F9 opens it: the drawer takes a share
    qtbot.waitUntil(w.monitor.isVisible, timeout=WAIT_MS)
    assert w.focus.mode == "both"
    shared = w.monitor.height()
    w.focus.actions["monitor"].trigger()  # Ctrl+3
    qtbot.waitUntil(lambda: not chat.isVisible() and w.monitor.height() > shared, timeout=WAIT_MS)
    assert w.monitor.height() >= 0.8 * w.height()
    assert w.monitor.titleBarWidget() is not None  # no "Monitor" title line: the height is the panels'
    w.show_panel("experiments")
    ex = w.panels["experiments"]
    qtbot.waitUntil(lambda: on_screen(ex.run_button, w), timeout=WAIT_MS)  # Run above the fold
    w.focus.actions["chat"].trigger()  # Ctrl+1
    qtbot.waitUntil(lambda: chat.isVisible() and not w.monitor.isVisible(), timeout=WAIT_MS)
    qtbot.waitUntil(lambda: chat.transcript.height() >= 0.6 * w.height(), timeout=WAIT_MS)
    w.focus.actions["both"].trigger()  # Ctrl+2: the drawer with its title line again
    qtbot.waitUntil(lambda: chat.isVisible() and w.monitor.isVisible(), timeout=WAIT_MS)
    assert w.monitor.titleBarWidget() is None
    assert [a.shortcut().toString() for a in w.focus.actions.values()] == ["Ctrl+1", "Ctrl+2", "Ctrl+3"]


def test_closing_the_monitor_in_focus_monitor_brings_the_chat_back(qtbot, make_window):
    w = make_window(compact=True)
    shown(qtbot, w)
    w.focus.set_mode("monitor")
    qtbot.waitUntil(w.monitor.isVisible, timeout=WAIT_MS)
    w.monitor_action.trigger()  # F9 closes the drawer
    qtbot.waitUntil(lambda: w.panels["chat"].isVisible(), timeout=WAIT_MS)
    assert w.focus.mode == "chat" and w.focus.actions["chat"].isChecked()


def test_a_lesson_on_a_short_screen_focuses_the_monitor(qtbot, make_window, ui_engine):
    from dataclasses import replace

    from engine.lesson import Kind, LessonMix

    w = make_window(compact=True)
    shown(qtbot, w)
    w.lessons.mix = replace(LessonMix(prefix_tokens=32, kinds=(Kind("short", 4, 4, 1.0),)), vocab_size=ui_engine.n_vocab)
    run = w.lessons.start()
    assert w.focus.mode == "monitor" and not w.panels["chat"].isVisible()
    assert w.monitor_tabs.currentWidget() is w.panels["routing"]
    qtbot.waitUntil(lambda: w.lessons.bar.isVisible(), timeout=WAIT_MS)
    w.lessons.stop()
    qtbot.waitUntil(lambda: all(s.handle.done for s in run.lesson.sent), timeout=WAIT_MS)


def test_the_teaching_run_row_is_whole_in_the_presenter_view(qtbot, make_window, ui_engine):
    from PySide6.QtWidgets import QAbstractButton, QLabel

    w = make_window(engine=None, compact=True)
    shown(qtbot, w)
    w.set_engine(ui_engine, owns=False)
    w.presenter_action.trigger()
    w.showNormal()  # a 1280x720 projector, as the presenter tests show it
    w.resize(1280, 720)
    qtbot.waitUntil(lambda: (w.width(), w.height()) == (1280, 720), timeout=WAIT_MS)
    w.show_panel("teaching")
    row = w.panels["teaching"].run_controls
    qtbot.waitUntil(row.isVisible, timeout=WAIT_MS)
    texts = [x for x in row.findChildren(QLabel) + row.findChildren(QAbstractButton) if x.isVisible() and x.text()]
    assert texts
    cut = [x.text() for x in texts if x.fontMetrics().horizontalAdvance(x.text()) > x.contentsRect().width()]
    assert not cut
