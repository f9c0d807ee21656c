"""System-prompt presets for the chat: save the prompt being written under a name, choose one to
fill the system prompt, delete one.

`PresetButton` is a "Presets ▾" button beside the chat's system prompt. Its menu lists the
presets (choosing one replaces the system prompt's text), then "Save as preset…" and a Delete
submenu. The presets persist in `QSettings` under `chat/presets` (a JSON object, name -> text,
in the order saved) once `attach(settings)` has been called; a store that has never held any
starts with `STARTERS`, which can be deleted like any other.

Thread contract: main thread only (a widget).
"""

from __future__ import annotations

import json
import logging
from functools import partial

from PySide6.QtCore import QSettings, Signal
from PySide6.QtWidgets import QInputDialog, QMenu, QPlainTextEdit, QToolButton, QWidget

log = logging.getLogger(__name__)

KEY = "chat/presets"
STARTERS = {
    "Helpful assistant": "You are a helpful assistant.",
    "Concise": "Answer briefly: one or two sentences, no preamble.",
    "Python tutor": "You are a patient Python tutor. Explain step by step and show code in Markdown code blocks.",
}


class PresetButton(QToolButton):
    status_message = Signal(str)
    presets_changed = Signal()

    def __init__(self, edit: QPlainTextEdit, parent: QWidget | None = None):
        super().__init__(parent)
        self.edit = edit
        self.settings: QSettings | None = None
        self._presets: dict[str, str] = dict(STARTERS)
        self.setText("Presets ▾")
        self.setToolTip("System-prompt presets: choose one, save the current prompt, delete one")
        self.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        self.setStyleSheet("QToolButton::menu-indicator { image: none; width: 0; }")  # the ▾ says it
        self.setMenu(QMenu(self))
        self.menu().aboutToShow.connect(self._build_menu)

    def attach(self, settings: QSettings) -> None:
        """Read the presets from `settings` and write every change back to it."""
        self.settings = settings
        raw = settings.value(KEY)
        if raw is None:
            self._presets = dict(STARTERS)
            return
        try:
            loaded = json.loads(str(raw))
            if not isinstance(loaded, dict):
                raise ValueError("not an object")
            self._presets = {str(k): str(v) for k, v in loaded.items()}
        except ValueError as e:
            log.warning("ignoring the saved system-prompt presets (%s)", e)
            self._presets = dict(STARTERS)

    def presets(self) -> dict[str, str]:
        return dict(self._presets)

    def choose(self, name: str) -> None:
        """Fill the system prompt with the preset `name`."""
        self.edit.setPlainText(self._presets[name])
        self.status_message.emit(f"system prompt: {name}")

    def save_preset(self, name: str, text: str | None = None) -> bool:
        """Save `text` (the system prompt now, by default) as `name`, replacing a preset of that
        name. False, with a message, for an empty name or prompt."""
        name = name.strip()
        text = self.edit.toPlainText() if text is None else text
        if not name or not text.strip():
            self.status_message.emit("a preset needs a name and a system prompt")
            return False
        self._presets[name] = text
        self._store()
        self.status_message.emit(f"saved the system prompt as the preset “{name}”")
        return True

    def delete(self, name: str) -> bool:
        if self._presets.pop(name, None) is None:
            return False
        self._store()
        self.status_message.emit(f"deleted the preset “{name}”")
        return True

    def ask_save(self) -> None:
        name, ok = QInputDialog.getText(self, "Save as preset", "Name for this system prompt:")
        if ok:
            self.save_preset(name)

    def _store(self) -> None:
        if self.settings is not None:
            self.settings.setValue(KEY, json.dumps(self._presets))
            self.settings.sync()
        self.presets_changed.emit()

    def _build_menu(self) -> None:
        menu = self.menu()
        menu.clear()
        current = self.edit.toPlainText()
        for name, text in self._presets.items():
            a = menu.addAction(name, partial(self.choose, name))
            a.setCheckable(True)
            a.setChecked(text == current)
            a.setToolTip(text)
        if not self._presets:
            menu.addAction("(no presets)").setEnabled(False)
        menu.addSeparator()
        save = menu.addAction("Save the system prompt as a preset…", self.ask_save)
        save.setEnabled(bool(current.strip()))
        delete = menu.addMenu("Delete preset")
        delete.setEnabled(bool(self._presets))
        for name in self._presets:
            delete.addAction(name, partial(self.delete, name))
