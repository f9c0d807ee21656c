"""The chat panel on a real engine: streaming through qasync, Stop, Regenerate, Copy, history."""

from __future__ import annotations

import json

from ui_fixtures import WAIT_MS, StepGate, make_window, qasync_loop, ui_engine  # noqa: F401

from PySide6.QtGui import QGuiApplication


def send(qtbot, chat, text: str) -> None:
    chat.input.setPlainText(text)
    chat.send_button.click()
    assert chat.busy, chat.transcript_text()
    qtbot.waitUntil(lambda: not chat.busy, timeout=WAIT_MS)


def test_stop_ends_a_streaming_reply(qtbot, make_window, ui_engine):
    w = make_window()
    chat = w.panels["chat"]
    chat.backend_combo.setCurrentText("cpu0")
    chat.max_tokens.setValue(600)
    gate = StepGate(ui_engine.bus, "cpu0", after=4)
    try:
        chat.input.setPlainText("Tell me a long story.")
        chat.send_button.click()
        assert chat.busy and not chat.send_button.isEnabled() and chat.stop_button.isEnabled()
        # The worker is held after a few steps: the tokens so far have streamed into the view.
        qtbot.waitUntil(lambda: gate.reached.is_set() and chat.streamed_text != "", timeout=WAIT_MS)
        streamed = chat.streamed_text
        assert streamed in chat.transcript_text()
        assert "streaming" in chat.transcript_text()
        chat.stop_button.click()
    finally:
        gate.release()
    qtbot.waitUntil(lambda: not chat.busy, timeout=WAIT_MS)
    reply = chat.chat.messages[-1]
    assert reply.role == "assistant"
    assert reply.meta["finish_reason"] == "cancelled"
    assert reply.meta["backend"] == "cpu0"
    assert reply.content.startswith(streamed) and reply.meta["output_tokens"] < 600
    assert "stopped" in chat.transcript_text()
    assert chat.send_button.isEnabled() and not chat.stop_button.isEnabled()


def test_a_reply_is_saved_with_what_served_it(qtbot, make_window, ui_engine, tmp_path):
    w = make_window()
    chat = w.panels["chat"]
    chat.max_tokens.setValue(12)
    send(qtbot, chat, "hello")
    reply = chat.chat.messages[-1]
    meta = reply.meta
    assert meta["backend"] in ui_engine.backends
    assert meta["ttft_s"] > 0 and meta["output_tokens"] >= 1
    assert meta["policy"] == "seed-score" and meta["reason"]
    text = chat.transcript_text()
    assert f"{meta['backend']} · TTFT" in text and f"cached {meta['cached_tokens']}/{meta['prompt_tokens']}" in text

    # The same conversation again: its prompt starts with the cached first turn.
    send(qtbot, chat, "and again")
    assert chat.chat.messages[-1].meta["cached_tokens"] > 0

    saved = json.loads((tmp_path / "chats" / f"{chat.chat.id}.json").read_text())
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant", "user", "assistant"]
    assert saved["messages"][1]["meta"]["backend"] == meta["backend"]


def _one_reply(qtbot, make_window):
    """A window's chat panel after one question and its (seeded, 8-token) reply."""
    chat = make_window().panels["chat"]
    chat.max_tokens.setValue(8)
    chat.seed.setValue(7)
    send(qtbot, chat, "first question")
    return chat


def test_regenerate_replaces_the_reply_keeping_the_earlier_one(qtbot, make_window):
    chat = _one_reply(qtbot, make_window)
    old_request = chat.chat.messages[-1].meta["request_id"]
    old_text = chat.chat.messages[-1].content
    assert chat.regenerate()
    qtbot.waitUntil(lambda: not chat.busy, timeout=WAIT_MS)
    assert len(chat.chat.messages) == 2  # the reply was replaced, not appended
    assert chat.chat.messages[-1].meta["request_id"] != old_request
    assert [e["content"] for e in chat.chat.messages[-1].meta["earlier"]] == [old_text]  # and kept


def test_copy_reply_puts_the_reply_on_the_clipboard(qtbot, make_window):
    chat = _one_reply(qtbot, make_window)
    assert chat.copy_reply() == chat.chat.messages[-1].content
    assert QGuiApplication.clipboard().text() == chat.chat.messages[-1].content


def test_a_new_chat_starts_empty_with_its_own_system_prompt(qtbot, make_window):
    chat = _one_reply(qtbot, make_window)
    first_id = chat.chat.id
    chat.new_button.click()
    assert chat.chat.messages == [] and chat.chat.id != first_id
    chat.system_edit.setPlainText("Answer in French.")  # the system prompt belongs to each chat
    send(qtbot, chat, "second chat")
    assert chat.chat.system == "Answer in French."
    assert chat.chat_list.count() == 2


def test_reopening_a_chat_restores_its_transcript_with_its_system_prompt(qtbot, make_window):
    chat = _one_reply(qtbot, make_window)
    first_id = chat.chat.id
    chat.new_button.click()
    chat.system_edit.setPlainText("Answer in French.")
    send(qtbot, chat, "second chat")
    chat.open_chat(first_id)
    assert "first question" in chat.transcript_text() and chat.system_edit.toPlainText() == "You are a helpful assistant."


def test_backend_override_pins_the_reply(qtbot, make_window, ui_engine):
    w = make_window()
    chat = w.panels["chat"]
    chat.max_tokens.setValue(4)
    chat.backend_combo.setCurrentText("cpu1")
    send(qtbot, chat, "pinned")
    meta = chat.chat.messages[-1].meta
    assert meta["backend"] == "cpu1" and "pinned" in meta["reason"]


def test_a_prompt_too_long_is_reported_not_raised(qtbot, make_window):
    w = make_window()
    chat = w.panels["chat"]
    assert not chat.send("word " * 3000)  # more tokens than the 1024-cell context
    assert not chat.busy
    assert "context" in chat.transcript_text()


def test_a_refused_prompt_leaves_the_chat_working(qtbot, make_window, tmp_path):
    w = make_window()
    chat = w.panels["chat"]
    chat.max_tokens.setValue(4)
    chat.input.setPlainText("word " * 3000)
    chat.send_button.click()
    assert not chat.busy and chat.chat.messages == []
    assert chat.input.toPlainText().startswith("word word")  # the text is not lost
    assert not (tmp_path / "chats" / f"{chat.chat.id}.json").exists()  # nothing broken saved
    send(qtbot, chat, "hi")  # the next message works
    assert [m.role for m in chat.chat.messages] == ["user", "assistant"]
    assert not chat.chat.messages[-1].meta["error"]
    assert chat.regenerate()
    qtbot.waitUntil(lambda: not chat.busy, timeout=WAIT_MS)
    assert [m.role for m in chat.chat.messages] == ["user", "assistant"]


def _short_replies(make_window):
    chat = make_window().panels["chat"]
    chat.max_tokens.setValue(4)
    return chat


def _listed(chat) -> list[str]:
    return [chat.chat_list.item(i).data(0x0100) for i in range(chat.chat_list.count())]


def test_deleted_messages_leave_the_saved_chat(qtbot, make_window, tmp_path):
    chat = _short_replies(make_window)
    send(qtbot, chat, "first question")
    send(qtbot, chat, "second question")
    assert chat.delete_message(3) and chat.delete_message(2)
    assert [m.content for m in chat.chat.messages][:1] == ["first question"] and len(chat.chat.messages) == 2
    saved = json.loads((tmp_path / "chats" / f"{chat.chat.id}.json").read_text())
    assert len(saved["messages"]) == 2


def test_editing_a_message_moves_it_back_to_the_input_box(qtbot, make_window):
    chat = _short_replies(make_window)
    send(qtbot, chat, "first question")
    assert chat.edit_message(0)  # edit and resend: back in the box, dropped from the chat
    assert chat.input.toPlainText() == "first question" and chat.chat.messages == []


def test_a_renamed_chat_exports_under_its_title(qtbot, make_window, tmp_path):
    chat = _short_replies(make_window)
    send(qtbot, chat, "edited question")
    chat.rename_chat(chat.chat.id, "My title")
    assert chat.chat_list.item(0).text() == "My title"
    md = chat.export_chat(tmp_path / "out.md").read_text()
    assert md.startswith("# My title") and "edited question" in md
    assert json.loads(chat.export_chat(tmp_path / "out.json").read_text())["name"] == "My title"


def test_search_lists_the_chat_that_holds_the_words(qtbot, make_window):
    chat = _short_replies(make_window)
    send(qtbot, chat, "edited question")
    first = chat.chat.id
    chat.new_button.click()
    send(qtbot, chat, "another topic")
    chat.search_edit.setText("edited")
    assert first in _listed(chat)


def test_a_deleted_chat_is_gone_from_the_list_with_its_file(qtbot, make_window, tmp_path):
    chat = _short_replies(make_window)
    send(qtbot, chat, "first question")
    first = chat.chat.id
    chat.new_button.click()
    send(qtbot, chat, "another topic")
    assert chat.delete_chat(first)
    assert not (tmp_path / "chats" / f"{first}.json").exists()
    assert first not in _listed(chat)


def test_enter_while_a_reply_streams_keeps_the_text(qtbot, make_window, ui_engine):
    w = make_window()
    chat = w.panels["chat"]
    chat.backend_combo.setCurrentText("cpu0")
    chat.max_tokens.setValue(600)
    gate = StepGate(ui_engine.bus, "cpu0", after=2)
    try:
        chat.input.setPlainText("first")
        chat.send_button.click()
        qtbot.waitUntil(gate.reached.is_set, timeout=WAIT_MS)
        chat.input.setPlainText("follow-up")
        with qtbot.waitSignal(chat.status_message, timeout=WAIT_MS) as sig:
            chat.input.submitted.emit()
        assert "still streaming" in sig.args[0] and "still streaming" in chat.state_label.text()
        assert chat.input.toPlainText() == "follow-up"
        chat.stop()
    finally:
        gate.release()
    qtbot.waitUntil(lambda: not chat.busy, timeout=WAIT_MS)


def _open_reply(chat, text: str) -> None:
    from ui.history import Chat, Message

    saved = Chat(messages=[Message("user", "show me"), Message("assistant", text, {"backend": "cpu0"})])
    chat.store.save(saved)
    chat.open_chat(saved.id)


def test_replies_render_markdown_keeping_code(qtbot, make_window):
    w = make_window()
    chat = w.panels["chat"]
    _open_reply(chat, "Some **bold** text.\n\n```python\ndef f():\n    return 1\n```\n")
    shown = chat.transcript_text()
    assert "bold" in shown and "**" not in shown
    assert "def f():\n    return 1" in shown  # indentation kept
    html_out = chat.view.toHtml()
    assert "monospace" in html_out and "font-weight" in html_out
    chat.view.anchorClicked.emit(__import__("PySide6.QtCore", fromlist=["QUrl"]).QUrl("copy-code:0"))
    assert QGuiApplication.clipboard().text() == "def f():\n    return 1\n"


def test_earlier_answers_are_shown_on_request(qtbot, make_window):
    from PySide6.QtCore import QUrl

    w = make_window()
    chat = w.panels["chat"]
    chat.max_tokens.setValue(4)
    send(qtbot, chat, "question")
    first = chat.chat.messages[-1].content
    assert chat.regenerate()
    qtbot.waitUntil(lambda: not chat.busy, timeout=WAIT_MS)
    assert "show 1 earlier answer" in chat.transcript_text()
    chat.view.anchorClicked.emit(QUrl("msg:earlier:1"))
    assert "hide 1 earlier answer" in chat.transcript_text()
    after = chat.transcript_text().split("hide 1 earlier answer")[1]
    assert f"#1 ({chat.chat.messages[1].meta['earlier'][0]['backend']}): " in after
    assert " ".join(first.split())[:20] in " ".join(after.split())


def test_long_chat_titles_are_elided_not_scrolled(qtbot, make_window):
    from PySide6.QtCore import Qt

    w = make_window()
    chat = w.panels["chat"]
    chat.max_tokens.setValue(2)
    title = "a very long first question " * 6
    send(qtbot, chat, title)
    item = chat.chat_list.item(0)
    assert chat.chat_list.horizontalScrollBarPolicy() == Qt.ScrollBarAlwaysOff
    assert chat.chat_list.textElideMode() == Qt.ElideRight
    assert item.toolTip().startswith(chat.chat.title)  # the whole title on hover
    assert "TTFT" in chat.state_label.toolTip() and "cached" in chat.state_label.toolTip()


def test_hovering_a_reply_token_shows_its_probabilities(qtbot, make_window):
    from PySide6.QtCore import QUrl
    from PySide6.QtWidgets import QToolTip

    w = make_window()
    chat = w.panels["chat"]
    chat.max_tokens.setValue(6)
    send(qtbot, chat, "question")
    tokens = chat.chat.messages[1].meta["logprobs"]
    assert "".join(t[0] for t in tokens) == chat.chat.messages[1].content
    chat.view.anchorClicked.emit(QUrl("msg:probs:1"))  # the reply, token by token
    assert "hide token probabilities" in chat.transcript_text()
    chat.view.highlighted.emit(QUrl("tok:1:0"))  # what QTextBrowser says when the mouse is on a token
    qtbot.waitUntil(QToolTip.isVisible, timeout=WAIT_MS)
    tip = QToolTip.text()
    assert tip.startswith(repr(tokens[0][0])) and "p = " in tip
    assert len(tip.splitlines()) == 1 + len(tokens[0][2])  # the token, then its alternatives
    chat.view.highlighted.emit(QUrl())  # the mouse left the tokens
    qtbot.waitUntil(lambda: not QToolTip.isVisible(), timeout=WAIT_MS)


OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}


def test_json_mode_with_a_schema_gives_a_reply_matching_it(qtbot, make_window):
    w = make_window()
    chat = w.panels["chat"]
    chat.max_tokens.setValue(64)
    chat.json_mode.setChecked(True)
    chat.schema_edit.setPlainText(json.dumps(OK_SCHEMA))
    send(qtbot, chat, "Is it ok?")
    reply = chat.chat.messages[-1]
    assert reply.meta["finish_reason"] == "stop", reply.content
    assert isinstance(json.loads(reply.content)["ok"], bool)


def test_a_schema_that_is_not_json_sends_nothing(qtbot, make_window):
    w = make_window()
    chat = w.panels["chat"]
    chat.json_mode.setChecked(True)
    chat.schema_edit.setPlainText('{"type": "object",')
    qtbot.waitUntil(lambda: "not JSON" in chat.schema_state.text(), timeout=WAIT_MS)
    chat.input.setPlainText("Is it ok?")
    chat.send_button.click()
    assert not chat.busy
    assert chat.chat.messages == []
    assert chat.input.toPlainText() == "Is it ok?"
    assert "not JSON" in chat.transcript_text()


def test_a_schema_the_converter_refuses_is_reported_with_its_reason(qtbot, make_window):
    w = make_window()
    chat = w.panels["chat"]
    chat.json_mode.setChecked(True)
    chat.schema_edit.setPlainText('{"type": "frobnicate"}')
    qtbot.waitUntil(lambda: "Unrecognized schema" in chat.schema_state.text(), timeout=WAIT_MS)


def test_the_transcript_follows_the_theme(qtbot, make_window, ui_engine):
    from ui.theme import DARK, LIGHT

    w = make_window()
    chat = w.panels["chat"]
    chat.max_tokens.setValue(8)
    try:
        w.set_theme("dark")
        send(qtbot, chat, "hello")
        dark = chat.view.toHtml()
        assert DARK.transcript.assistant in dark and DARK.transcript.user in dark
        w.set_theme("light")
        light = chat.view.toHtml()
        assert light != dark
        assert LIGHT.transcript.assistant in light and LIGHT.transcript.user in light
        assert DARK.transcript.assistant not in light and DARK.transcript.muted not in light
        w.set_theme("dark")  # and back: the dark colours again
        assert chat.view.toHtml() == dark
    finally:
        w.set_theme("dark")  # the palette is process-wide: later tests start dark


def test_code_blocks_follow_the_theme(qtbot, make_window):
    from ui.markdown import DARK_CODE, LIGHT_CODE

    w = make_window()
    chat = w.panels["chat"]
    try:
        w.set_theme("dark")
        _open_reply(chat, "```python\ndef f():\n    return 1\n```\n")
        assert DARK_CODE.bg in chat.view.toHtml()
        w.set_theme("light")
        light = chat.view.toHtml()
        assert LIGHT_CODE.bg in light and LIGHT_CODE.head_bg in light
        assert DARK_CODE.bg not in light and DARK_CODE.head_bg not in light
    finally:
        w.set_theme("dark")  # the palette is process-wide: later tests start dark
