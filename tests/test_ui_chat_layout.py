"""The chat first: the transcript's share of the window at laptop and desktop sizes, the Monitor
drawer (opened, closed, moved, remembered), code blocks that scroll on their own, and a view
that is not yanked back while a reply streams."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QSettings, Qt
from ui_fixtures import WAIT_MS, StepGate, make_window, qasync_loop, ui_engine  # noqa: F401


def shown(qtbot, w, width: int, height: int):
    w.resize(width, height)
    w.show()
    qtbot.waitExposed(w)
    qtbot.waitUntil(lambda: (w.width(), w.height()) == (width, height), timeout=WAIT_MS)
    return w.panels["chat"]


def open_saved(chat, turns: int, reply: str = "A short answer.") -> None:
    from ui.model.history import Chat, Message

    saved = Chat(messages=[m for i in range(turns) for m in
                           (Message("user", f"question {i + 1}"), Message("assistant", reply, {"backend": "cpu0"}))])
    chat.store.save(saved)
    chat.chats.open_chat(saved.id)


@pytest.mark.parametrize("size,compact", [((1280, 720), True), ((1366, 768), True), ((1920, 1080), False),
                                          ((2560, 1440), False)])
def test_the_transcript_gets_most_of_the_height(qtbot, make_window, size, compact):
    w = make_window(compact=compact)
    hint = w.minimumSizeHint()
    assert hint.width() <= size[0] and hint.height() <= size[1], hint  # the layout fits the screen
    chat = shown(qtbot, w, *size)
    qtbot.waitUntil(lambda: chat.transcript.height() >= 0.6 * w.height(), timeout=WAIT_MS)
    assert chat.transcript.width() >= 0.4 * w.width()
    # the wide layout opens the Monitor beside the chat; the compact one keeps it closed at first
    assert w.monitor.isVisible() is (not compact)


def test_the_transcript_shows_three_turns_at_once_at_1280x720(qtbot, make_window):
    w = make_window(compact=True)
    chat = shown(qtbot, w, 1280, 720)
    open_saved(chat, 6)
    view = chat.transcript.viewport()

    def whole(bubble) -> bool:
        top = bubble.mapTo(view, bubble.rect().topLeft()).y()
        return top >= 0 and top + bubble.height() <= view.height()

    qtbot.waitUntil(lambda: sum(whole(b) for b in chat.transcript.bubbles) >= 6, timeout=WAIT_MS)
    assert whole(chat.transcript.bubbles[-1])  # the last reply is in view


def test_a_long_code_line_scrolls_its_block_not_the_transcript(qtbot, make_window):
    w = make_window(compact=True)
    chat = shown(qtbot, w, 1280, 720)
    line = "x = [" + ", ".join(str(i) for i in range(200)) + "]"
    open_saved(chat, 1, f"Here:\n\n```python\n{line}\n```\n")
    block = chat.bubble(1).code_blocks[0]
    bar = block.scroll_area.horizontalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0 and bar.isVisible(), timeout=WAIT_MS)  # the block's own bar
    assert block.width() <= chat.transcript.viewport().width()
    assert chat.transcript.horizontalScrollBar().maximum() == 0
    assert chat.transcript.widget().width() <= chat.transcript.viewport().width()
    bar.setValue(bar.maximum())  # scrolled to the end of the line: the rest of the transcript stays
    assert chat.transcript.horizontalScrollBar().value() == 0


def test_f9_toggles_the_monitor_drawer(qtbot, make_window):
    w = make_window(compact=True)
    shown(qtbot, w, 1280, 720)
    assert not w.monitor.isVisible()  # a laptop screen: the chat alone at first
    assert w.monitor_action.shortcut().toString() == "F9"
    w.monitor_action.trigger()
    qtbot.waitUntil(w.monitor.isVisible, timeout=WAIT_MS)
    assert w.dockWidgetArea(w.monitor) == Qt.BottomDockWidgetArea
    chat = w.panels["chat"]
    assert chat.transcript.height() >= 80  # the chat still usable beside it
    w.monitor_action.trigger()
    qtbot.waitUntil(lambda: not w.monitor.isVisible(), timeout=WAIT_MS)
    qtbot.waitUntil(lambda: chat.transcript.height() >= 0.6 * w.height(), timeout=WAIT_MS)


def test_the_monitors_place_is_kept_for_the_next_window(qtbot, make_window, tmp_path):
    path = str(tmp_path / "kept.ini")
    w = make_window(compact=True, settings=QSettings(path, QSettings.IniFormat))
    shown(qtbot, w, 1280, 720)
    w.set_monitor_side(Qt.RightDockWidgetArea)
    assert w.dockWidgetArea(w.monitor) == Qt.RightDockWidgetArea and w.monitor.isVisible()
    w.shutdown()
    again = make_window(compact=True, settings=QSettings(path, QSettings.IniFormat))
    shown(qtbot, again, 1280, 720)
    qtbot.waitUntil(again.monitor.isVisible, timeout=WAIT_MS)
    assert again.dockWidgetArea(again.monitor) == Qt.RightDockWidgetArea


def test_show_panel_opens_the_monitor_at_its_tab(qtbot, make_window):
    w = make_window(compact=True)
    shown(qtbot, w, 1280, 720)
    w.show_panel("latency")
    qtbot.waitUntil(w.monitor.isVisible, timeout=WAIT_MS)
    assert w.monitor_tabs.tabText(w.monitor_tabs.currentIndex()) == "Latency"
    assert w.dock_of("latency") is w.monitor and w.dock_of("chat") is None


def test_scrolling_up_while_a_reply_streams_is_not_undone(qtbot, make_window, ui_engine):
    w = make_window(compact=True)
    chat = shown(qtbot, w, 1280, 720)
    open_saved(chat, 6, "A longer answer. " * 6)
    chat.backend_combo.setCurrentText("cpu0")
    chat.max_tokens.setValue(60)
    bar = chat.transcript.verticalScrollBar()
    gate = StepGate(ui_engine.bus, "cpu0", after=3)
    try:
        chat.input.setPlainText("one more")
        chat.send_button.click()
        qtbot.waitUntil(lambda: gate.reached.is_set() and bar.maximum() > 0
                        and bar.value() == bar.maximum(), timeout=WAIT_MS)  # the reply in view
        kept = bar.maximum() // 2
        bar.setValue(kept)  # the user scrolls up to read an earlier turn
    finally:
        gate.release()
    qtbot.waitUntil(lambda: not chat.busy, timeout=WAIT_MS)
    reply = chat.bubble(len(chat.chat.messages) - 1)

    def laid_out() -> bool:  # the finished reply's bubble has its place at the end of the transcript
        inner = chat.transcript.widget()
        return bar.maximum() > kept and reply.isVisible() and reply.geometry().bottom() < inner.height() and \
            bar.maximum() == inner.height() - chat.transcript.viewport().height()

    qtbot.waitUntil(laid_out, timeout=WAIT_MS)
    assert bar.value() == kept


def test_a_reply_rebuilds_only_the_bubbles_it_changed(qtbot, make_window):
    w = make_window(compact=True)
    chat = shown(qtbot, w, 1280, 720)
    open_saved(chat, 3)
    first, last_reply = chat.bubble(0), chat.bubble(5)
    assert "regenerate" in last_reply.buttons
    chat.max_tokens.setValue(4)
    chat.send("one more")
    qtbot.waitUntil(lambda: not chat.busy, timeout=WAIT_MS)
    assert chat.bubble(0) is first  # the earlier turns' widgets are kept as they were
    assert "regenerate" not in chat.bubble(5).buttons  # the reply before the new one lost Regenerate
    assert "regenerate" in chat.bubble(7).buttons
    assert [b.index for b in chat.transcript.bubbles] == list(range(8))
