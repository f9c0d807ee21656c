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


def test_reply_streams_into_the_view_and_stop_ends_it(qtbot, make_window, ui_engine):
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
        qtbot.waitUntil(lambda: gate.reached.is_set() and "".join(chat._streamed) != "", timeout=WAIT_MS)
        streamed = "".join(chat._streamed)
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


def test_reply_records_backend_ttft_and_cache_and_is_saved(qtbot, make_window, ui_engine, tmp_path):
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


def test_regenerate_copy_new_chat_and_reopen(qtbot, make_window):
    w = make_window()
    chat = w.panels["chat"]
    chat.max_tokens.setValue(8)
    chat.seed.setValue(7)
    send(qtbot, chat, "first question")
    first_id = chat.chat.id
    old_request = chat.chat.messages[-1].meta["request_id"]
    assert chat.regenerate()
    qtbot.waitUntil(lambda: not chat.busy, timeout=WAIT_MS)
    assert len(chat.chat.messages) == 2  # the reply was replaced, not appended
    assert chat.chat.messages[-1].meta["request_id"] != old_request
    assert chat.copy_reply() == chat.chat.messages[-1].content
    assert QGuiApplication.clipboard().text() == chat.chat.messages[-1].content

    chat.new_button.click()
    assert chat.chat.messages == [] and chat.chat.id != first_id
    chat.system_edit.setPlainText("Answer in French.")  # the system prompt belongs to each chat
    send(qtbot, chat, "second chat")
    assert chat.chat.system == "Answer in French."
    assert chat.chat_list.count() == 2
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
