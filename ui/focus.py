"""Focus chat / Focus monitor: which of the chat and the Monitor drawer gets the window's height.

At 1280x720 the two cannot share the height: with the Monitor open at the bottom the transcript
had 145 px, and the Experiments tab's Run button fell below the fold. `FocusSwitch` offers three
modes, as a switch at the menu bar's right and in the View menu:

- `chat` (Ctrl+1): the chat alone, the Monitor closed;
- `both` (Ctrl+2): the chat and the Monitor drawer side by side or stacked, as before;
- `monitor` (Ctrl+3): the Monitor alone, the whole height (the chat comes back with Ctrl+1/2),
  without the drawer's title line, which has nothing to say there.

Closing or opening the drawer another way (F9, its close button) moves the switch to `chat` or
`both`. Main thread only.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QObject, Signal
from PySide6.QtGui import QAction, QActionGroup, QKeySequence
from PySide6.QtWidgets import QDockWidget, QHBoxLayout, QToolButton, QWidget

MODES = {"chat": ("Focus &chat", "Chat", "Ctrl+1", "The chat takes the whole height; the Monitor is closed"),
         "both": ("Chat &and monitor", "Both", "Ctrl+2", "The chat and the Monitor share the window"),
         "monitor": ("Focus &monitor", "Monitor", "Ctrl+3",
                     "The Monitor takes the whole height (routing, latency, experiments…); Ctrl+1 brings the chat back")}


class FocusSwitch(QObject):
    changed = Signal(str)

    def __init__(self, chat: QWidget, monitor: QDockWidget, size_monitor: Callable[[], None],
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.chat = chat
        self.monitor = monitor
        self._size_monitor = size_monitor
        self.mode = "chat" if not monitor.isVisible() else "both"
        self._applying = False
        group = QActionGroup(self)
        self.actions: dict[str, QAction] = {}
        self.widget = QWidget()
        self.widget.setObjectName("focusSwitch")
        row = QHBoxLayout(self.widget)
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(0)
        # The mode in effect stands out on both themes (the primary button's blue).
        self.widget.setStyleSheet("QToolButton#focusButton { padding: 2px 10px; }"
                                  "QToolButton#focusButton:checked { background: #2f6fcb; color: white; "
                                  "font-weight: bold; }")
        for mode, (text, short, key, tip) in MODES.items():
            a = QAction(text, self, checkable=True, checked=mode == self.mode)
            a.setShortcut(QKeySequence(key))
            a.setIconText(short)
            a.setToolTip(f"{tip} ({key})")
            a.triggered.connect(lambda _=False, m=mode: self.set_mode(m))
            group.addAction(a)
            self.actions[mode] = a
            button = QToolButton()
            button.setDefaultAction(a)
            button.setObjectName("focusButton")
            row.addWidget(button)
        monitor.visibilityChanged.connect(self._sync)
        monitor.toggleViewAction().toggled.connect(self._sync)

    def set_mode(self, mode: str) -> None:
        """Give the height to the chat, to both, or to the Monitor."""
        if mode not in MODES:
            raise ValueError(f"focus mode must be one of {', '.join(MODES)}, got {mode!r}")
        self._applying = True
        try:
            self.chat.setVisible(mode != "monitor")
            self.bare_monitor(mode == "monitor")
            if mode == "chat":
                self.monitor.hide()
            else:
                self.monitor.show()
                self.monitor.raise_()
                if mode == "both":
                    self._size_monitor()
        finally:
            self._applying = False
        self._show(mode)

    def bare_monitor(self, bare: bool) -> None:
        """Leave out the drawer's title line (the Monitor alone on screen), or give it back."""
        if bare != (self.monitor.titleBarWidget() is not None):
            self.monitor.setTitleBarWidget(QWidget() if bare else None)  # type: ignore[arg-type]

    def apply(self) -> None:
        """Lay the window out for the mode in effect again (after the presenter view left)."""
        self.set_mode(self.mode)

    def _sync(self, *_args) -> None:
        """The drawer was opened or closed another way (F9, its close button)."""
        if self._applying:
            return
        shown = not self.monitor.isHidden()
        if not shown and self.mode != "chat":
            self.chat.setVisible(True)  # the Monitor was closed: the chat must not stay hidden
            self.bare_monitor(False)
            self._show("chat")
        elif shown and self.mode == "chat":
            self._show("both")

    def _show(self, mode: str) -> None:
        if mode != self.mode:
            self.mode = mode
            self.changed.emit(mode)
        self.actions[mode].setChecked(True)
