"""System-prompt presets in the chat: choose, save, delete, kept across restarts."""

from __future__ import annotations

from PySide6.QtCore import QSettings
from ui_fixtures import make_window, qasync_loop, ui_engine  # noqa: F401

from ui.chat.presets import STARTERS


def menu_action(presets, text):
    presets.menu().aboutToShow.emit()  # the menu is built as it opens
    return next(a for a in presets.menu().actions() if a.text() == text)


def kept(tmp_path):
    return QSettings(str(tmp_path / "kept.ini"), QSettings.IniFormat)


def test_choosing_a_preset_fills_the_system_prompt(qtbot, make_window):
    chat = make_window().panels["chat"]
    menu_action(chat.presets, "Concise").trigger()
    assert chat.system_edit.toPlainText() == STARTERS["Concise"]
    assert chat.chat.system == STARTERS["Concise"]  # what the next request is sent with


def test_a_saved_preset_survives_a_restart(qtbot, make_window, tmp_path):
    w = make_window(settings=kept(tmp_path))
    chat = w.panels["chat"]
    chat.system_edit.setPlainText("You are a pirate. Answer in pirate speak.")
    assert chat.presets.save_preset("Pirate")
    w.shutdown()
    again = make_window(settings=kept(tmp_path)).panels["chat"]
    assert again.presets.presets()["Pirate"] == "You are a pirate. Answer in pirate speak."
    menu_action(again.presets, "Pirate").trigger()
    assert again.chat.system == "You are a pirate. Answer in pirate speak."


def test_a_deleted_preset_stays_deleted_after_a_restart(qtbot, make_window, tmp_path):
    w = make_window(settings=kept(tmp_path))
    presets = w.panels["chat"].presets
    presets.menu().aboutToShow.emit()
    delete_menu = next(a.menu() for a in presets.menu().actions() if a.menu() is not None)
    next(a for a in delete_menu.actions() if a.text() == "Concise").trigger()
    assert "Concise" not in presets.presets()
    w.shutdown()
    again = make_window(settings=kept(tmp_path)).panels["chat"]
    assert "Concise" not in again.presets.presets()
    assert "Helpful assistant" in again.presets.presets()


def test_a_preset_without_a_name_or_a_prompt_is_not_saved(qtbot, make_window):
    chat = make_window().panels["chat"]
    before = chat.presets.presets()
    chat.system_edit.setPlainText("Be brief.")
    assert not chat.presets.save_preset("   ")
    chat.system_edit.setPlainText("  ")
    assert not chat.presets.save_preset("Empty")
    assert chat.presets.presets() == before
