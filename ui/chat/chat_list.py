"""The saved chats beside the transcript: New chat, search, the list, Delete chat.

`ChatList` owns which chat is open (`chat`) and what is done to the saved ones: it shows the
store's chats (the open one always listed, selected) filtered by the search box, and opens,
starts, renames, exports and deletes them (the confirmation, rename and export dialogs are its
own). When another chat is open it emits `opened(chat)`; the panel shows it. While a reply
streams (`set_busy`) the open chat stays the open chat.

Main thread only.
"""

from __future__ import annotations

import json
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QFileDialog,
    QInputDialog,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QMessageBox,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from ..model.history import Chat, ChatStore


class ChatList(QWidget):
    """The saved chats, newest first; the open one selected."""

    opened = Signal(object)  # the Chat now open: a saved one, or a new, empty one
    status_message = Signal(str)

    def __init__(self, store: ChatStore, parent: QWidget | None = None):
        super().__init__(parent)
        self.store = store
        self.chat = Chat()  # the open chat
        self.busy = False
        lv = QVBoxLayout(self)
        lv.setContentsMargins(0, 0, 4, 0)
        self.new_button = QPushButton("+ New chat")
        self.new_button.setToolTip("Start an empty chat (the current one stays in the list)")
        self.new_button.clicked.connect(self.new_chat)
        self.search_edit = QLineEdit()
        self.search_edit.setPlaceholderText("Search chats")
        self.search_edit.setClearButtonEnabled(True)
        self.search_edit.textChanged.connect(lambda _t: self.reload())
        self.chat_list = QListWidget()
        self.chat_list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.chat_list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.chat_list.itemClicked.connect(self._on_pick)
        self.chat_list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.chat_list.customContextMenuRequested.connect(self._menu)
        self.delete_chat_button = QPushButton("Delete chat")
        self.delete_chat_button.setToolTip("Delete the open chat from the disk (right-click a chat for more)")
        self.delete_chat_button.clicked.connect(lambda: self.delete_chat(self.chat.id, confirm=True))
        lv.addWidget(self.new_button)
        lv.addWidget(self.search_edit)
        lv.addWidget(self.chat_list, 1)
        lv.addWidget(self.delete_chat_button)
        saved = QLabel("Saved locally")
        saved.setObjectName("muted")
        saved.setToolTip(str(self.store.dir))
        lv.addWidget(saved)
        self.reload()

    def set_busy(self, busy: bool) -> None:
        """While a reply streams the open chat stays the open chat."""
        self.busy = busy
        for w in (self.new_button, self.chat_list, self.delete_chat_button):
            w.setEnabled(not busy)

    def reload(self) -> None:
        """List the saved chats that match the search, and the open one (selected) whatever it holds."""
        current = self.chat
        self.chat_list.clear()
        chats = self.store.list()
        if not any(c.id == current.id for c in chats):
            chats.insert(0, current)
        query = self.search_edit.text()
        for c in chats:
            if c.id != current.id and not c.matches(query):
                continue
            item = QListWidgetItem(c.title)
            item.setData(Qt.ItemDataRole.UserRole, c.id)
            item.setToolTip(f"{c.title}\n{len(c.messages)} messages")
            self.chat_list.addItem(item)
            if c.id == current.id:
                item.setSelected(True)
                self.chat_list.setCurrentItem(item)

    def save(self) -> None:
        """Save the open chat if it holds a message (a failure is said in the status bar)."""
        if not self.chat.messages:
            return
        try:
            self.store.save(self.chat)
        except OSError as e:
            self.status_message.emit(f"could not save the chat: {e}")

    def new_chat(self) -> None:
        """Save the open chat and open an empty one with the same system prompt."""
        if self.busy:
            return
        self.save()
        self._open(Chat(system=self.chat.system))

    def open_chat(self, chat_id: str) -> None:
        """Save the open chat and open the saved chat `chat_id`."""
        if self.busy:
            return
        self.save()
        self._open(self.store.load(chat_id))

    def delete_chat(self, chat_id: str, confirm: bool = False) -> bool:
        """Delete a saved chat; the open one is replaced by an empty chat."""
        if self.busy:
            return False
        if confirm and QMessageBox.question(self, "Delete chat", "Delete this chat? This cannot be undone.") \
                != QMessageBox.StandardButton.Yes:
            return False
        self.store.delete(chat_id)
        if chat_id == self.chat.id:
            self._open(Chat(system=self.chat.system))
        else:
            self.reload()
        self.status_message.emit("chat deleted")
        return True

    def rename_chat(self, chat_id: str, name: str) -> None:
        chat = self.chat if chat_id == self.chat.id else self.store.load(chat_id)
        chat.name = name.strip()
        if chat.messages:
            self.store.save(chat)
        self.reload()

    def export_chat(self, path: str | Path, chat_id: str | None = None) -> Path:
        """Write a chat (the open one by default) as Markdown (.md) or JSON (any other suffix)."""
        chat = self.chat if chat_id in (None, self.chat.id) else self.store.load(chat_id)
        path = Path(path)
        if path.suffix.lower() in (".md", ".markdown"):
            path.write_text(chat.to_markdown(), encoding="utf-8")
        else:
            path.write_text(json.dumps(chat.to_dict(), ensure_ascii=False, indent=1), encoding="utf-8")
        self.status_message.emit(f"chat exported to {path}")
        return path

    def _open(self, chat: Chat) -> None:
        self.chat = chat
        self.reload()
        self.opened.emit(chat)

    def _on_pick(self, item: QListWidgetItem) -> None:
        chat_id = item.data(Qt.ItemDataRole.UserRole)
        if chat_id and chat_id != self.chat.id:
            self.open_chat(chat_id)

    def _menu(self, pos) -> None:
        item = self.chat_list.itemAt(pos)
        if item is None or self.busy:
            return
        chat_id = item.data(Qt.ItemDataRole.UserRole)
        menu = QMenu(self)
        menu.addAction("Rename…", lambda: self._ask_rename(chat_id, item.text()))
        menu.addAction("Export as Markdown…", lambda: self._ask_export(chat_id, "Markdown (*.md)", ".md"))
        menu.addAction("Export as JSON…", lambda: self._ask_export(chat_id, "JSON (*.json)", ".json"))
        menu.addSeparator()
        menu.addAction("Delete", lambda: self.delete_chat(chat_id, confirm=True))
        menu.exec(self.chat_list.mapToGlobal(pos))

    def _ask_rename(self, chat_id: str, current: str) -> None:
        name, ok = QInputDialog.getText(self, "Rename chat", "Title", text=current)
        if ok:
            self.rename_chat(chat_id, name)

    def _ask_export(self, chat_id: str, filt: str, suffix: str) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export chat", f"chat{suffix}", filt)
        if path:
            try:
                self.export_chat(path, chat_id)
            except OSError as e:
                self.status_message.emit(f"could not export the chat: {e}")
