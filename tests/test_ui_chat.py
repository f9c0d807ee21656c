"""The chat panel on a real engine: streaming through qasync, Stop, Regenerate and its ‹1/2›
switcher, Edit with Save / Cancel, Continue, Copy, history, Markdown and code blocks."""

from __future__ import annotations

import json

from PySide6.QtGui import QGuiApplication
from ui_fixtures import WAIT_MS, StepGate, make_window, qasync_loop, ui_engine  # noqa: F401


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
    reply = chat.chat.messages[-1]
    assert reply.meta["request_id"] != old_request
    assert (reply.n_versions, reply.shown, reply.versions[0].content) == (2, 1, old_text)  # and kept


def test_the_switcher_shows_each_answer_in_turn(qtbot, make_window):
    chat = _one_reply(qtbot, make_window)
    chat.seed.setValue(8)  # another seed: another answer
    first = chat.chat.messages[1].content
    assert chat.regenerate()
    qtbot.waitUntil(lambda: not chat.busy, timeout=WAIT_MS)
    second = chat.chat.messages[1].content
    bubble = chat.bubble(1)
    assert bubble.version_label.text() == "2/2" and "‹2/2›" in chat.transcript_text()
    assert not bubble.buttons["next"].isEnabled()
    bubble.buttons["prev"].click()
    assert chat.chat.messages[1].content == first and len(chat.chat.messages) == 2
    bubble = chat.bubble(1)
    assert bubble.version_label.text() == "1/2" and not bubble.buttons["prev"].isEnabled()
    assert " ".join(first.split())[:20] in " ".join(chat.transcript_text().split())
    bubble.buttons["next"].click()
    assert chat.chat.messages[1].content == second and chat.bubble(1).version_label.text() == "2/2"
    chat.bubble(1).buttons["prev"].click()  # the choice is saved with the chat
    saved = json.loads(chat.store.path(chat.chat.id).read_text())
    assert saved["messages"][1]["content"] == first and saved["messages"][1]["shown"] == 0


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
    chat.chats.open_chat(first_id)
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


def _two_turns(qtbot, make_window):
    chat = _short_replies(make_window)
    send(qtbot, chat, "first question")
    send(qtbot, chat, "second question")
    return chat


def test_edit_then_cancel_leaves_the_chat_unchanged(qtbot, make_window):
    chat = _two_turns(qtbot, make_window)
    before = json.dumps(chat.chat.to_dict())
    saved_before = chat.store.path(chat.chat.id).read_text()
    shown_before = chat.transcript_text()
    chat.bubble(0).buttons["edit"].click()
    editor = chat.editor
    assert editor is not None and editor.toPlainText() == "first question"
    editor.setPlainText("a different question")
    chat.bubble(0).cancel_button.click()
    assert chat.editor is None
    assert json.dumps(chat.chat.to_dict()) == before  # nothing deleted, nothing changed
    assert chat.store.path(chat.chat.id).read_text() == saved_before
    assert chat.transcript_text() == shown_before and not chat.busy


def test_edit_then_save_answers_again_keeping_the_old_turns(qtbot, make_window):
    chat = _two_turns(qtbot, make_window)
    old_reply = chat.chat.messages[1].content
    chat.edit_message(0)
    chat.editor.setPlainText("an edited question")
    chat.bubble(0).save_button.click()
    assert chat.busy
    qtbot.waitUntil(lambda: not chat.busy, timeout=WAIT_MS)
    assert [m.content for m in chat.chat.messages][:1] == ["an edited question"]
    assert [m.role for m in chat.chat.messages] == ["user", "assistant"]
    assert chat.bubble(0).version_label.text() == "2/2"
    chat.bubble(0).buttons["prev"].click()  # the first wording, with both of its turns
    assert [m.content for m in chat.chat.messages[::2]] == ["first question", "second question"]
    assert chat.chat.messages[1].content == old_reply


def test_continue_goes_on_with_a_reply_cut_by_its_length(qtbot, make_window):
    chat = make_window().panels["chat"]
    chat.max_tokens.setValue(4)
    chat.seed.setValue(3)
    send(qtbot, chat, "Tell me a long story.")
    reply = chat.chat.messages[-1]
    assert reply.meta["finish_reason"] == "length"
    first = reply.content
    button = chat.bubble(1).buttons["continue"]
    assert "Continue" in chat.transcript_text() and "cut at max tokens" in chat.transcript_text()
    button.click()
    assert chat.busy
    qtbot.waitUntil(lambda: not chat.busy, timeout=WAIT_MS)
    assert len(chat.chat.messages) == 2  # the same reply, longer
    reply = chat.chat.messages[-1]
    assert reply.content.startswith(first) and len(reply.content) > len(first)
    assert reply.meta["continued"] == 1 and reply.meta["output_tokens"] == 8


def test_a_renamed_chat_exports_under_its_title(qtbot, make_window, tmp_path):
    chat = _short_replies(make_window)
    send(qtbot, chat, "edited question")
    chat.chats.rename_chat(chat.chat.id, "My title")
    assert chat.chat_list.item(0).text() == "My title"
    md = chat.chats.export_chat(tmp_path / "out.md").read_text()
    assert md.startswith("# My title") and "edited question" in md
    assert json.loads(chat.chats.export_chat(tmp_path / "out.json").read_text())["name"] == "My title"


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
    assert chat.chats.delete_chat(first)
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
    from ui.model.history import Chat, Message

    saved = Chat(messages=[Message("user", "show me"), Message("assistant", text, {"backend": "cpu0"})])
    chat.store.save(saved)
    chat.chats.open_chat(saved.id)


def test_replies_render_markdown_keeping_code(qtbot, make_window):
    w = make_window()
    chat = w.panels["chat"]
    _open_reply(chat, "Some **bold** text.\n\n```python\ndef f():\n    return 1\n```\n")
    shown = chat.transcript_text()
    assert "bold" in shown and "**" not in shown
    assert "def f():\n    return 1" in shown  # indentation kept
    block = chat.bubble(1).code_blocks[0]
    assert "monospace" in block.code_label.text() and "<strong>bold</strong>" in _painted(chat)
    block.copy_button.click()
    assert QGuiApplication.clipboard().text() == "def f():\n    return 1\n"


def test_a_code_block_in_a_list_keeps_its_copy_link(qtbot, make_window):
    w = make_window()
    chat = w.panels["chat"]
    _open_reply(chat, "1. first\n\n   ```\n   nested()\n   ```\n")
    bubble = chat.bubble(1)
    assert bubble.code_blocks == [] and bubble.inline_code == ["nested()\n"]
    bubble.link.disconnect()  # only the bubble's own handling: copy-code:0 is its nested block
    bubble._on_link("copy-code:0")
    assert QGuiApplication.clipboard().text() == "nested()\n"


def _painted(chat) -> str:
    """What the transcript paints with: every label's rich text and every style sheet in it."""
    from PySide6.QtWidgets import QLabel, QWidget

    inner = chat.transcript.inner
    return "".join(w.text() for w in inner.findChildren(QLabel)) + \
        "".join(w.styleSheet() for w in inner.findChildren(QWidget))


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
    from PySide6.QtWidgets import QToolTip

    w = make_window()
    chat = w.panels["chat"]
    chat.max_tokens.setValue(6)
    chat.token_probs.setChecked(True)
    send(qtbot, chat, "question")
    tokens = chat.chat.messages[1].meta["logprobs"]
    assert "".join(t[0] for t in tokens) == chat.chat.messages[1].content
    chat.bubble(1).buttons["probs"].click()  # the reply, token by token
    bubble = chat.bubble(1)
    assert bubble.buttons["probs"].text() == "Hide probabilities" and bubble.tokens_label is not None
    bubble.tokens_label.linkHovered.emit("tok:1:0")  # what QLabel says when the mouse is on a token
    qtbot.waitUntil(QToolTip.isVisible, timeout=WAIT_MS)
    tip = QToolTip.text()
    assert tip.startswith(repr(tokens[0][0])) and "p = " in tip
    assert len(tip.splitlines()) == 1 + len(tokens[0][2])  # the token, then its alternatives
    bubble.tokens_label.linkHovered.emit("")  # the mouse left the tokens
    qtbot.waitUntil(lambda: not QToolTip.isVisible(), timeout=WAIT_MS)


def test_a_short_chat_is_saved_small_without_token_probabilities(qtbot, make_window):
    chat = _short_replies(make_window)
    chat.max_tokens.setValue(24)
    send(qtbot, chat, "first question")
    send(qtbot, chat, "second question")
    path = chat.store.path(chat.chat.id)
    assert path.stat().st_size < 4000, path.stat().st_size
    assert all("logprobs" not in (m.meta or {}) for m in chat.chat.messages)
    assert "probs" not in chat.bubble(1).buttons


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
        dark = _painted(chat)
        assert DARK.transcript.assistant in dark and DARK.transcript.user in dark
        w.set_theme("light")
        light = _painted(chat)
        assert light != dark
        assert LIGHT.transcript.assistant in light and LIGHT.transcript.user in light
        assert DARK.transcript.assistant not in light and DARK.transcript.muted not in light
        w.set_theme("dark")  # and back: the dark colours again
        assert _painted(chat) == dark
    finally:
        w.set_theme("dark")  # the palette is process-wide: later tests start dark


def test_code_blocks_follow_the_theme(qtbot, make_window):
    from ui.model.markdown import DARK_CODE, LIGHT_CODE

    w = make_window()
    chat = w.panels["chat"]
    try:
        w.set_theme("dark")
        _open_reply(chat, "```python\ndef f():\n    return 1\n```\n")
        assert DARK_CODE.bg in _painted(chat)
        w.set_theme("light")
        light = _painted(chat)
        assert LIGHT_CODE.bg in light and LIGHT_CODE.head_bg in light
        assert DARK_CODE.bg not in light and DARK_CODE.head_bg not in light
    finally:
        w.set_theme("dark")  # the palette is process-wide: later tests start dark


def test_picking_chats_in_the_list_opens_each_in_turn(qtbot, make_window):
    chat = _short_replies(make_window)
    send(qtbot, chat, "first topic")
    first = chat.chat.id
    chat.new_button.click()
    send(qtbot, chat, "second topic")
    second = chat.chat.id

    def pick(chat_id: str) -> None:
        item = next(chat.chat_list.item(i) for i in range(chat.chat_list.count())
                    if chat.chat_list.item(i).data(0x0100) == chat_id)
        chat.chat_list.itemClicked.emit(item)

    for chat_id, text in ((first, "first topic"), (second, "second topic"), (first, "first topic")):
        pick(chat_id)
        assert chat.chat.id == chat_id and text in chat.transcript_text()
