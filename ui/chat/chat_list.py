"""The saved chats beside the transcript: New chat, search, the list, Delete chat.

`ChatList` shows the store's chats (the open one always listed, selected) filtered by the search
box, and asks for what the user picks through its signals: open, new, delete, rename, export (the
rename and export dialogs are its own). The panel does the work and calls `reload` after.

Main thread only.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QFileDialog,
    QInputDialog,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from ..model.history import Chat, ChatStore


class ChatList(QWidget):
    """The saved chats, newest first; the open one selected."""

    open_asked = Signal(str)  # chat id
    new_asked = Signal()
    delete_asked = Signal(str)  # chat id (the panel confirms)
    rename_asked = Signal(str, str)  # chat id, new title
    export_asked = Signal(str, str)  # chat id, path (.md: Markdown, else JSON)

    def __init__(self, store: ChatStore, parent: QWidget | None = None):
        super().__init__(parent)
        self.store = store
        self.busy = False
        self.current_id = ""  # the open chat (the panel sets it when it opens another)
        lv = QVBoxLayout(self)
        lv.setContentsMargins(0, 0, 4, 0)
        self.new_button = QPushButton("+ New chat")
        self.new_button.setToolTip("Start an empty chat (the current one stays in the list)")
        self.new_button.clicked.connect(self.new_asked.emit)
        self.search_edit = QLineEdit()
        self.search_edit.setPlaceholderText("Search chats")
        self.search_edit.setClearButtonEnabled(True)
        self.chat_list = QListWidget()
        self.chat_list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.chat_list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.chat_list.itemClicked.connect(self._on_pick)
        self.chat_list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.chat_list.customContextMenuRequested.connect(self._menu)
        self.delete_chat_button = QPushButton("Delete chat")
        self.delete_chat_button.setToolTip("Delete the open chat from the disk (right-click a chat for more)")
        self.delete_chat_button.clicked.connect(lambda: self.delete_asked.emit(self.current_id))
        lv.addWidget(self.new_button)
        lv.addWidget(self.search_edit)
        lv.addWidget(self.chat_list, 1)
        lv.addWidget(self.delete_chat_button)
        saved = QLabel("Saved locally")
        saved.setObjectName("muted")
        saved.setToolTip(str(self.store.dir))
        lv.addWidget(saved)

    def set_busy(self, busy: bool) -> None:
        """While a reply streams the open chat stays the open chat."""
        self.busy = busy
        for w in (self.new_button, self.chat_list, self.delete_chat_button):
            w.setEnabled(not busy)

    def reload(self, current: Chat) -> None:
        """List the saved chats that match the search, and `current` (selected) whatever it holds."""
        self.current_id = current.id
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

    def _on_pick(self, item: QListWidgetItem) -> None:
        chat_id = item.data(Qt.ItemDataRole.UserRole)
        if chat_id and chat_id != self.current_id:
            self.open_asked.emit(chat_id)

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
        menu.addAction("Delete", lambda: self.delete_asked.emit(chat_id))
        menu.exec(self.chat_list.mapToGlobal(pos))

    def _ask_rename(self, chat_id: str, current: str) -> None:
        name, ok = QInputDialog.getText(self, "Rename chat", "Title", text=current)
        if ok:
            self.rename_asked.emit(chat_id, name)

    def _ask_export(self, chat_id: str, filt: str, suffix: str) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export chat", f"chat{suffix}", filt)
        if path:
            self.export_asked.emit(chat_id, path)
