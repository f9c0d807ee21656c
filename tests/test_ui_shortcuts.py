"""Keyboard shortcuts for the chat: regenerate, copy the reply, search the chats; all listed by Ctrl+/."""

from __future__ import annotations

from PySide6.QtGui import QGuiApplication
from ui_fixtures import WAIT_MS, make_window, qasync_loop, ui_engine  # noqa: F401


def replied(qtbot, chat, text="hi"):
    chat.max_tokens.setValue(4)
    chat.temperature.setValue(0.0)
    assert chat.send(text)
    qtbot.waitUntil(lambda: not chat.busy, timeout=WAIT_MS)


def test_shortcut_list_names_regenerate_copy_search(qtbot, make_window):
    w = make_window()
    w.shortcuts_action.trigger()
    text = w.shortcuts_dialog.text()
    for key, what in (("Ctrl+R", "Regenerate"), ("Ctrl+Shift+C", "Copy the last reply"), ("Ctrl+F", "Search chats"),
                      ("F6", "Pause"), ("F7", "Step")):
        assert key in text and what in text, (key, what)


def test_ctrl_r_regenerates_the_last_reply(qtbot, make_window):
    w = make_window()
    chat = w.panels["chat"]
    replied(qtbot, chat)
    w.regenerate_action.trigger()
    assert chat.busy
    qtbot.waitUntil(lambda: not chat.busy, timeout=WAIT_MS)
    assert len(chat.chat.messages) == 2
    assert chat.chat.messages[-1].n_versions == 2  # the first answer is kept


def test_ctrl_shift_c_copies_the_last_reply(qtbot, make_window):
    w = make_window()
    chat = w.panels["chat"]
    replied(qtbot, chat)
    QGuiApplication.clipboard().setText("")
    w.copy_reply_action.trigger()
    assert QGuiApplication.clipboard().text() == chat.chat.messages[-1].content != ""


def test_ctrl_f_puts_the_cursor_in_the_chat_search(qtbot, make_window):
    w = make_window()
    w.show()
    qtbot.waitExposed(w)
    w.activateWindow()
    w.search_action.trigger()
    chat = w.panels["chat"]
    qtbot.waitUntil(lambda: chat.search_edit.hasFocus(), timeout=WAIT_MS)
